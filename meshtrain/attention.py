"""Choosing the attention implementation and the fused kernels once, outside traced code.

`config.attention.impl`:

* `xla`:    einsum attention (`model.xla_attention`), partitioned by XLA.
* `ring`:   context parallelism over `sequence` (`ring_attention.py`, playbook "Context
            Parallelism"); zig-zag layout applied once to the data (`data_permutation`).
            On GPU each ring step's block runs in the Pallas flash kernel.
* `pallas`: the Pallas flash kernel (playbook "Flash Attention 1-3") on each device's
            batch / head shard.

A Pallas call is a custom call the SPMD partitioner cannot split, so every kernel runs
inside a `jax.shard_map` over the mesh axes its operands are split on (`_kernel_map`):
the batch axes and, for attention, `tensor` (heads). Inside an enclosing manual region
(the gradient-accumulation loop) only the axes still automatic are mapped.
"""

from __future__ import annotations

import functools

import jax
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain import config as config_lib, model as model_lib, ring_attention
from meshtrain.mesh import BATCH_AXES


def _auto_axes(names: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of `names` that are > 1 and still automatic in the current (abstract) mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in names if mesh.shape.get(a, 1) > 1 and a not in manual)


def _kernel_map(fn, in_specs, out_specs, axes):
    """shard_map over `axes` (check_vma off: a pallas_call does not declare how its outputs vary)."""
    if not axes:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes), check_vma=False)


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Flash attention per (batch shard, head shard): q [B,T,H,Dh], k/v [B,T,K,Dh] -> [B,T,H,Dh]."""
    from meshtrain.pallas_kernels import flash_attention

    batch = _auto_axes(BATCH_AXES)
    heads = _auto_axes(("tensor",))
    x = P(batch or None, None, heads or None, None)
    seg = P(batch or None, None)

    def local(q, k, v, segment_ids):
        return flash_attention(q, k, v, causal=True, segment_ids=segment_ids)
    return _kernel_map(local, (x, x, x, seg), x, batch + heads)(q, k, v, segment_ids)


def ring(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, zigzag: bool) -> jax.Array:
    """Ring attention over `sequence` of the current mesh; the Pallas flash block on GPU."""
    block_fn = None
    if jax.default_backend() == "gpu":
        from meshtrain.pallas_kernels import flash_attention_with_lse
        block_fn = flash_attention_with_lse
    return ring_attention.ring_attention(q, k, v, segment_ids, mesh=jax.sharding.get_abstract_mesh(),
                                         zigzag=zigzag, block_fn=block_fn)


def make_attention_fn(config: ml_collections.ConfigDict) -> model_lib.AttentionFn:
    """The attention function of `config.attention.impl`."""
    impl = config.attention.impl
    if impl == "ring":
        return functools.partial(ring, zigzag=bool(config.attention.zigzag))
    if impl == "pallas":
        return pallas_attention
    return model_lib.xla_attention


def fused_rms_norm(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    """Pallas RMSNorm on each device's rows: x [B,T,D] split over batch / sequence (/ tensor under SP)."""
    from meshtrain.pallas_kernels import rms_norm

    batch = _auto_axes(BATCH_AXES)
    length = _auto_axes(("sequence", "tensor"))
    spec = P(batch or None, length or None, None)

    def local(x, weight):
        return rms_norm(x, weight, eps=eps)
    return _kernel_map(local, (spec, P()), spec, batch + length)(x, weight)


def fused_loss_sum(hidden: jax.Array, w_out: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Pallas output projection + cross-entropy summed over tokens: hidden [B,T,D], w_out [D,V] whole."""
    from meshtrain.pallas_kernels import fused_cross_entropy

    rows = _auto_axes(BATCH_AXES + ("sequence",))
    row_spec = P(rows or None)
    d = hidden.shape[-1]

    def local(hidden, w_out, targets, mask):
        loss = fused_cross_entropy(hidden, w_out, targets, mask)
        return jax.lax.psum(loss, rows) if rows else loss
    return _kernel_map(local, (row_spec, P(), row_spec, row_spec), P(), rows)(
        hidden.reshape(-1, d), w_out, targets.reshape(-1), mask.reshape(-1))


def data_permutation(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> np.ndarray | None:
    """The token order of the data: zig-zag for ring attention over more than one device, else None."""
    if config.attention.impl != "ring" or not config.attention.zigzag or sizes["sequence"] == 1:
        return None
    return ring_attention.zigzag_permutation(config.train.seq_len, sizes["sequence"])


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """Attention rules: ring needs seq_len divisible by 2 x sequence; xla/pallas cannot split the sequence."""
    impl, n, t = config.attention.impl, sizes["sequence"], config.train.seq_len
    if impl == "ring" and t % (2 * n):
        raise config_lib.ConfigError(
            "train.seq_len", t,
            f"ring attention cuts the sequence into 2 x mesh.sequence={2 * n} chunks (zig-zag); they must divide it")
    if impl != "ring" and n > 1:
        raise config_lib.ConfigError(
            "attention.impl", impl,
            f"mesh.sequence={n} splits the sequence: only attention.impl='ring' attends across sequence shards")

