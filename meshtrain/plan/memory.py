"""Memory model per device: parameters, gradients, optimizer state, activations, temporaries.

Playbook, "Memory usage in Transformers" and "ZeRO: Memory usage revisited". The playbook's
forms are reproduced exactly (`playbook_*` below); the planner itself counts meshtrain's own
state, which differs in how bytes are spent but not in the total: meshtrain keeps float32
parameters (the master weights, cast to bf16 inside each matmul; a pipeline in several chunks a
stage casts its stage's once a step instead), float32 gradients and two float32 Adam moments, i.e.
4 + 4 + 8 = 16 bytes per parameter, the playbook's 2 + 2 + 12 without fp32 gradient accumulation.

Playbook arithmetic checked here (the tests pin every number):

* the model-size table (16 / 112 / 1120 / 6480 GB and 20 / 140 / 1400 / 8100 GB), the ZeRO
  figures for Psi = 7B on 64 ranks (112 / 29.31 / 15.53 / 1.75 GB) and the GPT-2 formula
  h v + L (12 h^2 + 13 h) + 2 h = 123,653,376 for h=768, v=50257, L=12 (124,439,808 with
  GPT-2's 1024 learned positions) are right, in GB of 10^9 bytes;
* "70B -> 140GB (=133GiB)" ("Data Parallelism") is off: 140e9 bytes are 130.39 GiB;
* A2's "optimizer states ... around 6 h^2 per weight matrix" matches neither unit: Adam's two
  moments plus the fp32 master copy are 3 h^2 values, 12 h^2 bytes.

Activations are derived for meshtrain's block (pre-norm GQA attention + SwiGLU, scanned,
rematerialised by policy), not from GPT-2's 34 + 5 a s / h.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import ml_collections
import numpy as np

from meshtrain import mesh as mesh_lib, model, moe
from meshtrain.config import DEFAULT_SCHEDULE, ModelConfig, data_parallel_size
from meshtrain.mesh import MESH_ORDER
from meshtrain.parallel import schedules
from meshtrain.sharding_rules import ZERO_AXES, Placement, Rules

GB = 10**9


# --------------------------------------------------------------------------------------------
# The playbook's closed forms.
# --------------------------------------------------------------------------------------------


def playbook_bytes_per_param(fp32_grad_accum: bool) -> int:
    """bf16 params (2) + bf16 grads (2) + fp32 master and Adam moments (12) [+ fp32 grads (4)]."""
    return 2 + 2 + 12 + (4 if fp32_grad_accum else 0)


def playbook_zero_bytes(num_params: float, zero_stage: int, dp: int, k: int = 12,
                        fp32_grad_accum: bool = False) -> float:
    """Per-rank bytes of ZeRO-0..3: 2Psi + 2Psi + kPsi, the sharded terms divided by N_d."""
    grads = 2 + (4 if fp32_grad_accum else 0)
    params_b, grads_b, opt_b = 2 * num_params, grads * num_params, k * num_params
    if zero_stage >= 1:
        opt_b /= dp
    if zero_stage >= 2:
        grads_b /= dp
    if zero_stage >= 3:
        params_b /= dp
    return params_b + grads_b + opt_b


def playbook_gpt_params(h: int, v: int, n_layers: int, positions: int = 0) -> int:
    """N = h v + L (12 h^2 + 13 h) + 2 h (+ learned positions x h)."""
    return h * v + n_layers * (12 * h * h + 13 * h) + 2 * h + positions * h


# --------------------------------------------------------------------------------------------
# meshtrain's parameters, leaf by leaf, with their logical axis names.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    in_layers: bool  # inside the scanned stack (gathered per layer under ZeRO-3)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@functools.lru_cache(maxsize=64)
def param_table(cfg: ModelConfig) -> tuple[Leaf, ...]:
    """The parameters of `model.Transformer` (its own abstract parameter tree), in tree order
    (memoised: tracing the tree takes milliseconds, and a search asks for it per candidate)."""
    return tuple(Leaf(path, tuple(box.value.shape), tuple(box.names), box.names[0] == "layers")
            for path, box in model.param_leaves(cfg))


def num_params(cfg: ModelConfig) -> int:
    return model.num_params(cfg)


@functools.lru_cache(maxsize=1 << 16)
def local_size(leaf: Leaf, rules: Rules) -> int:
    """Elements of `leaf` on one device under `rules` (raises ShardingRuleError if not divisible;
    memoised: a search prices the same few leaves under the same few meshes for every candidate)."""
    spec = rules.spec(leaf.names, leaf.shape, what=leaf.path)
    sizes = dict(rules.mesh_shape)
    split = math.prod(sizes[a] for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry))
    return leaf.size // split


@functools.lru_cache(maxsize=1 << 12)
def placed_elements(cfg: ModelConfig, rules: Rules) -> int:
    """Elements of all of the model's parameters on one device under `rules` (memoised like
    `local_size`)."""
    return sum(local_size(leaf, rules) for leaf in param_table(cfg))


# --------------------------------------------------------------------------------------------
# The step the planner reasons about (a hypothetical run: sizes, no devices).
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """Everything about a configured step the models need: model, mesh, ZeRO, batch, remat."""

    model: ModelConfig
    sizes: dict[str, int]
    zero_stage: int
    batch_size: int
    seq_len: int
    grad_accum: int
    microbatches: int = 1  # pipeline micro-batches
    pipeline_repeats: int = 1
    pipeline_schedule: str = DEFAULT_SCHEDULE
    split_backward: str = "gemms"  # slot tables' W (`pipeline.split_backward`)
    weight_parts: int = 1  # split W as this many operations (`pipeline.weight_parts`)
    ulysses_degree: int = 0  # `attention.ulysses_degree` (0: all of mesh.sequence)
    layers_per_stage: tuple[int, ...] = ()  # `pipeline.layers_per_stage` as given (() = the default split)
    scheduler_slop: int = mesh_lib.XLA_DEFAULT_SLOP  # `train.xla_gpu_memory_limit_slop_factor`
    overlap_transfers: bool = False  # `pipeline.overlap_transfers`
    weight_span: int = 1  # `pipeline.weight_span`

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, sizes: dict[str, int]) -> Step:
        return cls(ModelConfig.from_config(config), dict(sizes), config.train.zero_stage, config.train.batch_size,
                   config.train.seq_len, config.train.grad_accum_steps, config.pipeline.microbatches,
                   config.pipeline.repeats, config.pipeline.schedule, config.pipeline.split_backward,
                   config.pipeline.weight_parts, config.attention.ulysses_degree,
                   tuple(config.pipeline.layers_per_stage), config.train.xla_gpu_memory_limit_slop_factor,
                   config.pipeline.overlap_transfers, config.pipeline.weight_span)

    @functools.cached_property
    def pipeline(self):
        """The pipeline the runtime would run (`parallel.pipeline.Pipeline.of`, as `layout.pipeline_plan`
        builds it), or None on one stage: its ticks, table, in-flight counts and transfers."""
        from meshtrain.parallel.pipeline import Pipeline, inputs_at_b

        m = self.model
        if self.sizes["stage"] == 1:
            return None
        unit = m.moe_every if m.num_experts else 1
        return Pipeline.of(self.pipeline_schedule, self.sizes["stage"], self.microbatches, self.pipeline_repeats,
                           m.stacked_layers // unit, (n // unit for n in self.layers_per_stage),
                           split_backward=self.split_backward, weight_parts=self.weight_parts,
                           weight_span=self.weight_span, overlap=self.overlap_transfers,
                           inputs_at_b=inputs_at_b(self.split_backward, m.remat_policy, self.overlap_transfers))

    @functools.cached_property
    def stored_model(self) -> ModelConfig:
        """The model as the state stores it: uneven pipeline stages add empty layer rows (each stage
        stores as many as the largest one runs; `parallel.pipeline.Pipeline.rows`)."""
        m = self.model
        if self.pipeline is None:
            return m
        unit = m.moe_every if m.num_experts else 1
        rows = self.pipeline.rows(m.stacked_layers // unit) * unit
        return dataclasses.replace(m, n_layers=rows + m.first_dense_layers)

    @functools.cached_property
    def rules(self) -> Rules:
        return Rules.for_sizes(tuple((a, self.sizes[a]) for a in MESH_ORDER), model=self.model)

    @property
    def context(self) -> tuple[int, int]:
        """(U, R): the all-to-all group and the K/V ring of context parallelism over `sequence` (ring
        attention: (1, N); Ulysses: (U, N / U); neither: (1, 1))."""
        n = self.sizes["sequence"]
        if self.model.attention_impl == "ulysses":
            u = n if self.ulysses_degree == 0 else self.ulysses_degree
            return u, n // u
        return 1, (n if self.model.attention_impl == "ring" else 1)

    @property
    def dp(self) -> int:
        return data_parallel_size(self.sizes)

    @property
    def expert_axes(self) -> dict[str, int]:
        """The axes the experts split over and their sizes (`expert`, and `fsdp` where the experts rest
        whole on its devices: `sharding_rules.experts_over_fsdp`): the MoE exchange's group."""
        return {a: self.sizes[a] for a in self.rules.split_axes("expert")}

    @property
    def ep(self) -> int:
        """Expert-parallel degree: devices that split one layer's experts and exchange tokens."""
        return math.prod(self.expert_axes.values())

    @property
    def micro_tokens(self) -> int:
        """Tokens of one micro-batch on one device (batch split over dp, length over sequence)."""
        return self.batch_size // self.grad_accum // self.dp * self.seq_len // self.sizes["sequence"]

    def placement(self) -> dict[str, Rules]:
        stored = Placement.for_zero_stage(self.rules, self.zero_stage)
        return {"params": stored.params, "grads": stored.grads, "optimizer": stored.opt_state,
                "compute": self.rules.without_fsdp()}


@dataclasses.dataclass(frozen=True)
class MoeRows:
    """One dropless MoE layer's rows on one device, per chunk of its tokens (`moe_dropless`)."""

    routed: int  # rows a chunk routes: its tokens x experts_per_token
    grouped: int  # rows of its grouped layout: what the exchange can deliver, each expert padded to whole tiles
    expected: int  # rows the grouped matmuls compute at the balanced load (`moe_dropless.expected_rows`)
    tile: int  # the grouped matmul's row tile (1: jax.lax.ragged_dot's groups back to back)
    chunks: int  # `model.moe_chunks` as run


def moe_rows(run: Step, tokens: int | None = None) -> MoeRows:
    """The rows of a dropless MoE layer on one device, as `moe_dropless.dropless_ffn` lays them out for a
    micro-batch: without `expert` every routed row of the chunk, under it the receive capacity
    (`model.moe_exchange_factor`: a multiple of the balanced load, or the worst case at 0)."""
    from meshtrain import moe_dropless
    from meshtrain.pallas_kernels.grouped_matmul import GroupLayout

    m, ep = run.model, run.ep
    tokens = tokens or run.micro_tokens
    chunks = moe_dropless.chunks_for(tokens, m.moe_chunks, ep)
    k, groups = m.experts_per_token, m.num_experts // ep
    routed = tokens // chunks * k
    tile = moe_dropless.kernel_tile(routed, groups) if m.moe_matmul == "pallas" else 1
    received = routed
    if ep > 1:
        worst = ep * tokens // chunks * min(k, groups)
        received = moe_dropless.receive_capacity(routed, ep, worst, m.moe_exchange_factor)
    grouped = GroupLayout.capacity(received, groups, tile)
    return MoeRows(routed, grouped, moe_dropless.expected_rows(routed, groups, tile, grouped), tile, chunks)


def dtype_bytes(name: str) -> int:
    return np.dtype({"bfloat16": "float16"}.get(name, name)).itemsize


def state_memory(run: Step) -> dict[str, int]:
    """Per-device bytes of params, gradients and optimizer state as meshtrain places them.

    Pipeline stages own their layers ("layers" -> stage). Parameters and Adam moments use
    `model.param_dtype`; gradients come out of `jax.grad` in the parameters' dtype.
    """
    pb = dtype_bytes(run.model.param_dtype)
    place = run.placement()
    model = run.stored_model
    params = placed_elements(model, place["params"]) * pb
    grads = placed_elements(model, place["grads"]) * pb
    opt = 2 * placed_elements(model, place["optimizer"]) * pb
    return {"params": params, "grads": grads, "optimizer": opt + 12}  # + step and two int32 counts


# What XLA:GPU allocates beside the state, calibrated on the H100 compiler (`python -m meshtrain.aot`,
# jax 0.10.2; the live buffers at the peak of each compiled step, read from XLA's buffer-assignment dump):
SCORE_BYTES = 10  # XLA attention, per element of [H/tp, t, T_kv]: f32 scores, f32 and bf16 probabilities, the mask
# less with the scores in bf16 (attention.scores_dtype=compute): measured on the runbook's 1.5B step for the
# H200 (4 x 4,096 tokens, 32 heads), temporaries 30.35 -> 22.35 GiB, 4 bytes per element of its 2.1e9
COMPUTE_SCORES_SAVING = 4
# unfused loss, per element of [t, V/tp]: the f32 logits (kept for the backward, whose single elementwise
# pass writes their gradient in the compute dtype over them: `model.cross_entropy_sum`, `model.head_logits`)
LOGIT_BYTES = 4
TOKEN_WORKSPACE = 2  # a layer's activations and their gradients are alive together in its backward
# dropless MoE, a layer's backward, per chunk of its tokens (`moe_rows`): buffers of the grouped layout's rows
# d_model wide (the dispatched rows, the experts' output, their gradients, the exchange's zeroed receive
# buffers) and the experts' width wide (gate, up, their product and gradients), and under `expert` of the
# routed rows d_model wide (sent, returned, their gradients)
MOE_D_BUFFERS = 4
MOE_F_BUFFERS = 2
MOE_ROUTED_BUFFERS = 4
# dropless MoE before its loss (`_moe_moments`): the [grouped rows, d_model] exchange buffers XLA allocates once
# for the step's layers and keeps, and the logits in float32 and the compute dtype (LOGIT_BYTES x this)
MOE_KEPT_BUFFERS = 16
LOSS_MOMENT = 1.5
# the layer scan's zero-initialised stacked expert-weight cotangents (f32): none left since the exchange's
# rows are gathered both ways (dropless and capacity MoE, H100 compiles of `bench/moe.py --modeled`)
EXPERT_GRAD_COPIES = 0.0
# A raised scheduler budget (`train.xla_gpu_memory_limit_slop_factor` > 95) lets XLA:GPU start the
# sequence-parallel gathers early: this many gathered activations [t, d_model] live beside the rest.
# One calibration point: the 405B config (1f1b, TP 8, SP, H100, slop 400) peaks 3.25 GiB higher
# than at 95, 13 gathered [8192, 16384] bf16 activations; the same with collective matmuls (pieces).
EARLY_GATHERS = 13


def _saved_per_layer(run: Step, remat: str, t: int) -> int:
    """Bytes one layer keeps for its backward for one micro-batch of `t` tokens (by remat policy)."""
    m, tp = run.model, run.sizes["tensor"]
    a = dtype_bytes(m.dtype)
    d_res = _residual_width(run)
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim // tp
    f = (m.moe_mlp_dim or m.mlp_dim) * (m.experts_per_token if m.num_experts else 1) // tp
    return {"none": a * t * (3 * d_res + qkv + m.n_heads * m.head_dim // tp + 3 * f + 2 * m.d_model),
            "selective": a * t * (d_res + qkv + 2 * m.d_model + 2 * f),
            # the layer's input and its mid-layer residual, q, k, v, the attention's output (and its
            # log-sum-exp: float32 a query head)
            "attention": a * t * (2 * d_res + qkv + m.n_heads * m.head_dim // tp) + 4 * t * m.n_heads // tp,
            "full": a * t * d_res, "offload": a * t * d_res}[remat]


def _split_per_layer(run: Step, t: int) -> tuple[int, int]:
    """Bytes the split backward keeps per layer and micro-batch of `t` tokens for W
    (`parallel.pipeline.SplitStage`): (the matmuls' inputs, F to W; their output gradients, B to W)."""
    m, tp = run.model, run.sizes["tensor"]
    # the d_model-wide ones (the inputs of q,k,v and gate,up; the output gradients of the output and down
    # projections) are kept as the residual stream is split: over `tensor` along the sequence under
    # sequence parallelism (405B, TP 8, zero bubble on 16,384 H100s: 67 GiB of W buffers, not 197)
    d, heads = _residual_width(run), m.n_heads * m.head_dim // tp
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim // tp
    fm = moe.shared_mlp_dim(m) // tp
    moe_share = 1 / m.moe_every if m.num_experts else 0.0
    dense, shared = 1 - moe_share, moe_share if m.shared_expert else 0.0
    # the inputs of q,k,v and the output projection, of gate,up and down; then their output gradients
    inputs = (d + heads) + dense * (d + m.mlp_dim // tp) + shared * (d + fm)
    grads = (qkv + d) + dense * (2 * m.mlp_dim // tp + d) + shared * (2 * fm + d)
    a = dtype_bytes(m.dtype) * t
    return int(a * inputs), int(a * grads)


def _residual_width(run: Step) -> int:
    """The residual stream's width per device: split over `tensor` along the sequence under sequence
    parallelism, and where the fused RMSNorm runs on each device's rows (its region splits them)."""
    m = run.model
    return m.d_model // (run.sizes["tensor"] if (m.sequence_parallel or m.fused_norm) else 1)


def _layer_workspace(run: Step, t: int) -> int:
    """One layer's backward (its forward rebuilt under remat): activations and their gradients, the
    attention score matrices (XLA attention; the flash kernel keeps none), the MoE dispatch buffers."""
    m, s = run.model, run.sizes
    tp, a = s["tensor"], dtype_bytes(m.dtype)
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim // tp
    per_token = _residual_width(run) + qkv + m.n_heads * m.head_dim // tp + m.d_model
    f, grouped_bytes = (m.moe_mlp_dim or m.mlp_dim) // tp, 0
    if m.num_experts and m.moe_dropless:  # the grouped layout of each chunk (`moe_rows`) and its exchange
        r = moe_rows(run, t)
        exchange = MOE_ROUTED_BUFFERS * r.routed * m.d_model if run.ep > 1 else 0
        grouped_bytes = a * r.chunks * (r.grouped * (MOE_D_BUFFERS * m.d_model + MOE_F_BUFFERS * f) + exchange)
        mlp = 0
    elif m.num_experts:  # every expert's capacity slots
        mlp = math.ceil(t * m.experts_per_token * m.capacity_factor) * (m.d_model + 3 * f)
    else:
        mlp = t * 3 * m.mlp_dim // tp
    workspace = TOKEN_WORKSPACE * a * (t * per_token + mlp) + grouped_bytes
    context = m.attention_impl in ("ring", "ulysses") and s["sequence"] > 1  # ring / Ulysses: flash blocks on GPU
    if m.attention_impl not in ("pallas", "cudnn") and not context:  # flash kernels keep no scores
        per_score = SCORE_BYTES - (COMPUTE_SCORES_SAVING if m.attention_scores_dtype == "compute"
                                   and dtype_bytes(m.dtype) == 2 else 0)
        workspace += per_score * t * (m.n_heads // tp) * run.seq_len
    return workspace


def _minor_fsdp_split(leaf: Leaf, rules: Rules) -> bool:
    """Weights stored split over fsdp along their last dimension (`embed`) under `rules`: the attention and
    MLP (or expert) output projections, not an expert's whose fsdp split (if any) is its expert dimension."""
    if not (leaf.in_layers and leaf.names[-1] == "embed" and leaf.path.rsplit("/", 1)[-1] in ("wo", "w_down")):
        return False
    spec = rules.spec(leaf.names, leaf.shape, what=leaf.path)
    last = spec[len(leaf.names) - 1] if len(spec) == len(leaf.names) else None
    return "fsdp" in ((last,) if isinstance(last, str) else (last or ()))


def activation_memory(run: Step, remat: str) -> dict[str, int]:
    """Bytes kept for the backward pass (activations) and everything else a step allocates beside the
    state and the gradients (temporaries), per device, as XLA:GPU lays the step out.

    Activations, per layer and micro-batch in flight (t tokens on one device; heads, KV heads and
    MLP width split over `tensor`, the residual too under sequence parallelism or the fused norm):
    `none` everything the backward reads; `selective` the outputs of weight matmuls and the
    residual input; `full` / `offload` the residual input. In flight: 1 without a pipeline; 1F1B up
    to `stage` micro-batches, slot tables their table's peak of chunks; GPipe and circular all m.
    The split backward (zero bubble) with `split_backward` gemms keeps a record per chunk from F to W,
    for its table's peak of them: the residuals until B, then in their place the matmuls' output
    gradients (selective and full remat: the larger of the two; none: both), beside the matmuls' inputs
    (`_split_per_layer`) (pullback: the residuals until W, as the table's in-flight count has them).

    Temporaries, the terms the H100 compiler shows at the peak (constants above):
    * the larger of one layer's backward workspace (`_layer_workspace`) and the unfused loss's
      logits (LOGIT_BYTES per [t, V/tp] element; gpipe / circular also hold the f32 gradient of the
      whole batch's logits, the head running once after the pipeline);
    * without ZeRO-3 the whole local gradient in float32 (computed whole, reduce-scattered after
      the backward); with ZeRO-3 and fsdp two layers of gathered weights (the prefetch) and the
      head's full float32 gradient (kept until its reduce-scatter at the end of the backward);
    * pipelines: the stage's weights gathered once per step (ZeRO-3, compute dtype), float32
      gradient accumulators of the whole stage and one micro-batch's stage gradient (slot tables: of the
      weights outside the layers only what one branch differentiates, `_branch_outer`; in several chunks a
      stage the sums kept out of the tick's switch, a chunk's gradient twice, the head's sums twice);
    * gradient accumulation: float32 accumulators and the micro-batch's gradients, and the
      embedding's float32 scatter-add target;
    * MoE: EXPERT_GRAD_COPIES of the experts' float32 gradients;
    * a scheduler budget raised above XLA's default under sequence parallelism: EARLY_GATHERS
      gathered activations (the gathers the scheduler then starts early).
    """
    m, s = run.model, run.sizes
    a = dtype_bytes(m.dtype)
    p = s["stage"]
    pipelined = p > 1
    layers = run.stored_model.stacked_layers // p  # the largest stage's layers
    t = run.micro_tokens // (run.microbatches if pipelined else 1)
    autodiff_pipe = pipelined and schedules.REGISTRY[run.pipeline_schedule].loop == schedules.AUTODIFF
    in_flight: float = 1
    if pipelined:  # chunk activations, each 1/v of the stage's layers (the autodiff ring: every micro-batch's input)
        in_flight = max(run.pipeline.in_flight()) / run.pipeline.repeats
    saved = _saved_per_layer(run, remat, t)
    activations = int(saved * layers * in_flight)
    if pipelined and run.pipeline_schedule in schedules.SPLIT_BACKWARD and run.split_backward == "gemms":
        # a record a micro-batch chunk from its F to its W: its residuals until B, then its output
        # gradients in the same bytes, beside its matmuls' inputs; the table's peak of them and the slot
        # the tick writes after its switch (`pipeline_tables._TableWork`, `SlotUnion`; no trash slot:
        # `slot_program._put_slots`)
        # (`SlotPlan.handoff`: B's switch hands its record to the W ticks of the same loop step, held once;
        # a W over `span` micro-batches reads the records of the step's `span` B's)
        slots = run.pipeline.plan.span if run.pipeline.plan.handoff else run.pipeline.plan.weight_slots + 1
        inputs, grads = _split_per_layer(run, t)
        # `pipeline_tables.SlotUnion` shares buffers of one shape and dtype: under selective and full
        # remat the residuals kept are matmul outputs and the layer input, the output gradients' shapes;
        # under none they are not (every intermediate, q / k / v per head group), so both are held
        record = max(saved, grads) if remat in ("selective", "full") else saved + grads
        activations = int((record + inputs) * layers * slots / run.pipeline.repeats)
        if run.pipeline.inputs_at_b:  # the residuals F to B; the inputs and output gradients B to W
            stash = saved * run.pipeline.plan.stash_slots
            activations = int((stash + (inputs + grads) * slots) * layers / run.pipeline.repeats)

    place = run.placement()
    compute, table = place["compute"], param_table(run.stored_model)
    whole = sum(local_size(leaf, compute) for leaf in table)  # the weights a device computes with
    per_layer = sum(local_size(leaf, compute) for leaf in table if leaf.in_layers) // layers
    zero3 = run.zero_stage >= 3 and math.prod(s[a] for a in ZERO_AXES) > 1  # ZeRO shards over them all
    loss = 0 if m.fused_loss else LOGIT_BYTES * t * m.vocab_size // s["tensor"]
    if autodiff_pipe and not m.fused_loss:
        loss += 4 * t * run.microbatches * m.vocab_size // s["tensor"]
    temporaries = max(_layer_workspace(run, t), loss)
    if pipelined and run.pipeline_schedule in schedules.TABLE_SCHEDULES and run.pipeline.repeats > 1:
        # in several chunks a stage the slot-table loop sums its layers' float32 gradients outside the
        # tick's switch, one chunk's gradient at a time (`pipeline_tables._TableWork.sums_outside`): the
        # sums, the switch's output chunk gradient and the window of the sums it is added to; the head's
        # sums go through the switch, which copies them (405B on 16 H100 stages in 2 chunks, compiled: 2
        # chunks of 6 GiB; llama3_8b on 4 stages: the head's 2 GiB twice)
        head = sum(local_size(leaf, compute) for leaf in table if not leaf.in_layers
                   and not (leaf.path.endswith("embedding") and not m.tie_embeddings))
        temporaries += (4 * whole + 2 * 4 * per_layer * layers // run.pipeline.repeats + 4 * head
                        + (a * whole if zero3 else 0))
    elif pipelined and run.pipeline_schedule in schedules.TABLE_SCHEDULES:
        # the slot-table loop's float32 sums of every weight the stage computes with, and one micro-batch's
        # gradient of what one branch differentiates: the chunk's layers and, of the outer weights, the most
        # one branch reads (`pipeline_tables._TableWork._add_outer`: the last stage's head, or stage 0's stem)
        outer = _branch_outer(run, table, compute)
        temporaries += 4 * whole + 4 * (per_layer * layers + outer) + (a * whole if zero3 else 0)
    elif pipelined:  # autodiff's loop: the whole stage's gradient a micro-batch beside the sums
        temporaries += 2 * 4 * whole + (dtype_bytes(m.dtype) * whole if zero3 else 0)
    else:
        if run.zero_stage < 3:
            grads = sum(local_size(leaf, place["grads"]) for leaf in table)
            temporaries += 4 * max(0, whole - grads)  # the whole gradient beside its shard, until scattered
        if zero3:
            head = sum(local_size(leaf, compute) for leaf in table if leaf.path.endswith("head"))
            # XLA lays out a float32 copy of the weights whose fsdp-split dimension is the minor one
            # (the output projections) before the layer loop gathers them
            transposed = sum(local_size(leaf, place["params"]) for leaf in table
                             if _minor_fsdp_split(leaf, place["params"]))
            temporaries += 2 * a * per_layer + 4 * head + 4 * transposed
        elif run.zero_stage >= 1 and s["fsdp"] * s["expert"] > 1:
            head = sum(local_size(leaf, compute) for leaf in table if leaf.path.endswith("head"))
            temporaries += 4 * head
    if run.grad_accum > 1:
        accumulators = sum(local_size(leaf, compute if run.zero_stage < 3 else run.rules) for leaf in table)
        embedding = sum(local_size(leaf, compute) for leaf in table if leaf.path.endswith("embedding"))
        temporaries += 2 * 4 * accumulators + 4 * embedding
    if m.num_experts:
        experts = sum(local_size(leaf, place["grads"]) for leaf in table if "expert" in leaf.names)
        temporaries += int(EXPERT_GRAD_COPIES * 4 * experts)
    if run.scheduler_slop > mesh_lib.XLA_DEFAULT_SLOP and m.sequence_parallel and s["tensor"] > 1:
        temporaries += EARLY_GATHERS * a * t * m.d_model
    if m.num_experts and m.moe_dropless and not pipelined:
        temporaries = _moe_moments(run, t, temporaries, loss)
    return {"activations": activations, "temporaries": int(temporaries)}


def _branch_outer(run: Step, table, compute) -> int:
    """Elements of the outer weights (outside the layer stack) whose float32 gradient a slot-table tick holds
    beside the sums: the larger of what the last stage's forward differentiates (final norm, head,
    multi-token prediction; the embedding where the head is tied to it or the prediction block reads it)
    and stage 0's backward (the dense first layers, and that embedding), plus the embedding where it is
    summed outside the switch (its scatter's float32 target): `pipeline_tables._TableWork._head_params`."""
    m = run.model
    in_switch = m.tie_embeddings or m.mtp_depth > 0
    head = first = outside = 0
    for leaf in table:
        if leaf.in_layers:
            continue
        size = local_size(leaf, compute)
        if leaf.path.startswith("dense_layers"):
            first += size
        elif leaf.path.endswith("embedding") and in_switch:
            head, first = head + size, first + size
        elif leaf.path.endswith("embedding"):
            outside += size
        else:
            head += size
    return max(head, first) + outside


def _moe_moments(run: Step, t: int, temporaries: float, loss: int) -> float:
    """A dropless MoE step's temporaries as the larger of its two fullest moments, less the gradients
    (`state_memory` counts them whole): the layers' backward (the terms above beside every gradient), or
    the loss before it, when only the head's and the embedding's gradients exist but the logits are held
    in float32 and the compute dtype, beside the exchange buffers XLA allocates once for every layer
    (calibrated on `bench/moe.py --modeled`'s H100 compiles, where the 4-layer steps peak at their loss)."""
    m = run.model
    place = run.placement()
    table = param_table(run.stored_model)
    grads = placed_elements(run.stored_model, place["grads"]) * dtype_bytes(m.param_dtype)
    outer = sum(local_size(leaf, place["grads"]) for leaf in table if not leaf.in_layers) * dtype_bytes(m.param_dtype)
    kept = MOE_KEPT_BUFFERS * dtype_bytes(m.dtype) * moe_rows(run, t).grouped * m.d_model
    at_loss = loss * LOSS_MOMENT + kept + outer
    return max(temporaries + grads, at_loss) - grads
