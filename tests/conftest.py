"""Test session setup: 8 fake CPU devices, float32 matmuls, before JAX starts."""

import atexit
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compare sharded and unsharded runs at 1e-5: matmuls must be full float32.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "float32")
# Most tests compile a step and run it a few times: LLVM's lowest optimisation level halves the
# CPU code generation time, and (jaxlib 0.10) the classic elemental emitters in place of XLA:CPU's
# MLIR fusion emitters take another fifth off each compile (measured: 7.0 -> 5.7 s for a bf16
# zero-bubble step); the HLO passes, where the bf16 aborts lived, run unchanged. XLA aborts the
# process on a flag it does not know, and jaxlib 0.12 no longer knows that one: it is version-gated.
_FLAGS = ["--xla_backend_optimization_level=0"]
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()
# No Python tracebacks in the lowered module's locations (op names, which the kernel model reads, stay):
# with them every operation carries up to 100 frames, which the GPU plugin's compile serialises to a
# portable artifact and XLA:GPU walks into kernel annotations. Measured on an H100 compile of a six-axis
# mesh (jax 0.10.2): 41.2 / 40.3 -> 36.3 / 35.3 s a test, the serialisation 11.7 -> 0.7 s of it.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
# Compiling for the H100 without one (the `gpu_aot` tests, where the CUDA plugin is installed): ptxas's
# own optimisations cost about a tenth of each compile and change nothing the tests count (the
# optimised HLO, its fusions, collectives, schedule and buffer sizes are fixed before ptxas runs).
if os.environ["JAX_PLATFORMS"] == "cpu" and importlib.util.find_spec("jax_plugins") is not None \
        and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None:
    os.environ["XLA_FLAGS"] += " --xla_gpu_disable_gpuasm_optimizations=true"

# Datasets the tests prepare go to a folder of this run, never to ~/tensorflow_datasets: made by the
# process that starts first (pytest, or xdist's controller) and shared by its workers through the
# environment, so the default corpus is prepared once a run; removed by its maker at exit. Folders of
# runs that were killed (no exit) are removed after a day.
if not os.environ.get("MESHTRAIN_TESTS_TFDS_DIR"):
    for stale in pathlib.Path(tempfile.gettempdir()).glob("meshtrain-tests-tfds-*"):
        try:
            if stale.stat().st_mtime < time.time() - 86400:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    os.environ["MESHTRAIN_TESTS_TFDS_DIR"] = tempfile.mkdtemp(prefix="meshtrain-tests-tfds-")
    atexit.register(shutil.rmtree, os.environ["MESHTRAIN_TESTS_TFDS_DIR"], ignore_errors=True)
os.environ["TFDS_DATA_DIR"] = os.environ["MESHTRAIN_TESTS_TFDS_DIR"]

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from meshtrain import compile_cache  # noqa: E402
from tests import compile_stats  # noqa: E402
from tests.utils import jax_cache_dir  # noqa: E402

# Compiled once, reused across runs: JAX's persistent compilation cache and the records of deviceless
# GPU compiles live in the per-user cache folder (`meshtrain.compile_cache`: $MESHTRAIN_CACHE_DIR, else
# ~/.cache/meshtrain), shared by the xdist workers, the commands the tests start, later runs and the
# benchmarks' --quick runs. A program whose module, compile options, XLA flags or jax/jaxlib versions
# changed has another key and is compiled afresh.
JAX_CACHE = compile_cache.use_jax_cache(jax_cache_dir())
compile_cache.use_records(compile_cache.records_default())
CACHE_MAX_BYTES = 6 * 2**30  # each store's size after a run's start; least recently used entries go first


def pytest_addoption(parser):
    parser.addoption("--compile-stats", default=None, metavar="FILE",
                     help="also write the run's compile figures (tests/compile_stats.py) as JSON to FILE")
    parser.addoption("--quick", action="store_true",
                     help="only the quick set listed in tests/quick.txt (every axis once, the schedules, the main "
                          "job, config errors): the development loop; CI runs everything")


QUICK_LIST = pathlib.Path(__file__).with_name("quick.txt")


def quick_set() -> list[str]:
    """The test ids (files, tests or parametrised cases) tests/quick.txt lists."""
    lines = (line.split("#")[0].strip() for line in QUICK_LIST.read_text().splitlines())
    return [line for line in lines if line]


def pytest_ignore_collect(collection_path, config):
    """With --quick, the files tests/quick.txt does not name are not even imported (the quick set runs
    where the suite's optional test dependencies, torch and datasets, are not installed)."""
    if config.getoption("quick") and collection_path.is_file() and collection_path.name.startswith("test_"):
        named = {entry.split("::")[0] for entry in quick_set()}
        relative = collection_path.resolve().relative_to(pathlib.Path(config.rootpath).resolve()).as_posix()
        return relative not in named or None
    return None


@pytest.hookimpl(tryfirst=True)  # before marker deselection: a stale entry is found whatever `-m` says
def pytest_collection_modifyitems(config, items):
    if config.getoption("quick"):
        _keep_quick_set(config, items)


def _keep_quick_set(config, items) -> None:
    wanted = quick_set()

    def listed(nodeid: str, entry: str) -> bool:
        return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))

    collected_files = {item.nodeid.split("::")[0] for item in items}
    stale = [e for e in wanted if e.split("::")[0] in collected_files and not any(listed(i.nodeid, e) for i in items)]
    if stale:
        raise pytest.UsageError(f"tests/quick.txt lists tests that do not exist: {', '.join(stale)}")
    keep = [any(listed(item.nodeid, e) for e in wanted) for item in items]
    config.hook.pytest_deselected(items=[item for item, k in zip(items, keep, strict=True) if not k])
    items[:] = [item for item, k in zip(items, keep, strict=True) if k]


def pytest_configure(config):
    config.pluginmanager.register(compile_stats.CompileStats(config), "meshtrain_compile_stats")
    if not hasattr(config, "workerinput"):  # once a run, before any worker starts
        for store in (JAX_CACHE, compile_cache.records_dir()):
            compile_cache.prune(store, CACHE_MAX_BYTES)


@pytest.fixture(scope="session")
def compilation_cache():
    """The persistent compilation cache folder of the whole run (`JAX_CACHE`), for a test's child
    processes (`utils.subprocess_env`): a resumed or relaunched run loads the program compiled before."""
    return JAX_CACHE


@pytest.fixture(scope="session")
def tiny_reference():
    """The single-device run every parallel layout is compared with: 3 steps of the float32 tiny
    model on synthetic packed batches -> (batches, losses, final params)."""
    from tests.utils import run_steps, synthetic_batches, tiny_config

    config = tiny_config()
    batches = synthetic_batches(config, 3)
    losses, params, _ = run_steps(config, batches)
    return batches, losses, params
