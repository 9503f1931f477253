"""Context parallelism: ring attention over the `sequence` mesh axis, zig-zag balanced.

Playbook, "Context Parallelism", "Discovering Ring Attention" and "Zig-Zag Ring
Attention – A Balanced Compute Implementation". The sequence is split over the N
devices of `axis_name`; every device keeps its queries while the key/value blocks
(and their segment ids) travel around the ring with `lax.ppermute`: N steps, N - 1
transfers, the next transfer issued before the current block is computed so the
two can overlap. Block results are merged with an online log-sum-exp softmax, the
idea flash attention uses inside one device.

Zig-zag layout: the sequence is cut into 2N chunks and device i holds chunks i and
2N - 1 - i, so every device owns as many early as late tokens and does the same
causal work. The permutation is applied once to the data (tokens, positions,
labels, segment ids: `zigzag_permutation`), never per layer; inside, causality is
decided by each token's global index, rebuilt from the device index and the layout.

Backward (`jax.custom_vjp`): a second ring, turning the other way, in which dK/dV
accumulate while they travel with their K/V block and arrive home after one more
hop (N - 1 transfers of K/V, N of dK/dV), so the residuals are only the local q,
k, v, segment ids, out and lse: O(local block), never O(full sequence). Work is
skipped by layout (`_RingStep`): with zig-zag every off-diagonal step
is half a block on every device.

Shapes below: B batch, T global length, L = T / N local length, H query heads,
K key/value heads (H % K == 0, grouped-query attention), D head dim,
G = H / K queries per key/value head. A comment such as `# [B, L_seq, H, D]` says
the length axis is split over `sequence` (global T, local L).

Pluggable block computation (`block_fn`). The local block is computed by
`forward(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
sm_scale) -> (out, lse)` with q [B, Lq, H, D], k/v [B, Lk, K, D], segment ids
[B, Lq] / [B, Lk] int32, positions (global token indices) [B, Lq] / [B, Lk] int32,
out [B, Lq, H, D] (normalised within the block) and lse [B, H, Lq] float32
(-inf where a row sees nothing in the block). A query attends to a key iff the
segment ids are equal and kv_position <= q_position. This is the signature of
`meshtrain.pallas_kernels.flash_attention.flash_attention_with_lse`, so the
kernel plugs in directly. Pass either such a callable (its
backward is then derived with `jax.vjp` from the cotangents of out and lse, so it
must be differentiable in both) or a `BlockAttention(forward, backward)` whose
`backward(q, k, v, out, lse, dout, *, <same keywords>) -> (dq, dk, dv)` takes the
*global* out / lse / dout of the query rows (the flash-attention backward kernel
computes exactly the block's share of the gradient from those). The default is
`jnp_block_attention()`: jnp, K/V walked in chunks so memory stays linear in the
block length. jnp blocks run under `shard_map(check_vma=True)`; other block_fns
with check_vma=False, because a `pallas_call` does not declare how its outputs
vary over the manual axis (`BlockAttention.vma_checked`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain.pallas_kernels import flash_attention_with_lse
from meshtrain.sharding_rules import auto_axes

Array = jax.Array
BlockForward = Callable[..., tuple[Array, Array]]
BlockBackward = Callable[..., tuple[Array, Array, Array]]


class BlockAttention(NamedTuple):
    """A local block attention: forward -> (out, lse); optional explicit backward.

    `vma_checked`: the functions are plain jnp/lax code that `shard_map(check_vma=True)`
    can type-check; leave False for kernels (`pallas_call`).
    """

    forward: BlockForward
    backward: BlockBackward | None = None
    vma_checked: bool = False


# ----------------------------------------------------------------------------
# Layout: zig-zag permutation and global token indices.


def zigzag_permutation(seq_len: int, n: int) -> np.ndarray:
    """Token order of the zig-zag layout for `n` devices: `x_zigzag = x[:, perm]`.

    The sequence is cut into 2n chunks; after sharding the permuted sequence over n
    devices, device i holds chunks i and 2n - 1 - i (playbook, "Zig-Zag Ring Attention").

    Args:
      seq_len: global sequence length T; must be divisible by 2 * n.
      n: number of devices on the sequence axis.

    Returns:
      int64 array of shape [seq_len], a permutation of range(seq_len).
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (size of the sequence mesh axis).")
    if seq_len % (2 * n):
        raise ValueError(
            f"seq_len={seq_len} must be divisible by 2 * n = {2 * n} for the zig-zag layout."
        )
    c = seq_len // (2 * n)
    chunks = np.arange(seq_len).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """The permutation that undoes `perm`: `x[:, perm][:, inverse_permutation(perm)] == x`."""
    perm = np.asarray(perm)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def _global_positions(device: Array | int, n: int, local_len: int, zigzag: bool) -> Array:
    """Global token indices [L] of the block owned by `device` on the ring."""
    if not zigzag:
        return device * local_len + jnp.arange(local_len, dtype=jnp.int32)
    c = local_len // 2
    r = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([device * c + r, (2 * n - 1 - device) * c + r])


def causal_pairs_per_device(seq_len: int, n: int, zigzag: bool) -> np.ndarray:
    """Unmasked (query, key) pairs of causal attention each device owns: the work balance.

    Counts pairs with key index <= query index for the queries a device holds (one
    document per row). With zig-zag every entry is equal; the contiguous layout gives
    device i about (2i + 1) / N^2 of the total.
    """
    perm = zigzag_permutation(seq_len, n) if zigzag else np.arange(seq_len)
    return (perm.reshape(n, -1) + 1).sum(axis=1)


# ----------------------------------------------------------------------------
# Local block attention in jnp (the default block_fn) and its backward.


def _block_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions) -> Array:
    """[B, Lq, Lk] bool: same document and key not in the query's future."""
    same_doc = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    return same_doc & causal


def _to_groups(x: Array, kv_heads: int) -> Array:
    """[B, L, H, D] -> [B, K, G*L, D] f32: one plain batched matmul per K/V head.

    (A 5-d einsum with both G and L as free dimensions lowers to a slow generic dot
    on CPU; this layout is about 6x faster there.)
    """
    b, length, h, d = x.shape
    g = h // kv_heads
    x = x.reshape(b, length, kv_heads, g, d).transpose(0, 2, 3, 1, 4)
    return x.reshape(b, kv_heads, g * length, d).astype(jnp.float32)


def _from_groups(x: Array, heads: int) -> Array:
    """[B, K, G*L, D] -> [B, L, H, D]."""
    b, kh, gl, d = x.shape
    g = heads // kh
    return x.reshape(b, kh, g, gl // g, d).transpose(0, 3, 1, 2, 4).reshape(b, gl // g, heads, d)


def _heads_first(x: Array) -> Array:
    """[B, L, K, D] -> [B, K, L, D] f32."""
    return jnp.swapaxes(x, 1, 2).astype(jnp.float32)


def _masked_scores(q_g, k_t, mask, sm_scale, fill) -> Array:
    """[B, K, G*Lq, Lk] scaled scores, `fill` where mask [B, Lq, Lk] is False."""
    b, kh, gl, _ = q_g.shape
    lq, lk = mask.shape[1:]
    s = jnp.einsum("bkqd,bksd->bkqs", q_g, k_t) * sm_scale
    s = jnp.where(mask[:, None, None], s.reshape(b, kh, gl // lq, lq, lk), fill)
    return s.reshape(b, kh, gl, lk)


def block_attention_forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    q_segment_ids: Array,
    kv_segment_ids: Array,
    q_positions: Array,
    kv_positions: Array,
    sm_scale: float,
) -> tuple[Array, Array]:
    """Masked softmax attention of one block: (out [B, Lq, H, D] f32, lse [B, H, Lq] f32).

    Rows that see no key in the block get out = 0 and lse = -inf, without NaNs in
    values or gradients (the max is stop-gradient'ed and the log guarded).
    """
    b, lq, h, _ = q.shape
    mask = _block_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    s = _masked_scores(_to_groups(q, k.shape[2]), _heads_first(k), mask, sm_scale, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(s - m)  # [B, K, G*Lq, Lk]
    denom = jnp.sum(p, axis=-1, keepdims=True)
    denom_safe = jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bkqs,bksd->bkqd", p, _heads_first(v)) / denom_safe
    lse = jnp.where(denom > 0, m + jnp.log(denom_safe), -jnp.inf)  # [B, K, G*Lq, 1]
    return _from_groups(o, h), lse.reshape(b, h, lq)


def block_attention_backward(
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    dout: Array,
    *,
    q_segment_ids: Array,
    kv_segment_ids: Array,
    q_positions: Array,
    kv_positions: Array,
    sm_scale: float,
) -> tuple[Array, Array, Array]:
    """This block's share of (dq, dk, dv) given the rows' global out, lse and dout (f32).

    Flash-attention backward: P = exp(S - lse) with the global lse,
    dS = P * (dO V^T - rowsum(dO * O)).
    """
    b, lq, h, _ = q.shape
    kh = k.shape[2]
    mask = _block_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    q_g, k_t, v_t = _to_groups(q, kh), _heads_first(k), _heads_first(v)
    s = _masked_scores(q_g, k_t, mask, sm_scale, -jnp.inf)
    lse_g = lse.reshape(b, kh, -1, 1).astype(jnp.float32)  # [B, K, G*Lq, 1]
    p = jnp.where(jnp.isfinite(s), jnp.exp(s - lse_g), 0.0)
    do_g = _to_groups(dout, kh)
    delta = jnp.sum(do_g * _to_groups(out, kh), axis=-1, keepdims=True)
    dv = jnp.einsum("bkqs,bkqd->bksd", p, do_g)
    dp = jnp.einsum("bkqd,bksd->bkqs", do_g, v_t)
    ds = p * (dp - delta) * sm_scale
    dq = _from_groups(jnp.einsum("bkqs,bksd->bkqd", ds, k_t), h)
    dk = jnp.einsum("bkqs,bkqd->bksd", ds, q_g)
    return dq, jnp.swapaxes(dk, 1, 2), jnp.swapaxes(dv, 1, 2)


def _to_rows(x: Array) -> Array:
    """[B, H, L] -> [B, L, H, 1], to scale outputs row by row."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def _merge(out, lse, o_b, lse_b):
    """Online softmax: merge block (o_b, lse_b) into the running (out, lse); -inf safe."""
    m = jnp.maximum(lse, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w, w_b = jnp.exp(lse - m), jnp.exp(lse_b - m)  # [B, H, L]
    tot = w + w_b
    tot_safe = jnp.where(tot > 0, tot, 1.0)
    out = (_to_rows(w) * out + _to_rows(w_b) * o_b) / _to_rows(tot_safe)
    lse = jnp.where(tot > 0, m + jnp.log(tot_safe), -jnp.inf)
    return out, lse


def _kv_chunks(x: Array, chunk: int) -> Array:
    """[B, Lk, ...] -> [Lk / chunk, B, chunk, ...]: the scan axis first."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // chunk, chunk, *x.shape[2:]), 1, 0)


def jnp_block_attention(kv_chunk: int | None = 128) -> BlockAttention:
    """The jnp block attention, walking K/V in chunks of `kv_chunk` rows (a `lax.scan`).

    Chunking keeps the temporaries O(Lq * kv_chunk) instead of O(Lq * Lk), so the
    memory of a ring step grows linearly in the sequence length at a fixed ring size
    (the flash-attention idea, in jnp). Blocks whose length `kv_chunk` does not divide,
    or no longer than it, are computed whole; None never chunks.
    """

    def chunked(lk: int) -> bool:
        return kv_chunk is not None and lk > kv_chunk and lk % kv_chunk == 0

    def split(k, v, masks):
        kv = (k, v, masks["kv_segment_ids"], masks["kv_positions"])
        return tuple(_kv_chunks(x, kv_chunk) for x in kv)

    def with_kv(masks, seg, pos):
        return {**masks, "kv_segment_ids": seg, "kv_positions": pos}

    def forward(q, k, v, **masks):
        if not chunked(k.shape[1]):
            return block_attention_forward(q, k, v, **masks)
        ks, vs, segs, poss = split(k, v, masks)

        def body(carry, xs):
            o_c, lse_c = block_attention_forward(q, xs[0], xs[1], **with_kv(masks, xs[2], xs[3]))
            return _merge(*carry, o_c, lse_c), None

        first = block_attention_forward(q, ks[0], vs[0], **with_kv(masks, segs[0], poss[0]))
        rest = tuple(x[1:] for x in (ks, vs, segs, poss))
        return lax.scan(body, first, rest)[0]

    def backward(q, k, v, out, lse, dout, **masks):
        if not chunked(k.shape[1]):
            return block_attention_backward(q, k, v, out, lse, dout, **masks)
        chunks = split(k, v, masks)

        def grads(xs):
            return block_attention_backward(q, xs[0], xs[1], out, lse, dout, **with_kv(masks, xs[2], xs[3]))

        def body(dq, xs):
            dq_c, dk_c, dv_c = grads(xs)
            return dq + dq_c, (dk_c, dv_c)

        dq0, dk0, dv0 = grads(tuple(x[0] for x in chunks))
        dq, (dks, dvs) = lax.scan(body, dq0, tuple(x[1:] for x in chunks))
        dk, dv = (jnp.concatenate([d0[None], ds]) for d0, ds in ((dk0, dks), (dv0, dvs)))
        return dq, *(jnp.moveaxis(d, 0, 1).reshape(k.shape) for d in (dk, dv))

    return BlockAttention(forward, backward, vma_checked=True)


JNP_BLOCK_ATTENTION = jnp_block_attention()


def _backward_from_vjp(forward: BlockForward) -> BlockBackward:
    """A block backward derived from a differentiable forward (out, lse) with jax.vjp.

    With w = exp(lse_b - lse) the block's weight in the merged output
    O = sum_b w_b O_b: dO_b = w_b dO and dlse_b = w_b * rowsum(dO * (O_b - O)).
    """

    def backward(q, k, v, out, lse, dout, **masks):
        (o_b, lse_b), vjp = jax.vjp(lambda q_, k_, v_: forward(q_, k_, v_, **masks), q, k, v)
        w = jnp.exp(lse_b.astype(jnp.float32) - lse)  # [B, H, Lq]; 0 where lse_b = -inf
        do_b = _to_rows(w) * dout
        delta_b = jnp.sum(dout * (o_b.astype(jnp.float32) - out), axis=-1)  # [B, Lq, H]
        dlse_b = w * jnp.swapaxes(delta_b, 1, 2)
        return vjp((do_b.astype(o_b.dtype), dlse_b.astype(lse_b.dtype)))

    return backward


def resolve_block_fn(block_fn: BlockForward | BlockAttention | None) -> BlockAttention:
    if block_fn is None:
        return JNP_BLOCK_ATTENTION
    if isinstance(block_fn, BlockAttention):
        if block_fn.backward is None:
            return block_fn._replace(backward=_backward_from_vjp(block_fn.forward))
        return block_fn
    if callable(block_fn):
        return BlockAttention(block_fn, _backward_from_vjp(block_fn))
    raise ValueError(f"block_fn={block_fn!r} must be None, a callable or a BlockAttention.")


# ----------------------------------------------------------------------------
# The ring (runs inside shard_map, manual over `axis_name` only).


def _q_rows(kw: dict, lo: int, hi: int) -> dict:
    """Block keywords restricted to query rows [lo, hi)."""
    return {
        **kw,
        "q_segment_ids": kw["q_segment_ids"][:, lo:hi],
        "q_positions": kw["q_positions"][:, lo:hi],
    }


def _kv_rows(kw: dict, lo: int, hi: int) -> dict:
    """Block keywords restricted to key/value rows [lo, hi)."""
    return {
        **kw,
        "kv_segment_ids": kw["kv_segment_ids"][:, lo:hi],
        "kv_positions": kw["kv_positions"][:, lo:hi],
    }


def _pad_rows(x: Array, axis: int, before: int, after: int, value: float = 0.0) -> Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (before, after)
    return jnp.pad(x, pad, constant_values=value)


@dataclasses.dataclass(frozen=True)
class _RingStep:
    """The block math of one ring step, with no collective: which query rows meet which key rows.

    Work skipping by layout, decided per step from the device index `idx` and the owner `src` of
    the K/V block at hand (masks by global position stay on, so the skipping changes cost, never
    results):
      * step 0 (src == idx): the diagonal block, causal inside.
      * zig-zag, src < idx: every local query sees the block's early chunk and none of its late
        chunk -> queries [2c] x keys [:c].
      * zig-zag, src > idx: only the local late chunk sees the block, all of it -> queries [c:] x
        keys [2c]. Either way half a block: equal work on all devices.
      * contiguous, src > idx: the block is entirely in the future -> skipped.
    """

    n: int
    axis_name: str
    zigzag: bool
    sm_scale: float
    block: BlockAttention
    heads: tuple[str, ...] = ()  # automatic mesh axes splitting the heads (the gathered transport's)
    # devices of `axis_name` in one Ulysses all-to-all group (`parallel/ulysses.py`): consecutive
    # indices; the ring joins the devices at the same place of each group, n * group in all
    group: int = 1

    def index(self):
        """This device's place on its ring."""
        return lax.axis_index(self.axis_name) // self.group if self.n > 1 else 0

    def pairs(self, hop: int = 1) -> list[tuple[int, int]]:
        """(source, destination) indices along `axis_name` of one hop round every ring."""
        g = self.group
        return [(r * g + j, ((r + hop) % self.n) * g + j) for r in range(self.n) for j in range(g)]

    def rings(self) -> list[list[int]] | None:
        """The rings as `axis_index_groups` of a gather or scatter (None: the whole axis is one ring)."""
        g = self.group
        return [[r * g + j for r in range(self.n)] for j in range(g)] if g > 1 else None

    def masks(self, seg_q, seg_kv, idx, src) -> dict:
        """The block keywords: segment ids and global token positions of the queries and the keys."""
        b, local_len = seg_q.shape
        pos_q = _global_positions(idx, self.n, local_len, self.zigzag)
        pos_kv = _global_positions(src, self.n, local_len, self.zigzag)
        return {"q_segment_ids": seg_q, "kv_segment_ids": seg_kv,
                "q_positions": jnp.broadcast_to(pos_q, (b, local_len)),
                "kv_positions": jnp.broadcast_to(pos_kv, (b, local_len)), "sm_scale": self.sm_scale}

    @staticmethod
    def _zeros(shape, like, value=0.0):
        """A float32 constant that varies over the manual axes `like` varies over (a cond branch's twin)."""
        axes = tuple(sorted(jax.typeof(like).manual_axis_type.varying))
        out = jnp.full(shape, value, jnp.float32)
        return lax.pcast(out, axes, to="varying") if axes else out

    def _fwd(self, q, k, v, kw):
        o, lse = self.block.forward(q, k, v, **kw)
        return o.astype(jnp.float32), lse.astype(jnp.float32)

    def _bwd(self, q, k, v, out, lse, dout, kw):
        return tuple(g.astype(jnp.float32) for g in self.block.backward(q, k, v, out, lse, dout, **kw))

    def forward(self, q, k, v, kw, idx, src, diagonal: bool):
        """(out [B, L, H, D], lse [B, H, L]) float32 of the local queries against the block at hand."""
        if diagonal:  # the ring's first step: the device's own block
            return self._fwd(q, k, v, kw)
        if not self.zigzag:
            o0, lse0 = self._zeros(q.shape, q), self._zeros((q.shape[0], q.shape[2], q.shape[1]), q, -jnp.inf)
            return lax.cond(src < idx, lambda: self._fwd(q, k, v, kw), lambda: (o0, lse0))
        c = q.shape[1] // 2

        def early():
            return self._fwd(q, k[:, :c], v[:, :c], _kv_rows(kw, 0, c))

        def late():
            o, lse = self._fwd(q[:, c:], k, v, _q_rows(kw, c, 2 * c))
            return _pad_rows(o, 1, c, 0), _pad_rows(lse, 2, c, 0, -jnp.inf)

        return lax.cond(src < idx, early, late)

    def backward(self, q, k, v, out, lse, dout, kw, idx, src, diagonal: bool):
        """(dq, dk, dv) float32: the block's share of the gradient, from the global out / lse / dout."""
        if diagonal:  # the ring's first step: the device's own block
            return self._bwd(q, k, v, out, lse, dout, kw)
        if not self.zigzag:
            zeros = (self._zeros(q.shape, q), self._zeros(k.shape, k), self._zeros(v.shape, v))
            return lax.cond(src < idx, lambda: self._bwd(q, k, v, out, lse, dout, kw), lambda: zeros)
        c = q.shape[1] // 2

        def early():
            dq, dk, dv = self._bwd(q, k[:, :c], v[:, :c], out, lse, dout, _kv_rows(kw, 0, c))
            return dq, _pad_rows(dk, 1, 0, c), _pad_rows(dv, 1, 0, c)

        def late():
            rows = (q[:, c:], k, v, out[:, c:], lse[:, :, c:], dout[:, c:])
            dq, dk, dv = self._bwd(*rows, _q_rows(kw, c, 2 * c))
            return _pad_rows(dq, 1, c, 0), dk, dv

        return lax.cond(src < idx, early, late)


def _forward_ring(step: _RingStep, q, k, v, seg):
    """The K/V blocks go round the ring (device i sends to i + 1); each is merged into the running
    (out, lse) by the online softmax. The next transfer is issued before the current block's compute.

    q: [B, L_seq, H, D]; k, v: [B, L_seq, K, D]; seg: [B, L_seq] -> out f32 [B, L_seq, H, D], lse f32 [B, H, L_seq].
    """
    n, axis = step.n, step.axis_name
    idx = step.index()  # a ring of one needs no bound axis
    kv = (k, v, seg)
    out = lse = None
    for t in range(n):
        nxt = lax.ppermute(kv, axis, step.pairs()) if t < n - 1 else None
        src = (idx - t) % n  # the device whose K/V block is here
        o_b, lse_b = step.forward(q, kv[0], kv[1], step.masks(seg, kv[2], idx, src), idx, src, t == 0)
        out, lse = (o_b, lse_b) if out is None else _merge(out, lse, o_b, lse_b)
        kv = nxt
    return out, lse


def _backward_ring(step: _RingStep, q, k, v, seg, out, lse, dout):
    """The gradient ring, turning the other way: dK/dV accumulate while they travel with their K/V
    block and one more hop after the last step takes them home (N - 1 transfers of K/V, N of dK/dV).

    Turning the same way as the forward, its K/V transfers would be the forward's ops on the same
    operands and XLA would merge them (CSE): all N - 1 received blocks would then stay alive from the
    forward to the backward, O(full sequence) per device instead of O(local block).
    """
    n, axis = step.n, step.axis_name
    back = step.pairs(-1)
    idx = step.index()
    out_f, dout_f = out.astype(jnp.float32), dout.astype(jnp.float32)
    kv = (k, v, seg)
    dq = dkv = None
    for t in range(n):
        nxt = lax.ppermute(kv, axis, back) if t < n - 1 else None
        src = (idx + t) % n
        kw = step.masks(seg, kv[2], idx, src)
        dq_b, dk_b, dv_b = step.backward(q, kv[0], kv[1], out_f, lse, dout_f, kw, idx, src, t == 0)
        dq = dq_b if dq is None else dq + dq_b
        dkv = (dk_b, dv_b) if dkv is None else (dkv[0] + dk_b, dkv[1] + dv_b)
        dkv = lax.ppermute(dkv, axis, back) if n > 1 else dkv
        kv = nxt
    return dq, dkv[0], dkv[1]


def _take(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def per_head_shard(collective, heads: tuple[str, ...], in_dims: tuple, out_dims: tuple, checked: bool = True):
    """`collective` (over the ring's axis) run on each device's heads when the automatic axes
    `heads` split them: under a still-automatic `tensor`, the partitioner replicates an
    all-gather's or reduce-scatter's operand over it first (a collective-permute passes the
    sharding through), so the K/V heads would cross `tensor` for nothing. `checked`: whether the
    enclosing region type-checks variance (not around a kernel), which this region then follows."""
    if not heads:
        return collective
    def specs(dims):
        return tuple(P() if d is None else P(*([None] * d), heads) for d in dims)
    return jax.shard_map(collective, in_specs=specs(in_dims), out_specs=specs(out_dims), axis_names=set(heads),
                         check_vma=checked)


def _gather_blocks(step: _RingStep, k, v, seg):
    """Every device's (k, v, seg) block, stacked [N, B, L_seq, ...] in device order."""
    gather = per_head_shard(lambda *x: lax.all_gather(x, step.axis_name, axis_index_groups=step.rings()),
                             step.heads, (2, 2, None), (3, 3, None))
    return gather(k, v, seg)


def _scatter_sums(step: _RingStep, dk_all, dv_all):
    """dK / dV [N, B, L_seq, K, D] of every block summed into their owners: [B, L_seq, K, D]."""
    def scatter(*d):
        return tuple(lax.psum_scatter(x, step.axis_name, scatter_dimension=0, tiled=False,
                                      axis_index_groups=step.rings()) for x in d)
    return per_head_shard(scatter, step.heads, (3, 3), (2, 2))(dk_all, dv_all)


def _forward_gathered(step: _RingStep, q, k, v, seg):
    """The ring's blocks, received by one all-gather over the axis instead of N - 1 hops (the same
    bytes); the blocks are visited in the ring's order, so the result is the ring's (to 1e-6 in
    `tests/test_ring_attention.py`)."""
    n = step.n
    idx = step.index()
    every = _gather_blocks(step, k, v, seg)  # [N, B, L_seq, ...]

    def visit(t, acc):
        src = (idx - t) % n
        kv = _take(every, src)
        o_b, lse_b = step.forward(q, kv[0], kv[1], step.masks(seg, kv[2], idx, src), idx, src, False)
        return _merge(*acc, o_b, lse_b)
    # the diagonal block first, then the others in one loop: N - 1 blocks share one compiled body
    # (unrolled, a 16-way ring in every 1F1B slot made the 405B search's layouts compile for minutes)
    own = _take(every, idx)
    first = step.forward(q, own[0], own[1], step.masks(seg, own[2], idx, idx), idx, idx, True)
    return lax.fori_loop(1, n, visit, first)


def _backward_gathered(step: _RingStep, q, k, v, seg, out, lse, dout):
    """The backward ring's sums, with the blocks gathered once and dK/dV of every block summed
    into their owners by one reduce-scatter (the same bytes as the N hops of the dK/dV ring)."""
    n = step.n
    idx = step.index()
    out_f, dout_f = out.astype(jnp.float32), dout.astype(jnp.float32)
    every = _gather_blocks(step, k, v, seg)

    def visit(t, acc, diagonal: bool = False):
        dq, dk_all, dv_all = acc
        src = (idx + t) % n
        kv = _take(every, src)
        kw = step.masks(seg, kv[2], idx, src)
        dq_b, dk_b, dv_b = step.backward(q, kv[0], kv[1], out_f, lse, dout_f, kw, idx, src, diagonal)
        dk_all = lax.dynamic_update_index_in_dim(dk_all, _take(dk_all, src) + dk_b, src, 0)
        dv_all = lax.dynamic_update_index_in_dim(dv_all, _take(dv_all, src) + dv_b, src, 0)
        return dq + dq_b, dk_all, dv_all
    zeros = (jnp.zeros_like(q, jnp.float32), *(jnp.zeros_like(every[i], jnp.float32) for i in (0, 1)))
    acc = visit(0, zeros, diagonal=True)  # the diagonal block, then the others in one loop
    dq, dk_all, dv_all = lax.fori_loop(1, n, visit, acc)
    dk, dv = _scatter_sums(step, dk_all, dv_all)
    return dq, dk, dv


def make_local_attention(n: int, axis_name: str, zigzag: bool, sm_scale: float, block: BlockAttention,
                          transport: str = "ring", heads: tuple[str, ...] = (), group: int = 1):
    """The per-device attention over local blocks [B, L_seq, ...]: the forward ring, and the backward
    ring as its `jax.custom_vjp` with O(local block) residuals (q, k, v, segment ids, out, lse).

    `transport` "gather" moves the blocks by all-gather and dK/dV by reduce-scatter: for a ring run
    by only some devices at a time (a 1F1B slot, a `lax.switch` whose branch differs per stage),
    where a collective-permute would wait for every device of the mesh (XLA:CPU rendezvous over the
    permute's whole device set), while all-gather and reduce-scatter meet per group. `heads`: the
    automatic axes that split the K/V heads, across which those two collectives run per shard.
    `group`: a ring of every `group`-th device of the axis (`_RingStep.group`, under Ulysses).
    """
    step = _RingStep(n, axis_name, zigzag, sm_scale, block, heads if transport == "gather" else (), group)
    forward, backward = ((_forward_gathered, _backward_gathered) if transport == "gather" and n > 1
                         else (_forward_ring, _backward_ring))

    @jax.custom_vjp
    def attention(q, k, v, seg):
        return forward(step, q, k, v, seg)[0].astype(q.dtype)

    def attention_fwd(q, k, v, seg):
        out, lse = forward(step, q, k, v, seg)
        out = out.astype(q.dtype)
        return out, (q, k, v, seg, out, lse)

    def attention_bwd(res, dout):
        q, k, v = res[:3]
        dq, dk, dv = backward(step, *res, dout)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


# ----------------------------------------------------------------------------
# Public entry points.


def ring_attention(
    q: Array,
    k: Array,
    v: Array,
    segment_ids: Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str = "sequence",
    zigzag: bool = True,
    sm_scale: float | None = None,
    block_fn: BlockForward | BlockAttention | None = None,
    transport: str = "ring",
    heads_axes: tuple[str, ...] = (),
) -> Array:
    """Causal, document-masked, grouped-query ring attention over the `axis_name` ring.

    Playbook, "Discovering Ring Attention" / "Zig-Zag Ring Attention". Only
    `axis_name` is manual inside the `shard_map`; batch (data / fsdp) and heads
    (tensor) stay under the automatic partitioner and compose.

    Args:
      q: [B, T_seq, H, D] queries (global array, T sharded over `axis_name`).
      k: [B, T_seq, K, D] keys, H % K == 0; K heads travel (no per-query-head copies).
      v: [B, T_seq, K, D] values.
      segment_ids: [B, T_seq] int32; tokens attend only within equal ids.
      mesh: the device mesh holding `axis_name`.
      axis_name: the context-parallel mesh axis.
      zigzag: True when the token order of all inputs is already
        `x[:, zigzag_permutation(T, N)]`; False for the natural (contiguous) order.
        Causality always follows the global token index of that layout.
      sm_scale: softmax scale; defaults to 1 / sqrt(D).
      block_fn: the local block computation (see the module docstring); None = jnp.
        E.g. `pallas_kernels.flash_attention.flash_attention_with_lse` on GPU.
      transport: "ring" (collective-permutes) or "gather" (all-gather / reduce-scatter, the same
        bytes): see `make_local_attention`.
      heads_axes: automatic mesh axes that split the heads (K and H) of q, k and v; the gathered
        transport moves each device's heads only.

    Returns:
      [B, T_seq, H, D] attention output in the input token order, dtype of q.
    """
    n = mesh.shape[axis_name]
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}: expected q [B, T, H, D] "
            "and k, v [B, T, K, D] of equal shape."
        )
    b, t, h, d = q.shape
    if k.shape[:2] != (b, t) or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(
            f"k.shape={k.shape} does not match q.shape={q.shape}: need the same B, T, D and "
            "H divisible by K (grouped-query attention)."
        )
    if segment_ids.shape != (b, t):
        raise ValueError(f"segment_ids.shape={segment_ids.shape} must be [B, T] = {(b, t)}.")
    inside = axis_name in getattr(mesh, "manual_axes", ())  # already in a region manual over the ring
    chunks = (2 if zigzag else 1) * (1 if inside else n)
    if t % chunks:
        if inside:
            raise ValueError(f"local sequence length L={t} must be even: zig-zag ring attention halves each block")
        raise ValueError(f"sequence length T={t} must be divisible by {'2 * ' if zigzag else ''}mesh.{axis_name}={n} "
                         f"(= {chunks}) for ring attention (zigzag={zigzag}).")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    block = resolve_block_fn(block_fn)
    heads_axes = tuple(a for a in heads_axes if mesh.shape[a] > 1)
    if heads_axes and k.shape[2] % math.prod(mesh.shape[a] for a in heads_axes):
        raise ValueError(f"K={k.shape[2]} key/value heads do not split over {heads_axes} "
                         f"({[mesh.shape[a] for a in heads_axes]} ways)")
    local = make_local_attention(n, axis_name, zigzag, scale, block, transport, heads_axes)
    if inside or n == 1:  # the enclosing region (a pipeline stage) is manual over the ring, or no ring
        return local(q, k, v, segment_ids.astype(jnp.int32))
    x_spec, seg_spec = P(None, axis_name, None, None), P(None, axis_name)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(x_spec, x_spec, x_spec, seg_spec),
        out_specs=x_spec,
        axis_names={axis_name},
        check_vma=block.vma_checked,
    )(q, k, v, segment_ids.astype(jnp.int32))


def dense_attention_reference(
    q: Array, k: Array, v: Array, segment_ids: Array, sm_scale: float | None = None
) -> Array:
    """Dense causal + document-masked GQA attention in natural token order (the reference).

    q [B, T, H, D], k / v [B, T, K, D], segment_ids [B, T] -> [B, T, H, D].
    """
    t, h, d = q.shape[1:]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    g = h // k.shape[2]
    k_h, v_h = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # head j uses kv head j // g
    s = jnp.einsum("bqhd,bshd->bhqs", q, k_h) * scale
    pos = jnp.arange(t)
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (pos[None, :] <= pos[:, None])
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqs,bshd->bqhd", p, v_h)


def ring(q: Array, k: Array, v: Array, segment_ids: Array, *, zigzag: bool, transport: str = "ring",
         flash: bool = False) -> Array:
    """Ring attention as the model calls attention (`attention.AttentionFn`), over `sequence` of the
    current mesh: each step's block in the Pallas flash kernel when `flash` (`layout.ring_flash`: on
    GPU), else in jnp einsums; K/V heads kept apart over `tensor` when they split over it."""
    mesh = jax.sharding.get_abstract_mesh()
    block_fn = flash_attention_with_lse if flash else None
    heads = auto_axes(("tensor",))
    if heads and k.shape[2] % mesh.shape["tensor"]:
        heads = ()  # K/V heads replicated over `tensor`: nothing to keep apart
    return ring_attention(q, k, v, segment_ids, mesh=mesh, zigzag=zigzag, block_fn=block_fn,
                          transport=transport, heads_axes=heads)


def in_conditional_slots(fn: Callable) -> Callable:
    """Attention `fn` as it must run inside a branch that only some stages take (a 1F1B slot): ring
    attention (alone or across Ulysses groups) moves its blocks by all-gather / reduce-scatter instead
    of collective-permutes."""
    if isinstance(fn, functools.partial) and "transport" in fn.keywords:
        return functools.partial(fn.func, **{**fn.keywords, "transport": "gather"})
    return fn
