"""Attention on one device's view: the plain einsum form and the flash kernel run per shard.

`config.attention.impl`, chosen once, outside traced code (`parallel.layout.attention_fn`):

* `auto`:   the default: `cudnn` on an NVIDIA GPU where cuDNN serves the model, else `xla`
            (`config.attention_impl`, decided in the layout plan from the mesh's devices).
* `xla`:    einsum attention (`xla_attention`), partitioned by XLA; its scores in float32 or, with
            `attention.scores_dtype=compute`, in the compute dtype (playbook "Mixed Precision Training":
            low-precision storage, float32 accumulation in the softmax).
* `cudnn`:  cuDNN's fused flash attention (`cudnn_attention`, playbook "Flash Attention 1-3") on each
            device's batch / head shard, as `pallas` below.
* `ring`:   context parallelism over `sequence` (`parallel/ring_attention.py`, playbook "Context
            Parallelism"); zig-zag layout applied once to the data (`layout.data_permutation`).
            On GPU each ring step's block runs in the Pallas flash kernel (`layout.ring_flash`).
* `pallas`: the Pallas flash kernel (playbook "Flash Attention 1-3") on each device's
            batch / head shard: a Pallas call is a custom call the SPMD partitioner cannot
            split, so it runs inside a `shard_map` over the axes its operands are split on
            (`sharding_rules.per_shard`).

Every implementation has the signature `AttentionFn`: causal, document-masked by segment ids,
grouped-query (G = H / K query heads share a K/V head, never copied).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec as P

from meshtrain import config as config_lib
from meshtrain.config import BATCH_AXES, CONTEXT_PARALLEL_IMPLS, require
from meshtrain.pallas_kernels import flash_attention, runs_are_documents
from meshtrain.pallas_kernels.flash_attention import MIN_BLOCK
from meshtrain.sharding_rules import auto_axes, per_shard

# attention_fn(q [B,T,H,Dh], k [B,T,K,Dh], v [B,T,K,Dh], segment_ids [B,T]) -> [B,T,H,Dh], causal.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _causal(query_index: jax.Array, key_index: jax.Array, window: int) -> jax.Array:
    """[T,S]: key at or before the query, and (window > 0) fewer than `window` tokens back."""
    offset = query_index[:, None] - key_index[None, :]
    return (offset >= 0) & (offset < window) if window else offset >= 0


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, window: int = 0,
                  scores_dtype: str = "float32") -> jax.Array:
    """Causal attention with document masking, written as einsums for XLA; `window` > 0 limits each
    query to its `window` latest keys (sliding-window attention, Mistral v0.1).

    Grouped-query attention shares each K/V head with G query heads without copying it.
    Scores in float32, or in q's dtype (`scores_dtype="compute"`); the softmax in float32.
    """
    t = q.shape[1]
    causal = _causal(jnp.arange(t), jnp.arange(t), window)  # [T,S]
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B,T,S]
    return masked_attention(q, k, v, causal[None] & same_doc, scores_dtype)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_segment_ids: jax.Array,
                     start: jax.Array, window: int = 0) -> jax.Array:
    """Attention of T new queries (cache slots start..start+T-1) over a KV cache of S slots.

    q [B,T,H,Dh]; k, v [B,S,K,Dh] (the new keys already written); key_segment_ids [B,S]: 0 for
    padding and unwritten slots. A query sees the written, non-padding slots up to its own (the
    `window` latest of them when > 0).
    """
    t, s = q.shape[1], k.shape[1]
    causal = _causal(start + jnp.arange(t), jnp.arange(s), window)  # [T,S]
    return masked_attention(q, k, v, causal[None] & (key_segment_ids > 0)[:, None, :])


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     scores_dtype: str = "float32") -> jax.Array:
    """Grouped-query attention of q [B,T,H,Dh] over k, v [B,S,K,Dh] where mask [B,T,S] allows;
    scores in float32 (or, `scores_dtype="compute"`, in q's dtype: the GEMM still accumulates in
    float32 and rounds once as it writes them), softmax in float32."""
    b, t, h, dh = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, dh)  # [B,T,K,G,Dh]
    # The scores stay in the layout the batched GEMM writes them, [B,K,T,G,S] (batch dims, then the
    # query's free dims in their order, then the key's): the mask's select, the softmax and the second
    # GEMM read them there, the [B,T,S] mask broadcast inside the select's fusion; no transpose of the
    # scores is ever written (`[B,K,G,T,S]` cost three).
    if scores_dtype == "compute":  # the scale on q (exact for a power-of-two head dim), scores as written
        scores = jnp.einsum("btkgd,bskd->bktgs", q * jnp.asarray(1 / math.sqrt(dh), q.dtype), k,
                            preferred_element_type=q.dtype)
    else:
        scores = jnp.einsum("btkgd,bskd->bktgs", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(dh)
    scores = jnp.where(mask[:, None, :, None, :], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = jnp.einsum("bktgs,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, dh)


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Flash attention per (batch shard, head shard): q [B,T,H,Dh], k [B,T,K,Dh], v [B,T,K,Dv] -> [B,T,H,Dv]."""
    batch = auto_axes(BATCH_AXES)
    heads = auto_axes(("tensor",))
    x = P(batch or None, None, heads or None, None)
    seg = P(batch or None, None)

    def local(q, k, v, segment_ids):
        return flash_attention(q, k, v, causal=True, segment_ids=segment_ids)
    return per_shard(local, (x, x, x, seg), x, batch + heads)(q, k, v, segment_ids)


def takes_narrow_values(fn: AttentionFn) -> bool:
    """Whether attention function `fn` takes values narrower than its queries and keys as they are (multi-head
    latent attention's 128 beside 192): the Pallas flash kernel, whose value tiles are their own width. The
    others take one head width, so the values come padded to it."""
    return fn is pallas_attention


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                    max_documents: int = 32) -> jax.Array:
    """cuDNN's fused attention per (batch shard, head shard): q [B,T,H,Dh], k/v [B,T,K,Dh] -> [B,T,H,Dh].

    Grouped-query K/V go to cuDNN as they are (its GQA reads each K/V head for its G query heads).
    Document masking, one branch a step picked on the device (`document_branches`), so every branch stays
    exact for any segment ids: where every row of the shard is one document (or padding alone), cuDNN's
    causal call alone, which skips the tiles above the diagonal; where each row holds at most
    `max_documents` runs of ids (`attention.max_documents`: its documents, the padding at its end one
    more), each a document of its own (`document_runs`), on a Hopper or later GPU,
    cuDNN's packed call (its THD layout: each document's offset and length, causal inside it, so a tile
    that crosses no document of its query is never computed: work proportional to the documents' squares,
    not the row's); otherwise (more documents, an id recurring, or an older GPU), from head dim
    `PALLAS_DOCUMENTS_MIN_HEAD_DIM` on the Pallas flash kernel with the segment ids, below it cuDNN's call
    with the document mask as a [B,1,T,S] additive bias (its only arbitrary mask).
    """
    batch = auto_axes(BATCH_AXES)
    heads = auto_axes(("tensor",))
    x = P(batch or None, None, heads or None, None)
    seg = P(batch or None, None)
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    # every axis still automatic, size 1 included: JAX's cuDNN call partitions itself (custom
    # partitioning), which fails in a region manual over only some axes (the accumulation and pipeline
    # loops); in a fully manual region there is nothing left to partition
    rest = tuple(a for a in mesh.axis_names if a not in manual) if not mesh.empty else ()
    local = functools.partial(_cudnn_local, max_documents=max_documents if cudnn_packs_documents() else 0)
    return per_shard(local, (x, x, x, seg), x, rest)(q, k, v, segment_ids)


# From this head dim on, rows of several documents go to the Pallas flash kernel, which masks documents
# by their segment ids, instead of cuDNN with the mask as a bias (whose backward always computes the
# bias's gradient). Measured on an H200 at 1 x 8,192 tokens, 32/8 heads of 128, causal (bench/kernels.py,
# calls queued back to back, 2026-11-27): cuDNN with the bias 26% / 21% of the bf16 peak forward /
# forward + backward, the Pallas kernel with its default tiles 40% / 35%; at head dim 64 (the runbook's
# shape) the two are within 10% of each other in the step's profile, and cuDNN keeps it.
PALLAS_DOCUMENTS_MIN_HEAD_DIM = 128

# `cudnn_attention`'s branches, in `lax.switch` order: the kernel model (`plan.kernel_model.kernels`) prices a step of
# one-document rows by the first and a step of packed rows by the second (the third takes rows past
# `attention.max_documents`).
DOCUMENT_BRANCHES = ("one_document", "packed", "past_limit")


def cudnn_packs_documents() -> bool:
    """Whether cuDNN's packed (THD) call serves here: JAX's own test, a Hopper or later GPU (an
    ahead-of-time compile answers it for its target: `meshtrain.aot.target_devices`)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
        return bool(cudnn.check_compute_capability("9.0"))
    except (ImportError, AttributeError, RuntimeError):
        return False


def document_paths(head_dim: int, seq_len: int, max_documents: int) -> str:
    """What `cudnn_attention` runs for rows of several documents here, for the start-of-run log."""
    fallback = ("the Pallas flash kernel" if head_dim >= PALLAS_DOCUMENTS_MIN_HEAD_DIM and seq_len % MIN_BLOCK == 0
                else "cuDNN with the document mask as a bias")
    if max_documents and cudnn_packs_documents():
        return (f"rows of documents: cuDNN's packed call up to attention.max_documents={max_documents} runs of ids, "
                f"past that {fallback}")
    return f"rows of documents: {fallback}" + (" (cuDNN's packed call needs a Hopper or later GPU)"
                                               if max_documents else "")


def document_runs(segment_ids: jax.Array, limit: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows of documents as cuDNN's packed call takes them: (fits, offsets [B, limit + 1], lengths [B, limit]).

    Each run of equal ids is a segment: offsets its first token, lengths its tokens, -1 past the row's last
    (JAX's `q_offsets` / `q_seqlen`). `fits` (a scalar): every row's runs are its documents, as the einsum
    attention's mask (`xla_attention`: equal ids) sees them (`pallas_kernels.runs_are_documents`), and
    number at most `limit`."""
    b, t = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    fits = jnp.all(runs_are_documents(segment_ids)) & jnp.all(starts.sum(axis=1) <= limit)
    offsets = jax.vmap(lambda s: jnp.nonzero(s, size=limit + 1, fill_value=-1)[0])(starts).astype(jnp.int32)
    ends = jnp.where(offsets[:, 1:] >= 0, offsets[:, 1:], t)
    lengths = jnp.where(offsets[:, :-1] >= 0, ends - offsets[:, :-1], -1).astype(jnp.int32)
    return fits, offsets, lengths


def document_branch(segment_ids: jax.Array, limit: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(index into DOCUMENT_BRANCHES, offsets, lengths) for the rows of `segment_ids`: one document a row,
    packed rows that `document_runs` fits in `limit`, or the rest; with `limit` 0 (no packed call) no runs are
    worked out: offsets and lengths are None."""
    one_document = jnp.all(segment_ids == segment_ids[:, :1])
    if not limit:
        return jnp.where(one_document, 0, 2).astype(jnp.int32), None, None
    fits, offsets, lengths = document_runs(segment_ids, limit)
    return jnp.where(one_document, 0, jnp.where(fits, 1, 2)).astype(jnp.int32), offsets, lengths


def _cudnn_local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                 max_documents: int) -> jax.Array:
    def one_document(q, k, v, segment_ids, offsets, lengths):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def packed(q, k, v, segment_ids, offsets, lengths):
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
        return cudnn.dot_product_attention(q, k, v, None, None, lengths, lengths, offsets, offsets,
                                           scale=1 / math.sqrt(q.shape[-1]), mask_type=cudnn.MaskType.CAUSAL,
                                           qkv_layout="BTNH")

    def past_limit(q, k, v, segment_ids, offsets, lengths):
        if q.shape[-1] >= PALLAS_DOCUMENTS_MIN_HEAD_DIM and q.shape[1] % MIN_BLOCK == 0:
            return flash_attention(q, k, v, causal=True, segment_ids=segment_ids)
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [B,1,T,S]
        return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True, implementation="cudnn")

    index, offsets, lengths = document_branch(segment_ids, max_documents)
    if not max_documents:  # no packed call: the two others, as a two-way choice
        return jax.lax.cond(index == 0, one_document, past_limit, q, k, v, segment_ids, None, None)
    return jax.lax.switch(index, [one_document, packed, past_limit], q, k, v, segment_ids, offsets, lengths)


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """Attention rules: ring needs seq_len divisible by 2 x sequence; the others cannot split the
    sequence; cudnn serves bf16 / fp16 and head dims up to 128 (`config.cudnn_refusal`; on a CPU mesh
    `parallel.layout.Layout.plan` refuses it). Ulysses' own rules: `parallel.ulysses.validate_config`."""
    att, n, t = config.attention, sizes["sequence"], config.train.seq_len
    impl = att.impl
    require(impl != "ring" or t % (2 * n) == 0, "train.seq_len", t,
            f"ring attention cuts the sequence into 2 x mesh.sequence={2 * n} chunks (zig-zag); they must divide it")
    require(impl in CONTEXT_PARALLEL_IMPLS or n == 1, "attention.impl", impl,
            f"mesh.sequence={n} splits the sequence: only attention.impl in {CONTEXT_PARALLEL_IMPLS} attends "
            "across sequence shards")
    require(impl == "ulysses" or att.ulysses_degree == 0, "attention.ulysses_degree", att.ulysses_degree,
            "is read only with attention.impl='ulysses'")
    require(isinstance(att.max_documents, int) and not isinstance(att.max_documents, bool)
            and att.max_documents >= 0, "attention.max_documents", att.max_documents,
            "runs of segment ids a row may hold for cuDNN's packed call: an integer >= 0 (0: never the packed call)")
    require(not config.model.sliding_window or impl in ("xla", "auto"), "model.sliding_window",
            config.model.sliding_window, "sliding-window attention runs in the einsum attention only: "
            f"attention.impl must be 'xla' or 'auto' (got {impl!r})")
    refusal = config_lib.cudnn_refusal(config) if impl == "cudnn" else None
    if refusal is not None:
        key, value, rule = refusal
        require(False, key, value, f"{rule} (attention.impl='cudnn'; 'auto' picks einsum attention here)")
