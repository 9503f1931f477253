"""`attention.impl` cudnn and auto (playbook, "Flash Attention 1-3").

On CPU: which implementation `auto` resolves to for each platform, and the one-line refusals of
`cudnn` where cuDNN cannot serve. On an NVIDIA GPU (the runbook's `kernel_tests` part runs this file
there): cuDNN's attention against the einsum attention, causal and document-masked, forward and
gradients, and a packed row of three documents against the documents run one by one. The H100
compile (cuDNN calls in the compiled step, `auto` on every mesh) is `tests/test_gpu_aot.py`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import attention, config as config_lib
from meshtrain.config import ConfigError
from meshtrain.parallel.layout import Layout
from meshtrain.validate import validate
from tests import utils

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="cuDNN's attention runs on an NVIDIA GPU: "
                              "bench/gpu/kernel_tests.py runs these tests on one")
# bf16 operands; the reference's scores and softmax in float32 (the Pallas kernel tests' bf16 tolerance)
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}


def _config(**model):
    c = utils.tiny_config()
    c.model.update({"dtype": "bfloat16", "head_dim": 64, **model})
    c.attention.impl = "auto"
    return c


@pytest.mark.parametrize("platform, model, expected", [
    ("cpu", {}, "xla"),
    ("gpu", {}, "cudnn"),
    ("gpu", {"dtype": "float32"}, "xla"),
    ("gpu", {"head_dim": 12}, "xla"),
    ("gpu", {"head_dim": 32}, "xla"),  # cuDNN serves it (attention.impl=cudnn), auto keeps the measured dims
    ("gpu", {"head_dim": 128}, "cudnn"),
    ("gpu", {"sliding_window": 8}, "xla"),
    ("tpu", {}, "xla"),
    # multi-head latent attention: head widths cuDNN refuses (192 / 128); the flash kernel in bf16 on a GPU
    ("gpu", {"kv_lora_rank": 32, "qk_rope_head_dim": 64, "head_dim": 192, "v_head_dim": 128}, "pallas"),
    ("gpu", {"kv_lora_rank": 32, "qk_rope_head_dim": 64, "head_dim": 192, "dtype": "float32"}, "xla"),
    ("cpu", {"kv_lora_rank": 32, "qk_rope_head_dim": 64, "head_dim": 192}, "xla"),
])
def test_auto_resolves_per_platform_and_model(platform, model, expected):
    c = _config(**model)
    assert config_lib.attention_impl(c, platform) == expected
    assert config_lib.ModelConfig.from_config(c, platform).attention_impl == expected


def test_default_is_auto_and_cpu_runs_einsum():
    assert config_lib.default_config().attention.impl == "auto"
    c = _config()
    layout = Layout.plan(c, validate(c, 1, inputs=False), "cpu")
    assert layout.attention_impl == "xla" and layout.attention is attention.xla_attention


@pytest.mark.parametrize("model, key", [({"dtype": "float32"}, "model.dtype"),
                                        ({"head_dim": 12}, "model.head_dim"),
                                        ({"sliding_window": 8}, "model.sliding_window")])
def test_cudnn_refused_where_it_cannot_serve(model, key):
    c = _config(**model)
    c.attention.impl = "cudnn"
    with pytest.raises(ConfigError, match=key) as error:
        validate(c, 1, inputs=False)
    assert len(str(error.value).splitlines()) == 1


def test_moe_pipeline_stage_keeps_einsum_attention():
    """cuDNN's calls declare no variance (the stage loop then goes unchecked), and MoE stages need the
    checks: auto picks einsum there, and cudnn is refused naming the key."""
    c = _config(num_experts=4)
    c.mesh.stage = 2
    assert config_lib.attention_impl(c, "gpu") == "xla"
    c.mesh.stage = 1
    assert config_lib.attention_impl(c, "gpu") == "cudnn"
    c.mesh.stage, c.mesh.data = 2, 1
    c.attention.impl = "cudnn"
    with pytest.raises(ConfigError, match="model.num_experts.*pipeline stage"):
        validate(c, 2, inputs=False)


def test_cudnn_regions_go_unchecked_on_a_gpu():
    c = _config()
    sizes = validate(c, 1, inputs=False)
    assert Layout.plan(c, sizes, "gpu").kernels and not Layout.plan(c, sizes, "cpu").kernels


def test_cudnn_refused_on_a_cpu_mesh():
    c = _config()
    c.attention.impl = "cudnn"
    sizes = validate(c, 1, inputs=False)
    with pytest.raises(ConfigError, match="attention.impl.*NVIDIA GPUs.*'cpu'"):
        Layout.plan(c, sizes, "cpu")
    assert Layout.plan(c, sizes, "gpu").attention.func is attention.cudnn_attention


def _packed_row(rng, t, documents, padding):
    """A row as the data path packs it (`data.packing`): documents with ids 1, 2, ..., then padding (0s)."""
    cuts = np.sort(rng.choice(np.arange(1, t - padding), documents - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [t - padding]]))
    return np.concatenate([np.repeat(np.arange(1, documents + 1), lengths), np.zeros(padding, int)])


def _run_mask(offsets, lengths, t):
    """[T, T]: what cuDNN's packed call attends, read from its offsets and lengths: each segment causal."""
    which = np.full(t, -1)
    for start, n in zip(offsets[:-1], lengths, strict=True):  # the last offset is -1 (limit + 1 of them)
        if start >= 0:
            assert n > 0 and (which[start:start + n] == -1).all()
            which[start:start + n] = start
    assert (which >= 0).all()  # every token in one segment
    return (which[:, None] == which[None, :]) & np.tri(t, dtype=bool)


def test_document_runs_describe_the_einsum_attentions_mask():
    """`attention.document_runs`: for the rows the data path packs (documents, then padding), at most
    `limit` of them, it fits, and the segments its offsets and lengths describe attend exactly as the einsum
    attention's mask (equal ids, causal); rows of more documents, an id that recurs, or padding before a
    document do not fit (they take the fallback, which masks by ids). `document_branch` picks the causal
    call for rows of one document each."""
    rng, t, limit = np.random.default_rng(0), 64, 6
    # the padding at a row's end is one more run: `limit` runs in all
    rows = {"packed": [_packed_row(rng, t, n, pad) for pad in (0, 5) for n in range(1, limit + 1 - (pad > 0))],
            "past the limit": [_packed_row(rng, t, limit + 1, 0), _packed_row(rng, t, limit, 3),
                               _packed_row(rng, t, 20, 3)],
            "an id recurring": [np.repeat([1, 2, 1, 3], 16), np.repeat([1, 0, 2, 0], 16)],
            "padding first": [np.repeat([0, 1, 2, 0], 16)]}
    for kind, group in rows.items():
        for row in group:
            fits, offsets, lengths = (np.asarray(x) for x in attention.document_runs(jnp.asarray(row[None]), limit))
            assert bool(fits) == (kind == "packed"), (kind, row)
            if fits:
                reference = (row[:, None] == row[None, :]) & np.tri(t, dtype=bool)
                np.testing.assert_array_equal(_run_mask(offsets[0], lengths[0], t), reference)
                assert offsets[0, -1] == -1 and (offsets[0] >= 0).sum() == len(np.unique(row))
    packed = jnp.asarray(np.stack(rows["packed"][:2]))
    one_each = jnp.asarray(np.stack([np.full(t, 3), np.zeros(t, int)]))
    assert [int(attention.document_branch(ids, lim)[0]) for ids, lim in
            ((one_each, limit), (packed, limit), (packed, 0), (jnp.asarray(rows["past the limit"][0][None]), limit))
            ] == [attention.DOCUMENT_BRANCHES.index(b) for b in ("one_document", "packed", "past_limit", "past_limit")]


def _qkv(b=2, t=512, h=8, kv=2, d=64, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16),
            jax.random.normal(ks[1], (b, t, kv, d), jnp.bfloat16),
            jax.random.normal(ks[2], (b, t, kv, d), jnp.bfloat16))


def _reference(q, k, v, segment_ids):
    """The einsum attention on the same bf16 values, computed in float32."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return attention.xla_attention(*f32, segment_ids)


def _segments(b, t, lengths):
    row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(t - sum(lengths))])
    return jnp.asarray(np.tile(row, (b, 1)), jnp.int32)


@gpu_only
@pytest.mark.parametrize("lengths", [(512,), (128, 256, 96), (12,) * 40],
                         ids=["one_document", "documents_and_padding", "past_max_documents"])
def test_cudnn_matches_einsum_forward_and_gradients(lengths):
    q, k, v = _qkv()
    seg = _segments(2, 512, lengths)
    ct = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * ct)

    out = jax.jit(attention.cudnn_attention)(q, k, v, seg)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(_reference(q, k, v, seg)), **BF16_TOL)
    got = jax.jit(jax.grad(loss(attention.cudnn_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(_reference), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, np.asarray(w) / scale, **BF16_TOL)


@gpu_only
def test_packed_row_equals_documents_one_by_one():
    """A row of 3 documents gives each document the output it has alone."""
    lengths = (128, 256, 128)
    q, k, v = _qkv(b=1)
    seg = _segments(1, 512, lengths)
    packed = np.asarray(jax.jit(attention.cudnn_attention)(q, k, v, seg), np.float32)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = jax.jit(attention.cudnn_attention)(q[:, part], k[:, part], v[:, part], jnp.ones((1, n), jnp.int32))
        np.testing.assert_allclose(packed[:, part], np.asarray(alone, np.float32), **BF16_TOL)
        start += n


def test_start_of_run_line_says_what_rows_of_documents_take(monkeypatch):
    """`Run.describe`'s attention line under cuDNN: the packed call where JAX says the GPU is a Hopper or
    later, up to attention.max_documents, and the fallback past it or without one."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    assert "cuDNN's packed call needs a Hopper" in attention.document_paths(128, 8192, 32)  # no GPU here
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    line = attention.document_paths(128, 8192, 32)
    assert "packed call up to attention.max_documents=32" in line and line.endswith("the Pallas flash kernel")
    assert attention.document_paths(64, 4096, 32).endswith("cuDNN with the document mask as a bias")
    assert "packed" not in attention.document_paths(64, 4096, 0)
