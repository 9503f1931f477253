"""Collective matmuls: sequence parallelism's gathers and scatters cut into pieces that run beside
the matmul's blocks (playbook, "Sequence Parallelism" and "Tensor Parallelism": overlapping the
all-gather / reduce-scatter of the activations with the column / row parallel GEMMs).

Under Megatron sequence parallelism (`model.sequence_parallel`) the residual stream is split along
the sequence over `tensor`. Each column-parallel matmul (Q/K/V, the MLP's gate and up) needs the
whole sequence: XLA gathers the activation, then multiplies. Each row-parallel matmul (attention's
output, the MLP's down projection) gives a partial sum over `tensor` that XLA reduce-scatters back to
sequence blocks. The next operation waits on each collective, and inside a layer scan there is no
other work for the scheduler to put beside it.

With `model.collective_matmul` both run inside a `shard_map` manual over `tensor` (and `sequence`,
whose blocks the pieces stay within), each device's rows cut into k pieces (k <= |tensor|):

* `all_gather_matmul`: piece j + 1 is all-gathered while the gathered piece j is multiplied; the
  gathered activation is never formed whole.
* `matmul_reduce_scatter`: the partial sums of piece j (device t's rows j, for every t) are
  reduce-scattered while piece j + 1 is multiplied.

An `optimization_barrier` chains the pieces' collectives (the next starts once the previous is
done), so that XLA neither combines them back into one nor runs them all ahead of the matmuls. Same
bytes as the whole collective ((n-1)/n of the activation per device), same FLOPs. The pieces move
by all-gather / reduce-scatter rather than a `ppermute` ring: a collective-permute meets every
device of the program, so inside a branch only some pipeline stages take (1F1B's slots, an uneven
stage's empty-slot `lax.cond`) it would wait forever; the gathers meet only their `tensor` group.
The backward is the pullback of the same pieces (`_manual`): the gather's transpose is the
matmul-then-scatter and the scatter's the gather-then-matmul, again one piece beside one block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from meshtrain.sharding_rules import auto_axes

AXIS = "tensor"
SAVED_NAME = "collective_matmul"  # the outputs: what `selective` remat keeps of them (model.py)


def _tensor_size() -> int:
    """Devices on `tensor` that are still automatic here (0: none to split the pieces over)."""
    return jax.sharding.get_abstract_mesh().shape[AXIS] if auto_axes((AXIS,)) else 0


def _spec(ndim: int, dims: dict[int, tuple[str, ...]]) -> P:
    """A rank-`ndim` spec splitting each dimension of `dims` over its mesh axes."""
    parts = [None] * ndim
    for position, axes in dims.items():
        parts[position] = axes if len(axes) > 1 else (axes[0] if axes else None)
    return P(*parts)


def _context() -> tuple[str, ...]:
    """The automatic `sequence` axis (context parallelism): the residual's length is split over
    (sequence, tensor), sequence-major (`length_sp`); the pieces move within each sequence block."""
    return auto_axes(("sequence",))


def _manual(local, in_specs: tuple[P, P], out_spec: P, axes: set[str]):
    """local(x, w) in a `shard_map` over `axes`, differentiated inside one: the backward is a second
    `shard_map` that runs `local`'s pullback on (x, w), the only residuals. Left to autodiff, the
    partial evaluation of a `shard_map` manual over some axes (remat, the pipeline's stage) emits
    per-device residuals laid out over free axes before manual ones, which Shardy rejects."""
    # Under an enclosing remat policy that saves matmul outputs (`selective`) the body's blocks would
    # become such residuals too: the body keeps none (its output is saved by name, `SAVED_NAME`).
    body = jax.checkpoint(local, policy=jax.checkpoint_policies.nothing_saveable)
    forward = jax.shard_map(body, in_specs=in_specs, out_specs=out_spec, axis_names=axes)

    def pullback(x, w, dy):
        return jax.vjp(local, x, w)[1](dy)

    backward = jax.shard_map(pullback, in_specs=(*in_specs, out_spec), out_specs=in_specs, axis_names=axes)

    @jax.custom_vjp
    def matmul(x, w):
        return forward(x, w)

    def matmul_fwd(x, w):
        return forward(x, w), (x, w)

    def matmul_bwd(residuals, dy):
        return backward(*residuals, dy)

    matmul.defvjp(matmul_fwd, matmul_bwd)
    return lambda x, w: checkpoint_name(matmul(x, w), SAVED_NAME)


def _chunks(rows: int, n: int) -> int:
    """Pieces a device's `rows` are cut into: the largest divisor of `rows` that is at most n."""
    return max(k for k in range(1, n + 1) if rows % k == 0)


def all_gather_matmul(eqn: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(eqn, x, w)` for x [B, T, D] split along T over `tensor` and w [D, s, ...] split along s
    over `tensor` (a column-parallel weight), the output [B, T, s, ...] split along s, in k pieces:
    piece j + 1 is gathered while piece j is multiplied; the whole gathered x is never formed."""
    n = _tensor_size()
    if n <= 1:
        return jnp.einsum(eqn, x, w)

    def local(x, w):
        rows = x.shape[1]
        k = _chunks(rows, n)
        pieces = jnp.split(x, k, axis=1)
        outs, gathered = [], lax.all_gather(pieces[0], AXIS, axis=1, tiled=True)
        for j in range(k):
            if j + 1 < k:  # the next gather starts once this one is done, beside this piece's matmul
                gathered, nxt = lax.optimization_barrier((gathered, pieces[j + 1]))
                following = lax.all_gather(nxt, AXIS, axis=1, tiled=True)
            outs.append(jnp.einsum(eqn, gathered, w))  # rows: device t's piece j, t = 0..n-1
            if j + 1 < k:
                gathered = following
        y = jnp.stack(outs, axis=2)  # [B, n * rows/k, k, ...]: (device, row in piece) x piece
        y = y.reshape(y.shape[0], n, rows // k, k, *y.shape[3:])
        y = jnp.moveaxis(y, 3, 2)  # device, piece, row: the sequence order
        return y.reshape(y.shape[0], n * rows, *y.shape[4:])

    seq = _context()
    return _manual(local, (_spec(x.ndim, {1: (*seq, AXIS)}), _spec(w.ndim, {1: (AXIS,)})),
                   _spec(w.ndim + 1, {1: seq, 2: (AXIS,)}), {AXIS, *seq})(x, w)


def matmul_reduce_scatter(eqn: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(eqn, x, w)` for x [B, T, F, ...] split along dim 2 over `tensor` and w split along its
    dim 0 (a row-parallel weight): the output [B, T, D] summed over `tensor` and split along T, as
    sequence parallelism keeps the residual, in k pieces: piece j is reduce-scattered while piece
    j + 1 is multiplied; the whole partial sum is never formed."""
    n = _tensor_size()
    if n <= 1:
        return jnp.einsum(eqn, x, w)

    def local(x, w):
        rows = x.shape[1] // n  # each device's rows of the result
        k = _chunks(rows, n)
        blocks = x.reshape(x.shape[0], n, k, rows // k, *x.shape[2:])  # device, piece, row
        outs, scattered = [], None
        for j in range(k):
            piece = blocks[:, :, j].reshape(x.shape[0], n * (rows // k), *x.shape[2:])
            part = jnp.einsum(eqn, piece, w)
            if scattered is not None:  # this scatter starts once the previous one is done
                scattered, part = lax.optimization_barrier((scattered, part))
                outs.append(scattered)
            scattered = lax.psum_scatter(part, AXIS, scatter_dimension=1, tiled=True)
        outs.append(scattered)
        return jnp.concatenate(outs, axis=1)

    seq = _context()
    return _manual(local, (_spec(x.ndim, {1: seq, 2: (AXIS,)}), _spec(w.ndim, {0: (AXIS,)})),
                   _spec(3, {1: (*seq, AXIS)}), {AXIS, *seq})(x, w)
