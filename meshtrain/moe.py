"""Mixture of experts: router, capacity and dropless dispatch, expert parallelism over `expert`.

Playbook, "Expert parallelism": every expert's feed-forward is independent, so the experts
are split over the `expert` mesh axis and each token's hidden state travels to the device
that owns its expert and back. Outside the MoE layers `expert` is one more batch axis
(the playbook's "EP combined with DP"), so the exchange is an all-to-all inside the group
of devices that share a data shard's experts. `fsdp`'s devices can own whole experts too
(`model.moe_fsdp`, `sharding_rules.experts_over_fsdp`): the experts then split over
(expert, fsdp) and the exchange runs over both.

The layer runs in one `jax.shard_map` that is manual over the batch axes (data, fsdp,
expert; each device routes its own rows) and automatic over the others (`tensor` splits
each expert's hidden width F Megatron-style, `sequence` the length). Per device:

1. Router (float32): softmax over E experts (or DeepSeek-V3's sigmoid scores, with its balancing bias
   that only chooses and group-limited routing: `route`), top-k, the k weights renormalised to sum
   to 1 (and scaled: `model.moe_routed_scale`).
2. Dispatch, one of
   * capacity (GShard / Switch): every batch row is a group; expert e takes at most
     C = min(T, ceil(capacity_factor * T * k / E)) of its tokens, first choices before
     second choices, the rest are dropped (their MoE output is zero; the residual carries
     them). Buffers [b, E, C, D] go to the experts with one `all_to_all` and come back
     with another: 2 in the forward, 2 (their transposes) in the backward.
   * dropless: assignments sorted by expert, each expert's tokens computed with one grouped
     matmul (`jax.lax.ragged_dot`). Across `expert` the sorted tokens travel in a buffer per
     destination sized for the worst case (XLA:CPU has no `ragged_all_to_all`), with the
     per-expert counts all-gathered beside them.
3. Combine: each token sums its k expert outputs times the router weights.

Losses (each averaged over the MoE layers and weighted by the config):
* load balancing (Switch Transformer, eq. 4): E * sum_e f_e * P_e, where f_e is the fraction
  of the N*k token-to-expert assignments sent to e and P_e the mean router probability of e
  over the N tokens; 1.0 when perfectly balanced.
* router z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2.
Both are taken over the whole global batch (sums psum-ed over the batch axes), so they do
not depend on the mesh.
* auxiliary-loss-free balancing (DeepSeek-V3; `model.moe_router_bias`): no loss; after each step
  the step moves every expert's bias by `model.moe_bias_rate` toward its layer's mean load
  (`balance_router_bias`), the loads reaching it as the bias's gradient (`choose_with_bias`).

Shapes: B batch rows (b per device), T length, D d_model, E experts (E_l = E / ep per
device), k experts per token, C capacity, F expert hidden width, N = b * T tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from meshtrain import fp8 as fp8_lib, moe_dropless as dropless
from meshtrain.config import ConfigError, ModelConfig
from meshtrain.sharding_rules import Rules, constrain, vary, varying

# Names of the exchanged token buffers, saved by the selective remat policy (never re-exchanged).
EXCHANGE_NAMES = ("moe_dispatched", "moe_returned")
# The router's balancing bias (`model.moe_router_bias`): a parameter the step moves, not the optimizer.
BIAS_NAME = "router_bias"


# ---------------------------------------------------------------------------------------------
# Validation (gathered by meshtrain.validate).
# ---------------------------------------------------------------------------------------------


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """The MoE rules: experts split evenly over `expert`, k <= E, whole groups of layers."""
    m = config.model
    if m.first_dense_layers and not m.num_experts:
        raise ConfigError("model.first_dense_layers", m.first_dense_layers,
                          "dense first layers come before MoE layers: needs model.num_experts > 0")
    if m.num_experts == 0:
        return
    if not (isinstance(m.first_dense_layers, int) and 0 <= m.first_dense_layers < m.n_layers):
        raise ConfigError("model.first_dense_layers", m.first_dense_layers,
                          f"must be an integer in [0, model.n_layers={m.n_layers})")
    if m.num_experts % sizes["expert"]:
        raise ConfigError("model.num_experts", m.num_experts,
                          f"the experts must be divisible by mesh.expert={sizes['expert']}")
    if m.moe_fsdp == "experts" and m.num_experts % (sizes["expert"] * sizes["fsdp"]):
        raise ConfigError("model.num_experts", m.num_experts,
                          f"model.moe_fsdp='experts' splits the experts over mesh.expert x mesh.fsdp="
                          f"{sizes['expert']} x {sizes['fsdp']}: they must divide by it (or model.moe_fsdp='weights')")
    if not 1 <= m.experts_per_token <= m.num_experts:
        raise ConfigError("model.experts_per_token", m.experts_per_token,
                          f"must be between 1 and model.num_experts={m.num_experts}")
    stacked = m.n_layers - m.first_dense_layers
    if m.moe_every < 1 or stacked % m.moe_every:
        raise ConfigError("model.moe_every", m.moe_every, f"must be >= 1 and divide model.n_layers={m.n_layers}"
                          + (f" - model.first_dense_layers={m.first_dense_layers}" if m.first_dense_layers else ""))
    if m.moe_groups < 1 or m.num_experts % m.moe_groups or (m.moe_groups > 1 and m.num_experts // m.moe_groups < 2):
        raise ConfigError("model.moe_groups", m.moe_groups,
                          f"must divide model.num_experts={m.num_experts} into groups of at least 2 experts "
                          "(a group's score is the sum of its two best)")
    groups = m.moe_topk_groups or m.moe_groups
    if not 0 <= m.moe_topk_groups <= m.moe_groups:
        raise ConfigError("model.moe_topk_groups", m.moe_topk_groups,
                          f"must be between 0 (every group) and model.moe_groups={m.moe_groups}")
    if groups * (m.num_experts // m.moe_groups) < m.experts_per_token:
        raise ConfigError("model.moe_topk_groups", m.moe_topk_groups,
                          f"{groups} groups of {m.num_experts // m.moe_groups} experts cannot hold "
                          f"model.experts_per_token={m.experts_per_token} choices")
    if not m.moe_routed_scale > 0:
        raise ConfigError("model.moe_routed_scale", m.moe_routed_scale, "must be > 0")
    if not m.moe_bias_rate >= 0:
        raise ConfigError("model.moe_bias_rate", m.moe_bias_rate, "must be >= 0 (0: the bias stays as it is)")
    if not m.capacity_factor > 0:
        raise ConfigError("model.capacity_factor", m.capacity_factor, "must be > 0")
    if not m.moe_exchange_factor >= 0:
        raise ConfigError("model.moe_exchange_factor", m.moe_exchange_factor,
                          "must be >= 0 (a multiple of a device's balanced load; 0: the worst case)")
    if m.moe_matmul == "pallas" and m.matmul_precision == "fp8":
        raise ConfigError("model.moe_matmul", m.moe_matmul, "the grouped matmul kernel runs in model.dtype: FP8 "
                          "expert matmuls (model.matmul_precision='fp8') run through 'ragged_dot' (or 'auto')")
    width = expert_mlp_dim(ModelConfig.from_config(config))
    if width % sizes["tensor"]:
        raise ConfigError("model.moe_mlp_dim", m.moe_mlp_dim,
                          f"the expert MLP width {width} must be divisible by mesh.tensor={sizes['tensor']}")



def expert_mlp_dim(cfg: ModelConfig) -> int:
    """F: each expert's hidden width (`moe_mlp_dim`, or `mlp_dim` when 0)."""
    return cfg.moe_mlp_dim or cfg.mlp_dim


def shared_mlp_dim(cfg: ModelConfig) -> int:
    """The shared expert's hidden width (`shared_expert_dim`, or F when 0; DeepSeek's n_shared experts are one
    SwiGLU n times as wide); 0 without one."""
    return (cfg.shared_expert_dim or expert_mlp_dim(cfg)) if cfg.shared_expert else 0


def capacity(cfg: ModelConfig, seq_len: int) -> int:
    """C: slots per expert per batch row, min(T, ceil(capacity_factor * T * k / E))."""
    c = math.ceil(cfg.capacity_factor * seq_len * cfg.experts_per_token / cfg.num_experts)
    return max(1, min(seq_len, c))


# ---------------------------------------------------------------------------------------------
# Router and its losses.
# ---------------------------------------------------------------------------------------------


def route(x: jax.Array, w_router: jax.Array, k: int, norm_topk: bool = True, *, scoring: str = "softmax",
          bias: jax.Array | None = None, groups: int = 1, topk_groups: int = 0, scale: float = 1.0,
          valid: jax.Array | None = None, copies: int = 1) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [..., D] -> (logits [..., E], probs [..., E], weights [..., k], experts [..., k]), float32.

    `scoring`: the scores are the softmax over the experts (Mixtral, Qwen3-MoE) or each logit's sigmoid
    (DeepSeek-V3); `probs`, what the balance loss reads, are the scores as a share of their sum. The k
    experts are the highest scores plus `bias` [E] (DeepSeek-V3's auxiliary-loss-free balancing: the bias
    only chooses; `choose_with_bias` hands the step the experts' loads through its gradient), among the
    `topk_groups` best of `groups` equal groups of experts where groups > 1 (`group_limited`). The
    weights are the chosen scores, renormalised to sum to 1 with `norm_topk` (Mixtral, Qwen3-MoE's and
    DeepSeek-V3's `norm_topk_prob`; else as scored: Qwen1.5/2-MoE, OLMoE), times `scale` (DeepSeek-V3's
    `routed_scaling_factor`). `valid` [...] (bool): the real tokens, the only ones a load counts; `copies`:
    the devices of an unchecked manual region that route these same tokens (each counts 1 / copies of them).
    """
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), w_router.astype(jnp.float32))
    if scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    if bias is None:
        top, experts = _choose(scores, k, groups, topk_groups)
    else:
        real = jnp.ones(scores.shape[:-1], jnp.float32) if valid is None else valid.astype(jnp.float32)
        real = real / copies if copies > 1 else real
        # varying where the tokens vary: the transpose of that cast sums the devices' loads
        bias = vary(bias.astype(jnp.float32), tuple(sorted(varying(scores) | varying(real))))
        top, experts = choose_with_bias(scores, bias, real, k, groups, topk_groups)
    if norm_topk:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return logits, probs, top * scale if scale != 1.0 else top, experts


def group_limited(choice: jax.Array, groups: int, topk_groups: int) -> jax.Array:
    """choice [..., E] with every expert outside the token's `topk_groups` best of `groups` equal groups
    set to -inf; a group's score is the sum of its two highest (DeepSeek-V3's node-limited routing:
    with a group a node's experts, a token's experts span at most `topk_groups` nodes)."""
    *lead, e = choice.shape
    grouped = choice.reshape(*lead, groups, e // groups)
    best = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., G]
    _, chosen = jax.lax.top_k(best, topk_groups)
    keep = jnp.any(chosen[..., None] == jnp.arange(groups), axis=-2)  # [..., G]
    return jnp.where(jnp.repeat(keep, e // groups, axis=-1), choice, -jnp.inf)


def _choose(scores: jax.Array, k: int, groups: int, topk_groups: int, choice: jax.Array | None = None):
    """(scores at the k chosen experts [..., k], the experts [..., k]): the top k of `choice` (the scores
    by default), group-limited where groups > 1."""
    choice = scores if choice is None else choice
    if groups > 1 and topk_groups and topk_groups < groups:
        choice = group_limited(choice, groups, topk_groups)
    _, experts = jax.lax.top_k(choice, k)
    return jnp.take_along_axis(scores, experts, axis=-1), experts


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def choose_with_bias(scores: jax.Array, bias: jax.Array, real: jax.Array, k: int, groups: int, topk_groups: int):
    """`_choose` on scores + bias [E] (the bias chooses; the weights are the unbiased scores).

    The bias takes no gradient from the loss: its cotangent is the number of real tokens (`real` [...]: 1
    real, 0 padding) each expert took, summed like any gradient over micro-batches, devices and pipeline
    stages, which is the load the step balances the bias by (`balance_router_bias`)."""
    return _choose(scores, k, groups, topk_groups, scores + bias)


def _choose_with_bias_fwd(scores, bias, real, k, groups, topk_groups):
    top, experts = _choose(scores, k, groups, topk_groups, scores + bias)
    e = scores.shape[-1]
    loads = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32) * real[..., None, None],
                    axis=tuple(range(experts.ndim)))
    return (top, experts), (experts, loads.astype(bias.dtype), real)


def _choose_with_bias_bwd(k, groups, topk_groups, residuals, cotangents):
    experts, loads, real = residuals
    d_top, _ = cotangents
    d_scores = jnp.sum(jax.nn.one_hot(experts, loads.shape[0], dtype=d_top.dtype) * d_top[..., None], axis=-2)
    return d_scores, loads, jnp.zeros_like(real)


choose_with_bias.defvjp(_choose_with_bias_fwd, _choose_with_bias_bwd)


def router_options(cfg: ModelConfig) -> dict:
    """`route`'s keyword arguments from the model config (all but the bias and the padding)."""
    return {"scoring": cfg.moe_router, "groups": cfg.moe_groups, "topk_groups": cfg.moe_topk_groups,
            "scale": cfg.moe_routed_scale}


def router_sums(logits: jax.Array, probs: jax.Array, experts: jax.Array,
                valid: jax.Array | None = None) -> dict[str, jax.Array]:
    """Additive statistics of a set of tokens (psum-able across devices); `valid` [...] (bool) leaves
    padding out: it counts as no token, no assignment, no probability mass and no logit."""
    e = probs.shape[-1]
    v = jnp.ones(probs.shape[:-1], jnp.float32) if valid is None else valid.astype(jnp.float32)
    assigned = jax.nn.one_hot(experts, e, dtype=jnp.float32) * v[..., None, None]
    return {"tokens": jnp.sum(v),
            "assigned": jnp.sum(assigned, axis=tuple(range(experts.ndim))),
            "probs": jnp.sum((probs * v[..., None]).reshape(-1, e), axis=0),
            "z": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * v)}


def load_balancing_loss(sums: dict[str, jax.Array]) -> jax.Array:
    """Switch Transformer: E * sum_e f_e * P_e (f_e: share of assignments, P_e: mean probability);
    0 for a set with no token (an all-padding row)."""
    e = sums["probs"].shape[0]
    f = sums["assigned"] / jnp.maximum(jnp.sum(sums["assigned"]), 1.0)
    p = sums["probs"] / jnp.maximum(sums["tokens"], 1.0)
    return e * jnp.sum(f * p)


def z_loss(sums: dict[str, jax.Array]) -> jax.Array:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    return sums["z"] / jnp.maximum(sums["tokens"], 1.0)


# ---------------------------------------------------------------------------------------------
# Expert computation, dispatch and combine (per device, inside the shard_map).
# ---------------------------------------------------------------------------------------------


def _expert_dot(dot, histories: tuple[jax.Array, ...], i: int, first_step: bool = False):
    """`dot` as it is, or through FP8 with amax history i of (gate, up, down) when `histories` are given
    (`first_step`: the histories are empty, `fp8.scaled_dot`)."""
    if not histories:
        return dot
    return lambda x, w, *extra: fp8_lib.scaled_dot(dot, first_step, x, w, histories[i], *extra)


def _swiglu_experts(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                    histories: tuple[jax.Array, ...] = (), first_step: bool = False) -> jax.Array:
    """Each expert's SwiGLU on its own slots: x [n, E_l, C, D] -> [n, E_l, C, D] (FP8 with `histories`)."""
    up_dot, down_dot = fp8_lib.einsum_dot("necd,edf->necf"), fp8_lib.einsum_dot("necf,efd->necd")
    gate = _expert_dot(up_dot, histories, 0, first_step)(x, w_gate)
    up = _expert_dot(up_dot, histories, 1, first_step)(x, w_up)
    return _expert_dot(down_dot, histories, 2, first_step)(nn.silu(gate) * up, w_down)


def capacity_slots(experts: jax.Array, num_experts: int, cap: int, valid: jax.Array | None = None) -> jax.Array:
    """experts [b, T, k] -> slot [b, T, k] in [0, E*C]: e*C + position in e's queue, E*C if dropped.

    Queues fill first choices (of all T tokens) before second choices (GShard). Padding (`valid`
    [b, T] False) takes no place in any queue: its slot is E*C.
    """
    b, t, k = experts.shape
    order = jnp.swapaxes(experts, 1, 2).reshape(b, k * t)  # choice-major
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)  # [b, kT, E]
    if valid is not None:
        real = jnp.tile(valid, (1, k))  # [b, kT], choice-major like `order`
        onehot = onehot * real[..., None].astype(jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # [b, kT]
    keep = position < cap if valid is None else (position < cap) & real
    slot = jnp.where(keep, order * cap + position, num_experts * cap)
    return jnp.swapaxes(slot.reshape(b, k, t), 1, 2)


def _capacity_ffn(x, weights, experts, w_gate, w_up, w_down, *, num_experts, cap, axis, ep, valid, histories=(),
                  first_step=False):
    """Capacity dispatch -> all_to_all -> experts -> all_to_all -> combine. x [b, T, D]; padding
    (`valid` False) is not dispatched, its output is 0 and it is not counted as dropped."""
    b, t, d = x.shape
    k = experts.shape[-1]
    slots = num_experts * cap
    slot = capacity_slots(experts, num_experts, cap, valid)  # [b, T, k]

    def scatter_row(xr, sr):  # [T, D], [T, k] -> [E*C, D]; dropped tokens land in the extra row
        return jnp.zeros((slots + 1, d), x.dtype).at[sr.reshape(-1)].add(jnp.repeat(xr, k, axis=0))[:slots]

    buf = jax.vmap(scatter_row)(x, slot).reshape(b, num_experts, cap, d)  # [b, E, C, D]
    if ep > 1:  # expert e's slots to device e // E_l: [b, E, C, D] -> [ep*b, E_l, C, D]
        buf = checkpoint_name(jax.lax.all_to_all(buf, axis, split_axis=1, concat_axis=0, tiled=True),
                              EXCHANGE_NAMES[0])
    out = _swiglu_experts(buf, w_gate, w_up, w_down, histories, first_step)
    if ep > 1:  # back to the tokens' devices: [ep*b, E_l, C, D] -> [b, E, C, D]
        out = checkpoint_name(jax.lax.all_to_all(out, axis, split_axis=0, concat_axis=1, tiled=True),
                              EXCHANGE_NAMES[1])
    out = jnp.concatenate([out.reshape(b, slots, d), jnp.zeros((b, 1, d), out.dtype)], axis=1)
    gathered = jax.vmap(lambda yr, sr: yr[sr])(out, slot)  # [b, T, k, D]
    y = jnp.einsum("btkd,btk->btd", gathered, weights.astype(x.dtype))
    return y, jnp.sum(((slot == slots) & valid[..., None]).astype(jnp.float32))


def moe_ffn(x: jax.Array, w_router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
            cfg: ModelConfig, bias: jax.Array | None = None, axis: tuple[str, ...] | None = None, ep: int = 1,
            row_axes: tuple[str, ...] = (), token_axes: tuple[str, ...] = (), width_axes: tuple[str, ...] = (),
            valid: jax.Array | None = None, histories: tuple[jax.Array, ...] = (),
            model_major: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE feed-forward of one device's rows x [b, T, D] -> ([b, T, D], stats).

    Runs with this device's experts w_* [E_l, ...] and the exchange over `axis` (ep devices),
    inside a region manual over `row_axes` (the batch axes: other devices hold other rows) and
    `token_axes` (`sequence`: other devices hold other tokens of the same rows); the router
    statistics are summed over both, so they are those of the whole (micro-)batch. With no axes
    it is the whole single-device layer. `valid` [b, T] (bool; None: every token) marks the real
    tokens: padding takes no expert capacity (dropless: its output is weighted 0) and stays out of
    the balance and z losses and the dropped fraction. `width_axes`: the manual axes the experts'
    width F is split over (each device holds its slice; the output's partial sums are added over them).
    `model_major`: the weights come [D, E_l, F] each (`gathers_model_dim`). `bias` [E]: the router's
    balancing bias (`model.moe_router_bias`).
    """
    dtype = jnp.dtype(cfg.dtype)
    valid = jnp.ones(x.shape[:2], bool) if valid is None else valid
    copies = jax.lax.psum(1, width_axes) if width_axes else 1  # each of them routes the same tokens
    logits, probs, weights, experts = route(x, w_router, cfg.experts_per_token, cfg.moe_norm_topk, bias=bias,
                                            valid=valid, copies=copies, **router_options(cfg))
    weights = weights * valid[..., None]
    w = tuple(wi.astype(dtype) for wi in (w_gate, w_up, w_down))
    x = x.astype(dtype)
    if cfg.moe_dropless:
        dot = dropless.GroupedDot(cfg.moe_matmul, histories=histories, first_step=cfg.fp8_first_step,
                                  model_major=model_major)
        y, dropped = dropless.dropless_ffn(x, weights, experts, *w, num_experts=cfg.num_experts, axis=axis, ep=ep,
                                           dot=dot, exchange=cfg.moe_exchange, factor=cfg.moe_exchange_factor,
                                           chunks=dropless.chunks_for(x.shape[0] * x.shape[1], cfg.moe_chunks, ep))
    else:
        y, dropped = _capacity_ffn(x, weights, experts, *w, num_experts=cfg.num_experts,
                                   cap=capacity(cfg, x.shape[1]), axis=axis, ep=ep, valid=valid, histories=histories,
                                   first_step=cfg.fp8_first_step)
    if width_axes:
        y = jax.lax.psum(y, width_axes)
    return y, router_stats(logits, probs, experts, dropped, cfg.moe_balance_scope, row_axes, token_axes, valid)


def router_stats(logits, probs, experts, dropped, scope: str, row_axes=(), token_axes=(),
                 valid=None) -> dict[str, jax.Array]:
    """{balance, z, dropped} of one MoE layer over the tokens of every device in `row_axes` x `token_axes`.

    scope "batch": the Switch balance loss and the z-loss over all tokens at once; "sequence": both
    per row (DeepSeek-V3's sequence-wise balance), averaged over rows, which is additive over rows and
    so decomposes exactly over micro-batches and pipeline slots, whatever padding the rows hold.
    """
    every = tuple(row_axes) + tuple(token_axes)
    valid = jnp.ones(logits.shape[:-1], bool) if valid is None else valid
    sums = {**router_sums(logits, probs, experts, valid), "dropped": dropped}
    total = jax.lax.psum(sums, every) if every else sums
    stats = {"z": z_loss(total), "dropped": total["dropped"] / jnp.maximum(jnp.sum(total["assigned"]), 1.0)}
    if scope == "batch":
        return {**stats, "balance": load_balancing_loss(total)}
    rows = jax.vmap(router_sums)(logits, probs, experts, valid)  # per row: [b, ...]
    rows = jax.lax.psum(rows, tuple(token_axes)) if token_axes else rows
    # per row, then averaged over rows: additive over rows whatever padding each row holds
    per_row = (jnp.sum(jax.vmap(load_balancing_loss)(rows)), jnp.sum(jax.vmap(z_loss)(rows)),
               jnp.asarray(logits.shape[0], jnp.float32))
    balance, z, count = jax.lax.psum(per_row, tuple(row_axes)) if row_axes else per_row
    return {**stats, "balance": balance / count, "z": z / count}


def moe_reference(x: jax.Array, w_router, w_gate, w_up, w_down, k: int, norm_topk: bool = True,
                  **router) -> jax.Array:
    """Per-token dense reference: y_n = sum_j weight_nj * SwiGLU_{e_nj}(x_n), no capacity. x [..., D];
    `router`: `route`'s keyword arguments."""
    _, _, weights, experts = route(x, w_router, k, norm_topk, **router)
    g, u, dn = w_gate[experts], w_up[experts], w_down[experts]  # [..., k, D, F], [..., k, F, D]
    hidden = nn.silu(jnp.einsum("...d,...kdf->...kf", x, g)) * jnp.einsum("...d,...kdf->...kf", x, u)
    return jnp.einsum("...kf,...kfd,...k->...d", hidden, dn, weights.astype(x.dtype))


# ---------------------------------------------------------------------------------------------
# The layer.
# ---------------------------------------------------------------------------------------------


def gathers_model_dim(cfg: ModelConfig, rules: Rules) -> bool:
    """Whether the grouped matmul kernel's region gathers the expert weights along their model dimension
    D (ZeRO-3 shards it, `rules`' "embed" entry, unless `expert` is the only such axis: the expert
    dimension takes it; below ZeRO-3 the weights rest whole), so that they enter it D first
    (`grouped_matmul`'s order "kgn" / "ngk"): an all-gather along the leading dimension is a copy of
    contiguous blocks, along any other it leaves a transpose of every gathered weight to the kernel's
    row-major layout."""
    if not (cfg.num_experts and cfg.moe_dropless and cfg.moe_matmul == "pallas" and cfg.zero_stage >= 3):
        return False
    spec = rules.spec(("expert", "embed", "mlp"))
    entry = spec[1] if len(spec) > 1 else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return any(a not in rules.manual for a in axes)


def expert_parallel(cfg: ModelConfig, rules: Rules, model_major: bool = False):
    """moe_ffn on each device's rows: (x, router, bias, w_gate, w_up, w_down, valid, histories) -> (y, stats)
    (bias: None without `model.moe_router_bias`).

    The layer needs its batch axes (`rules`' "batch" entry: data, fsdp, expert) manual, so that
    each device routes its own rows and the tokens travel over `expert` with `all_to_all`. Inside
    a region already manual over some of them (the pipeline's; `rules.manual`) it opens a
    `shard_map` over the rest only, or none: regions compose by axis. A region manual over
    `sequence` (ring attention inside a pipeline stage) holds a slice of each row: the statistics
    are summed over it too.

    The grouped matmul kernel (`model.moe_matmul='pallas'`) is a `pallas_call`, which the partitioner
    cannot split: the region is then manual over every split axis (playbook, "Tensor Parallelism":
    each `tensor` device runs its slice of every expert's width, the down projection's partial sums
    added with one `psum`; each `sequence` device routes its own tokens), and unchecked.
    """
    batch_axes = rules.split_axes("batch")
    axis = rules.split_axes("act_expert") or None  # the exchange's axes: expert (and fsdp: `experts_over_fsdp`)
    kernel = cfg.moe_dropless and cfg.moe_matmul == "pallas"
    width_axes = tuple(a for a in rules.split_axes("mlp") if a not in rules.manual) if kernel else ()
    lengths = rules.split_axes("length")
    token_axes = tuple(a for a in lengths if a in rules.manual or kernel)
    ep = math.prod(rules.size(a) for a in axis) if axis else 1
    fn = functools.partial(moe_ffn, cfg=cfg, axis=axis, ep=ep, row_axes=batch_axes,
                           token_axes=token_axes, width_axes=width_axes, model_major=model_major)
    todo = tuple(a for a in batch_axes if a not in rules.manual)
    fn = functools.partial(_with_valid, fn)
    tokens = tuple(a for a in lengths if a not in rules.manual) if kernel else ()
    if not (todo or tokens or width_axes):
        return fn
    experts = tuple(a for a in axis or () if a in todo) or None  # the expert split this region makes
    if not kernel:
        w_spec = P(experts)
        return jax.shard_map(fn, in_specs=(P(todo), P(), P(), w_spec, w_spec, w_spec, P(todo), P()),
                             out_specs=(P(todo), P()), axis_names=set(todo), check_vma=True)
    rows = P(todo or None, tokens or None)
    width = width_axes or None
    if model_major:  # [D, E, F] each (`gathers_model_dim`)
        w_specs = (P(None, experts, width),) * 3
    else:
        w_specs = (P(experts, None, width), P(experts, None, width), P(experts, width, None))
    in_specs = (rows, P(), P(), *w_specs, rows, P())
    return jax.shard_map(fn, in_specs=in_specs, out_specs=(rows, P()),
                         axis_names=set(todo) | set(tokens) | set(width_axes), check_vma=False)


def _with_valid(fn, x, router, bias, w_gate, w_up, w_down, valid, histories=()):
    return fn(x, router, w_gate, w_up, w_down, bias=bias, valid=valid, histories=histories)


class MoeMlp(nn.Module):
    """Router + E SwiGLU experts (split over `expert`) + optional shared expert. x [B, T, D].

    `valid` [B, T]: the real tokens (the block passes segment_ids > 0); padding takes no capacity
    and stays out of the router statistics.

    Returns (y [B, T, D], stats {balance, z, dropped}: float32 scalars of this layer).
    """

    cfg: ModelConfig
    rules: Rules

    @nn.compact
    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        e, d, f = cfg.num_experts, cfg.d_model, expert_mlp_dim(cfg)
        router = self._param("router", (d, e), ("embed", None))
        bias = None
        if cfg.moe_router_bias:  # chooses only; moved by the step (`balance_router_bias`), zeros at the start
            bias = self.param(BIAS_NAME, nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (e,),
                              jnp.dtype(cfg.param_dtype))
        # inside a region manual over `expert` (a pipeline stage) each device holds its own experts
        e = e // math.prod(self.rules.size(a) for a in self.rules.split_axes("expert") if a in self.rules.manual)
        w_gate = self._param("w_gate", (e, d, f), ("expert", "embed", "mlp"))
        w_up = self._param("w_up", (e, d, f), ("expert", "embed", "mlp"))
        w_down = self._param("w_down", (e, f, d), ("expert", "mlp", "embed"))
        valid = jnp.ones(x.shape[:2], bool) if valid is None else valid  # [B, T]; False: padding
        # under FP8 one amax history per stacked expert weight (one scale for all its experts)
        histories = tuple(fp8_lib.history(self, f"expert_{n}", cfg.fp8_history)
                          for n in ("gate", "up", "down")) if cfg.matmul_precision == "fp8" else ()
        w_gate, w_up, w_down = (w.astype(dtype) for w in (w_gate, w_up, w_down))  # gathered in dtype, not f32
        model_major = gathers_model_dim(cfg, self.rules)
        if model_major:  # [D, E, F]: as ZeRO-3 gathers them along D, read by the kernel without a transposed copy
            w_gate, w_up, w_down = w_gate.transpose(1, 0, 2), w_up.transpose(1, 0, 2), w_down.transpose(2, 0, 1)
        y, stats = expert_parallel(cfg, self.rules, model_major)(x, router, bias, w_gate, w_up, w_down, valid,
                                                                 histories)
        if cfg.shared_expert:  # a dense SwiGLU every token goes through (DeepSeek-MoE)
            fs = shared_mlp_dim(cfg)
            s_gate = self._param("shared_gate", (d, fs), ("embed", "mlp")).astype(dtype)
            s_up = self._param("shared_up", (d, fs), ("embed", "mlp")).astype(dtype)
            s_down = self._param("shared_down", (fs, d), ("mlp", "embed")).astype(dtype)
            gate = fp8_lib.matmul(self, "shared_gate")("btd,df->btf", x, s_gate)
            hidden = nn.silu(gate) * fp8_lib.matmul(self, "shared_up")("btd,df->btf", x, s_up)
            hidden = constrain(hidden, ("batch", "length", "act_mlp"), self.rules)
            y = y + fp8_lib.matmul(self, "shared_down")("btf,fd->btd", hidden, s_down)
        return y, stats

    def _param(self, name: str, shape: tuple[int, ...], names: tuple[str | None, ...]) -> jax.Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(self.cfg.init_std), names)
        return self.param(name, init, shape, jnp.dtype(self.cfg.param_dtype))


def loss_terms(stats: dict[str, jax.Array] | None,
               cfg: ModelConfig) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Stacked per-layer stats [L_moe] -> (losses added to the training loss, logged metrics)."""
    if stats is None:
        return {}, {}
    mean = {name: jnp.mean(value) for name, value in stats.items()}
    losses = {"moe_aux_loss": cfg.aux_loss_weight * mean["balance"],
              "moe_z_loss": cfg.router_z_loss_weight * mean["z"]}
    return losses, {"moe_load_balance": mean["balance"], "moe_dropped_fraction": mean["dropped"]}


# ---------------------------------------------------------------------------------------------
# Auxiliary-loss-free balancing (DeepSeek-V3): the router bias moved by the step.
# ---------------------------------------------------------------------------------------------


def _is_bias(path) -> bool:
    return getattr(path[-1], "key", None) == BIAS_NAME


def split_router_loads(grads):
    """(grads with every router bias's entry zeroed, {path: loads [..., E]}): the bias's "gradient" is the
    tokens each expert took this step (`choose_with_bias`), not a direction for the optimizer; with its
    zero gradient and no weight decay (`optimizer._decay_mask`) AdamW leaves it where it is."""
    loads = {}

    def take(path, g):
        if not _is_bias(path):
            return g
        loads[jax.tree_util.keystr(path)] = g.astype(jnp.float32)
        return jnp.zeros_like(g)

    return jax.tree_util.tree_map_with_path(take, grads), loads


def balance_router_bias(params, loads: dict, rate: float, apply: jax.Array):
    """params with each router bias moved by `rate` toward balance (DeepSeek-V3, "Auxiliary-Loss-Free Load
    Balancing"): up for an expert that took fewer tokens than its layer's mean, down for one that took
    more, unchanged where `apply` is False (a withheld step) or the loads are equal. Only the sign of
    load - mean is read, so any uniform scale of the loads (a count made on each of several devices that
    route the same tokens) moves the bias the same."""
    if not loads:
        return params

    def move(path, p):
        if not _is_bias(path):
            return p
        load = loads[jax.tree_util.keystr(path)]
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        return jnp.where(apply, p + step.astype(p.dtype), p)

    return jax.tree_util.tree_map_with_path(move, params)


def load_metrics(loads: dict) -> dict[str, jax.Array]:
    """{moe_max_load: the largest expert load over its layer's mean, averaged over the layers (1: balanced)}
    of the step's router-bias loads; {} without. Rows that routed nothing (an uneven pipeline's empty
    slots) are not layers."""
    if not loads:
        return {}
    ratios = jnp.concatenate([jnp.ravel(jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9))
                              for load in loads.values()])
    routed = jnp.concatenate([jnp.ravel(jnp.sum(load, axis=-1) > 0) for load in loads.values()])
    return {"moe_max_load": jnp.sum(jnp.where(routed, ratios, 0.0)) / jnp.maximum(jnp.sum(routed), 1)}
