"""Context parallelism by all-to-all (DeepSpeed-Ulysses), alone or with a ring across groups (USP).

Playbook, "Context Parallelism": the sequence is split over the N devices of `sequence`. Ulysses
trades that split for a split of the heads around attention: an all-to-all gives each device every
token of the sequence for H / N of the query heads (and K / N of the key/value heads, grouped-query
attention kept intact), attention runs locally on whole sequences, and a second all-to-all returns
the output to the sequence split. Four all-to-alls of activations per layer forward (q, k, v and the
output), their transposes backward; each moves (N-1)/N of its buffer, independent of the ring's N-1
hops of K/V, and needs H and K divisible by N.

Hybrid (ring x Ulysses, USP): `attention.ulysses_degree=U` < N groups U consecutive devices of
`sequence` (inside a node when `sequence` spans nodes: `mesh.dcn_sequence` keeps consecutive indices
in one node) for the all-to-all, and the R = N / U groups form a ring (`ring_attention`): after the
all-to-all, device (g, j) holds the tokens of group g for head slice j, and the devices at slice j
of every group pass those blocks round (zig-zag over R when `attention.zigzag`: the data's token
order is `zigzag_permutation(T, R)`, applied once, so that group g holds ring chunks g and 2R-1-g).

Shapes: q [B, L, H, D] with L = T / N tokens of this device; after the all-to-all [B, U L, H / U, D].
When `tensor` splits the heads, each all-to-all runs per head shard (a region manual over `tensor`
around the collective alone, `ring_attention.per_head_shard`), so it splits this device's heads
(H / tensor) further and never moves heads across `tensor`; attention between them stays automatic
over `tensor`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain.config import Axis, require
from meshtrain.pallas_kernels import flash_attention_with_lse
from meshtrain.parallel import ring_attention
from meshtrain.sharding_rules import auto_axes

SEQUENCE, TENSOR = Axis.SEQUENCE.value, Axis.TENSOR.value


def degree(ulysses_degree: int, sequence: int) -> int:
    """The all-to-all group size: `attention.ulysses_degree`, 0 meaning the whole `sequence` axis."""
    return sequence if ulysses_degree == 0 else ulysses_degree


def groups(n: int, u: int) -> list[list[int]] | None:
    """The all-to-all groups along `sequence`: U consecutive devices each (None: the whole axis)."""
    return [[g * u + j for j in range(u)] for g in range(n // u)] if u < n else None


def heads_split(kv_heads: int, tensor: int) -> int:
    """How many ways `tensor` splits the key/value heads (1 when they are replicated over it)."""
    return tensor if kv_heads % tensor == 0 else 1


def _local(q, k, v, seg, *, n: int, u: int, zigzag: bool, block, transport: str, heads: tuple[str, ...]):
    """Per device: all-to-all to whole-group sequences, attention (a ring of n / u across groups, or
    local), all-to-all back. q [B, L, H, D], k / v [B, L, K, D], seg [B, L] -> [B, L, H, D]."""
    grouped = groups(n, u)

    def exchange(split: int, concat: int):
        def move(*xs):
            return tuple(lax.all_to_all(x, SEQUENCE, split, concat, tiled=True, axis_index_groups=grouped) for x in xs)
        return move if not heads else (
            lambda *xs: ring_attention.per_head_shard(move, heads, (2,) * len(xs), (2,) * len(xs),
                                                      block.vma_checked)(*xs))

    q, k, v = exchange(2, 1)(q, k, v)  # [B, U L, H / U, D]
    seg = lax.all_gather(seg, SEQUENCE, axis=1, tiled=True, axis_index_groups=grouped)  # [B, U L]
    r = n // u
    scale = 1.0 / math.sqrt(q.shape[-1])
    attend = ring_attention.make_local_attention(r, SEQUENCE, zigzag and r > 1, scale, block, transport, group=u)
    (out,) = exchange(1, 2)(attend(q, k, v, seg))
    return out


def ulysses_attention(q, k, v, segment_ids, *, mesh, ulysses_degree: int = 0, zigzag: bool = True,
                      block_fn=None, transport: str = "ring", heads_axes: tuple[str, ...] = ()):
    """Causal, document-masked, grouped-query attention over `sequence` by all-to-all (module docstring).

    Args:
      q: [B, T_seq, H, D]; k, v: [B, T_seq, K, D]; segment_ids [B, T_seq] (T split over `sequence`).
      mesh: the (abstract) mesh holding `sequence`.
      ulysses_degree: devices per all-to-all group, dividing mesh.sequence; 0 is all of them (no ring).
      zigzag: the data's token order is `zigzag_permutation(T, mesh.sequence / ulysses_degree)` (used
        only with a ring: R > 1).
      block_fn: the local attention (`ring_attention` block functions; None: jnp).
      transport: the ring's ("ring" or "gather", `ring_attention.ring_attention`).
      heads_axes: automatic axes that split the heads: the all-to-alls run per head shard.

    Returns:
      [B, T_seq, H, D] in the input's token order, dtype of q.
    """
    n = mesh.shape[SEQUENCE]
    u = degree(ulysses_degree, n)
    split = math.prod(mesh.shape[a] for a in heads_axes)
    h, kv = q.shape[2] // split, k.shape[2] // split
    if n % u or h % u or kv % u:
        raise ValueError(f"Ulysses over {u} of mesh.sequence={n} devices needs them to divide it and the "
                         f"{h} query / {kv} key-value heads of a device (heads split {split} ways over {heads_axes})")
    block = ring_attention.resolve_block_fn(block_fn)
    local = functools.partial(_local, n=n, u=u, zigzag=zigzag, block=block, transport=transport,
                              heads=tuple(a for a in heads_axes if mesh.shape[a] > 1))
    seg = segment_ids.astype(jnp.int32)
    if SEQUENCE in getattr(mesh, "manual_axes", ()):  # the enclosing region (a pipeline stage) is manual over it
        return local(q, k, v, seg)
    x_spec, seg_spec = P(None, SEQUENCE, None, None), P(None, SEQUENCE)
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, seg_spec), out_specs=x_spec,
                         axis_names={SEQUENCE}, check_vma=block.vma_checked)(q, k, v, seg)


def ulysses(q, k, v, segment_ids, *, ulysses_degree: int, zigzag: bool, transport: str = "ring",
            flash: bool = False):
    """Ulysses (and ring x Ulysses) as the model calls attention (`attention.AttentionFn`), over
    `sequence` of the current mesh: the local attention in the Pallas flash kernel when `flash`
    (`layout.ring_flash`: on GPU), else jnp; the heads split over `tensor` when they divide it."""
    mesh = jax.sharding.get_abstract_mesh()
    heads = auto_axes((TENSOR,))
    if heads and heads_split(k.shape[2], mesh.shape[TENSOR]) == 1:
        heads = ()
    return ulysses_attention(q, k, v, segment_ids, mesh=mesh, ulysses_degree=ulysses_degree, zigzag=zigzag,
                             block_fn=flash_attention_with_lse if flash else None, transport=transport,
                             heads_axes=heads)


def validate_config(config, sizes: dict[str, int]) -> None:
    """Ulysses rules (gathered by `meshtrain.validate`); raises ConfigError: the group divides
    mesh.sequence and a device's query and key/value heads; the sequence divides into its pieces."""
    att = config.attention
    require(isinstance(att.ulysses_degree, int) and att.ulysses_degree >= 0, "attention.ulysses_degree",
            att.ulysses_degree, "must be 0 (all of mesh.sequence) or a positive integer")
    if att.impl != "ulysses":
        return
    n = sizes[SEQUENCE]
    u = degree(att.ulysses_degree, n)
    require(n % u == 0, "attention.ulysses_degree", att.ulysses_degree, f"must divide mesh.sequence={n}")
    m = config.model
    split = heads_split(m.n_kv_heads, sizes[TENSOR])
    for key, heads in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads)):
        require((heads // split) % u == 0, key, heads,
                f"Ulysses gives each of the {u} devices of a group an equal share of a device's {heads // split} "
                f"heads (split {split} way(s) over mesh.tensor): must be divisible by {u * split}")
    rings = n // u
    chunks = n * (2 if att.zigzag and rings > 1 else 1)
    require(config.train.seq_len % chunks == 0, "train.seq_len", config.train.seq_len,
            f"Ulysses over mesh.sequence={n}" + (f" (a zig-zag ring of {rings} groups)" if chunks > n else "")
            + f" cuts the sequence into {chunks} pieces: they must divide it")
