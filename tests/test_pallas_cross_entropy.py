"""Fused cross-entropy kernel (interpret mode) against the pure-jnp reference, and its GPU lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.fused import fused_loss_sum
from meshtrain.pallas_kernels import (
    CrossEntropyBlockSizes,
    fused_cross_entropy,
    fused_cross_entropy_reference,
)
from tests.utils import lower_for_h100, mesh_of, pallas_interpret

INTERPRET = pallas_interpret()  # interpret mode, or compiled on a GPU (MESHTRAIN_PALLAS=compiled)

F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}


def _inputs(n, d, v, dtype, bool_mask):
    ks = jax.random.split(jax.random.key(n + v), 4)
    hidden = jax.random.normal(ks[0], (n, d), jnp.float32).astype(dtype)
    w_out = (0.2 * jax.random.normal(ks[1], (d, v), jnp.float32)).astype(dtype)
    labels = jax.random.randint(ks[2], (n,), 0, v)
    keep = jax.random.uniform(ks[3], (n,)) > 0.3
    mask = keep if bool_mask else keep * jax.random.uniform(ks[3], (n,))
    return hidden, w_out, labels, mask


def _value_and_grads(fn, hidden, w_out, labels, mask, **kw):
    run = jax.value_and_grad(lambda h, w, m: fn(h, w, labels, m, **kw), argnums=(0, 1, 2))
    loss, grads = jax.jit(run)(hidden, w_out, mask.astype(jnp.float32))
    return (loss, *grads)


@pytest.mark.parametrize(
    "n,d,v,dtype,bool_mask,blocks",
    [
        (128, 64, 512, jnp.float32, True, None),
        (100, 48, 300, jnp.float32, False, None),  # every dimension padded to its tile
        (
            64,
            64,
            256,
            jnp.float32,
            False,
            CrossEntropyBlockSizes(block_n=16, block_v=32, block_d=16),
        ),
        (128, 64, 256, jnp.bfloat16, True, None),
    ],
)
def test_matches_reference(n, d, v, dtype, bool_mask, blocks):
    hidden, w_out, labels, mask = _inputs(n, d, v, dtype, bool_mask)
    got = _value_and_grads(
        fused_cross_entropy,
        hidden,
        w_out,
        labels,
        mask,
        block_sizes=blocks,
        interpret=INTERPRET,
    )
    want = _value_and_grads(fused_cross_entropy_reference, hidden, w_out, labels, mask)
    assert got[0].dtype == jnp.float32 and got[1].dtype == dtype and got[2].dtype == dtype
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    # The loss is a sum over tokens: compare it per token.
    np.testing.assert_allclose(got[0] / n, want[0] / n, **tol)
    for name, a, b in zip(("d_hidden", "d_w_out", "d_mask"), got[1:], want[1:], strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name, **tol)


@pytest.mark.parametrize(
    "shapes,blocks,match",
    [
        (((8, 64), (32, 128), (8,), (8,)), None, "hidden must be"),
        (((8, 64), (64, 128), (8, 1), (8,)), None, "labels must be"),
        (((8, 64), (64, 128), (8,), (4,)), None, "mask must be"),
        (
            ((8, 64), (64, 128), (8,), (8,)),
            CrossEntropyBlockSizes(block_v=100),
            "block_v=100",
        ),
        (
            ((8, 64), (64, 128), (8,), (8,)),
            CrossEntropyBlockSizes(block_d=8),
            "block_d=8",
        ),
    ],
)
def test_invalid_inputs_raise_wrapper_error(shapes, blocks, match):
    h, w, labels, mask = shapes
    with pytest.raises(ValueError, match=match):
        fused_cross_entropy(
            jnp.zeros(h),
            jnp.zeros(w),
            jnp.zeros(labels, jnp.int32),
            jnp.ones(mask),
            block_sizes=blocks,
            interpret=False,
        )


def test_lowers_to_triton_without_full_logits():
    """llama3_8b head: 8192 tokens, d_model 4096, vocab 128256, bf16; lowering only."""
    n, d, v = 8192, 4096, 128256
    args = (
        jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    fwd = lambda h, w, y, m: fused_cross_entropy(h, w, y, m, interpret=False)
    bwd = jax.grad(fwd, argnums=(0, 1))
    for f in (fwd, bwd):
        text = lower_for_h100(f, *args).as_text()
        assert "xla.gpu.triton" in text
        assert f"{n}x{v}" not in text  # no [tokens, vocab] buffer anywhere in the program


def test_compiled_temp_memory_has_no_full_logits_buffer():
    """A 32k-vocabulary loss + gradient: the fused kernel's temp memory stays below one [N, V] fp32
    buffer, the reference's does not (playbook, "Fused Kernels")."""
    n, d, v = 1024, 64, 32768
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32))
    logits_bytes = n * v * 4

    def temp_bytes(loss_fn):
        grad = jax.grad(lambda h, w, y, m: loss_fn(h, w, y, m), argnums=(0, 1))
        return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

    fused, reference = temp_bytes(fused_cross_entropy), temp_bytes(fused_cross_entropy_reference)
    assert fused < logits_bytes <= reference, (fused, reference, logits_bytes)


@pytest.mark.parametrize("vocab_split", [False, True])
def test_vocab_split_over_tensor_matches_reference_without_gathering_the_head(vocab_split):
    """`fused.fused_loss_sum` on data=2 x tensor=2 with the head's vocabulary split over `tensor`:
    loss and gradients equal the single-device reference, and the compiled step gathers no head
    when the kernel combines the per-token log-sum-exp over the axis instead."""
    mesh = mesh_of(data=2, tensor=2)
    b, t, d, v = 4, 16, 32, 264  # 132 per shard: each shard pads its block to the tile
    hidden, w_out, labels, mask = _inputs(b * t, d, v, jnp.float32, False)
    hidden, labels, mask = hidden.reshape(b, t, d), labels.reshape(b, t), mask.reshape(b, t)
    expected = _value_and_grads(lambda h, w, y, m: fused_cross_entropy_reference(
        h.reshape(-1, d), w, y.reshape(-1), m.reshape(-1)), hidden, w_out, labels, mask)
    with jax.set_mesh(mesh):
        h = jax.device_put(hidden, NamedSharding(mesh, P("data")))
        w = jax.device_put(w_out, NamedSharding(mesh, P(None, "tensor")))
        got = _value_and_grads(fused_loss_sum, h, w, labels, mask, vocab_split=vocab_split)
        fn = jax.jit(jax.grad(lambda h, w: fused_loss_sum(h, w, labels, mask, vocab_split=vocab_split), (0, 1)))
        text = fn.lower(h, w).compile().as_text()
    for a, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **F32_TOL)
    gathers = [line for line in text.splitlines() if "all-gather(" in line]
    assert bool(gathers) != vocab_split, gathers
