"""The decoder: token embedding, RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Llama-style, in Flax linen. Every parameter and activation carries logical axis names
only (`sharding_rules.RULES` maps them to mesh axes). The layers are stacked with
`nn.scan` so compile time does not grow with depth, and each layer is rematerialised
by a named policy (playbook, "Activation recomputation"):

* none:      keep everything the backward pass needs.
* selective: keep matmul outputs (projections, MLP), recompute the attention scores and
             softmax: the playbook's selective recomputation.
* full:      keep only each layer's input; recompute the layer in the backward pass.
* offload:   like selective, but the kept matmul outputs live in host memory.

Megatron sequence parallelism (`sequence_parallel`, playbook "Sequence Parallelism")
keeps the residual stream and the norms split over the sequence along `tensor`; the
partitioner turns the tensor-parallel all-reduces into all-gather + reduce-scatter.

Shapes: B batch, T length, D d_model, H query heads, K KV heads, G = H/K, Dh head_dim,
F mlp width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from meshtrain import collective_matmul as cm, fp8 as fp8_lib, moe as moe_lib
from meshtrain.attention import AttentionFn, cached_attention, takes_narrow_values, xla_attention
from meshtrain.config import BATCH_AXES, ModelConfig
from meshtrain.fused import fused_loss_sum, fused_rms_norm
from meshtrain.mesh import MESH_ORDER, compiler_options, single_device_mesh
from meshtrain.sharding_rules import Rules, constrain, varying

# What `remat.policy='attention'` keeps of each layer (`jax.ad_checkpoint.checkpoint_name`): the attention's
# q, k, v (after RoPE), its output (and the flash kernel's log-sum-exp: `pallas_kernels.flash_attention`),
# and the residual stream between attention and MLP.
ATTENTION_SAVED_NAMES = ("attention_q", "attention_k", "attention_v", "attention_out", "attention_lse",
                         "attention_residual")

# JAX's cuDNN attention keeps its forward's output and softmax statistics for its backward inside its own
# custom VJP, where no name reaches them: the primitive itself is saveable (a JAX that renames it recomputes
# the forward, as under `full`)
CUDNN_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


# attention implementations whose own residuals are the output `remat.policy='attention'` keeps (named inside
# the flash kernel's VJP, cuDNN's forward saveable): naming the layer's copy too would keep it twice
KERNEL_SAVES_OUTPUT = ("pallas", "cudnn")


def _cudnn_attention_forward(prim, *_, **__) -> bool:
    return prim.name == CUDNN_ATTENTION_FORWARD


# The dtype and layout copies a pipeline stage under remat `none` does not keep (`copies_not_kept`), and the
# identity the split backward's forward passes its weights through (`fp8.SPLIT_PROBES`)
_COPIES = ("convert_element_type", "reshape", "concatenate", "stop_gradient")


def copies_not_kept(prim, *avals, **params) -> bool:
    """A pipeline stage's policy under remat `none` (`parallel.pipeline`): every value the backward reads
    is kept but a dtype or layout copy (a cast, a reshape, a broadcast that only adds unit dimensions, a
    concatenation), which the backward makes again from what it keeps.

    Kept, the copies include the layer's weights in the compute dtype and the gate and up weights joined
    (`column_parallel_joined`): a copy of the stage's weights a micro-batch in flight. Not keeping them
    lowers both the temporaries and the kernel model's step of 1F1B and zero bubble (llama3_8b compiled
    for H100s: docs/pipeline.md, "At real shapes"). Without a pipeline the layer scan
    keeps one copy a layer, which the backward would otherwise make again (and gather again under
    ZeRO-3): there `none` stays no remat at all."""
    if prim.name == "broadcast_in_dim":  # a norm's scale made [1, 1, D] (a mask's broadcast is kept)
        return math.prod(params["shape"]) != math.prod(avals[0].shape)
    return prim.name not in _COPIES


REMAT_POLICIES = {
    # the MoE token exchanges are kept too: recomputing them would repeat two all-to-alls per layer;
    # so are the collective matmuls' outputs (matmul outputs, computed in a `shard_map`)
    "selective": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*moe_lib.EXCHANGE_NAMES, cm.SAVED_NAME)),
    # between the two (playbook, "Activation recomputation"): the backward rebuilds the norms and the MLP's
    # gate + up matmul (and the einsum attention's scores); not q, k, v, the output or down projections, nor
    # the flash kernel's or cuDNN's forward (405B config on H100s: 41.5% MFU against full's 40.8%, 68.08
    # GiB against 55.55; llama3_8b on fsdp 8: 57.8% against 54.2%, docs/mesh.md)
    "attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(*ATTENTION_SAVED_NAMES, *moe_lib.EXCHANGE_NAMES),
        _cudnn_attention_forward),
    "full": jax.checkpoint_policies.nothing_saveable,
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def rope_frequencies(cfg: ModelConfig, dim: int = 0) -> np.ndarray:
    """RoPE's inverse frequencies [dim/2] (float32; dim: the rotated width, head_dim by default), scaled
    for long contexts by `cfg.rope_scaling`:

    * linear: every frequency / rope_factor (positions interpolated);
    * llama3 (Llama 3.1): wavelengths longer than original_max_positions / low_freq_factor divided by
      rope_factor, shorter than original_max_positions / high_freq_factor kept, those between
      interpolated by how many times they fit in the original context.
    """
    dh = dim or cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float32) / np.float32(dh)))
    factor = np.float32(cfg.rope_factor)
    if cfg.rope_scaling == "linear":
        return (inv_freq / factor).astype(np.float32)
    if cfg.rope_scaling == "yarn":
        return _yarn_frequencies(cfg, dh)
    if cfg.rope_scaling != "llama3":
        return inv_freq.astype(np.float32)
    old, low, high = cfg.rope_original_max_positions, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * np.float32(math.pi) / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_frequencies(cfg: ModelConfig, dim: int) -> np.ndarray:
    """YaRN (Peng et al. 2023, as DeepSeek-V3 and transformers set it): frequency i of `dim`/2 is kept where
    it turns more than rope_beta_fast times over the original context, divided by rope_factor where it turns
    fewer than rope_beta_slow times, and linearly mixed between (the ramp's ends rounded outward)."""
    def correction_dim(rotations: float) -> float:
        turns = cfg.rope_original_max_positions / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    base = cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    keep = 1 - ramp  # the share of each frequency kept as it is (extrapolated)
    return ((1.0 / (cfg.rope_factor * base)) * (1 - keep) + (1.0 / base) * keep).astype(np.float32)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude scale 0.1 m ln(factor) + 1 (1 where the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN scales cos and sin by (1 for the other scalings)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor, 1.0)


def score_scale(cfg: ModelConfig) -> float:
    """The factor on the attention scores beside 1/sqrt(head_dim): YaRN's mscale(rope_mscale_all_dim)^2 (DeepSeek-V3's
    softmax scale), else 1. The attention functions scale by 1/sqrt(head_dim); the queries carry the rest."""
    if cfg.rope_scaling != "yarn" or not cfg.rope_mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


def rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotary position embedding (rotate-half layout), positions [B,T] restart per document."""
    dh = x.shape[-1]
    inv_freq = jnp.asarray(rope_frequencies(cfg, dh))  # [Dh/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B,T,1,Dh]
    x32 = x.astype(jnp.float32)
    half = dh // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    scale = np.float32(rope_attention_factor(cfg))
    if scale != 1:
        return (x32 * (jnp.cos(angles) * scale) + rotated * (jnp.sin(angles) * scale)).astype(x.dtype)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...],
           init=None) -> jax.Array:
    cfg: ModelConfig = module.cfg
    init = init or nn.initializers.normal(cfg.init_std)
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.dtype(cfg.param_dtype))


# Layer parameters the model reads only in the compute dtype (each cast where it is used): the attention
# and MLP weights and biases, dense and expert. A caller may cast them once beforehand
# (`in_compute_dtype`) for the same forward and the same gradients, rounded to the compute dtype as the
# cast's own gradient leaves them. The norm scales and the MoE router are read in float32 and stay.
COMPUTE_DTYPE_PARAMS = frozenset({"wq", "wk", "wv", "wo", "bq", "bk", "bv", "w_gate", "w_up", "w_down",
                                  "shared_gate", "shared_up", "shared_down", "wq_a", "wq_b", "wkv_a", "wkv_b"})


def in_compute_dtype(layer_params, dtype):
    """`layer_params` (the scanned layers' parameter tree) with COMPUTE_DTYPE_PARAMS in `dtype`: what the
    pipeline's slot-table executor slices a chunk from every tick (half the bytes of float32 in bf16, and
    no cast per layer, per micro-batch), and what ZeRO-3 then gathers."""
    def cast(path, leaf):
        name = getattr(path[-1], "key", None)
        return leaf.astype(dtype) if name in COMPUTE_DTYPE_PARAMS else leaf
    return jax.tree_util.tree_map_with_path(cast, layer_params)


# The epsilon of multi-head latent attention's latent RMSNorms: DeepSeek-V2/V3 fix it whatever their
# rms_norm_eps (their reference code and transformers' port alike).
LATENT_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, computed in float32. `names`: the scale's
    logical axis (the model dimension, or `head_dim` for Qwen3's per-head query / key norm, which
    always runs in jnp: the fused kernel takes [B,T,D] rows)."""

    cfg: ModelConfig
    names: tuple[str, ...] = ("embed",)
    eps: float = 0.0  # 0: model.norm_eps

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(self, "scale", (x.shape[-1],), self.names, nn.initializers.ones)
        eps = self.eps or self.cfg.norm_eps
        if self.cfg.fused_norm and self.names == ("embed",):
            return fused_rms_norm(x, scale, eps=eps)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def column_parallel(x: jax.Array, weights: tuple[jax.Array, ...], name: str, rules: Rules, dtype,
                    einsum=jnp.einsum) -> list[jax.Array]:
    """x [B,T,D] times column-parallel weights [D, n_i, ...] (dim 1 the logical `name`) as one matmul.

    Playbook, "Tensor Parallelism": Q, K and V (and the MLP's gate and up) read the same input, so
    its gradient is one sum over all their columns. Each weight is viewed as [D, shards, n_i/shards,
    ...] (`shards`: the devices splitting `name`) and the blocks are joined per shard, which keeps
    the join local to each device; one matmul then gives one partial input gradient, reduced over
    `tensor` once instead of once per weight (the fused QKV projection of Megatron-LM). The output
    is pinned to whole sequences split by `name`, so under sequence parallelism the activation is
    gathered, not the weights.
    """
    y = column_parallel_joined(x, weights, name, rules, dtype, einsum)
    cuts = list(itertools.accumulate(w.shape[1] // rules.shards(name) for w in weights))[:-1]
    parts = jnp.split(y, cuts, axis=3)
    return [part.reshape(*x.shape[:2], *w.shape[1:]) for part, w in zip(parts, weights, strict=True)]


def column_parallel_joined(x: jax.Array, weights: tuple[jax.Array, ...], name: str, rules: Rules, dtype,
                           einsum=jnp.einsum) -> jax.Array:
    """`column_parallel`'s one matmul, its output not split: [B, T, shards, sum of n_i / shards, ...],
    each shard's blocks of the weights side by side in their order."""
    shards = rules.shards(name)
    blocks = [w.astype(dtype).reshape(w.shape[0], shards, w.shape[1] // shards, *w.shape[2:]) for w in weights]
    y = einsum("btd,dsn...->btsn...", x, jnp.concatenate(blocks, axis=2))
    return constrain(y, ("batch", "length", f"act_{name}") + (None,) * (y.ndim - 3), rules)


@jax.custom_vjp
def swiglu(y: jax.Array) -> jax.Array:
    """silu(gate) * up of y [..., 2n], gate its first n columns and up its last n.

    Playbook, "Fused Kernels": the backward writes the gradient of the gate and the up projection
    side by side in one elementwise pass, the layout the joined gate + up matmul's backward reads
    (`column_parallel_joined`). Autodiff of the split computed the two halves in separate passes and
    then copied them together: three [B, T, F] passes a layer where one suffices (the runbook's 1.5B
    model by `meshtrain.aot`'s kernel model: docs/kernels.md).
    """
    gate, up = jnp.split(y, 2, axis=-1)
    return nn.silu(gate) * up


def _swiglu_fwd(y):
    return swiglu(y), y


def _swiglu_bwd(y, d_hidden):
    # One elementwise expression over y's 2n columns (a concatenation of the two halves' gradients
    # compiles to two passes and a copy): column j < n is the gate's, dh_j up_j silu'(g_j) with
    # silu'(g) = sig(g) (1 + g (1 - sig(g))); column n + j the up's, dh_j silu(g_j). Each reads its
    # gate, up and dh through views of y and dh doubled along the last axis.
    gate, up = jnp.split(y, 2, axis=-1)
    gate2, up2, dh2 = (jnp.concatenate([a, a], axis=-1) for a in (gate, up, d_hidden))
    sig = jax.nn.sigmoid(gate2)
    is_gate = lax.broadcasted_iota(jnp.int32, y.shape, y.ndim - 1) < gate.shape[-1]
    return (dh2 * jnp.where(is_gate, up2 * (sig * (1 + gate2 * (1 - sig))), gate2 * sig),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class Attention(nn.Module):
    """Grouped-query self-attention; heads split over `tensor` (Megatron column/row parallel).

    With `decode`, keys and values go to a KV cache (the "cache" collection: k, v [B,S,K,Dh],
    their segment ids [B,S] and the next slot), created by `init` on a [B,S] input, and the
    queries attend over it (`generate.py`): prefill writes the prompt, each decode step one token.
    """

    cfg: ModelConfig
    rules: Rules
    attention_fn: AttentionFn
    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        if self.cfg.kv_lora_rank:
            return self._latent(x, positions, segment_ids)
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        wq = _param(self, "wq", (d, h, dh), ("embed", "heads", "head_dim"))
        wk = _param(self, "wk", (d, kv, dh), ("embed", "kv_heads", "head_dim"))
        wv = _param(self, "wv", (d, kv, dh), ("embed", "kv_heads", "head_dim"))
        wo = _param(self, "wo", (h, dh, d), ("heads", "head_dim", "embed"))
        q, k, v = column_parallel(x, (wq, wk, wv), "heads", self.rules, dtype,
                                  fp8_lib.matmul(self, "qkv", cm.all_gather_matmul))
        if cfg.attention_bias:  # Qwen2: biases on the q, k, v projections
            q = q + _param(self, "bq", (h, dh), ("heads", "head_dim"), nn.initializers.zeros).astype(dtype)
            k = k + _param(self, "bk", (kv, dh), ("kv_heads", "head_dim"), nn.initializers.zeros).astype(dtype)
            v = v + _param(self, "bv", (kv, dh), ("kv_heads", "head_dim"), nn.initializers.zeros).astype(dtype)
        if cfg.qk_norm:  # Qwen3: each query and key head RMS-normalised before RoPE
            q = RMSNorm(cfg, ("head_dim",), name="q_norm")(q)
            k = RMSNorm(cfg, ("head_dim",), name="k_norm")(k)
        q = rope(q, positions, cfg)
        if score_scale(cfg) != 1:  # YaRN's mscale on the scores, carried by the queries
            q = q * jnp.asarray(score_scale(cfg), q.dtype)
        q = constrain(q, ("batch", "length", "act_heads", None), self.rules)
        k = constrain(rope(k, positions, cfg), ("batch", "length", "act_kv_heads", None), self.rules)
        v = constrain(v, ("batch", "length", "act_kv_heads", None), self.rules)
        q, k, v = (checkpoint_name(a, f"attention_{n}") for a, n in ((q, "q"), (k, "k"), (v, "v")))
        if self.decode:
            out = self._cached(q, k, v, segment_ids)
        elif cfg.sliding_window:  # einsum attention only (validated): keys at most sliding_window - 1 back
            out = self.attention_fn(q, k, v, segment_ids, window=cfg.sliding_window)
        else:
            out = self.attention_fn(q, k, v, segment_ids)  # [B,T,H,Dh]
        return self._out(out, wo)

    def _out(self, out: jax.Array, wo: jax.Array) -> jax.Array:
        """The heads' outputs [B,T,H,Dv] through the row-parallel output projection wo [H,Dv,D]."""
        out = constrain(out, ("batch", "length", "act_heads", None), self.rules)
        if self.cfg.attention_impl not in KERNEL_SAVES_OUTPUT:
            out = checkpoint_name(out, "attention_out")
        return fp8_lib.matmul(self, "out", cm.matmul_reduce_scatter)("bthk,hkd->btd", out,
                                                                     wo.astype(jnp.dtype(self.cfg.dtype)))

    def _latent(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Multi-head latent attention (DeepSeek-V2, section 2.1; V3 keeps it): each token's keys and values
        come from one latent c_kv [B,T,R] (`kv_lora_rank`, RMS-normalised) through wkv_b, and its RoPE key
        part k_pe [B,T,P] (`qk_rope_head_dim`) is one for all heads; queries likewise through their own latent
        (`q_lora_rank`; 0: projected directly). A query / key head is [nope | rope] (`head_dim` = nope + P),
        a value head `v_head_dim` wide. Heads split over `tensor` as in `__call__`; the latents are whole
        on every `tensor` device (each computes them, as Megatron-LM does). The Pallas flash kernel takes the
        values at their own width (`attention.takes_narrow_values`); the other attention functions take one
        head width: values narrower than head_dim are padded with zeros and the padding cut off the output.
        With `decode` the cache holds c_kv and k_pe alone (`_latent_cached`)."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        d, h, dh, r, p = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        nope, dv = dh - p, cfg.v_head_dim or cfg.head_dim
        x = x.astype(dtype)
        if cfg.q_lora_rank:
            wq_a = _param(self, "wq_a", (d, cfg.q_lora_rank), ("embed", "norm")).astype(dtype)
            c_q = RMSNorm(cfg, ("norm",), LATENT_NORM_EPS, name="q_a_norm")(jnp.einsum("btd,dr->btr", x, wq_a))
            wq_b = _param(self, "wq_b", (cfg.q_lora_rank, h, dh), ("embed", "heads", "head_dim")).astype(dtype)
            q = jnp.einsum("btr,rhk->bthk", c_q, wq_b)
        else:
            wq = _param(self, "wq", (d, h, dh), ("embed", "heads", "head_dim")).astype(dtype)
            q = jnp.einsum("btd,dhk->bthk", x, wq)
        q = constrain(q, ("batch", "length", "act_heads", None), self.rules)
        wkv_a = _param(self, "wkv_a", (d, r + p), ("embed", "norm")).astype(dtype)
        latent = jnp.einsum("btd,dr->btr", x, wkv_a)
        c_kv = RMSNorm(cfg, ("norm",), LATENT_NORM_EPS, name="kv_a_norm")(latent[..., :r])
        k_pe = rope(latent[..., None, r:], positions, cfg)  # [B,T,1,P]
        wkv_b = _param(self, "wkv_b", (r, h, nope + dv), ("embed", "heads", "head_dim"))
        wo = _param(self, "wo", (h, dv, d), ("heads", "head_dim", "embed"))
        q = jnp.concatenate([q[..., :nope], rope(q[..., nope:], positions, cfg)], axis=-1)
        if score_scale(cfg) != 1:  # YaRN's mscale on the scores (DeepSeek-V3's softmax scale), carried by the queries
            q = q * jnp.asarray(score_scale(cfg), q.dtype)
        if self.decode:
            return self._out(self._latent_cached(q, c_kv, k_pe[:, :, 0], wkv_b.astype(dtype), segment_ids), wo)
        kv = jnp.einsum("btr,rhk->bthk", c_kv, wkv_b.astype(dtype))
        kv = constrain(kv, ("batch", "length", "act_heads", None), self.rules)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_pe, (*k_pe.shape[:2], h, p))], axis=-1)
        v = kv[..., nope:]
        if dv < dh and not takes_narrow_values(self.attention_fn):
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dh - dv)))
        q, k, v = (constrain(a, ("batch", "length", "act_heads", None), self.rules) for a in (q, k, v))
        q, k, v = (checkpoint_name(a, f"attention_{n}") for a, n in ((q, "q"), (k, "k"), (v, "v")))
        out = self.attention_fn(q, k, v, segment_ids)  # [B,T,H,Dh] or [B,T,H,Dv]
        return self._out(out[..., :dv], wo)

    def _latent_cached(self, q: jax.Array, c_kv: jax.Array, k_pe: jax.Array, wkv_b: jax.Array,
                       segment_ids: jax.Array) -> jax.Array:
        """Latent attention of T new queries over the cache of c_kv [B,S,R] and k_pe [B,S,P] (R + P numbers a
        token a layer): wkv_b's key part is absorbed into the queries and its value part applied after the
        weighted sum (DeepSeek-V2, "Low-Rank Key-Value Joint Compression"), so no key or value is expanded."""
        cfg = self.cfg
        nope = cfg.head_dim - cfg.qk_rope_head_dim
        cached_c = self.variable("cache", "c_kv", jnp.zeros, c_kv.shape, c_kv.dtype)
        cached_pe = self.variable("cache", "k_pe", jnp.zeros, k_pe.shape, k_pe.dtype)
        cached_segments = self.variable("cache", "segment_ids", jnp.zeros, segment_ids.shape, jnp.int32)
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        dv = cfg.v_head_dim or cfg.head_dim
        if self.is_initializing():
            return jnp.zeros((*q.shape[:3], dv), q.dtype)
        start = index.value
        cached_c.value = jax.lax.dynamic_update_slice(cached_c.value, c_kv, (0, start, 0))
        cached_pe.value = jax.lax.dynamic_update_slice(cached_pe.value, k_pe, (0, start, 0))
        cached_segments.value = jax.lax.dynamic_update_slice(cached_segments.value,
                                                             segment_ids.astype(jnp.int32), (0, start))
        index.value = start + q.shape[1]
        q_latent = jnp.einsum("bthn,rhn->bthr", q[..., :nope], wkv_b[..., :nope])  # [B,T,H,R]
        scores = (jnp.einsum("bthr,bsr->bhts", q_latent, cached_c.value, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthp,bsp->bhts", q[..., nope:], cached_pe.value, preferred_element_type=jnp.float32))
        scores = scores / np.sqrt(cfg.head_dim).astype(np.float32)
        causal = (jnp.arange(cached_c.value.shape[1])[None, :] <= (start + jnp.arange(q.shape[1]))[:, None])
        allowed = causal[None] & (cached_segments.value > 0)[:, None, :]  # [B,T,S]
        scores = jnp.where(allowed[:, None], scores, jnp.finfo(scores.dtype).min)  # as `masked_attention`
        weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out_latent = jnp.einsum("bhts,bsr->bthr", weights, cached_c.value)
        return jnp.einsum("bthr,rhv->bthv", out_latent, wkv_b[..., nope:])

    def _cached(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
        names = ("batch", None, "act_kv_heads", None)  # the cache: batch and KV heads split as the activations
        cached_k = self.variable("cache", "k", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "v", jnp.zeros, v.shape, v.dtype)
        cached_segments = self.variable("cache", "segment_ids", jnp.zeros, segment_ids.shape, jnp.int32)
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        if self.is_initializing():  # the cache's shapes come from the init input [B,S]
            return jnp.zeros_like(q)
        start = index.value
        cached_k.value = constrain(jax.lax.dynamic_update_slice(cached_k.value, k, (0, start, 0, 0)), names,
                                   self.rules)
        cached_v.value = constrain(jax.lax.dynamic_update_slice(cached_v.value, v, (0, start, 0, 0)), names,
                                   self.rules)
        cached_segments.value = jax.lax.dynamic_update_slice(cached_segments.value,
                                                             segment_ids.astype(jnp.int32), (0, start))
        index.value = start + q.shape[1]
        return cached_attention(q, cached_k.value, cached_v.value, cached_segments.value, start,
                                window=self.cfg.sliding_window)


class Mlp(nn.Module):
    """SwiGLU feed-forward: w_down(silu(x w_gate) * x w_up); F split over `tensor`."""

    cfg: ModelConfig
    rules: Rules

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        w_gate = _param(self, "w_gate", (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))
        w_up = _param(self, "w_up", (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))
        w_down = _param(self, "w_down", (cfg.mlp_dim, cfg.d_model), ("mlp", "embed"))
        joined = column_parallel_joined(x, (w_gate, w_up), "mlp", self.rules, dtype,
                                        fp8_lib.matmul(self, "gate_up", cm.all_gather_matmul))
        hidden = swiglu(joined).reshape(*x.shape[:2], cfg.mlp_dim)  # [B, T, shards, F/shards] -> [B, T, F]
        hidden = constrain(hidden, ("batch", "length", "act_mlp"), self.rules)
        return fp8_lib.matmul(self, "down", cm.matmul_reduce_scatter)("btf,fd->btd", hidden, w_down.astype(dtype))


def residual_names(cfg: ModelConfig) -> tuple[str, str, str]:
    """Logical names of the residual stream: split over `tensor` too under sequence parallelism."""
    return ("batch", "length_sp" if cfg.sequence_parallel else "length", "act_embed")


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)). One scan step of a dense model.

    With `moe`, the MLP is the mixture of experts and the second output its router statistics.
    """

    cfg: ModelConfig
    rules: Rules
    attention_fn: AttentionFn
    moe: bool = False
    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
        names = residual_names(self.cfg)
        attn = Attention(self.cfg, self.rules, self.attention_fn, self.decode, name="attn")
        h = x + constrain(attn(RMSNorm(self.cfg, name="attn_norm")(x), positions, segment_ids), names, self.rules)
        h = checkpoint_name(h, "attention_residual")
        normed = RMSNorm(self.cfg, name="mlp_norm")(h)
        if self.moe:
            y, stats = moe_lib.MoeMlp(self.cfg, self.rules, name="moe")(normed, segment_ids > 0)  # 0: padding
        else:
            y, stats = Mlp(self.cfg, self.rules, name="mlp")(normed), None
        out = h + constrain(y, names, self.rules)
        return constrain(out, names, self.rules), stats


class MoeGroup(nn.Module):
    """`moe_every` layers, the last with the mixture of experts: one scan step of an MoE model."""

    cfg: ModelConfig
    rules: Rules
    attention_fn: AttentionFn
    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
        for i in range(self.cfg.moe_every - 1):
            x, _ = Block(self.cfg, self.rules, self.attention_fn, decode=self.decode, name=f"dense_{i}")(
                x, positions, segment_ids)
        return Block(self.cfg, self.rules, self.attention_fn, moe=True, decode=self.decode, name="moe_layer")(
            x, positions, segment_ids)


def scan_unit(cfg: ModelConfig) -> tuple[type[nn.Module], int]:
    """The scanned layer class (Block, or MoeGroup for an MoE model) and how many times it repeats."""
    if cfg.num_experts:
        return MoeGroup, cfg.moe_layers
    return Block, cfg.n_layers


def remat_block(cfg: ModelConfig) -> type[nn.Module]:
    """The scanned layer class, wrapped by the configured recomputation policy."""
    unit, _ = scan_unit(cfg)
    if cfg.remat_policy == "none":
        return unit
    return nn.remat(unit, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)


class LayerStack(Protocol):
    """Runs a bound `Transformer`'s scanned layers another way than `nn.scan` over one device's view:
    `parallel.pipeline.Pipeline` runs them as a pipeline over `stage`. The model imports no runner."""

    def forward(self, model: Transformer, x: jax.Array, positions: jax.Array,
                segment_ids: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B,T,D] through every layer -> (x [B,T,D], MoE router statistics; {} for a dense model)."""
        ...


class Transformer(nn.Module):
    """Embedding -> (the dense first layers ->) L scanned layers -> final norm -> output head (optionally tied)."""

    cfg: ModelConfig
    rules: Rules
    attention_fn: AttentionFn = xla_attention
    pipeline: LayerStack | None = None  # when mesh.stage > 1 the layer stack runs through it
    decode: bool = False  # attention over a KV cache ("cache" collection; see Attention)

    def setup(self):
        cfg = self.cfg
        self.embedding = _param(self, "embedding", (cfg.vocab_size, cfg.d_model), ("embed_vocab", "embed"))
        self.layers = nn.scan(
            scan_unit(cfg)[0] if self.decode else remat_block(cfg),
            variable_axes={"params": 0, "cache": 0, fp8_lib.COLLECTION: 0},
            split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast), length=scan_unit(cfg)[1],
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, self.rules, self.attention_fn, decode=self.decode, name="layers")
        if cfg.first_dense_layers:  # DeepSeek-V3's first_k_dense_replace: dense layers before the MoE stack
            block = Block if self.decode or cfg.remat_policy == "none" else nn.remat(
                Block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)
            self.dense_layers = nn.scan(
                block, variable_axes={"params": 0, "cache": 0, fp8_lib.COLLECTION: 0},
                split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast), length=cfg.first_dense_layers,
                metadata_params={nn.PARTITION_NAME: "dense_layers"},
            )(cfg, self.rules, self.attention_fn, decode=self.decode, name="dense_layers")
        self.final_norm = RMSNorm(cfg, name="final_norm")
        if cfg.mtp_depth and not self.decode:
            self.mtp = MultiTokenPrediction(cfg, self.rules, self.attention_fn, name="mtp")
        if not cfg.tie_embeddings:
            self.head = _param(self, "head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def hidden(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Final-norm hidden states [B,T,D] in the compute dtype."""
        return self.hidden_and_stats(tokens, positions, segment_ids)[0]

    def hidden_and_stats(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array):
        """Final-norm hidden states [B,T,D] and the MoE layers' router statistics ([L/moe_every]; None if dense)."""
        x = self.stem(tokens, positions, segment_ids)
        if self.pipeline is not None and not self.is_initializing():  # parallel/pipeline.py, over `stage`
            x, stats = self.pipeline.forward(self, x, positions, segment_ids)
            return self.final_norm(x), stats or None
        x, stats = self.layers(x, positions, segment_ids)
        return self.final_norm(x), stats

    def stem(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Token embeddings through the dense first layers (`model.first_dense_layers`) [B,T,D]: what the
        scanned layer stack reads (under a slot-table pipeline, what its first stage runs before its chunk)."""
        return self.dense(self.embed(tokens), positions, segment_ids)

    def dense(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x [B,T,D] through the dense first layers (the identity without them)."""
        if self.cfg.first_dense_layers:
            x, _ = self.dense_layers(x, positions, segment_ids)
        return x

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings [B,T,D] in the compute dtype."""
        # Gather the table whole first (ZeRO-3 stores it split over fsdp): a row gather from a split
        # table with the batch split over the same axis would be rematerialised involuntarily.
        table = constrain(self.embedding.astype(jnp.dtype(self.cfg.dtype)), ("embed_vocab", "act_embed"), self.rules)
        x = jnp.take(table, tokens, axis=0)  # [B,T,D]
        return constrain(x, residual_names(self.cfg), self.rules)

    def head_loss(self, x: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
        """Summed cross-entropy of the layer stack's output x [B,T,D] (final norm, head, loss): the last
        stage of 1F1B and the slot-table schedules."""
        return self._loss_sum(self.final_norm(x), batch)

    def head_and_mtp(self, x: jax.Array, batch: dict[str, jax.Array]):
        """(`head_loss`, multi-token prediction's `mtp_terms`) of the layer stack's output x [B,T,D]: the last
        stage of a slot-table pipeline under `model.mtp_depth`."""
        h = self.final_norm(x)
        return self._loss_sum(h, batch), self.mtp_terms(h, batch)

    def mtp_terms(self, h: jax.Array, batch: dict[str, jax.Array]):
        """Multi-token prediction's (unweighted cross-entropy sum, tokens it counts, the block's router
        statistics or None) from the final-normed hidden states h [B,T,D] (`MultiTokenPrediction`): this
        device's own sums, for the caller to weigh and reduce."""
        length = tuple(a for a in self.rules.split_axes("length") if a in self.rules.manual)
        next_embedded = self.embed(next_along_length(batch["inputs"], length))  # each position's next token
        out, stats = self.mtp(h, next_embedded, batch["positions"], batch["segment_ids"])
        targets = mtp_targets(batch, length)
        return self._loss_sum(out, targets), jnp.sum(targets["loss_mask"]), stats

    def _loss_sum(self, x: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
        """Summed cross-entropy of the normed hidden states x [B,T,D]: the fused Pallas head + loss under
        `model.fused_loss` (no [B,T,V] logits), else the logits and `cross_entropy_sum`."""
        if self.cfg.fused_loss:
            return fused_loss_sum(x, self.head_weight().astype(x.dtype), batch["targets"], batch["loss_mask"],
                                  vocab_split=self._vocab_split() and not self.cfg.tie_embeddings)
        return cross_entropy_sum(self._logits(x), batch["targets"], batch["loss_mask"], self._vocab_split())

    def head_weight(self) -> jax.Array:
        """[D, V] output projection (the embedding's transpose when tied)."""
        return self.embedding.T if self.cfg.tie_embeddings else self.head

    def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """float32 logits [B,T,V]."""
        x = self.hidden(tokens, positions, segment_ids)
        if self.cfg.mtp_depth and not self.decode and self.is_initializing():  # its parameters, beside the rest
            self.mtp(x, x, positions, segment_ids)
        return self._logits(x)

    def _logits(self, x: jax.Array) -> jax.Array:
        logits = head_logits(x, self.head_weight().astype(x.dtype))
        return constrain(logits, ("batch", "length", "act_vocab"), self.rules)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Sum over tokens of loss_mask * cross-entropy (float32), and auxiliary losses (added to it).

        Logged-only scalars (MoE dropped-token fraction, ...) are sown into the "metrics" collection.
        """
        x, stats = self.hidden_and_stats(batch["inputs"], batch["positions"], batch["segment_ids"])
        mtp = None
        if self.cfg.mtp_depth:
            mtp = self.mtp_terms(x, batch)
            if mtp[2] is not None:  # its router statistics join the MoE layers' (one more layer)
                stats = jax.tree.map(functools.partial(_one_more_unit, units=scan_unit(self.cfg)[1]), stats, mtp[2])
        aux, metrics = moe_lib.loss_terms(stats, self.cfg)
        if mtp is not None:
            mtp_sum, tokens, _ = mtp
            aux[MTP_SUM] = self.cfg.mtp_loss_weight * mtp_sum
            axes = tuple(sorted(varying(mtp_sum) | varying(tokens)))  # a manual region's devices: summed
            mtp_sum, tokens = (jax.lax.psum((mtp_sum, tokens), axes) if axes else (mtp_sum, tokens))
            metrics["mtp_loss"] = mtp_sum / jnp.maximum(tokens, 1.0)
        for name, value in metrics.items():
            self.sow("metrics", name, value, reduce_fn=lambda _, new: new, init_fn=lambda: jnp.zeros(()))
        return self._loss_sum(x, batch), aux

    def _vocab_split(self) -> bool:
        """Whether the logits' vocabulary dimension is split over devices (a static fact of the rules)."""
        return bool(self.rules.spec(("act_vocab",)))


def _one_more_unit(stats: jax.Array, more: jax.Array, units: int) -> jax.Array:
    """A router statistic of the MoE units joined by one more unit's: stacked [units] -> [units + 1], or,
    out of a pipeline (already averaged over its `units`), the mean over units + 1."""
    if stats.ndim:
        return jnp.concatenate([stats, more[None]])
    return (stats * units + more) / (units + 1)


# `Transformer.loss`'s aux entry holding multi-token prediction's weighted cross-entropy *sum*: the step adds
# it to the main loss's sum before dividing by the batch's tokens (`train_step.grads_one_pass`), so that it
# decomposes over micro-batches and devices as the main loss does; evaluation reads the main loss alone.
MTP_SUM = "mtp_loss_sum"


def next_along_length(x: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """x [B, T, ...] with position t holding position t + 1's entry (the last: the first's). `axes`: the
    manual axes that split the length into contiguous blocks (a region manual over `sequence`): each block's
    last entry comes from the next block's first, gathered (one column of every block; an all-gather, not a
    collective-permute, which inside a pipeline tick's `lax.switch` would wait for every device)."""
    if not axes:
        return jnp.roll(x, -1, axis=1)
    firsts = jax.lax.all_gather(x[:, :1], axes, axis=0, tiled=False)  # [blocks, B, 1, ...]
    n = firsts.shape[0]
    first = jax.lax.dynamic_index_in_dim(firsts, (jax.lax.axis_index(axes) + 1) % n, 0, keepdims=False)
    return jnp.concatenate([x[:, 1:], first], axis=1)


def mtp_targets(batch: dict[str, jax.Array], axes: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """Multi-token prediction's batch: at position t the target of position t + 1 (the token after next),
    counted where t + 1 holds a counted target of the same document (not past a row's end or across a
    document boundary). `axes`: as `next_along_length`'s."""
    shift = functools.partial(next_along_length, axes=axes)
    t = batch["targets"].shape[1]
    start = jax.lax.axis_index(axes) * t if axes else 0  # this block's first position in the row
    whole = t * (jax.lax.psum(1, axes) if axes else 1)
    inside = (start + jnp.arange(t) < whole - 1)[None, :]
    same = shift(batch["segment_ids"]) == batch["segment_ids"]
    mask = batch["loss_mask"]
    return {"targets": shift(batch["targets"]), "loss_mask": mask * shift(mask) * (inside & same).astype(mask.dtype)}


class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's multi-token prediction at depth 1 (the report's section 2.2, eq. 21-23): the main model's
    final hidden state h_t (after its final norm, what the head reads) and the embedding of token t + 1, each
    RMS-normalised, joined by one projection [2D -> D], through one more block (an MoE block in an MoE model)
    and its own final norm; the shared head then predicts token t + 2. Dropped for sampling, and for export
    unless asked (`hf.save(..., mtp=True)`: DeepSeek-V3's layer after the last)."""

    cfg: ModelConfig
    rules: Rules
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, h: jax.Array, next_embedded: jax.Array, positions: jax.Array, segment_ids: jax.Array):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        joined = jnp.concatenate([RMSNorm(cfg, name="embed_norm")(next_embedded), RMSNorm(cfg, name="hidden_norm")(h)],
                                 axis=-1)
        proj = _param(self, "proj", (2 * cfg.d_model, cfg.d_model), (None, "embed")).astype(dtype)
        x = constrain(jnp.einsum("btk,kd->btd", joined.astype(dtype), proj), residual_names(cfg), self.rules)
        block = Block if cfg.remat_policy == "none" else nn.remat(Block, policy=REMAT_POLICIES[cfg.remat_policy],
                                                                   prevent_cse=False)
        x, stats = block(cfg, self.rules, self.attention_fn, moe=bool(cfg.num_experts), name="block")(
            x, positions, segment_ids)
        return RMSNorm(cfg, name="norm")(x), stats


@jax.custom_vjp
def head_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """float32 logits [B,T,V] of x [B,T,D] and the head w [D,V], both in the compute dtype.

    The GEMM accumulates in float32 and returns float32 (the softmax over a large vocabulary needs
    it). Its backward rounds the logits' float32 gradient to the compute dtype and runs its two GEMMs
    there, accumulating in float32, as every other matmul of a mixed-precision step does (playbook,
    "Mixed Precision Training"): autodiff alone would multiply the float32 gradient against upcast
    operands, float32 GEMMs that run as TF32 on Hopper, a fraction of the bf16 rate
    (`plan.kernel_model.TF32_EFFICIENCY`; measured: docs/benchmarks.md). In float32 runs the rounding is the
    identity.
    """
    return jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32)


def _head_logits_fwd(x, w):
    return head_logits(x, w), (x, w)


def _head_logits_bwd(residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    dx = jnp.einsum("btv,dv->btd", g, w, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum("btd,btv->dv", x, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array,
                      vocab_split: bool = False) -> jax.Array:
    """sum(mask * (logsumexp(logits) - logits[target])).

    With the vocabulary split over `tensor` the target logit is picked by a one-hot product, which
    keeps the split (a gather would collect the whole [B,T,V] logits); otherwise by a gather.

    The gradient is one elementwise pass over the logits, (softmax - onehot) x mask x g (playbook,
    "Fused Kernels": one read of the [B,T,V] float32 logits, one write of their gradient), where
    autodiff would compute the softmax, scatter the target logit's gradient into a dense [B,T,V]
    buffer and add the two.
    """
    return _cross_entropy_sum(logits, targets, mask.astype(jnp.float32), vocab_split)


def _logsumexp_one_pass(x: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis in one read of x: a reduction carrying (running max, sum
    of exp(x - running max)), merged as the online softmax merges its blocks (playbook, "Flash
    Attention 1-3"). `jax.nn.logsumexp` reads x twice, once for the max and once for the sum: over
    the [B, T, V] float32 logits of a 128K vocabulary that second read is a few ms a step."""

    def merge(a, b):
        (m_a, s_a), (m_b, s_b) = a, b
        m = jnp.maximum(m_a, m_b)
        safe = jnp.isfinite(m)  # both -inf: nothing summed yet on either side
        return m, (s_a * jnp.exp(jnp.where(safe, m_a - m, 0.0)) + s_b * jnp.exp(jnp.where(safe, m_b - m, 0.0)))

    init = (jnp.array(-jnp.inf, x.dtype), jnp.array(0.0, x.dtype))
    m, total = lax.reduce((x, jnp.ones_like(x)), init, merge, (x.ndim - 1,))
    return m + jnp.log(total)


def _cross_entropy_parts(logits, targets, vocab_split: bool):
    """(log-sum-exp, target logit), each [B,T]. With the vocabulary split over devices the
    log-sum-exp is XLA's two reductions, which its partitioner splits into local ones and an
    all-reduce (a custom merge it could not split: it would gather the logits)."""
    log_z = jax.nn.logsumexp(logits, axis=-1) if vocab_split else _logsumexp_one_pass(logits)
    if vocab_split:
        target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
    else:
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z, target_logit


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy_sum(logits, targets, mask, vocab_split):
    log_z, target_logit = _cross_entropy_parts(logits, targets, vocab_split)
    return jnp.sum((log_z - target_logit) * mask)


def _cross_entropy_sum_fwd(logits, targets, mask, vocab_split):
    log_z, target_logit = _cross_entropy_parts(logits, targets, vocab_split)
    token_loss = log_z - target_logit
    return jnp.sum(token_loss * mask), (logits, targets, mask, log_z, token_loss)


def _cross_entropy_sum_bwd(vocab_split, residuals, g):
    logits, targets, mask, log_z, token_loss = residuals
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    dlogits = (jnp.exp(logits - log_z[..., None]) - onehot) * (mask * g)[..., None]
    return dlogits, None, token_loss * g


_cross_entropy_sum.defvjp(_cross_entropy_sum_fwd, _cross_entropy_sum_bwd)


def dummy_batch(batch: int, seq_len: int) -> dict[str, jax.Array]:
    """Zeros with the batch's shapes and dtypes: for `init` and `eval_shape`."""
    ints = jnp.zeros((batch, seq_len), jnp.int32)
    return {"inputs": ints, "targets": ints, "positions": ints, "segment_ids": ints + 1,
            "loss_mask": jnp.ones((batch, seq_len), jnp.float32)}


def abstract_params(cfg: ModelConfig) -> dict:
    """The parameter tree as `jax.ShapeDtypeStruct`s inside `nn.LogicallyPartitioned` boxes (the
    logical names of every dimension): the one list of parameters, traced from the model itself
    (`jax.eval_shape` of `init`, nothing allocated). The planner's table, the parameter counts and
    the Hugging Face layouts all read it."""
    layout_free = dataclasses.replace(cfg, remat_policy="none", attention_impl="xla", fused_norm=False,
                                      fused_loss=False, sequence_parallel=False)
    return _abstract_params(layout_free)


@functools.cache
def _abstract_params(cfg: ModelConfig) -> dict:
    """Traced with every axis of size 1 and no mesh: touches no device (the planner calls it before
    it fakes the devices it verifies on)."""
    model = Transformer(cfg, Rules(tuple((axis, 1) for axis in MESH_ORDER)), parent=None)  # callable in a module

    def init():
        ids = jnp.zeros((1, 1), jnp.int32)
        return model.init(jax.random.key(0), ids, ids, ids + 1)["params"]
    return jax.eval_shape(init)


def param_leaves(cfg: ModelConfig) -> list[tuple[str, nn.LogicallyPartitioned]]:
    """("a/b/c" path, box with the abstract array and its logical names) per parameter, in tree order."""
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params(cfg), is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return [("/".join(str(k.key) for k in path), box) for path, box in leaves]


def num_params(cfg: ModelConfig) -> int:
    """Exact parameter count (embedding, layers, final norm, head; routers, experts, shared expert)."""
    return sum(math.prod(box.value.shape) for _, box in param_leaves(cfg))


@functools.lru_cache(maxsize=64)
def num_active_params(cfg: ModelConfig) -> int:
    """Parameters a token passes through: of an expert-stacked weight only `experts_per_token` of the
    `num_experts` experts count (memoised: the planner's search asks per candidate)."""
    total = 0
    for _, box in param_leaves(cfg):
        size = math.prod(box.value.shape)
        total += size * cfg.experts_per_token // cfg.num_experts if "expert" in box.names else size
    return total


def logits(model_config: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """float32 logits [B, L, V] of `tokens` [B, L], each row one document (positions 0..L-1), every
    matmul in the compute dtype (FP8's amax histories are training state, not needed here).

    Runs on the mesh the parameters live on (e.g. as loaded by `meshtrain.hf.load`), or on one
    device when they are not sharded on a mesh.
    """
    mesh = params_mesh(params)
    rules = Rules.for_mesh(mesh, model=model_config)
    model = Transformer(dataclasses.replace(model_config, matmul_precision="bf16"), rules)
    tokens = jnp.asarray(tokens, jnp.int32)
    rows = tokens.shape[0]
    split = math.prod(mesh.shape[a] for a in BATCH_AXES)  # rows split over the batch axes: pad to fill them
    tokens = jnp.pad(tokens, ((0, -rows % split), (0, 0)))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    with jax.set_mesh(mesh):
        forward = jax.jit(model.apply, compiler_options=compiler_options(mesh))
        return forward({"params": params}, tokens, positions, jnp.ones_like(tokens))[:rows]


def params_mesh(params: dict) -> jax.sharding.Mesh:
    """The mesh of the first parameter, or a one-device mesh with all six axes of size 1."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and set(sharding.mesh.axis_names) == set(MESH_ORDER):
        return sharding.mesh
    return single_device_mesh()
