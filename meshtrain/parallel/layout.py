"""The parallel plan: from a config and the mesh's axis sizes, every region's manual axes, decided once.

    layout = Layout.plan(config, sizes, platform="gpu")
    layout.pipeline            # the schedule over `stage` (None when mesh.stage == 1)
    layout.accumulation_axes   # what the gradient-accumulation loop is manual over
    layout.attention           # the attention function the model runs (ring, cuDNN, flash or einsum)
    layout.attention_impl      # its name: `attention.impl` with 'auto' resolved for the platform

Playbook, "5D parallelism in a nutshell". XLA's partitioner handles every axis from the sharding
rules alone (`sharding_rules.py`) except where meshtrain writes the communication by hand; there a
`jax.shard_map` region is *manual* over some axes and automatic over the rest. Regions nest and
compose by axis: an inner region opens a `shard_map` only over the axes its enclosing region left
automatic (`Rules.manual` tells it which are already manual). The table, outermost first:

| region | manual over | why | decided by |
|---|---|---|---|
| gradient accumulation (`train.grad_accum_steps > 1`) | split batch axes the parameters are replicated over (not `fsdp` under ZeRO-3), `sequence` under ring | one data-parallel reduction per step | `accumulation_axes` |
| pipeline loop (`mesh.stage > 1`) | `stage`, every split batch axis, `sequence` when split | per-stage `switch` / `ppermute`, weights gathered once as they enter | `pipeline_axes` |
| MoE layer (`model.num_experts`) | the batch axes not yet manual (`data`, `fsdp`, `expert`) | the token exchange over `expert` (`moe.expert_parallel`) | the enclosing region |
| ring attention (`attention.impl='ring'`) | `sequence` (and `tensor` for the K/V heads) when not yet manual | K/V blocks travel the ring by `ppermute` | the enclosing region |
| Ulysses (`attention.impl='ulysses'`) | `sequence` when not yet manual; `tensor` around each all-to-all when it splits the heads | the all-to-alls trade the sequence split for a head split | the enclosing region |
| Pallas kernels (flash, fused norm / loss) | the axes each operand is split on | a `pallas_call` cannot be partitioned | `sharding_rules.per_shard` |
| cuDNN attention (`attention.impl` cudnn, or auto on a GPU) | every axis not yet manual | its custom partitioning fails in a partly manual region | `attention.cudnn_attention` |

A region holding a Pallas kernel or a cuDNN attention call is not type-checked for variance
(`kernels`: a `pallas_call` declares none, and cuDNN's gradients come back without one). The
pipeline loop and the accumulation loop are never open together (`pipeline` rules:
`train.grad_accum_steps` must be 1 with `mesh.stage > 1`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import ml_collections
import numpy as np

from meshtrain import attention as attention_lib, config as config_lib
from meshtrain.config import BATCH_AXES, CONTEXT_PARALLEL_IMPLS, Axis, require
from meshtrain.pallas_kernels.flash_attention import MIN_BLOCK
from meshtrain.parallel import (
    pipeline as pipeline_lib,
    pipeline_tables,
    ring_attention,
    schedules,
    slot_program,
    ulysses,
)
from meshtrain.sharding_rules import ZERO_AXES

STAGE, SEQUENCE = Axis.STAGE.value, Axis.SEQUENCE.value
GradsFn = Callable  # (params, histories, batch, model, total_tokens, accum_steps) -> (loss_sum, aux, grads, amaxes)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Which regions a step opens, over which axes, and what runs inside them."""

    sizes: Mapping[str, int]  # axis -> size, all six
    platform: str  # what the step is compiled for ('cpu', 'gpu', 'tpu'): the mesh's devices
    pipeline: pipeline_lib.Pipeline | None  # None unless mesh.stage > 1
    accumulation_axes: tuple[str, ...]
    kernels: bool  # Pallas kernels or cuDNN's attention run: their regions go unchecked
    ring_flash: bool  # ring attention's blocks in the Pallas flash kernel
    attention_impl: str  # `attention.impl` as run: 'auto' resolved (`config.attention_impl`)
    attention: attention_lib.AttentionFn
    permutation: np.ndarray | None  # the data's token order along the sequence (ring zig-zag), or None

    @classmethod
    def plan(cls, config: ml_collections.ConfigDict, sizes: Mapping[str, int], platform: str = "cpu") -> Layout:
        """The plan of a validated `config` on a mesh of `sizes` whose devices are `platform`'s.
        Raises ConfigError for `attention.impl='cudnn'` on devices other than NVIDIA GPUs."""
        impl = config_lib.attention_impl(config, platform)
        require(impl != "cudnn" or platform == "gpu", "attention.impl", impl,
                f"cuDNN's fused attention runs on NVIDIA GPUs; this mesh's devices are {platform!r} "
                "(attention.impl='auto' picks the einsum attention there)")
        exchange = config_lib.moe_exchange(config, platform)
        require(exchange != "ragged" or platform == "gpu" or not config.model.num_experts, "model.moe_exchange",
                exchange, f"jax.lax.ragged_all_to_all runs on GPUs (XLA:CPU has none); this mesh's devices are "
                f"{platform!r} ('auto' picks all_to_all there)")
        kernels = uses_kernels(config, sizes, platform)
        flash = ring_flash(config, sizes, platform)
        return cls(sizes=sizes, platform=platform, pipeline=pipeline_plan(config, sizes, kernels=kernels),
                   accumulation_axes=accumulation_axes(config, sizes), kernels=kernels, ring_flash=flash,
                   attention_impl=impl, attention=attention_fn(config, flash=flash, platform=platform),
                   permutation=data_permutation(config, sizes))

    def grads_function(self, default: GradsFn) -> GradsFn:
        """The step's loss-and-gradient function: the slot-table loop of 1F1B, interleaved 1F1B and zero
        bubble (`pipeline_tables.loss_and_grads`), else `default` (autodiff, gpipe and circular included)."""
        pipe = self.pipeline
        if pipe is not None and pipe.schedule in schedules.TABLE_SCHEDULES:
            return pipeline_tables.loss_and_grads
        return default

    def lockstep_rows(self) -> dict[int, np.ndarray] | None:
        """{switch size: rows [n, p] of the branch each stage takes, one row a table tick} of the pipeline's
        loops (`slot_program.segment_rows`), how the kernel model prices them (`plan.kernel_model.kernels`), or None
        without a slot loop."""
        pipe = self.pipeline
        if pipe is not None and pipe.plan is not None:
            return slot_program.segment_rows(pipe.plan)
        return None

    def slot_shares(self) -> dict[int, np.ndarray] | None:
        """{switch size: rows [n, p] of the share of its scanned slots stage s runs at that tick} (uneven
        stages: the chunk's units over the largest chunk's, the rest empty slots skipped by a `lax.cond`,
        `pipeline.skipping`), beside `lockstep_rows`; None where every stage runs all its slots."""
        pipe = self.pipeline
        if pipe is None or pipe.plan is None or pipe.counts is None:
            return None
        counts = np.asarray(pipe.counts, np.float64) / max(pipe.units)  # [p, v]
        return {n: counts[np.arange(chunks.shape[1]), np.clip(chunks, 0, counts.shape[1] - 1)]
                for n, chunks in slot_program.segment_rows(pipe.plan, "chunk").items()}

    def branch_share(self) -> dict[int, tuple[float, ...]] | None:
        """{switch size: the share of its loops' calls that take each branch} of the pipeline's `lax.switch`
        (how often each branch's collectives run: `plan.hlo.collectives`), or None without a slot loop."""
        pipe = self.pipeline
        if pipe is not None and pipe.plan is not None:
            return slot_program.branch_share(pipe.plan)
        return None


def pipeline_axes(sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The axes a pipeline loop is manual over: `stage`, every split batch axis (each device runs its
    own rows, gradients are reduced once per step, ZeRO-3 weights gathered once as they enter), and
    `sequence` when split (ring attention runs per device inside a stage)."""
    return (STAGE, *(a for a in BATCH_AXES if sizes[a] > 1), *((SEQUENCE,) if sizes[SEQUENCE] > 1 else ()))


def pipeline_plan(config: ml_collections.ConfigDict, sizes: Mapping[str, int], *,
                  kernels: bool = False) -> pipeline_lib.Pipeline | None:
    """The configured schedule on a mesh of `sizes`, or None when the mesh has a single stage.
    `kernels`: whether the step runs Pallas kernels (the loop then goes unchecked)."""
    if sizes[STAGE] <= 1:
        return None
    pipe = config.pipeline
    unit = config.model.moe_every if config.model.num_experts else 1  # layers per scanned unit
    return pipeline_lib.Pipeline.of(pipe.schedule, sizes[STAGE], pipe.microbatches, pipe.repeats,
                                    (config.model.n_layers - config.model.first_dense_layers) // unit,
                                    (n // unit for n in pipe.layers_per_stage),
                                    axes=pipeline_axes(sizes), checked=not kernels, split_backward=pipe.split_backward,
                                    weight_parts=pipe.weight_parts, weight_span=pipe.weight_span,
                                    overlap=pipe.overlap_transfers,
                                    inputs_at_b=pipeline_lib.inputs_at_b(pipe.split_backward, config.remat.policy,
                                                                         pipe.overlap_transfers))


def accumulation_axes(config: ml_collections.ConfigDict, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The axes the gradient-accumulation loop is manual over (`train_step.accumulate_gradients`).

    The split batch axes over which the parameters are replicated, so each device accumulates
    locally and the data-parallel reduction runs once per step, plus `sequence` under ring
    attention (the ring then runs per device inside). Under ZeRO-3 ZeRO's batch axes (`fsdp`,
    `expert`: `sharding_rules.ZERO_AXES`) stay automatic: each micro-batch gathers its weights and
    reduce-scatters its gradient (gradient shards accumulate; no full-size buffer). An MoE layer
    under ZeRO-3 with one of them split would need its own shard_map over it nested in the loop,
    which jax 0.10 cannot differentiate: there the loop stays automatic and reduces per micro-batch.
    """
    zero3 = config.train.zero_stage >= 3
    sharded = tuple(a for a in BATCH_AXES if a in ZERO_AXES and sizes[a] > 1)
    if zero3 and config.model.num_experts and sharded:
        return ()
    axes = tuple(a for a in BATCH_AXES if sizes[a] > 1 and not (zero3 and a in sharded))
    context = config.attention.impl in CONTEXT_PARALLEL_IMPLS and sizes[SEQUENCE] > 1
    return axes + ((SEQUENCE,) if context else ())


def ring_flash(config: ml_collections.ConfigDict, sizes: Mapping[str, int], platform: str) -> bool:
    """Whether ring attention computes its blocks with the Pallas flash kernel: compiled for a GPU
    (`platform`: the mesh's devices, not the host's), each block (seq_len / mesh.sequence, halved by
    zig-zag) a whole number of the kernel's smallest tile, and no MoE pipeline stage around it (the
    automatic choices keep that loop type-checked; jnp blocks there)."""
    if config.attention.impl not in CONTEXT_PARALLEL_IMPLS or sizes[SEQUENCE] == 1 or platform != "gpu":
        return False
    if config.model.num_experts and sizes[STAGE] > 1:
        return False
    rings = ring_size(config, sizes)  # Ulysses: each device attends over a whole group's tokens
    block = config.train.seq_len // rings // (2 if config.attention.zigzag and rings > 1 else 1)
    return block >= MIN_BLOCK and block % MIN_BLOCK == 0


def ring_size(config: ml_collections.ConfigDict, sizes: Mapping[str, int]) -> int:
    """Devices on the K/V ring: mesh.sequence under ring attention, the groups under Ulysses (1: none)."""
    if config.attention.impl == "ulysses":
        return sizes[SEQUENCE] // ulysses.degree(config.attention.ulysses_degree, sizes[SEQUENCE])
    return sizes[SEQUENCE] if config.attention.impl == "ring" else 1


def uses_kernels(config: ml_collections.ConfigDict, sizes: Mapping[str, int], platform: str = "cpu") -> bool:
    """Whether the step runs kernels that declare no variance, whose manual regions then go unchecked:
    the Pallas kernels (flash attention, the fused RMSNorm or loss, ring attention's flash blocks on a
    GPU: `ring_flash`), cuDNN's attention calls (`attention.impl` cudnn, or auto on a GPU) and the MoE's
    grouped matmul kernel (`model.moe_matmul` pallas, or auto on a GPU)."""
    m = config.model
    impl = config_lib.attention_impl(config, platform)
    grouped = bool(m.num_experts and m.moe_dropless and config_lib.moe_matmul(config, platform) == "pallas")
    named = impl in ("pallas", "cudnn") or m.fused_norm or m.fused_loss or grouped
    return bool(named or ring_flash(config, sizes, platform))


def attention_fn(config: ml_collections.ConfigDict, flash: bool = False,
                 platform: str = "cpu") -> attention_lib.AttentionFn:
    """The attention function of `config.attention.impl` on `platform`'s devices ('auto' resolved:
    `config.attention_impl`); `flash`: ring attention's blocks in the Pallas kernel (`ring_flash`)."""
    impl = config_lib.attention_impl(config, platform)
    if impl == "ring":
        return functools.partial(ring_attention.ring, zigzag=bool(config.attention.zigzag), flash=flash,
                                 transport="ring")
    if impl == "ulysses":
        return functools.partial(ulysses.ulysses, ulysses_degree=config.attention.ulysses_degree,
                                 zigzag=bool(config.attention.zigzag), flash=flash, transport="ring")
    if impl == "pallas":
        return attention_lib.pallas_attention
    if impl == "cudnn":
        return functools.partial(attention_lib.cudnn_attention, max_documents=config.attention.max_documents)
    if config.attention.scores_dtype != "float32":
        return functools.partial(attention_lib.xla_attention, scores_dtype=config.attention.scores_dtype)
    return attention_lib.xla_attention


def data_permutation(config: ml_collections.ConfigDict, sizes: Mapping[str, int]) -> np.ndarray | None:
    """The token order of the data: zig-zag for a ring of more than one device (ring attention over
    mesh.sequence, or across Ulysses groups), else None."""
    rings = ring_size(config, sizes)
    if not config.attention.zigzag or rings == 1:
        return None
    return ring_attention.zigzag_permutation(config.train.seq_len, rings)


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """Rules of the regions' composition (gathered by `meshtrain.validate`); raises ConfigError."""
    require(not (config.model.mtp_depth and data_permutation(config, sizes) is not None), "model.mtp_depth",
            config.model.mtp_depth, "multi-token prediction reads each position's next token, which the ring's zig-zag "
            "token order moves elsewhere: set attention.zigzag=False with it")
    kernels = uses_kernels(config, sizes)  # ring attention keeps jnp blocks in MoE stages
    require(sizes[STAGE] == 1 or not (kernels and config.model.num_experts)
            or config.pipeline.schedule in schedules.TABLE_SCHEDULES, "model.num_experts", config.model.num_experts,
            "MoE layers and Pallas kernels (attention.impl='pallas', model.fused_*, model.moe_matmul='pallas') share "
            f"a pipeline stage under the slot-table schedules {schedules.TABLE_SCHEDULES} only (got pipeline.schedule="
            f"{config.pipeline.schedule!r}): the kernels need the stage loop unchecked, whose router statistics' "
            "gradients only those scale (`pipeline.unchecked_aux_scale`); or use mesh.stage=1")
