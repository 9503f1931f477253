"""Multi-head latent attention (DeepSeek-V2/V3, `model.kv_lora_rank` > 0).

* The layer against the DeepSeek-V2 report's equations written out per head in NumPy (float64): query and
  key / value latents with their RMSNorms, the decoupled RoPE key shared by the heads, values narrower than
  the query / key heads; with and without the query latent.
* The model trains equal to one device (losses, gradient norms, parameters) on meshes crossing it with
  `tensor`, `fsdp` (ZeRO-3), `sequence` (ring and Ulysses), `stage` (1F1B) and, with DeepSeek-V3's router,
  `expert`; and with the Pallas flash kernel.
* Sampling with the latent cache (c_kv and k_pe alone, kv_lora_rank + qk_rope_head_dim numbers a token a
  layer) gives the full forward's logits and tokens, on one device and tensor-parallel.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from meshtrain import generate, model as model_lib, train_step
from meshtrain.config import ConfigError, ModelConfig
from meshtrain.sharding_rules import Rules
from meshtrain.validate import validate
from tests import utils

LATENT = {"model.kv_lora_rank": 32, "model.q_lora_rank": 24, "model.qk_rope_head_dim": 8, "model.head_dim": 24,
          "model.v_head_dim": 16, "model.n_heads": 8, "model.n_kv_heads": 8}
H, DH, P, R, RQ, DV = 8, 24, 8, 32, 24, 16


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta):
    """Rotate-half RoPE of x [T, ..., P] at `positions` [T]."""
    p = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, p, 2) / p)
    angles = positions[:, None] * inv  # [T, P/2]
    angles = np.concatenate([angles, angles], -1).reshape(len(positions), *([1] * (x.ndim - 2)), p)
    rotated = np.concatenate([-x[..., p // 2:], x[..., :p // 2]], -1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def _reference(params, x, positions, segments, cfg: ModelConfig):
    """One row x [T, D]: DeepSeek-V2's equations (9)-(19), head by head, float64; the latents' RMSNorm epsilon
    1e-6 whatever the model's (DeepSeek's code fixes it)."""
    f = {k: (np.asarray(v["scale"], np.float64) if isinstance(v, dict) else np.asarray(v, np.float64))
         for k, v in params.items()}
    x = np.asarray(x, np.float64)
    nope = DH - P
    if cfg.q_lora_rank:
        q = np.einsum("tr,rhk->thk", _rms(x @ f["wq_a"], f["q_a_norm"], 1e-6), f["wq_b"])
    else:
        q = np.einsum("td,dhk->thk", x, f["wq"])
    latent = x @ f["wkv_a"]
    c_kv, k_pe = _rms(latent[:, :R], f["kv_a_norm"], 1e-6), _rope(latent[:, R:], positions, cfg.rope_theta)
    kv = np.einsum("tr,rhk->thk", c_kv, f["wkv_b"])
    t = x.shape[0]
    out = np.zeros((t, H, DV))
    for h in range(H):
        qh = np.concatenate([q[:, h, :nope], _rope(q[:, h, nope:], positions, cfg.rope_theta)], -1)
        kh = np.concatenate([kv[:, h, :nope], k_pe], -1)
        scores = qh @ kh.T / np.sqrt(DH)
        allowed = (np.arange(t)[None, :] <= np.arange(t)[:, None]) & (segments[:, None] == segments[None, :])
        scores = np.where(allowed, scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (w / w.sum(-1, keepdims=True)) @ kv[:, h, nope:]
    return np.einsum("thv,hvd->td", out, f["wo"])


@pytest.mark.parametrize("q_lora", [RQ, 0], ids=["query-latent", "query-direct"])
def test_layer_equals_the_reports_equations(q_lora):
    config = utils.tiny_config({}, **{**LATENT, "model.q_lora_rank": q_lora, "model.dtype": "float32"})
    cfg = ModelConfig.from_config(config, "cpu")
    layer = model_lib.Attention(cfg, Rules.for_mesh(utils.mesh_of()), model_lib.xla_attention)
    t = 16
    x = jax.random.normal(jax.random.key(0), (2, t, cfg.d_model), jnp.float32)
    segments = np.array([[1] * 10 + [2] * 6, [1] * 16])  # two documents in the first row
    positions = np.array([list(range(10)) + list(range(6)), list(range(16))])
    params = nn.unbox(layer.init(jax.random.key(1), x, positions, segments)["params"])
    params = jax.tree.map(lambda a: a * 4.0, params)  # scores far from uniform
    assert set(params) == ({"wq_a", "q_a_norm", "wq_b"} if q_lora else {"wq"}) | {"wkv_a", "kv_a_norm", "wkv_b", "wo"}
    assert params["wkv_a"].shape == (cfg.d_model, R + P) and params["wkv_b"].shape == (R, H, DH - P + DV)
    y = layer.apply({"params": params}, x, positions, segments)
    for row in range(2):
        np.testing.assert_allclose(y[row], _reference(params, x[row], positions[row], segments[row], cfg),
                                   rtol=1e-5, atol=1e-5)


# --- the model on meshes ------------------------------------------------------------------------------

STEPS = 3
DEEPSEEK_MOE = {"model.moe_router": "sigmoid", "model.moe_router_bias": True, "model.moe_groups": 4,
                "model.moe_topk_groups": 2, "model.moe_routed_scale": 2.5, "model.moe_dropless": True}


def _config(sizes: dict, moe: bool = False, **overrides):
    """The composed tiny model (`utils.composed_config`: ring attention with `sequence`, 1F1B with `stage`,
    ZeRO-3 with `fsdp`) with latent attention (and DeepSeek-V3's router with `moe`)."""
    config = utils.composed_config(sizes, moe=moe)
    return utils.apply_overrides(config, {**LATENT, **(DEEPSEEK_MOE if moe else {}), **overrides})


@functools.cache
def _trained(key: tuple, moe: bool, overrides: tuple = ()):
    config = _config(dict(key), moe, **dict(overrides))
    records, state = utils.train_synthetic(config, STEPS)
    return np.array([[r["loss"], r["grad_norm"]] for r in records]), jax.tree.map(np.asarray, state.params)


CASES = [({"tensor": 2, "data": 2, "fsdp": 2}, False, ()),
         ({"sequence": 2, "tensor": 2, "data": 2}, False, ()),
         ({"sequence": 4, "data": 2}, False, (("attention.impl", "ulysses"),)),
         ({"stage": 2, "data": 2, "tensor": 2}, False, ()),
         ({"data": 2}, False, (("attention.impl", "pallas"),)),
         ({"expert": 2, "fsdp": 2, "tensor": 2}, True, ()),
         ({"stage": 2, "expert": 2, "data": 2}, True, ())]


@pytest.mark.parametrize("sizes, moe, overrides", CASES, ids=[
    "x".join(f"{a}{n}" for a, n in s.items()) + ("-moe" if m else "") + "".join(f"-{v}" for _, v in o)
    for s, m, o in CASES])
def test_model_trains_like_one_device(sizes, moe, overrides):
    got, params = _trained(tuple(sorted(sizes.items())), moe, overrides)
    want, ref_params = _trained((), moe, ())
    np.testing.assert_allclose(got, want, rtol=1e-4)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)


# --- sampling with the latent cache -------------------------------------------------------------------

PROMPTS = [[1, 70, 72, 75, 80, 3], [1, 90], [1, 40, 41, 42]]
NEW = 8


@pytest.mark.parametrize("sizes", [{}, {"tensor": 2, "data": 2, "fsdp": 2}], ids=["1dev", "tensor2xdata2xfsdp2"])
def test_latent_cache_sampling_equals_the_full_forward(sizes):
    def build(mesh):
        run = utils.resolve(utils.tiny_config(mesh, **{**LATENT, "model.dtype": "float32"}))
        return run, train_step.build(run)[0]
    _, single = build({})
    params = jax.tree.map(lambda a: a * 3.0, single.create(0).params)  # sharper attention than at init
    run, factory = build(sizes)
    cfg = run.model
    params = jax.device_put(params, jax.tree.map(lambda a: a.sharding, factory.abstract.params))
    new, logits = generate.generate(cfg, params, PROMPTS, NEW, return_logits=True)
    host = jax.device_put(jax.tree.map(np.asarray, params), jax.devices()[0])
    for row, prompt in enumerate(PROMPTS):
        full = np.asarray(model_lib.logits(cfg, host, np.array([prompt + new[row]])))[0]
        np.testing.assert_allclose(logits[row], full[len(prompt) - 1:len(prompt) - 1 + NEW], rtol=1e-5, atol=1e-5)
        assert new[row] == list(np.argmax(full[len(prompt) - 1:-1], axis=-1))
    model = model_lib.Transformer(cfg, Rules.for_mesh(utils.mesh_of()), decode=True)
    ids = jnp.ones((2, 12), jnp.int32)
    cache = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids)["cache"])
    shapes = {k: v.shape for k, v in cache["layers"]["attn"].items() if k in ("c_kv", "k_pe", "k", "v")}
    assert shapes == {"c_kv": (cfg.n_layers, 2, 12, R), "k_pe": (cfg.n_layers, 2, 12, P)}  # no expanded keys


@pytest.mark.parametrize("key, value, match", [
    ("model.qk_rope_head_dim", 0, "must be even, > 0 and < model.head_dim=24"),
    ("model.qk_rope_head_dim", 24, "must be even, > 0 and < model.head_dim=24"),
    ("model.n_kv_heads", 4, "expands a key and a value per query head"),
    ("model.qk_norm", True, "multi-head latent attention has none"),
    ("model.matmul_precision", "fp8", "use 'bf16'"),
])
def test_validation_names_key_value_and_rule(key, value, match):
    config = utils.apply_overrides(_config({"data": 8}), {key: value})
    with pytest.raises(ConfigError, match=match) as err:
        validate(config, 8)
    assert key in str(err.value)


def test_latent_keys_need_the_latent():
    config = utils.tiny_config({"data": 8}, **{"model.qk_rope_head_dim": 8})
    with pytest.raises(ConfigError, match="set model.kv_lora_rank"):
        validate(config, 8)
