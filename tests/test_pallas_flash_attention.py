"""Flash attention kernel (interpret mode) against the pure-jnp reference, and its GPU lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.pallas_kernels import (
    FlashBlockSizes,
    document_tiles,
    flash_attention,
    flash_attention_reference,
    flash_attention_with_lse,
    flash_attention_with_lse_reference,
)
from meshtrain.pallas_kernels._common import resolve_interpret
from tests.utils import lower_for_h100, pallas_interpret

INTERPRET = pallas_interpret()  # interpret mode, or compiled on a GPU (MESHTRAIN_PALLAS=compiled)

F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}


def _inputs(b, lq, lk, h, kh, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, lq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, lk, kh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, lk, kh, d), jnp.float32).astype(dtype)
    d_out = jax.random.normal(ks[3], (b, lq, h, d), jnp.float32).astype(dtype)
    d_lse = jax.random.normal(ks[4], (b, h, lq), jnp.float32)
    return q, k, v, d_out, d_lse


def _segments(b, length, seed):
    """Documents of random lengths packed into each row."""
    starts = jax.random.bernoulli(jax.random.key(seed), 0.02, (b, length))
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def _value_and_grads(fn, q, k, v, d_out, d_lse, **kw):
    """(out, lse, dq, dk, dv) with random cotangents on both outputs."""

    def run(q, k, v):
        (out, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
        return (out, lse, *vjp((d_out, d_lse)))

    return jax.jit(run)(q, k, v)


def _assert_close(got, want, tol):
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a) | jnp.isneginf(b))), name
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name, **tol)


GRID = [
    # (batch, length, heads, kv_heads, head_dim, causal, segments)
    (1, 128, 4, 4, 64, True, False),
    (3, 128, 4, 1, 64, False, True),
    (1, 256, 8, 1, 128, True, True),
    (1, 256, 3, 3, 128, False, False),
    (1, 256, 6, 2, 64, True, False),  # group of 3 query heads per K/V head
    (2, 128, 8, 2, 64, True, True),
    (1, 1024, 4, 1, 64, True, True),
    (2, 128, 4, 2, 8, True, True),  # tiny model head_dim 8, zero-padded to 16
]


@pytest.mark.parametrize("b,length,h,kh,d,causal,segments", GRID)
def test_matches_reference_float32(b, length, h, kh, d, causal, segments):
    q, k, v, d_out, d_lse = _inputs(b, length, length, h, kh, d, jnp.float32)
    kw = {
        "causal": causal,
        "segment_ids": _segments(b, length, 1) if segments else None,
    }
    got = _value_and_grads(flash_attention_with_lse, q, k, v, d_out, d_lse, interpret=INTERPRET, **kw)
    want = _value_and_grads(flash_attention_with_lse_reference, q, k, v, d_out, d_lse, **kw)
    _assert_close(got, want, F32_TOL)


@pytest.mark.parametrize("d,dv,segments", [(24, 16, True), (64, 32, False), (192, 128, True)],
                         ids=["padded-keys", "narrow", "latent-attention"])
def test_values_narrower_than_keys_match_reference_float32(d, dv, segments):
    """Values of their own head dim (multi-head latent attention: queries and keys 192 wide, padded to 256,
    values 128 and not padded): out [.., dv] and all three gradients equal the reference's."""
    b, length, h, kh = 2, 128, 4, 2
    q, k, _, _, d_lse = _inputs(b, length, length, h, kh, d, jnp.float32)
    _, _, v, d_out, _ = _inputs(b, length, length, h, kh, dv, jnp.float32, seed=1)
    kw = {"causal": True, "segment_ids": _segments(b, length, 2) if segments else None}
    got = _value_and_grads(flash_attention_with_lse, q, k, v, d_out, d_lse, interpret=INTERPRET, **kw)
    want = _value_and_grads(flash_attention_with_lse_reference, q, k, v, d_out, d_lse, **kw)
    assert got[0].shape == (b, length, h, dv) and got[4].shape == v.shape
    _assert_close(got, want, F32_TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_bfloat16(causal):
    q, k, v, d_out, d_lse = _inputs(1, 256, 256, 8, 2, 64, jnp.bfloat16, seed=3)
    kw = {"causal": causal, "segment_ids": _segments(1, 256, 2)}
    got = _value_and_grads(flash_attention_with_lse, q, k, v, d_out, d_lse, interpret=INTERPRET, **kw)
    want = _value_and_grads(flash_attention_with_lse_reference, q, k, v, d_out, d_lse, **kw)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    assert got[2].dtype == got[3].dtype == jnp.bfloat16
    _assert_close(got, want, BF16_TOL)


def test_ring_step_block_with_offsets_and_empty_rows():
    """A ring step: Lq != Lk, global positions, separate ids; some rows see no key."""
    b, lq, lk = 2, 128, 256
    q, k, v, d_out, d_lse = _inputs(b, lq, lk, 4, 2, 64, jnp.float32, seed=5)
    q_pos = jnp.broadcast_to(256 + jnp.arange(lq), (b, lq)).astype(jnp.int32)
    kv_pos = jnp.broadcast_to(200 + jnp.arange(lk), (b, lk)).astype(jnp.int32)
    q_seg = jnp.broadcast_to(jnp.where(jnp.arange(lq) < 40, 7, 8), (b, lq)).astype(jnp.int32)
    q_seg = q_seg.at[1, :16].set(99)  # a document with no keys in this block
    kv_seg = jnp.full((b, lk), 8, jnp.int32)
    kw = {
        "causal": True,
        "q_segment_ids": q_seg,
        "kv_segment_ids": kv_seg,
        "q_positions": q_pos,
        "kv_positions": kv_pos,
    }
    got = _value_and_grads(flash_attention_with_lse, q, k, v, d_out, d_lse, interpret=INTERPRET, **kw)
    want = _value_and_grads(flash_attention_with_lse_reference, q, k, v, d_out, d_lse, **kw)
    _assert_close(got, want, F32_TOL)
    out, lse, dq = got[0], got[1], got[2]
    empty = q_seg != 8
    assert bool(jnp.all(jnp.where(empty[:, :, None, None], out == 0, True)))
    assert bool(jnp.all(jnp.isneginf(lse) == empty[:, None, :]))
    assert bool(jnp.all(jnp.where(empty[:, :, None, None], dq == 0, True)))


def test_flash_attention_output_only_and_block_override():
    q, k, v, _, _ = _inputs(1, 256, 256, 4, 2, 64, jnp.float32, seed=7)
    want = flash_attention_reference(q, k, v, causal=True)
    blocks = FlashBlockSizes(block_q=32, block_kv=64, block_q_bwd=16, block_kv_bwd=32)
    for bs in (None, blocks):
        got = flash_attention(q, k, v, causal=True, block_sizes=bs, interpret=INTERPRET)
        np.testing.assert_allclose(got, want, **F32_TOL)
    loss = lambda fn, **kw: lambda q: jnp.sum(jnp.sin(fn(q, k, v, **kw)))
    np.testing.assert_allclose(
        jax.grad(loss(flash_attention, block_sizes=blocks, interpret=INTERPRET))(q),
        jax.grad(loss(flash_attention_reference))(q),
        **F32_TOL,
    )


@pytest.mark.parametrize(
    "blocks",
    [
        FlashBlockSizes(block_q=64, block_kv=16, block_q_bwd=16, block_kv_bwd=64),  # q tiles taller than K/V tiles
        FlashBlockSizes(block_q=16, block_kv=64, block_q_bwd=64, block_kv_bwd=16, num_warps=8, num_stages=3),
    ],
)
@pytest.mark.parametrize("segments", [False, True])
def test_tiles_below_and_across_the_diagonal(blocks, segments):
    """Causal: the tiles wholly below the diagonal skip the causal mask, the ones it crosses keep it,
    for every ratio of query to key tile in the forward and both backward kernels."""
    q, k, v, d_out, d_lse = _inputs(1, 256, 256, 4, 2, 32, jnp.float32, seed=11)
    kw = {"causal": True, "segment_ids": _segments(1, 256, 4) if segments else None}
    got = _value_and_grads(flash_attention_with_lse, q, k, v, d_out, d_lse, interpret=INTERPRET,
                           block_sizes=blocks, **kw)
    want = _value_and_grads(flash_attention_with_lse_reference, q, k, v, d_out, d_lse, **kw)
    _assert_close(got, want, F32_TOL)


def _packed(lengths, length):
    """One row as the data path packs it: documents of `lengths` with ids 1, 2, ..., then padding (0s)."""
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(length - sum(lengths))])
    return jnp.asarray(ids[None], jnp.int32)


DOCUMENT_ROWS = {
    "documents and padding": _packed((40, 7, 100, 3, 60), 256),
    "one document": _packed((256,), 256),
    "an id recurring": jnp.asarray(np.repeat([1, 2, 1, 3], 64)[None], jnp.int32),  # no tile skipped
    "padding first": jnp.asarray(np.repeat([0, 1, 0], [30, 200, 26])[None], jnp.int32),  # no tile skipped
}


@pytest.mark.parametrize("row", list(DOCUMENT_ROWS), ids=lambda name: name.replace(" ", "-"))
def test_tiles_of_other_documents_skipped_exactly(row):
    """Self-attention over packed documents (`segment_ids`) skips the tiles that hold other documents' keys
    alone (`document_tiles`): forward and gradients equal the reference, with 16-row tiles (many per
    document, documents across tile edges), and where ids recur no tile is skipped."""
    q, k, v, d_out, d_lse = _inputs(1, 256, 256, 4, 2, 32, jnp.float32, seed=5)
    blocks = FlashBlockSizes(block_q=16, block_kv=32, block_q_bwd=32, block_kv_bwd=16)
    kw = {"causal": True, "segment_ids": DOCUMENT_ROWS[row]}
    got = _value_and_grads(flash_attention_with_lse, q, k, v, d_out, d_lse, interpret=INTERPRET,
                           block_sizes=blocks, **kw)
    want = _value_and_grads(flash_attention_with_lse_reference, q, k, v, d_out, d_lse, **kw)
    _assert_close(got, want, F32_TOL)


def _visited(first_kv, end_q, bq, bk, length):
    """The (query tile, key tile) pairs the forward and the dk/dv kernels visit: from `first_kv` (or up to
    `end_q`) to the causal diagonal."""
    forward = {(i, j) for i, first in enumerate(first_kv) for j in range(first, ((i + 1) * bq - 1) // bk + 1)}
    dkdv = {(i, j) for j, end in enumerate(end_q) for i in range(j * bk // bq, end)}
    return forward, dkdv


@pytest.mark.parametrize("bq, bk", [(16, 32), (32, 16), (64, 64)])
def test_document_tiles_are_the_tiles_documents_fill(bq, bk):
    """For rows of documents the kernels visit exactly the tiles that hold a (query, key) pair of one
    document, causal: work in the documents' squares, not the row's; for a row whose ids recur, every
    tile up to the diagonal."""
    length, rng = 512, np.random.default_rng(3)
    for lengths in ((512,), (300, 12, 200), tuple(rng.multinomial(500, np.ones(9) / 9))):
        ids = _packed(lengths, length)
        first_kv, end_q = (np.asarray(x[0]) for x in document_tiles(ids, bq, bk))
        row = np.asarray(ids[0])
        allowed = (row[:, None] == row[None, :]) & np.tri(length, dtype=bool)
        needed = {(i, j) for i in range(length // bq) for j in range(length // bk)
                  if allowed[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()}
        forward, dkdv = _visited(first_kv, end_q, bq, bk, length)
        assert forward == needed == dkdv, lengths
    causal = {(i, j) for i in range(length // bq) for j in range(((i + 1) * bq - 1) // bk + 1)}
    recurring = jnp.asarray(np.repeat([1, 2, 1, 2], length // 4)[None], jnp.int32)
    first_kv, end_q = (np.asarray(x[0]) for x in document_tiles(recurring, bq, bk))
    assert _visited(first_kv, end_q, bq, bk, length) == (causal, causal)


def test_launch_params_default_by_head_dim_and_are_checked():
    assert FlashBlockSizes().launch_params(64, backward=False) == (4, 2)
    assert FlashBlockSizes().launch_params(128, backward=True) == (8, 2)
    tuned = FlashBlockSizes(num_warps=8, num_stages=3, num_warps_bwd=4, num_stages_bwd=1)
    assert tuned.launch_params(64, backward=False) == (8, 3)
    assert tuned.launch_params(128, backward=True) == (4, 1)
    with pytest.raises(ValueError, match="num_warps=3"):
        FlashBlockSizes(num_warps=3).fit(128, 128, user_given=True)


def test_default_blocks_fit_the_shape():
    fitted = FlashBlockSizes().fit(96, 48, user_given=False)
    assert fitted == FlashBlockSizes(block_q=32, block_kv=16, block_q_bwd=32, block_kv_bwd=16)
    bf16_64 = FlashBlockSizes.default(64, jnp.bfloat16)
    assert (bf16_64.block_q, bf16_64.block_kv, bf16_64.launch_params(64, backward=False)) == (64, 64, (4, 3))
    f32_128 = FlashBlockSizes.default(128, jnp.float32)  # 128 x 128 float32 tiles overflow an SM's shared memory
    assert (f32_128.block_q, f32_128.block_kv) == (64, 64)
    bf16_128 = FlashBlockSizes.default(128, jnp.bfloat16)
    assert bf16_128.launch_params(128, backward=False) == (8, 3)
    assert bf16_128.launch_params(128, backward=True) == (4, 2)
    # above 128 (latent attention's 192, padded to 256) 128 x 128 bf16 tiles ask 329 KB of shared memory and
    # fail XLA's GPU compile (tests/test_gpu_aot.py, latent-attention-deepseek-heads): 64 x 64
    bf16_256 = FlashBlockSizes.default(256, jnp.bfloat16)
    assert (bf16_256.block_q, bf16_256.block_kv) == (64, 64)
    assert FlashBlockSizes.default(64, jnp.float32) == FlashBlockSizes()
    assert resolve_interpret(None) is (jax.default_backend() == "cpu")


@pytest.mark.parametrize(
    "q_shape,kv_shape,kw,match",
    [
        ((1, 128, 6, 64), (1, 128, 4, 64), {}, "multiple of kv heads"),
        ((1, 128, 4, 48), (1, 128, 4, 48), {}, None),  # head_dim padded to 64
        ((1, 100, 4, 64), (1, 100, 4, 64), {}, "q length=100"),
        (
            (1, 128, 4, 64),
            (1, 128, 4, 64),
            {"block_sizes": FlashBlockSizes(block_q=96)},
            "block_q=96",
        ),
        (
            (1, 128, 4, 64),
            (1, 128, 4, 64),
            {"block_sizes": FlashBlockSizes(block_kv=256, block_kv_bwd=64)},
            None,
        ),
        (
            (1, 128, 4, 64),
            (1, 128, 4, 64),
            {"segment_ids": jnp.zeros((1, 64), jnp.int32)},
            "q_segment_ids",
        ),
    ],
)
def test_invalid_shapes_raise_wrapper_error(q_shape, kv_shape, kw, match):
    q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
    kv = jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16)
    f = lambda q, k, v: flash_attention(q, k, v, interpret=False, **kw)
    if match is None:  # clamped block / padded head_dim: lowers
        lower_for_h100(f, q, kv, kv)
        return
    with pytest.raises(ValueError, match=match):
        lower_for_h100(f, q, kv, kv)


LOWERING = [
    # llama3_8b: 32 heads, 8 KV heads, head_dim 128, L = 8192, batch 1, bf16.
    (1, 8192, 8192, 32, 8, 128, jnp.bfloat16, "plain"),
    (1, 8192, 8192, 32, 8, 128, jnp.bfloat16, "segments"),
    (1, 8192, 8192, 32, 8, 128, jnp.bfloat16, "documents"),  # self-attention: other documents' tiles skipped
    (1, 4096, 8192, 32, 8, 128, jnp.bfloat16, "ring"),
    *[(b, n, n, h, kh, d, jnp.float32, "segments" if s else "plain") for b, n, h, kh, d, _, s in GRID],
    # DeepSeek-V3's latent attention: queries and keys 192 wide (padded to 256), values 128
    (1, 4096, 4096, 16, 16, (192, 128), jnp.bfloat16, "segments"),
]


@pytest.mark.parametrize("b,lq,lk,h,kh,d,dtype,mode", LOWERING)
def test_lowers_to_triton_forward_and_backward(b, lq, lk, h, kh, d, dtype, mode):
    d, dv = d if isinstance(d, tuple) else (d, d)  # (queries and keys, values)
    q = jax.ShapeDtypeStruct((b, lq, h, d), dtype)
    kv = jax.ShapeDtypeStruct((b, lk, kh, d), dtype)
    values = jax.ShapeDtypeStruct((b, lk, kh, dv), dtype)
    ids_q, ids_kv = (
        jax.ShapeDtypeStruct((b, lq), jnp.int32),
        jax.ShapeDtypeStruct((b, lk), jnp.int32),
    )

    def fwd(q, k, v, iq, ikv):
        kw = {}
        if mode == "documents":
            kw = {"segment_ids": iq}
        elif mode != "plain":
            kw = {"q_segment_ids": iq, "kv_segment_ids": ikv}
        if mode == "ring":
            kw.update(q_positions=iq, kv_positions=ikv)
        return flash_attention_with_lse(q, k, v, causal=True, interpret=False, **kw)

    def loss(q, k, v, iq, ikv):
        out, lse = fwd(q, k, v, iq, ikv)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    for f in (fwd, jax.grad(loss, argnums=(0, 1, 2))):
        text = lower_for_h100(f, q, kv, values, ids_q, ids_kv).as_text()
        assert "xla.gpu.triton" in text
