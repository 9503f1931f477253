"""The fused Pallas kernels inside the mesh: RMSNorm and the output projection + cross-entropy.

Playbook, "Fused Kernels". The kernels (`pallas_kernels/`) know no mesh; here each runs on every
device's block of rows, inside a `shard_map` over the axes the rows are split on
(`sharding_rules.per_shard`); inside an enclosing manual region only the axes still automatic
are mapped. `model.fused_norm` and `model.fused_loss` switch them on.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from meshtrain.config import BATCH_AXES
from meshtrain.pallas_kernels import fused_cross_entropy, rms_norm
from meshtrain.sharding_rules import auto_axes, per_shard


def fused_rms_norm(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    """Pallas RMSNorm on each device's rows: x [B,T,D] split over batch / sequence (/ tensor under SP)."""
    batch = auto_axes(BATCH_AXES)
    length = auto_axes(("sequence", "tensor"))
    spec = P(batch or None, length or None, None)

    def local(x, weight):
        return rms_norm(x, weight, eps=eps)
    return per_shard(local, (spec, P()), spec, batch + length)(x, weight)


def fused_loss_sum(hidden: jax.Array, w_out: jax.Array, targets: jax.Array, mask: jax.Array, *,
                   vocab_split: bool = False) -> jax.Array:
    """Pallas output projection + cross-entropy summed over tokens: hidden [B,T,D], w_out [D,V].

    Each device runs the kernel on its rows. When `vocab_split` (the head's vocabulary rests split
    over `tensor`) each device also keeps its vocabulary block and the kernel combines the per-token
    log-sum-exp over `tensor`: per token two floats cross the axis instead of the [D, V] head.
    """
    rows = auto_axes(BATCH_AXES + ("sequence",))
    vocab = auto_axes(("tensor",)) if vocab_split else ()
    row_spec = P(rows or None)
    d = hidden.shape[-1]

    def local(hidden, w_out, targets, mask):
        loss = fused_cross_entropy(hidden, w_out, targets, mask, vocab_axis=vocab[0] if vocab else None)
        return jax.lax.psum(loss, rows) if rows else loss
    return per_shard(local, (row_spec, P(None, vocab or None), row_spec, row_spec), P(), rows + vocab)(
        hidden.reshape(-1, d), w_out, targets.reshape(-1), mask.reshape(-1))
