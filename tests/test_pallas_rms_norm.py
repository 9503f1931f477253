"""Fused RMSNorm kernel (interpret mode) against the pure-jnp reference, and its GPU lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.pallas_kernels import RMSNormBlockSizes, rms_norm, rms_norm_reference
from tests.utils import lower_for_h100, pallas_interpret

INTERPRET = pallas_interpret()  # interpret mode, or compiled on a GPU (MESHTRAIN_PALLAS=compiled)

F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}


def _value_and_grads(fn, x, w, dy, **kw):
    def run(x, w):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, eps=1e-6, **kw), x, w)
        return (y, *vjp(dy))

    return jax.jit(run)(x, w)


@pytest.mark.parametrize(
    "shape,dtype,blocks",
    [
        ((3, 5, 64), jnp.float32, None),  # odd row count: one row per tile
        ((2, 16, 128), jnp.float32, RMSNormBlockSizes(block_rows=4, max_programs=2)),
        ((4, 24, 96), jnp.float32, None),  # D not a power of two: zero-padded tile
        ((2, 32, 256), jnp.bfloat16, None),
    ],
)
def test_matches_reference(shape, dtype, blocks):
    ks = jax.random.split(jax.random.key(0), 3)
    x = (3.0 * jax.random.normal(ks[0], shape, jnp.float32)).astype(dtype)
    w = 1.0 + 0.1 * jax.random.normal(ks[1], shape[-1:], jnp.float32)
    dy = jax.random.normal(ks[2], shape, jnp.float32).astype(dtype)
    got = _value_and_grads(rms_norm, x, w, dy, block_sizes=blocks, interpret=INTERPRET)
    want = _value_and_grads(rms_norm_reference, x, w, dy)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == w.dtype
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    for name, a, b in zip(("y", "dx", "dweight"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name, **tol)


def test_default_blocks_depend_on_width():
    assert RMSNormBlockSizes.for_shape(8192, 4096).block_rows == 4
    assert RMSNormBlockSizes.for_shape(8192, 64).block_rows == 64
    assert RMSNormBlockSizes().fit(12, user_given=False).block_rows == 4


@pytest.mark.parametrize(
    "x_shape,w_shape,kw,match",
    [
        ((4, 64), (32,), {"eps": 1e-6}, "weight shape"),
        ((4, 64), (64,), {"eps": 0.0}, "eps=0.0"),
        (
            (12, 64),
            (64,),
            {"eps": 1e-6, "block_sizes": RMSNormBlockSizes(block_rows=8)},
            "rows=12",
        ),
        (
            (12, 64),
            (64,),
            {"eps": 1e-6, "block_sizes": RMSNormBlockSizes(block_rows=3)},
            "block_rows=3",
        ),
    ],
)
def test_invalid_inputs_raise_wrapper_error(x_shape, w_shape, kw, match):
    x, w = jnp.zeros(x_shape), jnp.ones(w_shape)
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w, interpret=False, **kw)


@pytest.mark.parametrize("shape", [(1, 8192, 4096), (2, 128, 96)])  # llama3_8b; padded width
def test_lowers_to_triton_forward_and_backward(shape):
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct(shape[-1:], jnp.float32)
    fwd = lambda x, w: rms_norm(x, w, eps=1e-5, interpret=False)
    bwd = jax.grad(lambda x, w: jnp.sum(fwd(x, w).astype(jnp.float32)), argnums=(0, 1))
    for f in (fwd, bwd):
        text = lower_for_h100(f, x, w).as_text()
        assert "xla.gpu.triton" in text
