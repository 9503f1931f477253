"""Attention: the plain einsum form, the implementation choice, and the kernel run per shard.

`config.attention.impl`, chosen once, outside traced code (`attention_fn`):

* `xla`:    einsum attention (`xla_attention`), partitioned by XLA.
* `ring`:   context parallelism over `sequence` (`ring_attention.py`, playbook "Context
            Parallelism"); zig-zag layout applied once to the data (`data_permutation`).
            On GPU each ring step's block runs in the Pallas flash kernel (`ring_flash`).
* `pallas`: the Pallas flash kernel (playbook "Flash Attention 1-3") on each device's
            batch / head shard: a Pallas call is a custom call the SPMD partitioner cannot
            split, so it runs inside a `shard_map` over the axes its operands are split on
            (`sharding_rules.per_shard`).

Every implementation has the signature `AttentionFn`: causal, document-masked by segment ids,
grouped-query (G = H / K query heads share a K/V head, never copied).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtrain import ring_attention
from meshtrain.config import BATCH_AXES, require
from meshtrain.pallas_kernels import flash_attention, flash_attention_with_lse
from meshtrain.pallas_kernels.flash_attention import MIN_BLOCK
from meshtrain.sharding_rules import auto_axes, per_shard

# attention_fn(q [B,T,H,Dh], k [B,T,K,Dh], v [B,T,K,Dh], segment_ids [B,T]) -> [B,T,H,Dh], causal.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Causal attention with document masking, written as einsums for XLA.

    Grouped-query attention shares each K/V head with G query heads without copying it.
    Scores and softmax run in float32.
    """
    t = q.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]  # [T,S]
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B,T,S]
    return masked_attention(q, k, v, causal[None] & same_doc)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_segment_ids: jax.Array,
                     start: jax.Array) -> jax.Array:
    """Attention of T new queries (cache slots start..start+T-1) over a KV cache of S slots.

    q [B,T,H,Dh]; k, v [B,S,K,Dh] (the new keys already written); key_segment_ids [B,S]: 0 for
    padding and unwritten slots. A query sees the written, non-padding slots up to its own.
    """
    t, s = q.shape[1], k.shape[1]
    causal = (start + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :]  # [T,S]
    return masked_attention(q, k, v, causal[None] & (key_segment_ids > 0)[:, None, :])


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B,T,H,Dh] over k, v [B,S,K,Dh] where mask [B,T,S] allows;
    scores and softmax in float32."""
    b, t, h, dh = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, dh)  # [B,T,K,G,Dh]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(dh)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, dh)


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Flash attention per (batch shard, head shard): q [B,T,H,Dh], k/v [B,T,K,Dh] -> [B,T,H,Dh]."""
    batch = auto_axes(BATCH_AXES)
    heads = auto_axes(("tensor",))
    x = P(batch or None, None, heads or None, None)
    seg = P(batch or None, None)

    def local(q, k, v, segment_ids):
        return flash_attention(q, k, v, causal=True, segment_ids=segment_ids)
    return per_shard(local, (x, x, x, seg), x, batch + heads)(q, k, v, segment_ids)


def ring(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, zigzag: bool,
         transport: str = "ring", flash: bool = False) -> jax.Array:
    """Ring attention over `sequence` of the current mesh; each step's block in the Pallas flash kernel
    when `flash` (`ring_flash`: on GPU), else in jnp einsums."""
    mesh = jax.sharding.get_abstract_mesh()
    block_fn = flash_attention_with_lse if flash else None
    heads = auto_axes(("tensor",))
    if heads and k.shape[2] % mesh.shape["tensor"]:
        heads = ()  # K/V heads replicated over `tensor`: nothing to keep apart
    return ring_attention.ring_attention(q, k, v, segment_ids, mesh=mesh, zigzag=zigzag, block_fn=block_fn,
                                         transport=transport, heads_axes=heads)


def ring_flash(config: ml_collections.ConfigDict, sizes: dict[str, int], platform: str) -> bool:
    """Whether ring attention computes its blocks with the Pallas flash kernel: compiled for a GPU
    (`platform`: the mesh's devices, not the host's), each block (seq_len / mesh.sequence, halved by
    zig-zag) a whole number of the kernel's smallest tile, and no MoE pipeline stage around it (its
    loop stays type-checked, `pipeline.validate_config`; jnp blocks there)."""
    if config.attention.impl != "ring" or sizes["sequence"] == 1 or platform != "gpu":
        return False
    if config.model.num_experts and sizes["stage"] > 1:
        return False
    block = config.train.seq_len // sizes["sequence"] // (2 if config.attention.zigzag else 1)
    return block >= MIN_BLOCK and block % MIN_BLOCK == 0


def uses_kernels(config: ml_collections.ConfigDict, sizes: dict[str, int], platform: str = "cpu") -> bool:
    """Whether the step runs Pallas kernels, whose manual regions then go unchecked (a pallas_call
    declares no variance): flash attention, the fused RMSNorm or loss, or ring attention's flash blocks
    on a GPU (`ring_flash`)."""
    m = config.model
    named = config.attention.impl == "pallas" or m.fused_norm or m.fused_loss
    return bool(named or ring_flash(config, sizes, platform))


def in_conditional_slots(fn: AttentionFn) -> AttentionFn:
    """`fn` as it must run inside a branch that only some stages take (a 1F1B slot): ring attention
    moves its blocks by all-gather / reduce-scatter instead of collective-permutes."""
    if isinstance(fn, functools.partial) and fn.func is ring:
        return functools.partial(ring, **{**fn.keywords, "transport": "gather"})
    return fn


def attention_fn(config: ml_collections.ConfigDict, flash: bool = False) -> AttentionFn:
    """The attention function of `config.attention.impl`; `flash`: ring attention's blocks in the Pallas
    kernel (`ring_flash`)."""
    impl = config.attention.impl
    if impl == "ring":
        return functools.partial(ring, zigzag=bool(config.attention.zigzag), flash=flash)
    if impl == "pallas":
        return pallas_attention
    return xla_attention


def data_permutation(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> np.ndarray | None:
    """The token order of the data: zig-zag for ring attention over more than one device, else None."""
    if config.attention.impl != "ring" or not config.attention.zigzag or sizes["sequence"] == 1:
        return None
    return ring_attention.zigzag_permutation(config.train.seq_len, sizes["sequence"])


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """Attention rules: ring needs seq_len divisible by 2 x sequence; xla/pallas cannot split the sequence."""
    impl, n, t = config.attention.impl, sizes["sequence"], config.train.seq_len
    require(impl != "ring" or t % (2 * n) == 0, "train.seq_len", t,
            f"ring attention cuts the sequence into 2 x mesh.sequence={2 * n} chunks (zig-zag); they must divide it")
    require(impl == "ring" or n == 1, "attention.impl", impl,
            f"mesh.sequence={n} splits the sequence: only attention.impl='ring' attends across sequence shards")
