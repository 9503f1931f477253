"""Collective matmuls (`collective_matmul.py`): the pieces' gathers and scatters give the
einsum's values and gradients, under remat policies that save matmul outputs, and the module runs
them as pieces (one collective per piece, none of the whole activation)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import collective_matmul as cm

COLUMN = "btd,dsn...->btsn..."
ROW = "btf,fd->btd"


def _mesh(sequence: int, tensor: int, data: int):
    axes = ("data", "sequence", "tensor")
    return jax.make_mesh((data, sequence, tensor), axes, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=jax.devices()[:data * sequence * tensor])


# float32 here: a bf16 psum_scatter in a `shard_map` manual over some axes aborts XLA:CPU unless the
# all-reduce-promotion pass is off, as meshtrain's steps compile (`mesh.CPU_COMPILER_OPTIONS`); the
# bf16 model runs are in tests/test_default_dtype.py.
def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (2, 32, 8))  # [B, T, D]
    w = jax.random.normal(k[1], (8, 8, 3, 5))  # [D, s, n, h]: s split over tensor
    h = jax.random.normal(k[2], (2, 32, 16))  # [B, T, F]: F split over tensor
    w2 = jax.random.normal(k[3], (16, 8))
    return x, w, h, w2


def _loss(x, w, h, w2, matmuls):
    gather, scatter = matmuls
    y = gather(COLUMN, x, w)
    z = scatter(ROW, h, w2)
    return jnp.sum(jnp.sin(y) ** 2) + jnp.sum(jnp.cos(z) * z)


POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@pytest.mark.parametrize("sequence, tensor, data", [(1, 4, 2), (2, 4, 1), (1, 8, 1)])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_pieces_equal_the_einsum(sequence, tensor, data, policy):
    x, w, h, w2 = _inputs()
    mesh = _mesh(sequence, tensor, data)
    plain = (jnp.einsum, jnp.einsum)
    want_loss, want_grads = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3))(x, w, h, w2, plain)

    def pieced(x, w, h, w2):
        return _loss(x, w, h, w2, (cm.all_gather_matmul, cm.matmul_reduce_scatter))
    fn = pieced if POLICIES[policy] is None else jax.checkpoint(pieced, policy=POLICIES[policy])
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(
            (x, w, h, w2), (P("data", ("sequence", "tensor")), P(None, "tensor"), P("data", "sequence", "tensor"),
                            P("tensor")), strict=True)]
        loss, grads = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3)))(*placed)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):  # composite: sums over the pieces in their order
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_activation_moves_in_pieces():
    """Over 4 devices the 8 local rows go in 4 pieces: 4 all-gathers to [B=2, 4*2, 8] rather than one
    of the whole [2, 32, 8] activation, and 4 reduce-scatters of [2, 4*2, 8] partial sums (the batch
    stays automatic over `data` inside the manual region)."""
    x, w, h, w2 = _inputs()
    mesh = _mesh(1, 4, 2)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))
        hs = jax.device_put(h, NamedSharding(mesh, P("data", None, "tensor")))
        w2s = jax.device_put(w2, NamedSharding(mesh, P("tensor")))
        text = jax.jit(lambda *a: (cm.all_gather_matmul(COLUMN, a[0], a[1]),
                                   cm.matmul_reduce_scatter(ROW, a[2], a[3]))).lower(xs, ws, hs, w2s).as_text()
    gathers = re.findall(r"all_gather.*?-> tensor<([\dx]+)xf32>", text)
    scatters = re.findall(r"reduce_scatter.*?\(tensor<([\dx]+)xf32>\)", text, flags=re.S)
    assert gathers == ["2x8x8"] * 4, gathers
    assert len(scatters) == 4, scatters
