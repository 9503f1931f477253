"""Memory model per device: parameters, gradients, optimizer state, activations, temporaries.

Playbook, "Memory usage in Transformers" and "ZeRO: Memory usage revisited". The playbook's
forms are reproduced exactly (`playbook_*` below); the planner itself counts meshtrain's own
state, which differs in how bytes are spent but not in the total: meshtrain keeps float32
parameters (the master weights, cast to bf16 inside each matmul, no stored bf16 copy), float32
gradients and two float32 Adam moments, i.e. 4 + 4 + 8 = 16 bytes per parameter, the playbook's
2 + 2 + 12 without fp32 gradient accumulation.

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
import math

import ml_collections
import numpy as np

from meshtrain import model, schedules
from meshtrain.config import ModelConfig
from meshtrain.mesh import MESH_ORDER
from meshtrain.sharding_rules import Rules

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


def param_table(cfg: ModelConfig) -> list[Leaf]:
    """The parameters of `model.Transformer` (its own abstract parameter tree), in tree order."""
    return [Leaf(path, tuple(box.value.shape), tuple(box.names), box.names[0] == "layers")
            for path, box in model.param_leaves(cfg)]


def num_params(cfg: ModelConfig) -> int:
    return model.num_params(cfg)


def local_size(leaf: Leaf, rules: Rules) -> int:
    """Elements of `leaf` on one device under `rules` (raises ShardingRuleError if not divisible)."""
    spec = rules.spec(leaf.names, leaf.shape, what=leaf.path)
    sizes = dict(rules.mesh_shape)
    split = math.prod(sizes[a] for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry))
    return leaf.size // split


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
    pipeline_schedule: str = "gpipe"

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, sizes: dict[str, int]) -> Step:
        return cls(ModelConfig.from_config(config), dict(sizes), config.train.zero_stage, config.train.batch_size,
                   config.train.seq_len, config.train.grad_accum_steps, config.pipeline.microbatches,
                   config.pipeline.repeats, config.pipeline.schedule)

    @property
    def pipeline_ticks(self) -> int:
        """Clock ticks of the pipeline loop (pipeline.py): m + p - 1 (v*m + p - 1 circular; 1f1b: two slots a
        tick; interleaved_1f1b and zero_bubble: their slot table's ticks, one F, B or W per stage each)."""
        p, m, v = self.sizes["stage"], self.microbatches, self.pipeline_repeats
        if p == 1:
            return 1
        if self.pipeline_schedule in schedules.TABLE_SCHEDULES:
            return len(self.pipeline_table)
        return v * m + p - 1

    @property
    def pipeline_table(self):
        """The executed slot table of a table schedule (`schedules.simulate`)."""
        return schedules.simulate(self.pipeline_schedule, self.sizes["stage"], self.microbatches,
                                  self.pipeline_repeats)

    @property
    def rules(self) -> Rules:
        return Rules(tuple((a, self.sizes[a]) for a in MESH_ORDER))

    @property
    def dp(self) -> int:
        return self.sizes["data"] * self.sizes["fsdp"] * self.sizes["expert"]

    @property
    def micro_tokens(self) -> int:
        """Tokens of one micro-batch on one device (batch split over dp, length over sequence)."""
        return self.batch_size // self.grad_accum // self.dp * self.seq_len // self.sizes["sequence"]

    def placement(self) -> dict[str, Rules]:
        rules = self.rules
        flat = rules.without_fsdp()
        z = self.zero_stage
        return {"params": rules if z >= 3 else flat, "grads": rules if z >= 1 else flat,
                "optimizer": rules if z >= 1 else flat, "compute": flat}


def dtype_bytes(name: str) -> int:
    return np.dtype({"bfloat16": "float16"}.get(name, name)).itemsize


def state_memory(run: Step) -> dict[str, int]:
    """Per-device bytes of params, gradients and optimizer state as meshtrain places them.

    Pipeline stages own their layers ("layers" -> stage). Parameters and Adam moments use
    `model.param_dtype`; gradients come out of `jax.grad` in the parameters' dtype.
    """
    pb = dtype_bytes(run.model.param_dtype)
    place = run.placement()
    table = param_table(run.model)
    params = sum(local_size(leaf, place["params"]) for leaf in table) * pb
    grads = sum(local_size(leaf, place["grads"]) for leaf in table) * pb
    opt = 2 * sum(local_size(leaf, place["optimizer"]) for leaf in table) * pb
    return {"params": params, "grads": grads, "optimizer": opt + 12}  # + step and two int32 counts


def activation_memory(run: Step, remat: str) -> dict[str, int]:
    """Bytes kept for the backward pass (activations) and the largest transient buffers (temporaries).

    Per layer and micro-batch on one device, t = tokens per device, a = compute dtype bytes,
    with heads, KV heads and MLP width split over `tensor` (tp) and the residual stream split
    over `tensor` too under sequence parallelism:

    * none:      everything the backward pass reads: residual input and the two norm outputs,
                 q, k, v, the attention output, the float32 scores and bf16 probabilities
                 (t x H/tp x T_kv), the gate, up, and their product;
    * selective: outputs of weight matmuls only (q, k, v, attention projection, gate, up, down)
                 plus the residual input (`dots_with_no_batch_dims_saveable`);
    * full / offload: the residual input only (offload keeps the matmul outputs on the host).

    Temporaries (besides the gradients, counted apart): float32 logits and their softmax for
    one micro-batch, one layer rebuilt for its backward (the `none` set), float32 accumulators
    with gradient accumulation (and under 1F1B) and, under ZeRO-3, two layers of gathered weights
    (1F1B: the whole stage).
    """
    m, s = run.model, run.sizes
    tp, a = s["tensor"], dtype_bytes(m.dtype)
    t = run.micro_tokens
    layers = m.n_layers // s["stage"]
    d_res = m.d_model // (tp if m.sequence_parallel else 1)
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim // tp
    f = (m.moe_mlp_dim or m.mlp_dim) * (m.experts_per_token if m.num_experts else 1) // tp
    t_kv = run.seq_len // s["sequence"] if m.attention_impl == "ring" else run.seq_len
    scores = t * (m.n_heads // tp) * t_kv * (4 + a)
    everything = a * t * (3 * d_res + qkv + m.n_heads * m.head_dim // tp + 3 * f + 2 * m.d_model) + scores
    saved = {"none": everything,
             "selective": a * t * (d_res + qkv + 2 * m.d_model + 2 * f),
             "full": a * t * d_res, "offload": a * t * d_res}[remat]
    # pipelined stages keep up to `stages` micro-batches in flight (1F1B / GPipe bound); slot tables
    # keep their table's peak of chunk activations, each 1/v of the stage's layers
    in_flight = min(s["stage"], run.microbatches) if s["stage"] > 1 else 1
    tabled = s["stage"] > 1 and run.pipeline_schedule in schedules.TABLE_SCHEDULES
    if tabled:
        in_flight = max(schedules.in_flight(run.pipeline_table)) / run.pipeline_repeats
    activations = saved * layers * in_flight + a * t * m.d_model
    if tabled and run.pipeline_schedule == "zero_bubble":  # each stashed B's output gradient, until its W
        activations += in_flight * a * t * m.d_model
    logits = t * (m.vocab_size // tp) * 4 * 2
    compute = run.placement()["compute"]
    table = param_table(m)
    accumulators = 0
    if run.grad_accum > 1:  # float32 accumulators, whole over the batch axes until the loop ends
        accumulators = 4 * sum(local_size(leaf, compute if run.zero_stage < 3 else run.rules) for leaf in table)
    gathered = 0
    if run.zero_stage >= 3:
        per_layer = sum(local_size(leaf, compute) for leaf in table if leaf.in_layers)
        gathered = 2 * per_layer // m.n_layers * dtype_bytes(m.param_dtype)
    if s["stage"] > 1 and run.pipeline_schedule in ("1f1b", *schedules.TABLE_SCHEDULES):
        # the 1F1B loop sums float32 gradients of the whole stage (and embedding / head) across its
        # slots, and under ZeRO-3 holds the stage's weights gathered for the whole step
        whole = sum(local_size(leaf, compute) for leaf in table)
        accumulators = 4 * whole
        gathered = whole * dtype_bytes(m.param_dtype) if run.zero_stage >= 3 else 0
    rebuild = everything if remat != "none" else 0
    return {"activations": activations, "temporaries": logits + rebuild + accumulators + gathered}
