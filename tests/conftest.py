"""Test session setup: 8 fake CPU devices, float32 matmuls, before JAX starts."""

import atexit
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile

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
# Compiling for the H100 without one (the `gpu_aot` tests, where the CUDA plugin is installed): ptxas's
# own optimisations cost about a tenth of each compile and change nothing the tests count (the
# optimised HLO, its fusions, collectives, schedule and buffer sizes are fixed before ptxas runs).
if os.environ["JAX_PLATFORMS"] == "cpu" and importlib.util.find_spec("jax_plugins") is not None \
        and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None:
    os.environ["XLA_FLAGS"] += " --xla_gpu_disable_gpuasm_optimizations=true"

# Datasets the tests prepare go to a folder of this session, never to ~/tensorflow_datasets.
_TFDS_DIR = tempfile.mkdtemp(prefix="meshtrain-tests-tfds-")
atexit.register(shutil.rmtree, _TFDS_DIR, ignore_errors=True)
os.environ["TFDS_DATA_DIR"] = _TFDS_DIR

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from tests.utils import persistent_compilation_cache  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """One persistent compilation cache for the whole run, shared by the xdist workers (under
    pytest's base temp folder, which pytest cleans): a program compiled by one test (the float32
    references, the same step on two meshes of equal shape...) is loaded by the next."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    jax.config.update("jax_compilation_cache_dir", str(root / "jax_cache_shared"))
    yield


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache in a folder of this test session (one per worker), for
    the module's process and its children (`utils.subprocess_env`): a resumed or relaunched run
    loads the program the run before it compiled."""
    with persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache") as directory:
        yield directory


@pytest.fixture(scope="session")
def tiny_reference():
    """The single-device run every parallel layout is compared with: 3 steps of the float32 tiny
    model on synthetic packed batches -> (batches, losses, final params)."""
    from tests.utils import run_steps, synthetic_batches, tiny_config

    config = tiny_config()
    batches = synthetic_batches(config, 3)
    losses, params, _ = run_steps(config, batches)
    return batches, losses, params
