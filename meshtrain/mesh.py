"""The six-axis device mesh: axis names, construction, fake CPU devices, multi-process start.

Playbook, "5D parallelism in a nutshell": every parallelism is one axis of one mesh.
The devices are laid out outermost to innermost as data, stage, fsdp, expert, sequence,
tensor, so that the axes with the heaviest traffic (tensor, sequence) are neighbours on
the fastest links. Multi-node meshes split each axis into an in-node and a cross-node
(DCN) part (`config.mesh.dcn_*`) so that `tensor` stays inside a node.
"""

from __future__ import annotations

import logging
import os
import re

import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils

from meshtrain import config as config_lib
from meshtrain.config import Axis

log = logging.getLogger(__name__)


# Device order, outermost (slowest links) to innermost (fastest links).
MESH_ORDER: tuple[str, ...] = (Axis.DATA.value, Axis.STAGE.value, Axis.FSDP.value,
                               Axis.EXPERT.value, Axis.SEQUENCE.value, Axis.TENSOR.value)


def fake_cpu_devices(count: int) -> None:
    """Asks for `count` CPU devices; effective only before JAX initialises its backends."""
    if count <= 0:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.default_backend() == "cpu" and jax.device_count() != count:
            log.warning("JAX already started with %d devices; config.cpu_devices=%d ignored",
                        jax.device_count(), count, extra={"local": True})
        return
    jax.config.update("jax_num_cpu_devices", count)


def maybe_initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """Starts `jax.distributed` when the config or the environment says the run is multi-process.

    Explicit `config.distributed.*` values win; otherwise JAX's own cluster detection
    (SLURM, Open MPI, cloud TPU/GPU launchers) is used when such an environment is present.
    """
    dist = config.distributed
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return  # already joined
    if dist.coordinator_address:
        jax.distributed.initialize(dist.coordinator_address, num_processes=dist.num_processes,
                                   process_id=dist.process_id)
    elif any(var in os.environ for var in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")):
        jax.distributed.initialize()


def make_mesh(config: ml_collections.ConfigDict, devices: list | None = None) -> jax.sharding.Mesh:
    """Builds the mesh from `config.mesh`, axes in MESH_ORDER, Auto axis types (logical-rule sharding).

    Raises ConfigError if the axis sizes do not multiply to the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = config_lib.mesh_shape(config, len(devices))
    shape = tuple(sizes[name] for name in MESH_ORDER)
    dcn = tuple(int(config.mesh[f"dcn_{name}"]) for name in MESH_ORDER)
    if np.prod(dcn) > 1:
        ici = tuple(s // d for s, d in zip(shape, dcn, strict=True))
        device_array = _hybrid_device_array(ici, dcn, devices)
    else:
        device_array = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_ORDER)
    return jax.sharding.Mesh(device_array, MESH_ORDER, axis_types=axis_types)


def _hybrid_device_array(ici: tuple[int, ...], dcn: tuple[int, ...], devices: list) -> np.ndarray:
    """Devices laid out so that each axis is (cross-node part) x (in-node part), nodes outermost.

    Nodes ("granules") are slices where the devices span several (multi-slice TPU), else the processes
    the devices belong to (GPU nodes: one process per node, also for a GPU target's devices compiled
    ahead of time; GPU devices report one slice, 0, however many nodes); a single process of fake CPU
    devices is cut into consecutive granules so the layout can be tested.
    """
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, allow_split_physical_axes=True)
    if len({d.process_index for d in devices}) > 1:
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, process_is_granule=True,
                                                    allow_split_physical_axes=True)
    per_granule = int(np.prod(ici))
    granules = [mesh_utils.create_device_mesh(ici, devices[g * per_granule:(g + 1) * per_granule],
                                              allow_split_physical_axes=True)
                for g in range(int(np.prod(dcn)))]
    stacked = np.stack(granules).reshape(dcn + ici)  # [dcn..., ici...]
    n = len(ici)
    interleaved = stacked.transpose([i for pair in zip(range(n), range(n, 2 * n), strict=True) for i in pair])
    return interleaved.reshape(tuple(d * i for d, i in zip(dcn, ici, strict=True)))


# XLA:CPU's AllReducePromotion pass rewrites each bfloat16 all-reduce as a float32 one: it clones
# the reduction computation and re-creates its root with HloInstruction::CreateBinary. Inside a
# `jax.shard_map` that is manual over only some of the mesh's axes (every shard_map meshtrain
# writes: the MoE exchange, the pipeline, ring attention, the kernel wrappers, the accumulation
# loop), Shardy leaves that root a `copy` of the add (the reducer's replicated-sharding
# annotation), and the clone aborts the process: "hlo_instruction.cc: Invalid binary instruction
# opcode copy". Any bf16 all-reduce there triggers it: an explicit psum / pmax, the psum that
# autodiff puts where a replicated bf16 operand meets per-device values (check_vma=True), or the
# psum of a replicated bf16 input's cotangent at a check_vma=False boundary. float32 and float16
# all-reduces are not promoted and compile; so do bfloat16 ones with the pass off, which the CPU
# collectives (in-process and gloo) reduce directly. GPU compilers do not promote bfloat16 (NCCL
# reduces it), so only CPU compiles get the option. tests/test_xla_workarounds.py keeps the
# minimal programs.
CPU_COMPILER_OPTIONS: dict[str, str] = {"xla_disable_hlo_passes": "all-reduce-promotion"}


# Playbook, "Data Parallelism" (overlap) and "ZeRO-3" (prefetch): on GPU the collectives should run
# behind compute. XLA:GPU's latency-hiding scheduler orders each asynchronous start/done pair
# around independent compute; the collective pipeliner moves a scanned layer's all-gather into the
# previous iteration and its reduce-scatter / all-reduce into the next, so layer i's weights are
# gathered while layer i-1 computes (FSDP's prefetch), and the while-loop double buffering unrolls
# the layer scan by two so that the moved collectives have a neighbour to hide behind.
# `bench/gpu/overlap.py` counts the pairs and the compute between them on the first GPU run.
# The values are typed (bool): XLA:GPU rejects the string "true" for a bool option
# ("'true' is not a valid bool value"), which would end every multi-device GPU run at its first compile.
#
# XLA renamed the collective pipeliner's switches in jaxlib 0.11.1: the booleans
# `xla_gpu_enable_pipelined_<kind>` up to 0.11.0, the enums `xla_gpu_pipeline_<kind>`
# (`COLLECTIVE_PIPELINING_MODE_ON`, given by name) from 0.11.1 on. An option the compiler does not know
# ends every multi-device GPU compile ("No such compile option"), so the names follow the jaxlib this
# process runs: deviceless H100 compiles checked on jaxlib 0.10.2, 0.11.0, 0.11.1, 0.11.2 and 0.12.0.1.
PIPELINER_RENAMED = (0, 11, 1)


def jaxlib_version() -> tuple[int, ...]:
    """The running jaxlib's version, e.g. (0, 12, 0, 1)."""
    import jaxlib

    return tuple(int(part) for part in re.findall(r"\d+", jaxlib.__version__)[:4])


def collective_pipeliner_options(version: tuple[int, ...]) -> dict[str, bool | str]:
    """The options that turn XLA:GPU's collective pipeliner on for gathers, scatters and all-reduces,
    named as the compiler of jaxlib `version` knows them."""
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    if version < PIPELINER_RENAMED:
        return {f"xla_gpu_enable_pipelined_{kind}": True for kind in kinds}
    return {f"xla_gpu_pipeline_{kind}": "COLLECTIVE_PIPELINING_MODE_ON" for kind in kinds}


GPU_COMPILER_OPTIONS: dict[str, bool | int | str] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    **collective_pipeliner_options(jaxlib_version()),
    "xla_gpu_enable_while_loop_double_buffering": True,
}
# With a pipeline (`stage` > 1), up to eight asynchronous collectives in flight at once, not XLA's one:
# a pipeline tick sends an activation forward and a gradient back, and a tick's `lax.switch` whose
# branches hold collectives (tensor parallelism's, sequence parallelism's) takes its share of the limit,
# so with one (or two, or three) in flight the permutes wait with nothing beside them. 8 H100s,
# llama3_8b 4 layers: stage 4 x tensor 2 overlapped 1F1B, 2 of 4 permutes beside compute at limits 1-2,
# 4 of 4 at 3; stage 4 x fsdp 2: the stage weights' gathers 4 -> 9 of 9 and the gradients'
# reduce-scatters 2 -> 5 of 6 (1f1b; zero bubble); llama3_405b's overlapped 1F1B: 2 -> 4 of 4 permutes
# at 8 (3 is not enough there), its plain config's reduce-scatters 82 -> 117 of 190 beside compute,
# every peak within 0.06 GiB. Without a pipeline it mostly costs memory and overlaps as much or less
# (pairs beside compute, peak at limits 1 / 8: llama3_8b fsdp 8 68 / 68 of 70, 43.26 / 45.17 GiB;
# fsdp 4 x tensor 2 76 / 75 of 80, 31.27 / 32.18; Pallas kernels 67 / 67 of 70, 22.13 / 23.68;
# llama3_70b fsdp 16 x tensor 4 74 / 71 of 82; Mixtral expert 8 x tensor 8 84 / 80 of 85; ring
# attention 68.08 / 73.74 GiB), so those meshes keep XLA's default. The exception measured: Llama 3
# 405B on fsdp 16,384 alone, 40 / 49 of 49 gathers and 9 / 11 of 11 scatters, 61.98 / 59.68 GiB.
PIPELINE_COLLECTIVE_OVERLAP_LIMIT = 8


# The scheduler's memory budget: XLA:GPU gives the latency-hiding scheduler (80% of HBM - the
# program's inputs and outputs) x slop / 100 for temporaries, and above it the scheduler orders for
# memory and starts no collective before it must. A step whose temporaries pass that budget (the
# 405B config: 53.4 GiB against 40.5 on an H100) keeps its gathers waiting (16 of 388 overlapped); a larger slop lets
# the scheduler overlap and the compiled peak (checked against usable HBM by `meshtrain.aot`)
# says what it cost. `train.xla_gpu_memory_limit_slop_factor`; XLA's default 95.
XLA_DEFAULT_SLOP = 95


def compiler_options(mesh: jax.sharding.Mesh, slop: int = XLA_DEFAULT_SLOP) -> dict[str, str | bool | int]:
    """XLA options for programs compiled over `mesh` (`jax.jit(..., compiler_options=...)`); `slop`:
    the GPU scheduler's memory budget factor (train steps pass `train.xla_gpu_memory_limit_slop_factor`)."""
    platform = mesh.devices.flat[0].platform
    if platform == "cpu":
        return dict(CPU_COMPILER_OPTIONS)
    if platform not in ("gpu", "cuda", "rocm") or mesh.size == 1:
        return {}
    options: dict[str, str | bool | int] = dict(GPU_COMPILER_OPTIONS)
    if dict(getattr(mesh, "shape", {})).get("stage", 1) > 1:
        options["xla_gpu_experimental_parallel_collective_overlap_limit"] = PIPELINE_COLLECTIVE_OVERLAP_LIMIT
    if slop != XLA_DEFAULT_SLOP:
        options["xla_gpu_memory_limit_slop_factor"] = slop
    return options


def single_device_mesh(device: jax.Device | None = None) -> jax.sharding.Mesh:
    """All six axes of size 1 on one device: where unsharded arrays run through the model."""
    return jax.make_mesh((1,) * len(MESH_ORDER), MESH_ORDER, devices=[device or jax.devices()[0]],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_ORDER))


def describe(mesh: jax.sharding.Mesh) -> str:
    """One line: the non-trivial axes and the device count."""
    parts = [f"{name}={size}" for name, size in mesh.shape.items() if size > 1] or ["single device"]
    return f"mesh {', '.join(parts)} ({mesh.size} devices, {jax.process_count()} process(es))"
