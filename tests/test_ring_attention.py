"""Ring attention equals dense causal document-masked attention, value and gradient."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.pallas_kernels.flash_attention import flash_attention_with_lse
from meshtrain.parallel import ring_attention as ra
from tests.utils import mesh_of

AXES = ("data", "stage", "fsdp", "expert", "sequence", "tensor")
B, D = 2, 8
RTOL = 1e-5


def make_mesh(sequence: int, data: int = 1, tensor: int = 1) -> jax.sharding.Mesh:
    return mesh_of(sequence=sequence, data=data, tensor=tensor)


def make_inputs(t: int, h: int, kh: int, seed: int = 0, docs: np.ndarray | None = None):
    """q [B,T,H,D], k/v [B,T,K,D], ct (output cotangent) and packed-document segment ids."""
    rng = np.random.RandomState(seed)
    q, k, v, ct = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((B, t, h, D), (B, t, kh, D), (B, t, kh, D), (B, t, h, D))
    )
    if docs is None:  # row 0: documents of random lengths; row 1: one document
        cuts = np.sort(rng.choice(np.arange(1, t), 3, replace=False))
        docs = np.stack([np.searchsorted(cuts, np.arange(t), side="right"), np.zeros(t, int)])
    return q, k, v, ct, jnp.asarray(docs, jnp.int32)


def value_and_grads(attn, q, k, v, ct):
    """(out, (dq, dk, dv)) of `attn` for the output cotangent ct, in one jit."""

    def run(q, k, v, ct):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(ct)

    return jax.jit(run)(q, k, v, ct)


@jax.jit
def dense_value_and_grads(q, k, v, seg, ct):
    out, vjp = jax.vjp(lambda *x: ra.dense_attention_reference(*x, seg), q, k, v)
    return out, vjp(ct)


def assert_close(actual, expected):
    # atol: rounding errors of float32 sums scale with the magnitude of the summed
    # terms, not with the (possibly cancelled, near-zero) result, so entries near 0
    # need an absolute floor at the array's own scale: 1e-5 * max|expected|.
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.all(np.isfinite(np.asarray(a)))
        chex.assert_trees_all_close(a, e, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(e))))


def check_against_dense(mesh, t, h, kh, zigzag, shard=None, docs=None, block_fn=None, transport="ring"):
    """Ring attention on `mesh` (inputs in the layout's token order) vs the dense reference."""
    q, k, v, ct, seg = make_inputs(t, h, kh, docs=docs)
    n = mesh.shape["sequence"]
    perm = ra.zigzag_permutation(t, n) if zigzag else np.arange(t)
    inv = ra.inverse_permutation(perm)
    with jax.set_mesh(mesh):
        q_p, k_p, v_p, ct_p = (x[:, perm] for x in (q, k, v, ct))
        seg_p = seg[:, perm]
        if shard is not None:
            q_p, k_p, v_p, ct_p = (jax.device_put(x, shard) for x in (q_p, k_p, v_p, ct_p))

        def attn(q_, k_, v_):
            return ra.ring_attention(
                q_, k_, v_, seg_p, mesh=mesh, zigzag=zigzag, block_fn=block_fn, transport=transport
            )

        out, grads = value_and_grads(attn, q_p, k_p, v_p, ct_p)
    ref_out, ref_grads = dense_value_and_grads(q, k, v, seg, ct)
    assert_close((out[:, inv], *(g[:, inv] for g in grads)), (ref_out, *ref_grads))
    return out


@pytest.mark.parametrize("sequence", [2, 4, 8])
@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize(("h", "kh"), [(4, 2), (4, 1)])
def test_matches_dense(sequence, zigzag, h, kh):
    check_against_dense(make_mesh(sequence), t=32, h=h, kh=kh, zigzag=zigzag)


@pytest.mark.parametrize("sequence", [2, 4])
@pytest.mark.parametrize("zigzag", [True, False])
def test_gather_transport_matches_the_ring(sequence, zigzag):
    """transport="gather" (all-gather / reduce-scatter, for 1F1B slots) visits the same blocks in the
    same order: equal to the ring's output and gradients, and to the dense reference."""
    mesh = make_mesh(sequence)
    ring = check_against_dense(mesh, t=32, h=4, kh=2, zigzag=zigzag)
    gathered = check_against_dense(mesh, t=32, h=4, kh=2, zigzag=zigzag, transport="gather")
    np.testing.assert_allclose(np.asarray(gathered), np.asarray(ring), rtol=1e-6, atol=1e-7)


def test_matches_dense_on_data_sequence_tensor_mesh():
    mesh = make_mesh(sequence=2, data=2, tensor=2)
    shard = NamedSharding(mesh, P("data", "sequence", "tensor", None))
    out = check_against_dense(mesh, t=32, h=4, kh=2, zigzag=True, shard=shard)
    assert out.sharding.is_equivalent_to(shard, 4)


def test_composes_without_extra_collectives_on_data_sequence_tensor_mesh():
    """Batch over data and heads over tensor stay local: only the K/V ring moves."""
    mesh = make_mesh(sequence=2, data=2, tensor=2)
    shard = NamedSharding(mesh, P("data", "sequence", "tensor", None))
    q, k, v, _, seg = make_inputs(32, 4, 2)
    with jax.set_mesh(mesh):
        q, k, v = (jax.device_put(x, shard) for x in (q, k, v))
        seg = jax.device_put(seg, NamedSharding(mesh, P("data", "sequence")))
        hlo = jax.jit(lambda *a: ra.ring_attention(*a, mesh=mesh)).lower(q, k, v, seg)
        text = hlo.compile().as_text()
    assert not re.search(r"all-gather|all-reduce|all-to-all|reduce-scatter", text)
    assert "collective-permute(" in text


def test_sequence_one_is_local_attention():
    mesh = make_mesh(sequence=1, data=8)
    for zigzag in (True, False):
        check_against_dense(mesh, t=32, h=4, kh=2, zigzag=zigzag)
    q, k, v, _, seg = make_inputs(32, 4, 2)
    with jax.set_mesh(mesh):
        text = jax.jit(lambda *a: ra.ring_attention(*a, mesh=mesh)).lower(q, k, v, seg)
        assert "collective-permute" not in text.compile().as_text()


def test_fully_masked_blocks_give_no_nans():
    """Every zig-zag chunk its own document: all off-diagonal blocks are fully masked."""
    t, n = 32, 4
    docs = np.tile(np.arange(t) // (t // (2 * n)), (B, 1))
    check_against_dense(make_mesh(n), t=t, h=4, kh=2, zigzag=True, docs=docs)
    check_against_dense(make_mesh(n), t=t, h=4, kh=2, zigzag=False, docs=docs)


def test_plain_callable_block_fn_uses_vjp_backward():
    """A forward-only block_fn (like the Pallas kernel) gets its backward from jax.vjp."""
    check_against_dense(
        make_mesh(4), t=32, h=4, kh=2, zigzag=True, block_fn=ra.block_attention_forward
    )


@pytest.mark.parametrize("zigzag", [True, False])
def test_kv_chunked_jnp_block(zigzag):
    """K/V walked in chunks of 4 rows inside each 16-row block (8-row zig-zag halves)."""
    block = ra.jnp_block_attention(kv_chunk=4)
    check_against_dense(make_mesh(2), t=32, h=4, kh=2, zigzag=zigzag, block_fn=block)


def test_flash_kernel_block_fn():
    """The Pallas flash kernel (interpret mode on CPU) plugs in as the block computation."""
    # Zig-zag half blocks are T / (2N) = 16 rows: the kernel tiles are powers of two >= 16.
    check_against_dense(make_mesh(2), t=64, h=4, kh=2, zigzag=True, block_fn=flash_attention_with_lse)


def _moved(hlo_text: str) -> list[tuple[str, int]]:
    """(dtype, elements) of every collective-permute payload in compiled HLO."""
    moved = []
    for line in hlo_text.splitlines():
        if " collective-permute(" not in line or "=" not in line:
            continue
        result_type = line.split("=", 1)[1].split("collective-permute(")[0]
        for dtype, dims in re.findall(r"([a-z]+\d+)\[([\d,]*)\]", result_type):
            moved.append((dtype, int(np.prod([int(x) for x in dims.split(",") if x]))))
    return moved


@pytest.mark.parametrize("zigzag", [True, False])
def test_ring_moves_n_minus_1_kv_blocks_forward(zigzag):
    n, t, h, kh = 4, 64, 4, 2
    mesh = make_mesh(n)
    q, k, v, _, seg = make_inputs(t, h, kh)
    block = B * (t // n) * kh * D  # elements of one local K (or V) block
    with jax.set_mesh(mesh):

        def attn(*args):
            return ra.ring_attention(*args, mesh=mesh, zigzag=zigzag)

        def loss(*args):
            return jnp.sum(attn(*args))

        fwd = _moved(jax.jit(attn).lower(q, k, v, seg).compile().as_text())
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg).compile()
        both = _moved(step.as_text())
    kv_f32 = sum(e for dt, e in fwd if dt == "f32")
    seg_s32 = sum(e for dt, e in fwd if dt == "s32")
    # N - 1 transfers of one K and one V block (+ their segment ids), nothing else.
    assert kv_f32 == (n - 1) * 2 * block
    assert seg_s32 == (n - 1) * B * (t // n)
    assert all(e <= 2 * block for dt, e in fwd if dt == "f32")
    assert sum(1 for dt, _ in fwd if dt == "f32") in (n - 1, 2 * (n - 1))
    # Forward + backward: K/V ring twice (N - 1 each) and dK/dV home in N hops.
    assert sum(e for dt, e in both if dt == "f32") == (2 * (n - 1) + n) * 2 * block
    assert sum(e for dt, e in both if dt == "s32") == 2 * (n - 1) * B * (t // n)


def test_residuals_are_local_blocks():
    """Saved for backward: local q, k, v, segment ids, out and lse; nothing O(T) or O(T^2)."""
    n, t, h, kh = 4, 64, 4, 2
    mesh = make_mesh(n)
    q, k, v, _, seg = make_inputs(t, h, kh)
    with jax.set_mesh(mesh):
        shard = NamedSharding(mesh, P(None, "sequence"))
        q, k, v, seg = (jax.device_put(x, shard) for x in (q, k, v, seg))

        def residuals(q, k, v, seg):
            return jax.vjp(lambda *x: ra.ring_attention(*x, seg, mesh=mesh), q, k, v)[1]

        vjp = jax.jit(residuals)(q, k, v, seg)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(vjp))
    local = t // n
    expected = 4 * B * local * (2 * h * D + 2 * kh * D + 1 + h)  # q,out,k,v f32; seg i32; lse f32
    assert per_device == expected


def test_step_memory_grows_linearly_in_sequence_length():
    """Compiled fwd+bwd temp bytes at 4x the length: 4x with K/V chunks (16x would be quadratic)."""
    mesh, block = make_mesh(2), ra.jnp_block_attention(kv_chunk=16)

    def temp_bytes(t):
        shard = NamedSharding(mesh, P(None, "sequence"))
        shapes = ((1, t, 2, D, jnp.float32), (1, t, 1, D, jnp.float32), (1, t, 1, D, jnp.float32), (1, t, jnp.int32))
        args = [jax.ShapeDtypeStruct(s[:-1], s[-1], sharding=shard) for s in shapes]

        def loss(*a):
            return jnp.sum(ra.ring_attention(*a, mesh=mesh, block_fn=block))

        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(1024) <= 4.5 * temp_bytes(256)


def test_zigzag_permutation_layout():
    perm = ra.zigzag_permutation(8, 2)
    np.testing.assert_array_equal(perm, [0, 1, 6, 7, 2, 3, 4, 5])
    x = np.arange(48).reshape(2, 24)
    perm = ra.zigzag_permutation(24, 3)
    np.testing.assert_array_equal(x[:, perm][:, ra.inverse_permutation(perm)], x)
    with pytest.raises(ValueError, match=r"seq_len=20 must be divisible by 2 \* n = 8"):
        ra.zigzag_permutation(20, 4)


def test_zigzag_balances_causal_work():
    zig = ra.causal_pairs_per_device(64, 4, zigzag=True)
    contiguous = ra.causal_pairs_per_device(64, 4, zigzag=False)
    assert zig.sum() == contiguous.sum() == 64 * 65 // 2
    assert np.all(zig == zig[0])
    np.testing.assert_array_equal(contiguous, [136, 392, 648, 904])  # 1 : 2.9 : 4.8 : 6.6


def test_bad_inputs_raise():
    mesh = make_mesh(4)
    q, k, v, _, seg = make_inputs(20, 4, 2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"T=20 must be divisible by 2 \*"):
        ra.ring_attention(q, k, v, seg, mesh=mesh)
    q3, k3, v3, _, seg = make_inputs(32, 4, 3)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="H divisible by K"):
        ra.ring_attention(q3, k3, v3, seg, mesh=mesh)
