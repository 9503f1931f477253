"""Shared test helpers: the tiny config in float32, meshes, a few-step training run on a chosen
mesh, and the checkpoint / child-process helpers of the checkpoint and launch tests."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import pathlib

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshtrain import (
    checkpoint as checkpoint_lib,
    compile_cache,
    config as config_lib,
    config_reference,
    mesh as mesh_lib,
    train_step as train_step_lib,
)
from meshtrain.run import Run
from meshtrain.sharding_rules import Rules
from meshtrain.validate import validate

ROOT = pathlib.Path(__file__).resolve().parents[1]
AXES = config_lib.MESH_AXES


def pallas_interpret() -> bool:
    """How the Pallas kernel tests run their kernels: in interpret mode (the default, any host) or
    compiled by Triton on the GPU JAX runs on (`MESHTRAIN_PALLAS=compiled`, set by the GPU runbook
    `bench/gpu/run_all.sh`), against the same references and tolerances."""
    mode = os.environ.get("MESHTRAIN_PALLAS", "interpret")
    if mode not in ("interpret", "compiled"):
        raise ValueError(f"MESHTRAIN_PALLAS={mode!r}: must be 'interpret' or 'compiled'")
    return mode == "interpret"


H100_KIND = "NVIDIA H100 80GB HBM3"  # what an H100's JAX device reports as its device_kind


def lower_for_h100(fn, *args):
    """`fn` traced on `args` and lowered for CUDA on a host without a GPU, its Pallas kernels through
    Triton for an H100. From jaxlib 0.11 on, Triton lowering asks the GPU it targets, and with no GPU
    present it reads the abstract mesh's device: an H100 is named there (on jaxlib 0.10, which
    assumed one, the same context changes nothing)."""
    device = jax.sharding.AbstractDevice(device_kind=H100_KIND, num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("h100",), axis_types=(jax.sharding.AxisType.Explicit,),
                                     abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def load_config_file(name: str):
    """`configs/<name>.py`'s get_config()."""
    spec = importlib.util.spec_from_file_location(f"configs_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def tiny_config(mesh: dict | None = None, **overrides):
    """configs/tiny.py in float32 on synthetic data, all mesh axes 1 except `mesh`; overrides are
    dotted keys, e.g. tiny_config({'fsdp': 8}, **{'train.zero_stage': 3})."""
    c = load_config_file("tiny")
    c.model.dtype = "float32"
    c.data.source = "synthetic"
    for axis in AXES:
        c.mesh[axis] = 1
    for axis, size in (mesh or {}).items():
        c.mesh[axis] = size
    return apply_overrides(c, overrides)


def apply_overrides(config, overrides: dict):
    """`config` with each dotted key of `overrides` ("train.zero_stage": 3) set; returns it."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


def composed_config(mesh: dict, moe: bool | None = None):
    """The tiny config with what each axis of `mesh` brings along (tests/test_compose.py, bench/compose.py):
    the MoE with `expert` (or with `moe`; sequence-wise balance loss; dropless with `sequence`), ring
    attention with `sequence`, the 1F1B schedule with `stage`, ZeRO-3 with `fsdp`; and `COMPOSED_RIDERS`."""
    moe, ring = mesh.get("expert", 1) > 1 if moe is None else moe, mesh.get("sequence", 1) > 1
    if moe:
        c = load_config_file("tiny_moe")
        c.model.dtype, c.data.source = "float32", "synthetic"
        for axis in AXES:
            c.mesh[axis] = mesh.get(axis, 1)
        c.model.moe_balance_scope = "sequence"
        c.model.moe_dropless = ring
    else:
        c = tiny_config(mesh)
    c.train.seq_len, c.train.warmup_steps = 32, 1
    if ring:
        c.attention.impl = "ring"
    if mesh.get("stage", 1) > 1:
        c.pipeline.schedule, c.pipeline.microbatches = "1f1b", 2
    c.train.zero_stage = 3 if mesh.get("fsdp", 1) > 1 else 1
    axes = tuple(a for a in AXES if mesh.get(a, 1) > 1)
    return apply_overrides(c, COMPOSED_RIDERS.get(axes, {}))


# Features that ride along on one three-axis mesh each (tests/test_compose.py, test_default_dtype.py):
# they change memory, never values, so the mesh still trains to the data=8 run's numbers.
# (Remat `none` on the pipelined ones: an MoE stage keeps everything, a dense one makes its copies again.)
COMPOSED_RIDERS = {("data", "expert", "stage"): {"remat.policy": "none"},
                   ("data", "sequence", "stage"): {"remat.policy": "none"}}


def devices_for(config) -> list:
    """The first (product of the mesh axes) devices."""
    n = int(np.prod([max(config.mesh[a], 1) for a in AXES]))
    return jax.devices()[:n]


def synthetic_batches(config, steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Host batches with two documents per row and some padding, deterministic from `seed`."""
    rng = np.random.default_rng(seed)
    b, t, v = config.train.batch_size, config.train.seq_len, config.model.vocab_size
    out = []
    for _ in range(steps):
        tokens = rng.integers(3, v, size=(b, t + 1), dtype=np.int32)
        cut = rng.integers(t // 4, 3 * t // 4, size=b)
        pad = rng.integers(0, t // 8, size=b)
        idx = np.arange(t)[None]
        segment = np.where(idx < cut[:, None], 1, 2).astype(np.int32)
        segment = np.where(idx >= t - pad[:, None], 0, segment)
        positions = np.where(segment == 1, idx, idx - cut[:, None]).astype(np.int32)
        positions = np.where(segment == 0, 0, positions)
        loss_mask = (segment > 0).astype(np.float32)
        loss_mask[np.arange(b), cut - 1] = 0.0  # no target across the document boundary
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment,
                    "positions": positions, "loss_mask": loss_mask})
    return out


def mesh_of(**sizes) -> jax.sharding.Mesh:
    """A six-axis mesh on the first devices: the given axis sizes, every other axis 1. Under the GPU
    runbook's compiled kernel tests (`MESHTRAIN_PALLAS=compiled`) on a machine with fewer GPUs the test
    is skipped with the count in its reason (the runbook reports it; the CPU suite runs it on fake
    devices)."""
    config = tiny_config(sizes)
    devices = devices_for(config)
    needed = int(np.prod([max(config.mesh[a], 1) for a in AXES]))
    if len(devices) < needed and not pallas_interpret():
        import pytest  # here: bench scripts import this module where pytest is not installed

        pytest.skip(f"needs {needed} devices, this machine has {len(devices)} (the CPU suite runs it on fake devices)")
    return mesh_lib.make_mesh(config, devices)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """The batch sharding a run on `mesh` uses (`Run.batch_sharding`)."""
    return NamedSharding(mesh, Rules.for_mesh(mesh).spec(("batch", "length")))


def resolve(config, devices=None) -> Run:
    """`config` resolved on the first (product of its mesh axes) devices."""
    devices = devices or devices_for(config)
    validate(config, len(devices))
    return Run.resolve(config, devices)


# Config keys that choose how a run is laid out on its mesh, never the model or optimizer it starts with.
LAYOUT = {"attention.impl": "xla", "attention.ulysses_degree": 0, "remat.policy": "none", "model.fused_norm": False,
          "model.fused_loss": False, "model.sequence_parallel": False, "model.collective_matmul": False,
          "train.zero_stage": 0, "pipeline.layers_per_stage": ()}


_HOST_STATES: dict[str, object] = {}  # initial train states on one device, by config (this test process)


def initial_state(factory, config):
    """`factory.create(config.seed)` without compiling an initialiser for every mesh: the state of the
    same model and optimizer initialised once on one device (per test process), placed in the
    factory's shardings and layer order. Equal bit for bit, since initialisation is the same on every
    mesh (`tests/test_parallel_equivalence.py::test_every_mesh_initialises_the_same_state`)."""
    single = apply_overrides(copy.deepcopy(config), {**{f"mesh.{a}": 1 for a in AXES}, **LAYOUT})
    key = json.dumps(flatten(single), sort_keys=True, default=str)
    if key not in _HOST_STATES:
        one, _ = train_step_lib.build(resolve(single, jax.devices()[:1]))
        _HOST_STATES[key] = jax.device_get(one.create(single.seed))
    state = jax.tree.map(lambda a, target: jax.device_put(a, target.sharding), _HOST_STATES[key], factory.canonical)
    return factory.from_canonical(state)


def flatten(config) -> dict:
    """{"a.b": value} of every leaf of a ConfigDict (`config_reference.flat_keys`)."""
    return config_reference.flat_keys(config)


def train(config, batches, devices=None):
    """Trains len(batches) steps; returns (metrics per step as floats, final state, factory)."""
    run = resolve(config, devices)
    factory, step_fn = train_step_lib.build(run)
    state = initial_state(factory, config)
    records = []
    with jax.set_mesh(run.mesh):
        for batch in batches:
            state, metrics = step_fn(state, batch)
            records.append(jax.tree.map(float, jax.device_get(metrics)))
    return records, state, factory


def train_synthetic(config, steps: int):
    """Trains `steps` steps on `synthetic_batches`, each in the run's token order (ring attention's zig-zag
    permutation applied, as the data iterator would); returns (metrics per step as floats, final state)."""
    batches = synthetic_batches(config, steps)
    permutation = resolve(config).layout.permutation
    if permutation is not None:
        batches = [{k: v[:, permutation] for k, v in b.items()} for b in batches]
    records, state, _ = train(config, batches)
    return records, state


def run_steps(config, batches, devices=None):
    """Trains len(batches) steps; returns (losses, final params as numpy, factory)."""
    records, state, factory = train(config, batches, devices)
    return np.array([r["loss"] for r in records]), jax.tree.map(np.asarray, state.params), factory


# Checkpoint and process helpers (test_checkpoint, test_checkpoint_crash, test_launch).

STEPS = 12


def config_for(workdir, mesh=None, **overrides):
    """The checkpoint tests' run: tiny, 2 layers, `STEPS` steps on the default corpus; a shorter run
    warms up over its whole length (a warmup longer than the run is refused)."""
    steps = overrides.get("steps", STEPS)
    c = tiny_config(mesh or {"fsdp": 8}, **{
        "model.n_layers": 2, "train.seq_len": 32, "train.batch_size": 8, "steps": STEPS, "log_every": 1,
        "data.source": "text_files", "workdir": str(workdir), "checkpoint.keep": 100,
        "train.warmup_steps": min(10, steps), **overrides})
    return c


def losses_of(workdir) -> dict[int, float]:
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            assert record["step"] not in out, f"step {record['step']} trained twice"
            out[record["step"]] = float(record["loss"])  # "nan" is written as a string
    return out


def abstract_state(config, devices=None):
    factory, _ = train_step_lib.build(resolve(config, devices or jax.devices()))
    return factory.canonical  # how checkpoints hold the state


def load(workdir, step, abstract) -> checkpoint_lib.Restored:
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(workdir), read_only=True)
    try:
        return ckpt.restore(abstract, step)
    finally:
        ckpt.close()


def all_steps(workdir) -> list[int]:
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(workdir), read_only=True)
    steps = ckpt.all_steps()
    ckpt.close()
    return steps


def latest_step(workdir) -> int | None:
    return (all_steps(workdir) or [None])[-1]


def assert_bitwise(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def cli_args(config_overrides: dict) -> list[str]:
    """Command-line flags for `python -m meshtrain.train` equal to `config_for(...)` with overrides."""
    flags = {"mesh.data": 1, "mesh.fsdp": 8, "model.dtype": "float32", "model.n_layers": 2, "train.seq_len": 32,
             "train.batch_size": 8, "log_every": 1, "data.source": "text_files", **config_overrides}
    return ["--config", str(ROOT / "configs" / "tiny.py")] + [f"--config.{k}={v}" for k, v in flags.items()]


def jax_cache_dir() -> pathlib.Path:
    """The folder of JAX's persistent compilation cache the tests share (`meshtrain.compile_cache`)."""
    return compile_cache.cache_dir() / "jax"


def subprocess_env(cache_dir) -> dict:
    """CPU, float32 matmuls, and a shared compilation cache so each restart skips the compile."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "float32",
            "PYTHONPATH": str(ROOT), **compile_cache.jax_cache_env(cache_dir)}


