"""Time model and mesh search: playbook, "Finding the Best Training Configuration".

Step time = compute at a stated efficiency (recomputation included) + pipeline bubble +
communication that does not hide behind compute. Gradient reductions and ZeRO gathers overlap
with the backward / forward passes (prefetching, playbook "ZeRO-3"); ring attention overlaps
with attention; tensor-parallel, pipeline and expert collectives sit on the critical path.
An axis is in-node when it and every axis inside it (mesh order, innermost `tensor`) fit in
`devices_per_node`; otherwise its collectives run at the network bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable

import ml_collections

from meshtrain import cli, config as config_lib, metrics, moe
from meshtrain.mesh import MESH_ORDER
from meshtrain.parallel import cost, schedules
from meshtrain.plan import comm, memory
from meshtrain.plan.hardware import Gpu
from meshtrain.sharding_rules import ShardingRuleError
from meshtrain.validate import validate_layout

# achieved / peak FLOP/s of the step's compute as a whole (the hardware FLOPs, recomputation included;
# the gradient sums' HBM traffic is priced apart): what the H100 kernel model (`meshtrain.aot`, `plan.kernel_model`,
# within 2% of a measured H200 step) makes of the compiled steps of the dense configs, 0.59 (the GPU
# runbook's 1.5B on an H200) to 0.68 (llama3_8b on fsdp 8, batch 8): model FLOPs at 44.2% to 51.0% MFU
# under full remat (docs/aot.md). The 405B config's step (pipeline ticks priced as the table runs them)
# under full remat then models 6.53 s of compute and bubble against the kernel model's 6.66 s; at 0.5 it was 8.43 s.
EFFICIENCY = 0.65
# axes whose transfers run behind compute: the data-parallel gradients and ZeRO gathers behind the layers'
# matmuls; the ring's K/V blocks only behind the attention blocks they feed (its share of the FLOPs)
OVERLAPPED = ("data", "fsdp", "sequence")
RECOMPUTE = {"none": 0.0, "selective": 0.0, "offload": 0.0, "full": 1.0}  # extra forward passes


def recompute_passes(model: config_lib.ModelConfig, seq_len: int, remat: str) -> float:
    """Forward passes the backward runs again under `remat` (`RECOMPUTE`, in the units `EFFICIENCY` was
    calibrated in: `full` is 1). `attention` rebuilds only the MLP's gate + up matmuls of what `full`
    rebuilds (the q, k, v and output projections, the attention's forward, gate + up; the down projection's
    output is read by nothing in the backward, so neither policy recomputes it): their share of those FLOPs.
    Compiled for H100s, the kernel model's step under `attention` is shorter than under `full` for llama3_8b
    on fsdp 8 and for the 405B config, less so at 405B, whose kept values cost stash traffic; how close this
    price comes to the kernel model there: docs/mesh.md and docs/405b.md."""
    if remat != "attention":
        return RECOMPUTE[remat]
    d, f = model.d_model, model.moe_mlp_dim or model.mlp_dim
    moe_layers = model.moe_layers
    per_moe = f * model.experts_per_token + moe.shared_mlp_dim(model)
    gate_up = 4 * d * ((model.n_layers - moe_layers) * model.mlp_dim + moe_layers * per_moe)
    heads = model.n_heads * model.head_dim
    projections = 2 * d * (heads + 2 * model.n_kv_heads * model.head_dim) + 2 * heads * d
    attention = model.n_layers * (projections + 4 * seq_len * heads)
    return gate_up / (gate_up + attention)


def moe_compute(run: memory.Step, gpu: Gpu, passes: float) -> tuple[float, float]:
    """(hardware FLOPs, seconds) per device and step of the MoE layers' expert matmuls, priced as they run
    (playbook, "Expert parallelism"): dropless through the grouped matmul kernel (`model.moe_matmul`
    pallas), each chunk's routed rows at the balanced load padded to whole tiles (`memory.moe_rows`), each
    kernel at its share of the peak (`plan.kernel_model.GROUPED_EFFICIENCY`); capacity dispatch as XLA GEMMs over
    every expert's capacity slots (`capacity_factor` x the routed rows). Three matmuls, forward (and its
    recomputation) and both gradients; beside them the rows' elementwise passes (`MOE_LAYOUT_PASSES`) and
    each pass's copy of the layer's expert weights, at the HBM bandwidth. (0, 0) for a dense model and for
    `jax.lax.ragged_dot`, which XLA:GPU runs as dense work over every expert: priced with the rest."""
    from meshtrain.plan import kernel_model

    m = run.model
    grouped = m.moe_dropless and m.moe_matmul == "pallas"
    if not m.num_experts or (m.moe_dropless and not grouped):
        return 0.0, 0.0
    f = (m.moe_mlp_dim or m.mlp_dim) // run.sizes["tensor"]
    # a pipeline stage runs its own MoE rows (the largest stage's: lock-step) on each of its micro-batches
    p = run.sizes["stage"]
    layers, reps, tokens = m.moe_layers, run.grad_accum, run.micro_tokens
    if p > 1:
        layers, reps, tokens = run.stored_model.moe_layers // p, run.microbatches, run.micro_tokens // run.microbatches
    if grouped:
        rows = memory.moe_rows(run, tokens)
        computed, held = rows.expected * rows.chunks, rows.grouped * rows.chunks
        warps = 8 if rows.tile >= 128 else 4
        share = {kind: kernel_model.GROUPED_EFFICIENCY[(kind, warps)]
                 for kind in ("grouped_matmul", "grouped_matmul_dx", "grouped_matmul_dw")}
    else:  # every expert's C slots a row, filled or not
        computed = held = math.ceil(tokens * m.experts_per_token * m.capacity_factor)
        share = dict.fromkeys(("grouped_matmul", "grouped_matmul_dx", "grouped_matmul_dw"),
                              kernel_model.KERNEL_TIMES.flop_efficiency)
    a = memory.dtype_bytes(m.dtype)
    one = 2.0 * computed * m.d_model * f  # one matmul over a micro-batch's rows on one device
    # a matmul reads its experts' weights whole, its rows and writes its output: with many experts of few rows
    # each (128 experts on one device) the weights' bytes outlast the FLOPs
    moved = (m.num_experts // run.ep * m.d_model * f + computed * m.d_model + held * f) * a
    bound = moved / (gpu.hbm_bandwidth * HBM_EFFICIENCY) * gpu.peak_flops  # the same in FLOP-seconds at the peak
    work = 3 * ((1 + passes) * max(one / share["grouped_matmul"], bound) + max(one / share["grouped_matmul_dx"], bound)
                + max(one / share["grouped_matmul_dw"], bound))
    layout = MOE_LAYOUT_PASSES[grouped] * held * (m.d_model + f) * a * (2 + passes)
    # each pass reads the layer's expert weights into a buffer of their own (a custom call's operand):
    # converted from the stored dtype and sliced out of the layer stack, or, gathered by ZeRO-3 along
    # their model dimension, only the local shard converted
    weights = 3 * m.num_experts // run.ep * m.d_model * f
    split = run.sizes["sequence"] * (1 if run.rules.experts_over_fsdp else run.sizes["fsdp"])  # ZeRO's on D
    per_weight = WEIGHT_CONVERT_BYTES / split if run.zero_stage >= 3 and split > 1 else WEIGHT_CONVERT_BYTES + 2 * a
    copies = weights * per_weight * (2 + passes) if grouped else 0.0
    seconds = layers * reps * work / gpu.peak_flops
    seconds += layers * (reps * layout + copies) / (gpu.hbm_bandwidth * HBM_EFFICIENCY)
    return layers * reps * one * (3 * (1 + passes) + 6), seconds


def exposed_exchange(run: memory.Step, seconds: float, expert_seconds: float) -> float:
    """The seconds of the MoE exchange (`seconds` in all) the step waits for. In c chunks (`model.moe_chunks`)
    a layer's pass exchanges 2c times, and all but the first chunk's dispatch and the last one's return
    can run beside another chunk's grouped matmuls, (c - 1) / c of the experts' time (`moe_compute`): what
    does not fit beside them stays exposed, at least 1/c of the exchange."""
    chunks = memory.moe_rows(run).chunks if run.model.moe_dropless else 1
    hidden = min(seconds * (chunks - 1) / chunks, expert_seconds * (chunks - 1) / chunks)
    return seconds - hidden


def moe_rest_seconds(run: memory.Step, gpu: Gpu, passes: float, peak: float) -> float:
    """Seconds per device and step of an MoE step's work beside its grouped expert matmuls (`moe_compute`),
    by its parts, as the kernel model prices them: the other matmuls at the GEMMs' share of the peak, the
    attention's FLOPs at the attention kernels', the optimizer's pass over its state and the loss's over
    the logits at the HBM bandwidth. (A dense step keeps `EFFICIENCY`, calibrated on dense steps as a
    whole: their MLP GEMMs dominate; an MoE step's rest runs at a lower share of the peak.)"""
    from meshtrain.plan import kernel_model

    m = run.model
    n = math.prod(run.sizes.values())
    tokens = run.batch_size * run.seq_len
    attention = metrics.attention_flops_per_token(m, run.seq_len)
    experts = 18.0 * m.experts_per_token * m.d_model * (m.moe_mlp_dim or m.mlp_dim) * m.moe_layers
    scale = tokens / n * (1 + passes / 3)
    matmuls = (metrics.flops_per_token(m, run.seq_len) - attention - experts) * scale
    state = memory.placed_elements(run.stored_model, run.placement()["optimizer"]) * OPTIMIZER_BYTES
    logits = run.micro_tokens * m.vocab_size // run.sizes["tensor"] * run.grad_accum * LOSS_BYTES
    # the norms, residuals and conversions of a device's tokens, whole on every `tensor` device
    layers = run.stored_model.n_layers // run.sizes["stage"]  # a pipeline stage's (the largest's) layers
    tokens_passes = TOKEN_PASSES * run.micro_tokens * run.grad_accum * m.d_model * layers * (2 + passes)
    return (matmuls / (peak * kernel_model.KERNEL_TIMES.flop_efficiency)
            + attention * scale / (peak * ATTENTION_EFFICIENCY)
            + (state + logits + tokens_passes * memory.dtype_bytes(m.dtype)) / (gpu.hbm_bandwidth * HBM_EFFICIENCY))


# An MoE step's parts beside its experts (`moe_rest_seconds`), as the H100 kernel model prices them: attention at the
# share of the peak of the attention kernels at head dims above 64 (`plan.kernel_model.MEASURED_EFFICIENCY`: cuDNN
# 0.47 / 0.50, the Pallas flash kernel's 0.40 / 0.47), AdamW's pass over its float32 state (reads parameter, gradient
# and two moments, writes three) and the unfused loss's passes over the float32 logits (the head's GEMM writes them
# beside its FLOPs; the log-sum-exp reads them, the gradient's pass reads them and writes the gradient in the compute
# dtype: 4 + 4 + 2 bytes a logit), at `HBM_EFFICIENCY` of the bandwidth (`plan.kernel_model.KernelTimes`); a stored
# float32 weight converted to the compute dtype reads 4 bytes and writes 2.
ATTENTION_EFFICIENCY = 0.45
OPTIMIZER_BYTES = 28
LOSS_BYTES = 10
HBM_EFFICIENCY = 0.65
WEIGHT_CONVERT_BYTES = 6
# reads and writes of a layer's [tokens, d_model] a pass, in the compute dtype (the norms' float32 steps
# included): calibrated with MOE_LAYOUT_PASSES on the same compiles and Mixtral on expert 8 x tensor 8
# (`aot.REFERENCE_MESHES`), whose tokens are whole on each `tensor` device
TOKEN_PASSES = 20.0
# The MoE rows' elementwise work a pass of one layer (the gathers into and out of the layout, the exchange's
# buffers, the gradients' sums; with capacity dispatch the SwiGLU's passes too, which the grouped kernels
# fuse), in reads and writes of [rows, d_model + width] in the compute dtype: calibrated on the H100
# compiles of `bench/moe.py --modeled` (the kernel model's price of those kernels). {grouped: passes}
MOE_LAYOUT_PASSES = {True: 1.5, False: 6.0}


@dataclasses.dataclass
class Estimate:
    # the candidate's config, or a function that builds it (`config`): a search prices tens of thousands
    # of candidates and reads the config of a few
    source: ml_collections.ConfigDict | Callable[[], ml_collections.ConfigDict]
    run: memory.Step
    remat: str
    memory: dict[str, int]
    comm_bytes: dict[str, float]
    comm_seconds: dict[str, float]
    compute_seconds: float
    bubble_seconds: float
    step_seconds: float
    tokens_per_second: float
    mfu: float
    fits: bool
    usable_bytes: int
    limit: str = ""
    # seconds a micro-batch's weight gradients take to add into the float32 sums (in `compute_seconds`,
    # once per micro-batch)
    accumulate_seconds: float = 0.0

    @functools.cached_property
    def config(self) -> ml_collections.ConfigDict:
        return self.source if isinstance(self.source, ml_collections.ConfigDict) else self.source()

    @property
    def pipeline(self) -> str:
        """The pipeline in a few words ('' without a `stage` axis): schedule, chunks, overlap, micro-batches."""
        if self.run.sizes["stage"] == 1:
            return ""
        chunks = f" v={self.run.pipeline_repeats}" if self.run.pipeline_repeats > 1 else ""
        overlap = ", transfers overlapped" if self.run.overlap_transfers else ""
        return f"{self.run.pipeline_schedule}{chunks}{overlap}, {self.run.microbatches} micro-batches"

    def as_json(self) -> dict:
        return {"num_params": memory.num_params(self.run.model), "mesh": dict(self.run.sizes),
                "zero_stage": self.run.zero_stage, "remat": self.remat, "grad_accum_steps": self.run.grad_accum,
                "micro_batch_per_device": self.run.batch_size // self.run.grad_accum // self.run.dp,
                "memory_per_device_bytes": dict(self.memory),
                "comm_bytes_per_step": {a: int(b) for a, b in self.comm_bytes.items()},
                "exposed_comm_seconds": dict(self.comm_seconds), "compute_seconds": self.compute_seconds,
                "bubble_seconds": self.bubble_seconds, "predicted_step_time_s": self.step_seconds,
                "tokens_per_second": self.tokens_per_second, "predicted_mfu": self.mfu, "fits": self.fits,
                "limit": self.limit, "pipeline": self.pipeline}


def in_node_axes(sizes: dict[str, int], devices_per_node: int) -> set[str]:
    inside, product = set(), 1
    for axis in reversed(MESH_ORDER):
        product *= sizes[axis]
        if product <= devices_per_node or sizes[axis] == 1:
            inside.add(axis)
    return inside


def memory_breakdown(run: memory.Step, remat: str) -> dict[str, int]:
    state = memory.state_memory(run)
    act = memory.activation_memory(run, remat)
    out = {**state, **act}
    out["total"] = sum(out.values())
    return out


def estimate(config: ml_collections.ConfigDict, sizes: dict[str, int], gpu: Gpu, devices_per_node: int = 8,
             efficiency: float = EFFICIENCY, run: memory.Step | None = None) -> Estimate:
    """Memory, communication and time of the configured step on `gpu`s (`run`: the config's
    `memory.Step`, when the caller has it; it must be `memory.Step.from_config(config, sizes)`)."""
    run = run or memory.Step.from_config(config, sizes)
    remat = config.remat.policy
    mem = memory_breakdown(run, remat)
    colls = comm.step_collectives(run, remat, comm.GPU)
    per_axis = comm.bytes_by_axis(colls)
    n = math.prod(sizes.values())
    tokens = run.batch_size * run.seq_len
    per_token = metrics.flops_per_token(run.model, run.seq_len)
    model_flops = per_token * tokens
    passes = recompute_passes(run.model, run.seq_len, remat)
    hardware_flops = model_flops * (1 + passes / 3)  # a forward pass is 1/3 of fwd + bwd
    # the FP8 share of the FLOPs at the FP8 peak (model.matmul_precision='fp8')
    peak = metrics.blended_peak(gpu.peak_flops, gpu.peak_fp8_flops, metrics.fp8_flops_per_token(run.model) / per_token)
    # a pipeline runs in lock-step: every tick lasts as long as the stage (chunk) with the most layers, so
    # uneven stages compute as if each held that many (`memory.Step.stored_model`'s rows)
    busy = metrics.flops_per_token(run.stored_model, run.seq_len) / per_token
    expert_flops, expert_seconds = moe_compute(run, gpu, passes)  # the grouped kernels' own price
    if expert_flops:  # the rest of an MoE step by its parts
        compute = moe_rest_seconds(run, gpu, passes, peak) + expert_seconds
    else:
        compute = hardware_flops * busy / n / (peak * efficiency)
    inside = in_node_axes(sizes, devices_per_node)
    # every micro-batch adds its weight gradients into float32 sums (a pipeline stage's or the accumulation
    # loop's): the sums and the gradient read, the sums written, at the HBM bandwidth. Memory-bound work
    # beside the FLOPs: with micro-batches of a few hundred tokens it outlasts them (405B on 64 stages in
    # 1,024 micro-batches: the H100 kernel model's step ten times the FLOPs alone)
    micro = run.microbatches if sizes["stage"] > 1 else run.grad_accum
    accumulate = 0.0
    if micro > 1:
        place = run.placement()["compute" if sizes["stage"] > 1 or run.zero_stage < 3 else "grads"]
        summed = sum(memory.local_size(leaf, place) for leaf in memory.param_table(run.stored_model)
                     if leaf.in_layers or sizes["stage"] == 1)
        accumulate = 3 * 4 * summed / gpu.hbm_bandwidth
    compute += micro * accumulate if micro > 1 else 0.0
    exposed = {}
    attention = metrics.attention_flops_per_token(run.model, run.seq_len) / per_token
    exchange: dict[str, float] = {}  # the MoE exchange's bytes per axis (expert, and fsdp where experts split over it)
    for c in colls:
        if c.what == comm.EXCHANGE:
            for axis, nbytes in comm.attribute(c.kind, c.full_bytes, c.axes).items():
                exchange[axis] = exchange.get(axis, 0.0) + nbytes * c.count
    def bandwidth(axis: str) -> float:
        return gpu.nvlink_bandwidth if axis in inside else gpu.network_bandwidth

    # the exchange hides behind the grouped matmuls once, whatever axes it runs over: its exposed seconds
    # shared among them by their part of its time
    exchanging = {axis: nbytes / bandwidth(axis) for axis, nbytes in exchange.items()}
    total = sum(exchanging.values())
    left = exposed_exchange(run, total, expert_seconds) if exchanging else 0.0
    for axis, nbytes in per_axis.items():
        seconds = nbytes / bandwidth(axis)
        behind = compute * (attention if axis == "sequence" else 1.0)
        if axis in exchange:  # ZeRO's share behind compute as over fsdp; the MoE exchange (`exposed_exchange`)
            exposed[axis] = max(0.0, seconds - exchanging[axis] - behind) + left * exchanging[axis] / total
            continue
        exposed[axis] = max(0.0, seconds - behind) if axis in OVERLAPPED else seconds
    bubble = 0.0
    if sizes["stage"] > 1:  # the loop as executed in lock-step (`parallel.cost`), not the table's formula
        p, m, v = sizes["stage"], run.microbatches, run.pipeline_repeats
        flops = compute - m * accumulate
        span = run.pipeline.span
        costs = cost.BranchCosts.analytic(flops / (m * (3 + passes)), recompute_share=passes,
                                          recompute=remat != "none", split_backward=run.split_backward,
                                          accumulate=accumulate, weight_span=span)
        executed = cost.step_time(run.pipeline_schedule, p, m, v, costs, run.weight_parts,
                                  overlap=run.overlap_transfers, defer_w=run.pipeline.defers_w, span=span)
        # a W over several micro-batches adds to the gradient sums once for them all
        compute -= cost.step_time(run.pipeline_schedule, p, m, v, costs, run.weight_parts,
                                  overlap=run.overlap_transfers, defer_w=run.pipeline.defers_w).work - executed.work
        bubble = executed.seconds - compute
        # the stage-to-stage permutes priced inside the loop: after each tick's (slot's) operation, or with
        # `pipeline.overlap_transfers` beside the next one's, hidden where that lasts longer (the H100 compile
        # of 405B in 2 interleaved chunks a stage has every permute with compute beside it: docs/405b.md)
        permutes = sum(comm.attribute(c.kind, c.full_bytes, c.axes)["stage"] * c.count for c in colls
                       if c.kind == "collective-permute" and "stage" in c.axes)
        link = gpu.nvlink_bandwidth if "stage" in inside else gpu.network_bandwidth
        count, in_tick = run.pipeline.transfers  # the permutes of a step, of a tick
        per_tick = permutes / link / count * in_tick
        moved = cost.step_time(run.pipeline_schedule, p, m, v, dataclasses.replace(costs, transfer=per_tick),
                               run.weight_parts, overlap=run.overlap_transfers,
                               defer_w=run.pipeline.defers_w, span=span).seconds
        exposed["stage"] = moved - compute - bubble + exposed.get("stage", 0.0) - permutes / link
    step = compute + bubble + sum(exposed.values())
    fits = mem["total"] <= gpu.usable_bytes
    est = Estimate(config, run, remat, mem, per_axis, exposed, compute, bubble, step, tokens / step,
                   model_flops / step / (n * peak), fits, gpu.usable_bytes)
    est.limit = binding_limit(est)
    est.accumulate_seconds = accumulate
    return est


def binding_limit(est: Estimate) -> str:
    """Why this candidate is not faster (or does not fit), in a few words."""
    use = est.memory["total"] / est.usable_bytes
    if not est.fits:
        return f"memory: {use:.0%} of usable HBM"
    costs = {"compute": est.compute_seconds, "pipeline bubble": est.bubble_seconds,
             **{f"{a} comm": s for a, s in est.comm_seconds.items()}}
    worst = max((k for k in costs if k != "compute"), key=costs.get, default=None)
    if worst and costs[worst] > 0.05 * est.step_seconds:
        return f"{worst} {costs[worst] / est.step_seconds:.0%} of step; memory {use:.0%}"
    return f"compute-bound; memory {use:.0%}"


def _factorizations(n: int, axes: list[str]):
    if len(axes) == 1:
        yield {axes[0]: n}
        return
    for d in (d for d in range(1, n + 1) if n % d == 0):
        for rest in _factorizations(n // d, axes[1:]):
            yield {axes[0]: d, **rest}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SEARCH_REPEATS = (2, 4)  # chunks a stage the search tries for a chunked schedule


def _pipeline_choices() -> tuple[tuple[str, int, bool], ...]:
    """The schedules a search tries on a pipelined mesh, (pipeline.schedule, pipeline.repeats,
    pipeline.overlap_transfers), read off the registry: the slot tables, whose activation memory is
    flat in m, with their fused backward (zero bubble's split one is left out: measured on an H200,
    slower than 1F1B, docs/pipeline.md); each chunked one at SEARCH_REPEATS chunks a stage; with and
    without the transfers behind compute, except where the two tables are one (the alternating tables:
    the overlap hides the transfers for the same ticks and memory)."""
    choices = []
    for name, entry in schedules.REGISTRY.items():
        if entry.loop != schedules.TABLE or entry.split_backward:
            continue
        overlaps = (True,) if entry.alternating else (False, True) if entry.overlapping else (False,)
        choices += [(name, v, overlap) for v in (SEARCH_REPEATS if entry.chunked else (1,)) for overlap in overlaps]
    return tuple(choices)


# 1F1B with and without its transfers behind compute, interleaved 1F1B in 2 and 4 chunks a stage
PIPELINE_CHOICES = _pipeline_choices()


def candidate_configs(config: ml_collections.ConfigDict, num_devices: int, devices_per_node: int = 8):
    """Valid (config, sizes) over meshes x ZeRO stage x remat policy x gradient accumulation, and on a
    pipelined mesh x PIPELINE_CHOICES."""
    for _, sizes, _, layout in _candidates(config, num_devices, devices_per_node):
        yield with_layout(config, layout), sizes


def with_layout(config: ml_collections.ConfigDict, layout: dict[str, object]) -> ml_collections.ConfigDict:
    """A copy of `config` with the keys of `layout` ("mesh.fsdp" -> 8, ...) set; locked if `config` is."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        cli.apply_overrides(c, layout)
    if config.is_locked:  # a copy of an unlocked config is unlocked
        c.lock()
    return c


def _candidates(config: ml_collections.ConfigDict, num_devices: int, devices_per_node: int):
    """(scratch config, sizes, `memory.Step`, layout) per valid candidate: the scratch is one config a
    mesh, valid only until the next candidate; `with_layout(config, layout)` is the candidate's own
    (the Step is built to check its state fits the mesh)."""
    axes = ["data", "fsdp", "tensor", "sequence"] + (["expert"] if config.model.num_experts else ["stage"])
    for mesh in _factorizations(num_devices, axes):
        if mesh["tensor"] > devices_per_node:
            continue
        zeros = (0, 1, 2, 3) if mesh["fsdp"] * mesh.get("expert", 1) > 1 else (0,)
        dp = config_lib.data_parallel_size({axis: mesh.get(axis, 1) for axis in config_lib.BATCH_AXES})
        if config.train.batch_size % dp:
            continue
        per_rank = config.train.batch_size // dp
        # ring attention splits the sequence; a pipeline takes one row per micro-batch (the smallest
        # bubble) instead of gradient accumulation, under one of PIPELINE_CHOICES (flat activation memory)
        pipelined = mesh.get("stage", 1) > 1
        # one scratch copy a mesh, set and validated per combination. The combinations set only layout
        # keys, each to a valid choice: the config's other fields are checked once a mesh
        # (`validate_fields`), the layout rules per combination.
        mesh_layout = {f"mesh.{axis}": mesh.get(axis, 1) for axis in config_lib.MESH_AXES}
        mesh_layout.update({f"mesh.dcn_{axis}": 1 for axis in config_lib.MESH_AXES})
        if mesh.get("sequence", 1) > 1:
            mesh_layout["attention.impl"] = "ring"
        c = config.copy_and_resolve_references()
        with c.unlocked():
            cli.apply_overrides(c, mesh_layout)
            fields_checked = False
            for zero, remat, accum, (schedule, repeats, overlap) in itertools.product(
                    zeros, ("none", "selective", "attention", "full"), [1] if pipelined else _divisors(per_rank),
                    PIPELINE_CHOICES if pipelined else [PIPELINE_CHOICES[0]]):
                combination = {"train.zero_stage": zero, "remat.policy": remat, "train.grad_accum_steps": accum}
                if pipelined:
                    combination.update({"pipeline.schedule": schedule, "pipeline.microbatches": per_rank,
                                        "pipeline.repeats": repeats, "pipeline.overlap_transfers": overlap})
                cli.apply_overrides(c, combination)
                try:
                    if not fields_checked:
                        config_lib.validate_fields(c)
                        fields_checked = True
                    sizes = validate_layout(c, num_devices)
                    run = memory.Step.from_config(c, sizes)
                    memory.state_memory(run)
                except (ValueError, ShardingRuleError):
                    if not fields_checked:
                        break  # a field no combination sets is invalid: every combination would fail
                    continue
                yield c, sizes, run, {**mesh_layout, **combination}


# The search ranks first the candidates whose modelled memory leaves this share of usable HBM free:
# the model's error against the compiler (docs/aot.md, "Planning a run": mean 4.4%). Without it the 405B
# search chose a layout modelled at 76.90 GiB that the H100 compiler put at 78.07 (over 78 usable).
SEARCH_HEADROOM = 0.05
PROGRESS_SECONDS = 10.0


def search(config: ml_collections.ConfigDict, num_devices: int, gpu: Gpu, devices_per_node: int = 8,
           efficiency: float = EFFICIENCY, progress: Callable[[int, float, bool], None] | None = None
           ) -> list[Estimate]:
    """Every valid candidate: those that fit with SEARCH_HEADROOM to spare first, ranked by predicted
    MFU; then those that fit only without it, by MFU; then the rest, smallest first.

    `progress(candidates so far, seconds, done)` is called every PROGRESS_SECONDS and once at the end
    (a search over thousands of devices prices tens of thousands of candidates)."""
    out, start = [], time.monotonic()
    last = start
    for c, sizes, run, layout in _candidates(config, num_devices, devices_per_node):
        e = estimate(c, sizes, gpu, devices_per_node, efficiency, run)
        e.source = functools.partial(with_layout, config, layout)  # the scratch `c` changes next candidate
        out.append(e)
        if progress and time.monotonic() - last >= PROGRESS_SECONDS:
            last = time.monotonic()
            progress(len(out), last - start, False)
    if progress:
        progress(len(out), time.monotonic() - start, True)

    def rank(e: Estimate):
        spare = e.memory["total"] <= (1 - SEARCH_HEADROOM) * e.usable_bytes
        return (not e.fits, not spare, -round(e.mfu, 4) if e.fits else e.memory["total"],
                sum(e.comm_bytes.values()), e.memory["total"])
    out.sort(key=rank)
    return out


def no_fit_message(best: Estimate, gpu: Gpu, num_devices: int) -> str:
    """What would have to change when nothing fits: the closest candidate and the shortfall."""
    need = best.memory["total"]
    global_state = 16 * memory.num_params(best.run.model)  # params + grads + Adam moments, float32
    more = max(num_devices + 1, math.ceil(global_state / (0.5 * gpu.usable_bytes)))  # state <= half of HBM
    mesh = ", ".join(f"{a}={n}" for a, n in best.run.sizes.items() if n > 1) or "single device"
    tips = [f"a GPU with at least {need / 2**30:.1f} GiB usable",
            "a smaller train.batch_size or train.seq_len (activations)"]
    tips.insert(0, f"about {more} devices or more (ZeRO-3 shards the {global_state / 2**30:.0f} GiB of state "
                   "so it takes at most half of each device)")
    return (f"no mesh of {num_devices} x {gpu.name} fits: the smallest candidate ({mesh}, ZeRO-{best.run.zero_stage}, "
            f"remat={best.remat}, accumulation {best.run.grad_accum}) needs {need / 2**30:.1f} GiB per device, "
            f"{gpu.usable_bytes / 2**30:.1f} GiB usable. It would take: " + "; or ".join(tips))
