"""The grouped matmul kernel (`pallas_kernels.grouped_matmul`) against `jax.lax.ragged_dot`, in
interpret mode: values and both gradients, every weight axis order, empty and partial groups, rows of
no group; the group layout; the arguments it refuses. Its Triton lowering for an H100 is compiled
in the `gpu_aot` set (tests/test_gpu_aot.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.pallas_kernels import grouped_matmul as gm

G, K, N, TILE = 4, 32, 48, 16
BLOCKS = gm.GroupedBlockSizes(block_m=TILE, block_n=16, block_k=16)
ORDERS = {"gkn": (0, 1, 2), "kgn": (1, 0, 2), "ngk": (2, 0, 1), "nkg": (2, 1, 0)}


def _layout(sizes, spare_tiles: int = 1) -> gm.GroupLayout:
    sizes = jnp.asarray(sizes, jnp.int32)
    rows = gm.GroupLayout.capacity(int(sizes.sum()), len(sizes), TILE) + spare_tiles * TILE
    return gm.GroupLayout.pack(sizes, TILE, rows)


def _operands(layout: gm.GroupLayout, dtype, seed: int = 0):
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (layout.rows, K), jnp.float32)
    x = jnp.where(layout.valid_rows()[:, None], x, 7.0).astype(dtype)  # the rows of no group hold garbage
    w = jax.random.normal(kw, (len(layout.sizes), K, N), jnp.float32).astype(dtype)
    cot = jax.random.normal(kc, (layout.rows, N), jnp.float32)
    return x, w, cot


def _vjp(fn, x, w, cot):
    out, pullback = jax.vjp(fn, x, w)
    return out, *pullback(cot.astype(out.dtype))


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("sizes", [(5, 0, 20, 16), (0, 0, 0, 33), (16, 16, 16, 16)],
                         ids=["partial-and-empty", "one-group", "whole-tiles"])
def test_float32_equals_ragged_dot(sizes, order):
    layout = _layout(sizes)
    x, w, cot = _operands(layout, jnp.float32)
    perm = ORDERS[order]
    w_ordered = jnp.transpose(w, perm)
    y, dx, dw = _vjp(lambda x, w: gm.grouped_matmul(x, w, layout, order=order, blocks=BLOCKS, interpret=True),
                     x, w_ordered, cot)
    y_ref, dx_ref, dw_ref = _vjp(lambda x, w: gm.grouped_matmul_reference(x, w, layout), x, w, cot)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, jnp.transpose(dw_ref, perm), rtol=1e-5, atol=1e-5)


def test_rows_of_no_group_are_zero_and_take_no_part():
    layout = _layout((5, 0, 20, 16), spare_tiles=2)
    x, w, cot = _operands(layout, jnp.float32)
    y, dx, dw = _vjp(lambda x, w: gm.grouped_matmul(x, w, layout, blocks=BLOCKS, interpret=True), x, w, cot)
    none = ~np.asarray(layout.valid_rows())
    assert none.sum() > 2 * TILE  # padding inside tiles and whole tiles past the groups
    np.testing.assert_array_equal(np.asarray(y)[none], 0.0)
    np.testing.assert_array_equal(np.asarray(dx)[none], 0.0)
    # the garbage in those rows of x changes no weight gradient
    _, _, dw_clean = _vjp(lambda x, w: gm.grouped_matmul(x, w, layout, blocks=BLOCKS, interpret=True),
                          jnp.where(layout.valid_rows()[:, None], x, 0.0), w, cot)
    np.testing.assert_array_equal(dw, dw_clean)
    np.testing.assert_array_equal(np.asarray(dw)[1], 0.0)  # the empty group


def test_bfloat16_within_its_rounding_of_float32():
    layout = _layout((5, 3, 20, 16))
    x, w, cot = _operands(layout, jnp.float32)
    run = lambda x, w: gm.grouped_matmul(x, w, layout, blocks=BLOCKS, interpret=True)  # noqa: E731
    y32, dx32, dw32 = _vjp(run, x, w, cot)
    y16, dx16, dw16 = _vjp(run, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), cot)
    assert y16.dtype == dx16.dtype == dw16.dtype == jnp.bfloat16
    for got, want in ((y16, y32), (dx16, dx32), (dw16, dw32)):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2 ** -7 * scale)


def test_layout_packs_groups_in_whole_tiles():
    layout = gm.GroupLayout.pack(jnp.array([5, 0, 20, 16], jnp.int32), TILE, 128)
    np.testing.assert_array_equal(layout.starts, [0, 16, 16, 48])
    group, owned = layout.tile_groups()
    np.testing.assert_array_equal(group, [0, 2, 2, 3, 4, 4, 4, 4])  # 4 = no group
    np.testing.assert_array_equal(owned, [5, 16, 4, 16, 0, 0, 0, 0])
    assert gm.GroupLayout.capacity(41, 4, TILE) == 112  # 41 + 4 * 15 = 101, in whole tiles
    valid = np.asarray(layout.valid_rows())
    assert valid.sum() == 41 and valid[:5].all() and not valid[5:16].any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(order="gkk"), "permutation"),
    (dict(blocks=gm.GroupedBlockSizes(block_m=32)), "layout's tile"),
])
def test_refuses_bad_arguments(kwargs, match):
    layout = _layout((5, 0, 20, 16))
    x, w, _ = _operands(layout, jnp.float32)
    with pytest.raises(ValueError, match=match):
        gm.grouped_matmul(x, w, layout, interpret=True, **kwargs)


def test_refuses_mismatched_operands():
    layout = _layout((5, 0, 20, 16))
    x, w, _ = _operands(layout, jnp.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        gm.grouped_matmul(x, w.astype(jnp.bfloat16), layout, interpret=True)
    with pytest.raises(ValueError, match="expected"):
        gm.grouped_matmul(x[:-TILE], w, layout, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        gm.GroupedBlockSizes(block_n=24)


@pytest.mark.parametrize("orders", [("gkn", "gkn", "gkn"), ("kgn", "kgn", "ngk")], ids=["gkn", "model-major"])
def test_fused_swiglu_equals_its_three_matmuls(orders):
    """`grouped_swiglu` (gate and up in one pass, the down projection's input gradient through the SwiGLU
    in one, x's gradient from both in one) against ragged_dot's three matmuls, values and all four
    gradients, in float32."""
    layout = _layout((5, 0, 20, 16))
    ks = jax.random.split(jax.random.key(3), 5)
    f = 64
    x = jnp.where(layout.valid_rows()[:, None], jax.random.normal(ks[0], (layout.rows, K)), 3.0)
    w_gate, w_up = (jax.random.normal(k_, (G, K, f)) / 4 for k_ in ks[1:3])
    w_down = jax.random.normal(ks[3], (G, f, K)) / 4
    cot = jax.random.normal(ks[4], (layout.rows, K))
    perms = [{"gkn": (0, 1, 2), "kgn": (1, 0, 2), "ngk": (2, 0, 1)}[o] for o in orders]
    weights = [jnp.transpose(w, p) for w, p in zip((w_gate, w_up, w_down), perms, strict=True)]
    fused = jax.value_and_grad(
        lambda x, *w: jnp.sum(gm.grouped_swiglu(x, *w, layout, orders=orders, blocks=BLOCKS, interpret=True) * cot),
        argnums=(0, 1, 2, 3))
    reference = jax.value_and_grad(
        lambda x, *w: jnp.sum(gm.grouped_swiglu_reference(x, *w, layout) * cot), argnums=(0, 1, 2, 3))
    (value, grads), (value_ref, grads_ref) = fused(x, *weights), reference(x, w_gate, w_up, w_down)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    y = gm.grouped_swiglu(x, *weights, layout, orders=orders, blocks=BLOCKS, interpret=True)
    np.testing.assert_allclose(y, gm.grouped_swiglu_reference(x, w_gate, w_up, w_down, layout), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[0], grads_ref[0], rtol=1e-5, atol=1e-5)
    for got, want, p in zip(grads[1:], grads_ref[1:], perms, strict=True):
        np.testing.assert_allclose(got, jnp.transpose(want, p), rtol=1e-5, atol=1e-5)
