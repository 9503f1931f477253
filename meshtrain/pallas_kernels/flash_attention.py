"""Flash attention in Pallas (Triton on GPU, interpret mode on CPU).

Playbook, "Flash Attention 1-3": the [L, L] score matrix is never written to
memory. The forward kernel walks K/V tiles with an online softmax and keeps the
running max, the running sum and the output tile in fast memory; it writes the
output and the log-sum-exp (lse). The backward pass recomputes the probabilities
from the lse: one kernel accumulates dQ over K/V tiles, another accumulates dK/dV
over Q tiles and over the query heads that share the K/V head (grouped-query
attention without copying K/V). Inputs may be bf16; all accumulation is fp32
("Mixed Precision Training").

Masks: `causal` keeps keys with kv_position <= q_position (positions default to
0..L-1 for both sides); segment ids keep keys of the same document. Self-attention
over packed documents (`segment_ids`) skips the tiles that hold other documents alone
(`document_tiles`): work in the documents' squares, not the row's. A query row
that sees no key at all gets out = 0 and lse = -inf; its gradients are 0 and
finite. The lse output is differentiable, so ring attention (playbook, "Context
Parallelism") can combine the partial results of its ring steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from meshtrain.pallas_kernels._common import (
    NN,
    NT,
    TN,
    dot,
    fit_block,
    floor_power_of_two,
    is_power_of_two,
    resolve_interpret,
)

_INIT_MAX = -1e30  # finite start of the running max: rows without keys stay finite.
MIN_BLOCK = 16  # the smallest tile (tl.dot needs 16 rows): a sequence shorter than it cannot be tiled
@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Tile sizes (powers of two >= 16) and Triton launch parameters of the forward and backward kernels.

    Attributes:
        block_q: query rows per forward program.
        block_kv: key rows per step of the forward loop.
        block_q_bwd: query rows per tile in both backward kernels.
        block_kv_bwd: key rows per tile in both backward kernels.
        num_warps, num_stages: the forward kernel's warps per program and software-pipelining
            depth of its K/V loop (None: the default for the head dim, `launch_params`).
        num_warps_bwd, num_stages_bwd: the same for both backward kernels.
    """

    block_q: int = 128
    block_kv: int = 128
    block_q_bwd: int = 64
    block_kv_bwd: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None

    @classmethod
    def default(cls, head_dim: int, dtype) -> FlashBlockSizes:
        """The tiles and launch parameters used when none are given, by (padded) head dim and dtype,
        as `bench/kernels.py --sweep` chose them on an H200 (causal, bf16, 32 query heads on 8 K/V
        heads; the timings and how many configurations each choice beat: docs/kernels.md):

        - head dim 64 (4 x 4,096 tokens): forward 64 x 64 tiles, 4 warps, 3 stages (faster than the
          former 128 x 128, 2 stages); backward 64 x 64, 4 warps, 2 stages, next to the fastest timed.
        - head dim 128 (1 x 8,192): forward 128 x 128, 8 warps, 3 stages (faster than 2 stages);
          backward 64 x 64 with 4 warps, about twice as fast as with the former 8 warps.
        - float32 at head dim >= 128, and any dtype above 128 (multi-head latent attention's 192, padded
          to 256): 64 x 64 forward tiles (128 x 128 float32 tiles at 128, or bf16 ones at 256, ask 262 and
          329 KB of shared memory; an H100 / H200 SM has 227 KB). Not timed on a GPU.
        """
        itemsize = jnp.dtype(dtype).itemsize
        if itemsize <= 2 and head_dim <= 64:
            return cls(block_q=64, block_kv=64, num_warps=4, num_stages=3, num_warps_bwd=4, num_stages_bwd=2)
        if itemsize <= 2 and head_dim == 128:
            return cls(block_q=128, block_kv=128, num_warps=8, num_stages=3, num_warps_bwd=4, num_stages_bwd=2)
        if itemsize >= 4 and head_dim >= 128 or head_dim > 128:
            return cls(block_q=64, block_kv=64)
        return cls()

    def fit(self, len_q: int, len_kv: int, *, user_given: bool) -> FlashBlockSizes:
        """Clamps every block to its length (halving defaults until they divide it)."""
        fit = functools.partial(fit_block, minimum=MIN_BLOCK, user_given=user_given)
        for name in ("num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd"):
            value = getattr(self, name)
            if value is not None and (value < 1 or (name.startswith("num_warps") and not is_power_of_two(value))):
                raise ValueError(f"{name}={value} must be a positive integer (warps: a power of two)")
        return dataclasses.replace(
            self,
            block_q=fit("block_q", self.block_q, len_q, "q length"),
            block_kv=fit("block_kv", self.block_kv, len_kv, "kv length"),
            block_q_bwd=fit("block_q_bwd", self.block_q_bwd, len_q, "q length"),
            block_kv_bwd=fit("block_kv_bwd", self.block_kv_bwd, len_kv, "kv length"),
        )

    def launch_params(self, head_dim: int, *, backward: bool) -> tuple[int, int]:
        """(num_warps, num_stages) of the forward or the backward kernels: the given ones, else 4 warps
        up to head dim 64 and 8 above, 2 stages."""
        warps = self.num_warps_bwd if backward else self.num_warps
        stages = self.num_stages_bwd if backward else self.num_stages
        return (warps or (4 if head_dim <= 64 else 8)), (stages or 2)


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    sm_scale: float
    blocks: FlashBlockSizes
    interpret: bool
    has_segments: bool
    has_positions: bool  # explicit positions given (else 0..L-1, which allows tile skipping)
    # self-attention over documents (`segment_ids`, default positions): tiles of other documents are skipped
    # by each tile's bounds (`document_tiles`), which come after the other side inputs
    skips_documents: bool = False


def _split_refs(refs, cfg: _Config):
    """Unpacks (q, k, v, [q_seg, kv_seg], [q_pos, kv_pos], [bound], *rest) kernel refs; `bound`, where
    documents are skipped, is the tile's own bound (`document_tiles`) as a scalar, else None."""
    q_ref, k_ref, v_ref, *rest = refs
    segs = (rest.pop(0), rest.pop(0)) if cfg.has_segments else None
    pos = (rest.pop(0), rest.pop(0)) if cfg.has_positions else None
    bound = rest.pop(0)[0] if cfg.skips_documents else None
    return q_ref, k_ref, v_ref, segs, pos, bound, rest


def runs_are_documents(segment_ids: jax.Array) -> jax.Array:
    """[B] bool: each row's runs of equal ids are its documents, every token seeing its own run alone (as
    a mask of equal ids sees them): each run's id is above every id before it in the row, or the row ends in
    one run of 0s (padding) with no 0 before it. What the data path packs (`data.packing`)."""
    starts = segment_ids[:, 1:] != segment_ids[:, :-1]
    before = lax.cummax(segment_ids, axis=1)[:, :-1]  # the largest id before each token
    zero = segment_ids == 0
    zeros_to_end = jnp.flip(lax.cummin(jnp.flip(zero, 1).astype(jnp.int32), axis=1), 1).astype(bool)
    zero_before = lax.cummax(zero.astype(jnp.int32), axis=1)[:, :-1].astype(bool)
    padding = zeros_to_end[:, 1:] & ~zero_before
    return jnp.all(~starts | (segment_ids[:, 1:] > before) | padding, axis=1)


def document_tiles(segment_ids: jax.Array, block_q: int, block_kv: int) -> tuple[jax.Array, jax.Array]:
    """The tiles a document mask leaves, for self-attention over rows of `segment_ids` [B, L]:
    (first_kv [B, L / block_q]: the first key tile query tile i can see, the one holding the start of its
    first token's document; end_q [B, L / block_kv]: one past the last query tile key tile j can be seen
    from, the one holding the end of its last token's document). Rows whose runs are not their documents
    (`runs_are_documents`) keep every tile: 0 and L / block_q."""
    b, length = segment_ids.shape
    index = jnp.arange(length, dtype=jnp.int32)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = jnp.concatenate([jnp.ones((b, 1), bool), change], axis=1)
    ends = jnp.concatenate([change, jnp.ones((b, 1), bool)], axis=1)  # the last token of its run
    first = lax.cummax(jnp.where(starts, index, 0), axis=1)
    last = jnp.flip(lax.cummin(jnp.flip(jnp.where(ends, index, length - 1), 1), axis=1), 1)
    documents = runs_are_documents(segment_ids)[:, None]
    first_kv = jnp.where(documents, first[:, ::block_q] // block_kv, 0)
    end_q = jnp.where(documents, last[:, block_kv - 1::block_kv] // block_q + 1, length // block_q)
    return first_kv.astype(jnp.int32), end_q.astype(jnp.int32)


def _mask(cfg: _Config, q_pos, kv_pos, q_seg, kv_seg, causal: bool):
    """[bq, bk] boolean mask of allowed (query, key) pairs, or None when all are. `causal` False: the
    tile lies wholly below the diagonal (every key precedes every query), so only documents mask it."""
    mask = None
    if cfg.causal and causal:
        mask = kv_pos[None, :] <= q_pos[:, None]
    if cfg.has_segments:
        same = q_seg[:, None] == kv_seg[None, :]
        mask = same if mask is None else jnp.logical_and(mask, same)
    return mask


def _scores(cfg, q, k, q_pos, kv_pos, q_seg, kv_seg, causal=True):
    s = dot(q, k, NT) * cfg.sm_scale
    mask = _mask(cfg, q_pos, kv_pos, q_seg, kv_seg, causal)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _positions(cfg, pos_ref, index, start, size):
    if cfg.has_positions:
        return pos_ref[index]
    return start + lax.broadcasted_iota(jnp.int32, (size,), 0)


def _forward_kernel(*refs, cfg: _Config, len_kv: int):
    q_ref, k_ref, v_ref, segs, pos, first_kv, (o_ref, lse_ref) = _split_refs(refs, cfg)
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_kv
    i = pl.program_id(2)
    q = q_ref[...]  # [bq, D]
    q_pos = _positions(cfg, pos and pos[0], slice(None), i * bq, bq)
    q_seg = segs[0][...] if segs else None

    def body(j, carry, causal):
        acc, m, denom = carry
        ks = pl.ds(j * bk, bk)
        kv_pos = _positions(cfg, pos and pos[1], ks, j * bk, bk)
        kv_seg = segs[1][ks] if segs else None
        s = _scores(cfg, q, k_ref[ks, :], q_pos, kv_pos, q_seg, kv_seg, causal)  # [bq, bk]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # masked scores are -inf: p = 0
        denom = alpha * denom + jnp.sum(p, axis=1)
        v = v_ref[ks, :]
        acc = alpha[:, None] * acc + dot(p.astype(v.dtype), v, NN)
        return acc, m_new, denom

    init = (
        jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),  # as wide as the values
        jnp.full((bq,), _INIT_MAX, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    acc, m, denom = _diagonal_loops(cfg, i, bq, bk, len_kv, body, init, first_kv)
    empty = denom == 0.0
    denom_safe = jnp.where(empty, 1.0, denom)
    o_ref[...] = (acc / denom_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(denom_safe))


def _diagonal_loops(cfg: _Config, i, bq: int, bk: int, len_kv: int, body, init, first_kv=None):
    """Runs `body(j, carry, causal)` over the K/V tiles query tile `i` reads, from `first_kv` (None: 0; the
    tiles before it hold other documents' keys alone). Causal with default positions: the tiles wholly below
    the diagonal first, with no causal mask to build (most of them), then the ones the diagonal crosses; the
    tiles right of it, all masked, are skipped."""
    num_kv = len_kv // bk
    first = 0 if first_kv is None else first_kv
    if not (cfg.causal and not cfg.has_positions):
        return lax.fori_loop(first, num_kv, functools.partial(body, causal=True), init)
    num_kv = jnp.minimum(lax.div((i + 1) * bq + bk - 1, bk), num_kv)
    num_below = jnp.minimum(lax.div(i * bq, bk), num_kv)  # tile j's last key (j+1)*bk-1 < i*bq
    carry = lax.fori_loop(first, num_below, functools.partial(body, causal=False), init)
    return lax.fori_loop(jnp.maximum(first, num_below), num_kv, functools.partial(body, causal=True), carry)


def _dq_kernel(*refs, cfg: _Config, len_kv: int):
    q_ref, k_ref, v_ref, segs, pos, first_kv, rest = _split_refs(refs, cfg)
    do_ref, lse_ref, delta_ref, dq_ref = rest
    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_kv_bwd
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = _positions(cfg, pos and pos[0], slice(None), i * bq, bq)
    q_seg = segs[0][...] if segs else None

    def body(j, dq, causal):
        ks = pl.ds(j * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        kv_pos = _positions(cfg, pos and pos[1], ks, j * bk, bk)
        kv_seg = segs[1][ks] if segs else None
        p = jnp.exp(_scores(cfg, q, k, q_pos, kv_pos, q_seg, kv_seg, causal) - lse[:, None])
        ds = p * (dot(do, v, NT) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k, NN)

    dq = _diagonal_loops(cfg, i, bq, bk, len_kv, body, jnp.zeros(q.shape, jnp.float32), first_kv)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Config, len_q: int, group: int):
    q_ref, k_ref, v_ref, segs, pos, end_q, rest = _split_refs(refs, cfg)
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref = rest
    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_kv_bwd
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]  # [bk, D], [bk, Dv]
    kv_pos = _positions(cfg, pos and pos[1], slice(None), j * bk, bk)
    kv_seg = segs[1][...] if segs else None
    num_q = len_q // bq if end_q is None else end_q  # the q tiles from end_q on hold other documents alone
    default_causal = cfg.causal and not cfg.has_positions
    first_q = lax.div(j * bk, bq) if default_causal else 0  # the q tiles above the diagonal see no key here
    # q tiles from here on lie wholly below the diagonal (first query i*bq >= last key (j+1)*bk-1): no causal
    # mask; with explicit positions (ring blocks) every tile keeps it
    first_below = jnp.minimum(lax.div((j + 1) * bk + bq - 1, bq), num_q) if default_causal else num_q

    def q_tile(i, carry, g, causal):
        dk, dv = carry
        qs = pl.ds(i * bq, bq)
        q, do = q_ref[qs, g, :], do_ref[qs, g, :]
        q_pos = _positions(cfg, pos and pos[0], qs, i * bq, bq)
        q_seg = segs[0][qs] if segs else None
        s = _scores(cfg, q, k, q_pos, kv_pos, q_seg, kv_seg, causal)
        p = jnp.exp(s - lse_ref[g, qs][:, None])  # [bq, bk]
        dv = dv + dot(p.astype(do.dtype), do, TN)
        ds = p * (dot(do, v, NT) - delta_ref[g, qs][:, None])
        dk = dk + dot(ds.astype(q.dtype), q, TN)
        return dk, dv

    def head(g, carry):  # the query heads that read this K/V head
        carry = lax.fori_loop(first_q, first_below, functools.partial(q_tile, g=g, causal=True), carry)
        return lax.fori_loop(first_below, num_q, functools.partial(q_tile, g=g, causal=False), carry)

    dk, dv = lax.fori_loop(0, group, head, (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _side_inputs(cfg, q_seg, kv_seg, q_pos, kv_pos, q_spec, kv_spec, bounds=None):
    """Segment / position operands and their BlockSpecs, in kernel order; then, where documents are
    skipped, `bounds` [B, tiles] (`document_tiles`), one a program (its grid's last index)."""
    args, specs = [], []
    if cfg.has_segments:
        args += [q_seg, kv_seg]
        specs += [q_spec, kv_spec]
    if cfg.has_positions:
        args += [q_pos, kv_pos]
        specs += [q_spec, kv_spec]
    if cfg.skips_documents:
        args.append(bounds)
        specs.append(pl.BlockSpec((None, 1), lambda b_, h_, i: (b_, i)))
    return args, specs


def _params(cfg: _Config, head_dim: int, *, backward: bool):
    warps, stages = cfg.blocks.launch_params(head_dim, backward=backward)
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _forward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    b, len_q, h, d = q.shape
    len_kv, kh = k.shape[1], k.shape[2]
    group, bq = h // kh, cfg.blocks.block_q
    first_kv = document_tiles(q_seg, bq, cfg.blocks.block_kv)[0] if cfg.skips_documents else None
    side, side_specs = _side_inputs(
        cfg,
        q_seg,
        kv_seg,
        q_pos,
        kv_pos,
        pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
        pl.BlockSpec((None, len_kv), lambda b_, h_, i: (b_, 0)),
        first_kv,
    )
    value_dim = v.shape[-1]
    kv_spec = pl.BlockSpec((None, len_kv, None, d), lambda b_, h_, i: (b_, 0, h_ // group, 0))
    v_spec = pl.BlockSpec((None, len_kv, None, value_dim), lambda b_, h_, i: (b_, 0, h_ // group, 0))
    q_spec = pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0))
    out_spec = pl.BlockSpec((None, bq, None, value_dim), lambda b_, h_, i: (b_, i, h_, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg, len_kv=len_kv),
        grid=(b, h, len_q // bq),
        in_specs=[q_spec, kv_spec, v_spec, *side_specs],
        out_specs=[
            out_spec,
            pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, len_q, h, value_dim), q.dtype),
            jax.ShapeDtypeStruct((b, h, len_q), jnp.float32),
        ],
        compiler_params=_params(cfg, d, backward=False),
        interpret=cfg.interpret,
        name="flash_attention_forward",
    )(q, k, v, *side)


def _backward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, do, dlse):
    b, len_q, h, d = q.shape
    len_kv, kh = k.shape[1], k.shape[2]
    group = h // kh
    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_kv_bwd
    # d lse / d s = p, so the lse cotangent folds into delta = rowsum(dO * O) - dlse.
    delta = jnp.einsum("blhd,blhd->bhl", do.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse
    lse = jnp.where(jnp.isneginf(lse), 0.0, lse)  # rows without keys: all p are exp(-inf) = 0
    do = do.astype(q.dtype)
    first_kv, end_q = document_tiles(q_seg, bq, bk) if cfg.skips_documents else (None, None)

    side, side_specs = _side_inputs(
        cfg,
        q_seg,
        kv_seg,
        q_pos,
        kv_pos,
        pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
        pl.BlockSpec((None, len_kv), lambda b_, h_, i: (b_, 0)),
        first_kv,
    )
    value_dim = v.shape[-1]
    q_spec = pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0))
    do_spec = pl.BlockSpec((None, bq, None, value_dim), lambda b_, h_, i: (b_, i, h_, 0))
    kv_spec = pl.BlockSpec((None, len_kv, None, d), lambda b_, h_, i: (b_, 0, h_ // group, 0))
    v_spec = pl.BlockSpec((None, len_kv, None, value_dim), lambda b_, h_, i: (b_, 0, h_ // group, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, len_kv=len_kv),
        grid=(b, h, len_q // bq),
        in_specs=[q_spec, kv_spec, v_spec, *side_specs, do_spec, row_spec, row_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(cfg, d, backward=True),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, *side, do, lse, delta)

    side, side_specs = _side_inputs(
        cfg,
        q_seg,
        kv_seg,
        q_pos,
        kv_pos,
        pl.BlockSpec((None, len_q), lambda b_, g_, j: (b_, 0)),
        pl.BlockSpec((None, bk), lambda b_, g_, j: (b_, j)),
        end_q,
    )
    q_group_spec = pl.BlockSpec((None, len_q, group, d), lambda b_, g_, j: (b_, 0, g_, 0))
    do_group_spec = pl.BlockSpec((None, len_q, group, value_dim), lambda b_, g_, j: (b_, 0, g_, 0))
    kv_tile_spec = pl.BlockSpec((None, bk, None, d), lambda b_, g_, j: (b_, j, g_, 0))
    v_tile_spec = pl.BlockSpec((None, bk, None, value_dim), lambda b_, g_, j: (b_, j, g_, 0))
    rows_spec = pl.BlockSpec((None, group, len_q), lambda b_, g_, j: (b_, g_, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, len_q=len_q, group=group),
        grid=(b, kh, len_kv // bk),
        in_specs=[
            q_group_spec,
            kv_tile_spec,
            v_tile_spec,
            *side_specs,
            do_group_spec,
            rows_spec,
            rows_spec,
        ],
        out_specs=[kv_tile_spec, v_tile_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        compiler_params=_params(cfg, d, backward=True),
        interpret=cfg.interpret,
        name="flash_attention_dkdv",
    )(q, k, v, *side, do, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    return _forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)


def _flash_fwd(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    out, lse = _forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return (out, lse), (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse)


def _flash_bwd(cfg, residuals, cotangents):
    q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse = residuals
    do, dlse = cotangents
    dq, dk, dv = _backward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, do, dlse)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_ids(name: str, ids, batch: int, length: int):
    if ids is None:
        return None
    ids = jnp.asarray(ids)
    if ids.shape != (batch, length) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an integer array of shape {(batch, length)} "
            f"[batch, length], got {ids.dtype}{list(ids.shape)}"
        )
    return ids.astype(jnp.int32)


def _validate(q, k, v, segment_ids, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "q must be [batch, length, heads, head_dim], k [batch, length, kv_heads, head_dim] and v "
            f"[batch, length, kv_heads, value_dim]; got q{list(q.shape)}, k{list(k.shape)}, v{list(v.shape)}"
        )
    b, _, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k batch/head_dim {k.shape[0]}/{k.shape[3]} must equal q's {b}/{d}")
    if h % k.shape[2]:
        raise ValueError(f"q heads ({h}) must be a multiple of kv heads ({k.shape[2]}) for GQA")
    if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (q, k, v)):
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None and (q_segment_ids is not None or kv_segment_ids is not None):
        raise ValueError("pass segment_ids or q_segment_ids/kv_segment_ids, not both")
    if segment_ids is not None:
        q_segment_ids = kv_segment_ids = segment_ids
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if (q_positions is None) != (kv_positions is None):
        raise ValueError("q_positions and kv_positions must be given together")
    len_q, len_kv = q.shape[1], k.shape[1]
    return (
        _check_ids("q_segment_ids", q_segment_ids, b, len_q),
        _check_ids("kv_segment_ids", kv_segment_ids, b, len_kv),
        _check_ids("q_positions", q_positions, b, len_q),
        _check_ids("kv_positions", kv_positions, b, len_kv),
    )


def flash_attention_with_lse(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    sm_scale: float | None = None,
    block_sizes: FlashBlockSizes | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention output and log-sum-exp, both differentiable.

    Args:
        q: [B, Lq, H, D] queries.
        k: [B, Lk, K, D] keys, H % K == 0 (each K/V head serves H // K query heads).
        v: [B, Lk, K, Dv] values, Dv the value head dim (D, or another width: multi-head latent
            attention's values are narrower than its queries and keys).
        causal: keep keys with kv_position <= q_position.
        segment_ids: [B, L] ids for both sides (self-attention, Lq == Lk).
        q_segment_ids: [B, Lq] query ids, with `kv_segment_ids` [B, Lk] (ring steps).
        kv_segment_ids: see `q_segment_ids`.
        q_positions: [B, Lq] global token indices for the causal mask, with
            `kv_positions` [B, Lk]; default 0..L-1 on both sides.
        kv_positions: see `q_positions`.
        sm_scale: score scale, default 1/sqrt(D).
        block_sizes: tile sizes and launch parameters; default `FlashBlockSizes.default` for the
            head dim and dtype, fitted to the lengths.
        interpret: Pallas interpret mode; None = on CPU only.

    Returns:
        out [B, Lq, H, Dv] in q.dtype and lse [B, H, Lq] float32, the natural-log
        log-sum-exp of the scaled, masked scores. Rows without any visible key
        give out = 0 and lse = -inf. A head dim (D, Dv) that is not a power of two
        >= 16 is zero-padded to one for the kernels (a copy of q and k, or of v).

    Raises:
        ValueError: for shapes, dtypes or block sizes the kernels do not support.
    """
    ids = _validate(q, k, v, segment_ids, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    q_seg, kv_seg, q_pos, kv_pos = ids
    user_given = block_sizes is not None
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    padded, padded_v = (max(16, n if is_power_of_two(n) else 2 * floor_power_of_two(n)) for n in (head_dim, value_dim))
    blocks = block_sizes or FlashBlockSizes.default(padded, q.dtype)
    blocks = blocks.fit(q.shape[1], k.shape[1], user_given=user_given)
    has_positions = causal and q_pos is not None
    cfg = _Config(
        causal=bool(causal),
        sm_scale=float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])),
        blocks=blocks,
        interpret=resolve_interpret(interpret),
        has_segments=q_seg is not None,
        has_positions=has_positions,
        skips_documents=segment_ids is not None and not has_positions and q.shape[1] == k.shape[1],
    )
    if not has_positions:
        q_pos = kv_pos = None
    # Triton tiles are powers of two and tl.dot needs 16: zero columns leave the
    # scores unchanged and give zero output columns, which are sliced off.
    if padded != head_dim:
        q, k = (jnp.pad(x, ((0, 0),) * 3 + ((0, padded - head_dim),)) for x in (q, k))
    if padded_v != value_dim:
        v = jnp.pad(v, ((0, 0),) * 3 + ((0, padded_v - value_dim),))
    out, lse = _flash(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
    return (out if padded_v == value_dim else out[..., :value_dim]), lse


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    block_sizes: FlashBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Self-attention output [B, L, H, Dv]; see `flash_attention_with_lse`."""
    out, _ = flash_attention_with_lse(
        q,
        k,
        v,
        causal=causal,
        segment_ids=segment_ids,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    return out


def flash_attention_with_lse_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    sm_scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp (out, lse) with the semantics of `flash_attention_with_lse`, in fp32 (matmuls at full
    float32 precision: a GPU's default for float32 is TF32)."""
    q_seg, kv_seg, q_pos, kv_pos = _validate(
        q, k, v, segment_ids, q_segment_ids, kv_segment_ids, q_positions, kv_positions
    )
    b, len_q, h, d = q.shape
    len_kv, kh = k.shape[1], k.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qf = q.astype(jnp.float32).reshape(b, len_q, kh, h // kh, d)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qf, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * scale
    mask = jnp.ones((b, 1, 1, len_q, len_kv), bool)
    if causal:
        if q_pos is None:
            q_pos = jnp.broadcast_to(jnp.arange(len_q), (b, len_q))
            kv_pos = jnp.broadcast_to(jnp.arange(len_kv), (b, len_kv))
        mask &= (kv_pos[:, None, :] <= q_pos[:, :, None])[:, None, None]
    if q_seg is not None:
        mask &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    empty = denom == 0.0
    denom_safe = jnp.where(empty, 1.0, denom)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p / denom_safe, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(denom_safe))[..., 0]
    return out.reshape(b, len_q, h, v.shape[-1]).astype(q.dtype), lse.reshape(b, h, len_q)


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Pure-jnp attention output with the semantics of `flash_attention`."""
    out, _ = flash_attention_with_lse_reference(q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)
    return out
