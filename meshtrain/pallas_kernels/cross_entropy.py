"""Fused output projection + softmax cross-entropy in Pallas.

Playbook, "Fused Kernels" and "Mixed Precision Training": the [tokens, vocab]
fp32 logits are the largest activation of a language model (tokens x 128k x 4
bytes for Llama 3). Here they only ever exist one [block_n, block_v] tile at a
time, in fast memory. The forward kernel computes, per (token tile, vocab tile),
the tile's logits (contracting d_model in chunks), its log-sum-exp and the label
logit; the [vocab / block_v, tokens] partials are combined by a logsumexp. The
backward recomputes the logits one chunk of tokens at a time (at most
CHUNK_LOGITS_BYTES of fp32 logits, at least MIN_CHUNKS chunks), forms dlogits =
(softmax - onehot) in the compute dtype and runs dlogits @ W^T and hidden^T @ dlogits
as XLA GEMMs (cuBLAS on a GPU), d_W summed over the chunks. A Pallas backward that
added every tile's two products into d_hidden and d_W with atomic adds (the design
of Cut Cross-Entropy, Wijmans et al. 2024) ran at a small share of the bf16 peak on
an H200, bound by the bytes its atomics moved (`bench/gpu/mfu.py --profile`; the
figures in docs/kernels.md). All accumulation is fp32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from meshtrain.pallas_kernels._common import (
    NN,
    NT,
    TN,
    dot,
    floor_power_of_two,
    is_power_of_two,
    resolve_interpret,
)


@dataclasses.dataclass(frozen=True)
class CrossEntropyBlockSizes:
    """Tile sizes (powers of two >= 16); each is clamped to its dimension, which
    is zero-padded up to a multiple of the tile when needed (a copy: multiples of
    the tile avoid it; Llama 3's 128256 = 1002 x 128).

    Attributes:
        block_n: tokens per tile.
        block_v: vocabulary entries per tile.
        block_d: d_model chunk of the tile's matmul.
    """

    block_n: int = 64
    block_v: int = 128
    block_d: int = 64

    def fit(self, n: int, v: int, d: int) -> CrossEntropyBlockSizes:
        def one(name, block, dim):
            if not is_power_of_two(block) or block < 16:
                raise ValueError(f"{name}={block} must be a power of two >= 16 (Triton tile rule)")
            return min(block, max(16, floor_power_of_two(dim)))

        return CrossEntropyBlockSizes(
            one("block_n", self.block_n, n),
            one("block_v", self.block_v, v),
            one("block_d", self.block_d, d),
        )


@dataclasses.dataclass(frozen=True)
class _Config:
    vocab: int  # true vocabulary size (of this shard); columns past it are padding
    blocks: CrossEntropyBlockSizes
    interpret: bool
    vocab_axis: str | None = None  # mesh axis the vocabulary is split over (inside a shard_map)


def _logits_tile(h_ref, w_ref, cfg: _Config):
    """fp32 logits of this program's [block_n, block_v] tile and its column ids."""
    bn, bv, bd = cfg.blocks.block_n, cfg.blocks.block_v, cfg.blocks.block_d

    def body(t, acc):
        ds = pl.ds(t * bd, bd)
        return acc + dot(h_ref[:, ds], w_ref[ds, :], NN)

    logits = lax.fori_loop(0, h_ref.shape[1] // bd, body, jnp.zeros((bn, bv), jnp.float32))
    cols = pl.program_id(1) * bv + lax.broadcasted_iota(jnp.int32, (bv,), 0)
    if cfg.vocab % bv:  # padded vocabulary: padding columns never win
        logits = jnp.where(cols[None, :] < cfg.vocab, logits, -jnp.inf)
    return logits, cols


def _forward_kernel(h_ref, w_ref, labels_ref, lse_ref, target_ref, *, cfg: _Config):
    logits, cols = _logits_tile(h_ref, w_ref, cfg)
    m = jnp.max(logits, axis=1)  # every tile holds at least one real column
    lse_ref[...] = m + jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=1))
    hit = cols[None, :] == labels_ref[...][:, None]
    target_ref[...] = jnp.sum(jnp.where(hit, logits, 0.0), axis=1)


def _specs(cfg: _Config, d: int):
    bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
    return (
        pl.BlockSpec((bn, d), lambda i, j: (i, 0)),  # hidden
        pl.BlockSpec((d, bv), lambda i, j: (0, j)),  # w_out
        pl.BlockSpec((bn,), lambda i, j: (i,)),  # per-token vectors
    )


def _forward(cfg: _Config, h, w, labels):
    (n, d), v = h.shape, w.shape[1]
    bn, bv = cfg.blocks.block_n, cfg.blocks.block_v
    h_spec, w_spec, tok_spec = _specs(cfg, d)
    part_spec = pl.BlockSpec((None, bn), lambda i, j: (j, i))
    parts = jax.ShapeDtypeStruct((v // bv, n), jnp.float32)
    lse_parts, target_parts = pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        grid=(n // bn, v // bv),
        in_specs=[h_spec, w_spec, tok_spec],
        out_specs=[part_spec, part_spec],
        out_shape=[parts, parts],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=cfg.interpret,
        name="cross_entropy_forward",
    )(h, w, labels)
    return jax.nn.logsumexp(lse_parts, axis=0), jnp.sum(target_parts, axis=0)


# The backward's chunks (`_backward`): at most 512 MiB of float32 logits each (1,024 tokens of Llama 3's
# 128,256-entry vocabulary: each chunk's GEMMs stay compute-bound, W read 3 times a chunk) and at least
# MIN_CHUNKS of them, so that no [N, V] buffer exists.
CHUNK_LOGITS_BYTES = 1 << 29
MIN_CHUNKS = 8


def _chunk_tokens(n: int, v: int, block_n: int) -> int:
    """Tokens per chunk of the backward: a power of two dividing n (a multiple of block_n), at most
    CHUNK_LOGITS_BYTES of float32 logits and n / MIN_CHUNKS tokens, at least block_n."""
    limit = min(floor_power_of_two(max(1, CHUNK_LOGITS_BYTES // (4 * v))), max(1, n // MIN_CHUNKS))
    chunk = block_n
    while chunk * 2 <= limit and n % (chunk * 2) == 0:
        chunk *= 2
    return chunk


def _backward(cfg: _Config, h, w, labels, lse, scale):
    """(dh, dw) in float32: the logits again, one chunk of tokens at a time, then dlogits = (softmax -
    onehot) x scale in the compute dtype and its two GEMMs, dh = dlogits @ W^T per chunk and
    dW += h^T @ dlogits over the chunks, all XLA GEMMs (cuBLAS on a GPU) accumulating in float32."""
    (n, d), v = h.shape, w.shape[1]
    c = _chunk_tokens(n, v, cfg.blocks.block_n)
    cols = lax.broadcasted_iota(jnp.int32, (1, v), 1)

    def chunk(dw, xs):
        h_c, labels_c, lse_c, scale_c = xs
        logits = dot(h_c, w, NN)  # [c, v] float32
        if cfg.vocab % cfg.blocks.block_v:  # padded vocabulary: padding columns get no probability
            logits = jnp.where(cols < cfg.vocab, logits, -jnp.inf)
        p = jnp.exp(logits - lse_c[:, None])
        dlogits = ((p - (cols == labels_c[:, None]).astype(jnp.float32)) * scale_c[:, None]).astype(h.dtype)
        return dw + dot(h_c, dlogits, TN), dot(dlogits, w, NT)

    xs = (h.reshape(n // c, c, d), labels.reshape(n // c, c), lse.reshape(n // c, c), scale.reshape(n // c, c))
    dw, dh = lax.scan(chunk, jnp.zeros((d, v), jnp.float32), xs)
    return dh.reshape(n, d), dw


def _combine(cfg: _Config, lse, target):
    """Per-token log-sum-exp and target logit over the whole vocabulary from this shard's.

    lse = max + log(sum over shards of exp(lse_shard - max)); the target logit lives on one shard
    (labels outside a shard hit no column there and add 0).
    """
    if cfg.vocab_axis is None:
        return lse, target
    top = lax.pmax(lax.stop_gradient(lse), cfg.vocab_axis)
    lse = top + jnp.log(lax.psum(jnp.exp(lse - top), cfg.vocab_axis))
    return lse, lax.psum(target, cfg.vocab_axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss_sum(cfg, h, w, labels, mask):
    lse, target = _combine(cfg, *_forward(cfg, h, w, labels))
    return jnp.sum(mask * (lse - target))


def _loss_sum_fwd(cfg, h, w, labels, mask):
    lse, target = _combine(cfg, *_forward(cfg, h, w, labels))
    token_loss = lse - target
    return jnp.sum(mask * token_loss), (h, w, labels, mask, lse, token_loss)


def _loss_sum_bwd(cfg, residuals, g):
    h, w, labels, mask, lse, token_loss = residuals
    # Every shard's loss is the whole loss: the cotangent of the shared value is their sum. With the
    # global lse each shard forms its own columns of softmax - onehot: dw is its shard's gradient;
    # dh and the mask's cotangent are this shard's share, which the enclosing shard_map adds over
    # the axis (their inputs are replicated over it).
    total = g if cfg.vocab_axis is None else lax.psum(g, cfg.vocab_axis)
    dh, dw = _backward(cfg, h, w, labels, lse, mask * total)
    return dh.astype(h.dtype), dw.astype(w.dtype), None, g * token_loss


_loss_sum.defvjp(_loss_sum_fwd, _loss_sum_bwd)


def _validate(hidden, w_out, labels, mask):
    if hidden.ndim != 2 or w_out.ndim != 2 or hidden.shape[1] != w_out.shape[0]:
        raise ValueError(
            f"hidden must be [N, D] and w_out [D, V]; got hidden{list(hidden.shape)}, w_out{list(w_out.shape)}"
        )
    n = hidden.shape[0]
    if labels.shape != (n,) or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be integer [{n}], got {labels.dtype}{list(labels.shape)}")
    if mask.shape != (n,):
        raise ValueError(f"mask must be [{n}] (float or bool), got {list(mask.shape)}")
    if not (jnp.issubdtype(hidden.dtype, jnp.floating) and jnp.issubdtype(w_out.dtype, jnp.floating)):
        raise ValueError(f"hidden and w_out must be floating point, got {hidden.dtype}, {w_out.dtype}")


def _pad(x, axis: int, multiple: int):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def fused_cross_entropy(
    hidden: jax.Array,
    w_out: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
    *,
    block_sizes: CrossEntropyBlockSizes | None = None,
    interpret: bool | None = None,
    vocab_axis: str | None = None,
) -> jax.Array:
    """Masked sum of token cross-entropies of softmax(hidden @ w_out).

    The trainer divides by a global token count, so the sum (not the mean) is
    returned. Gradients flow to hidden and w_out (and to a float mask).

    With `vocab_axis` (inside a `shard_map` with check_vma=False, manual over that mesh axis),
    `w_out` is this device's contiguous block of the vocabulary, in axis order, and `labels` stay
    global ids: each device computes its block's log-sum-exp and target logit, and one combine
    over the axis (pmax + psum of [N] vectors) gives the whole vocabulary's. The [D, V] head is
    never gathered (playbook, "Tensor Parallelism": the vocabulary-parallel cross-entropy).

    Args:
        hidden: [N, D] final hidden states.
        w_out: [D, V] output projection.
        labels: [N] integer targets in [0, V).
        mask: [N] float weights or bool.
        block_sizes: tile sizes; default chosen from the shape.
        interpret: Pallas interpret mode; None = on CPU only.

    Returns:
        float32 scalar sum(mask * token_loss); the token count is sum(mask).

    Raises:
        ValueError: for shapes, dtypes or block sizes the kernels do not support.
    """
    _validate(hidden, w_out, labels, mask)
    (n, d), v = hidden.shape, w_out.shape[1]
    blocks = (block_sizes or CrossEntropyBlockSizes()).fit(n, v, d)
    cfg = _Config(vocab=v, blocks=blocks, interpret=resolve_interpret(interpret), vocab_axis=vocab_axis)
    mask = mask.astype(jnp.float32)
    if vocab_axis is not None:  # this shard's columns are [offset, offset + v); other labels hit no column
        labels = labels - lax.axis_index(vocab_axis) * v
        labels = jnp.where((labels >= 0) & (labels < v), labels, -1)  # not a padding column either
    h = _pad(_pad(hidden, 0, blocks.block_n), 1, blocks.block_d)
    w = _pad(_pad(w_out, 0, blocks.block_d), 1, blocks.block_v)
    labels_p = _pad(labels.astype(jnp.int32), 0, blocks.block_n)
    mask_p = _pad(mask, 0, blocks.block_n)  # padded tokens weigh 0
    return _loss_sum(cfg, h, w, labels_p, mask_p)


def fused_cross_entropy_reference(hidden: jax.Array, w_out: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Pure-jnp sum(mask * token cross-entropy) with full fp32 logits (the matmul at full float32
    precision: a GPU's default for float32 is TF32), for tests."""
    _validate(hidden, w_out, labels, mask)
    logits = jnp.dot(hidden.astype(jnp.float32), w_out.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum(mask * (lse - target))
