"""DeepSeek-V3's router: sigmoid scores, a balancing bias that only chooses (moved by the step toward the
under-loaded experts, not by the gradient), group-limited routing, the routed scaling factor.

* `moe.route` against a per-token NumPy reference written from the DeepSeek-V3 report's equations.
* The layer on meshes crossing `expert` with `data`, `fsdp`, `tensor` and `sequence`, every dispatch: output
  and gradients equal the per-token reference's, the bias's "gradient" being the tokens each expert took.
* The model trains equal to one device (losses, gradient norms, the load metric, every parameter and bias
  after the step moved it) on expert, fsdp, tensor, sequence and 1F1B stage meshes.
* The bias balances: trained on the embedded corpus with no auxiliary loss, the moving bias ends with a
  lower max / mean expert load than the frozen one; it survives a resume bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from meshtrain import data, moe, train
from meshtrain.config import ConfigError, ModelConfig
from meshtrain.sharding_rules import Rules
from meshtrain.validate import validate
from tests import utils
from tests.test_checkpoint import hook_data

E, K, B, T, D, F = 8, 2, 8, 16, 16, 32
GROUPS, TOPK_GROUPS, SCALE = 4, 2, 2.5
DEEPSEEK = dict(moe_router="sigmoid", moe_router_bias=True, moe_groups=GROUPS, moe_topk_groups=TOPK_GROUPS,
                moe_routed_scale=SCALE)
CFG = ModelConfig(vocab_size=16, d_model=D, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, mlp_dim=F,
                  num_experts=E, experts_per_token=K, capacity_factor=E / K, **DEEPSEEK)  # C = T: nothing dropped


def _numpy_route(x, w, bias, valid):
    """Per token, as the report writes it: s = sigmoid(x . w_e); groups ranked by the sum of their two best
    s + b; top-k of s + b inside the best TOPK_GROUPS groups; weights s / sum(s) over the k, times SCALE."""
    s = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ w.astype(np.float64))))
    weights, experts, loads = np.zeros(s.shape[:-1] + (K,)), np.zeros(s.shape[:-1] + (K,), int), np.zeros(E)
    size = E // GROUPS
    for idx in np.ndindex(s.shape[:-1]):
        biased = s[idx] + bias
        group_score = [np.sort(biased[g * size:(g + 1) * size])[-2:].sum() for g in range(GROUPS)]
        allowed = [e for g in np.argsort(group_score)[-TOPK_GROUPS:] for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:K]
        experts[idx] = chosen
        weights[idx] = s[idx][chosen] / s[idx][chosen].sum() * SCALE
        if valid[idx]:
            loads[chosen] += 1
    return weights, experts, loads


def test_route_equals_the_reports_equations():
    kx, kw, kb = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, T, D), jnp.float32)
    w = jax.random.normal(kw, (D, E), jnp.float32) * 0.3
    bias = jax.random.normal(kb, (E,), jnp.float32) * 0.2  # large enough to change choices and groups
    valid = np.arange(T)[None, :] < np.arange(T, T - B, -1)[:, None]  # padding at the rows' ends

    def weights_sum(bias):
        _, _, weights, experts = moe.route(x, w, K, True, bias=bias, valid=jnp.asarray(valid),
                                           **moe.router_options(CFG))
        return jnp.sum(weights), (weights, experts)

    loads, (weights, experts) = jax.grad(weights_sum, has_aux=True)(bias)
    want_weights, want_experts, want_loads = _numpy_route(np.asarray(x), np.asarray(w), np.asarray(bias), valid)
    order = np.argsort(np.asarray(experts), axis=-1)  # the same experts, in whatever order top-k gives them
    want_order = np.argsort(want_experts, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, -1),
                                  np.take_along_axis(want_experts, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_weights, want_order, -1), rtol=1e-5)
    np.testing.assert_array_equal(loads, want_loads)  # the bias's cotangent: real tokens each expert took
    unbiased = moe.route(x, w, K, True, **moe.router_options(CFG))[3]
    assert (np.sort(np.asarray(unbiased), -1) != np.sort(np.asarray(experts), -1)).any()  # the bias chooses


def test_group_limited_routing_keeps_a_tokens_experts_in_its_best_groups():
    scores = jax.random.uniform(jax.random.key(1), (64, E))
    _, experts = moe._choose(scores, K, GROUPS, 1)  # one group of two experts: both chosen from it
    assert (np.asarray(experts) // (E // GROUPS) == np.asarray(experts)[:, :1] // (E // GROUPS)).all()


def _inputs(seed: int = 0):
    kx, kp, kc, kb = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (B, T, D), jnp.float32)
    params = nn.unbox(moe.MoeMlp(CFG, Rules.for_mesh(utils.mesh_of())).init(kp, x)["params"])
    params["router"] = params["router"] * 50.0  # spread the tokens over every expert
    params[moe.BIAS_NAME] = jax.random.normal(kb, (E,), jnp.float32) * 0.1
    return params, x, jax.random.normal(kc, (B, T, D), jnp.float32)


def _reference_vjp(params, x, cot):
    def f(params, x):
        y = moe.moe_reference(x, params["router"], params["w_gate"], params["w_up"], params["w_down"], K,
                              bias=params[moe.BIAS_NAME], **moe.router_options(CFG))
        return jnp.sum(y * cot), y
    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads


DISPATCHES = {"capacity": {}, "dropless": dict(moe_dropless=True),
              "dropless-kernel": dict(moe_dropless=True, moe_matmul="pallas")}


@pytest.mark.parametrize("dispatch", list(DISPATCHES))
@pytest.mark.parametrize("sizes", [{}, {"data": 2, "expert": 4}, {"expert": 2, "tensor": 2, "sequence": 2},
                                   {"fsdp": 2, "expert": 2, "tensor": 2}],
                         ids=lambda s: "x".join(f"{a}{n}" for a, n in s.items()) or "1dev")
def test_layer_equals_per_token_reference(sizes, dispatch):
    """Output and every gradient within 1e-5; the bias's is the count of tokens each expert took, summed
    over the devices that route them (the same count whichever devices hold the tokens)."""
    params, x, cot = _inputs()
    y_ref, g_ref = _reference_vjp(params, x, cot)
    mesh = utils.mesh_of(**sizes)
    cfg = dataclasses.replace(CFG, **DISPATCHES[dispatch])
    layer = moe.MoeMlp(cfg, Rules.for_mesh(mesh, model=cfg))

    def f(params, x):
        y, stats = layer.apply({"params": params}, x)
        return jnp.sum(y * cot), (y, stats)

    with jax.set_mesh(mesh):
        (_, (y, stats)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    for name in g_ref[0]:
        np.testing.assert_allclose(grads[0][name], g_ref[0][name], atol=1e-5, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(grads[1], g_ref[1], atol=1e-5, rtol=1e-5)
    assert float(jnp.sum(g_ref[0][moe.BIAS_NAME])) == B * T * K
    assert float(stats["dropped"]) == 0.0


# --- the model ------------------------------------------------------------------------------------------

STEPS = 3
ROUTER_KEYS = {"model.moe_router": "sigmoid", "model.moe_router_bias": True, "model.moe_groups": GROUPS,
               "model.moe_topk_groups": TOPK_GROUPS, "model.moe_routed_scale": SCALE, "model.moe_dropless": True,
               "model.moe_bias_rate": 0.01, "model.aux_loss_weight": 1e-3}


def _config(sizes: dict, **overrides):
    """The composed tiny MoE (`utils.composed_config`: sequence-wise balance loss, 1F1B with `stage`, ZeRO-3
    with `fsdp`, ring attention with `sequence`) with DeepSeek-V3's router, dropless."""
    schedule = sizes.pop("schedule", None)  # a pipeline schedule other than 1F1B
    config = utils.apply_overrides(utils.composed_config(sizes, moe=True), {**ROUTER_KEYS, **overrides})
    return utils.apply_overrides(config, {"pipeline.schedule": schedule} if schedule else {})


# DeepSeek-V3's first_k_dense_replace: the first layer dense, the other three MoE
DENSE_FIRST = (("model.first_dense_layers", 1), ("model.moe_every", 1))


@functools.cache
def _trained(key: tuple, overrides: tuple = ()):
    """([STEPS, 3] loss, gradient norm and max / mean load; final params) on the mesh `dict(key)`."""
    config = _config(dict(key), **dict(overrides))
    records, state = utils.train_synthetic(config, STEPS)
    return (np.array([[r["loss"], r["grad_norm"], r["moe_max_load"]] for r in records]),
            jax.tree.map(np.asarray, state.params))


def _biases(params) -> list[np.ndarray]:
    return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params) if moe._is_bias(path)]


@pytest.mark.parametrize("sizes", [{"expert": 8}, {"data": 2, "expert": 2, "tensor": 2}, {"fsdp": 4, "expert": 2},
                                   {"expert": 2, "sequence": 2, "tensor": 2}, {"stage": 2, "fsdp": 2, "expert": 2},
                                   {"stage": 2, "data": 2, "expert": 2, "schedule": "zero_bubble"},
                                   {"stage": 2, "data": 2, "expert": 2, "schedule": "gpipe"}],
                         ids=lambda s: "x".join(f"{a}{n}" for a, n in s.items()))
def test_model_trains_like_one_device(sizes):
    """Losses, gradient norms (the loads are not gradients: they stay out of the norm), loads, parameters
    and the moved biases of one device, to 1e-4 (composite)."""
    got, params = _trained(tuple(sorted(sizes.items())))
    want, ref_params = _trained(())
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert (want[:, 2] > 1.0).all()  # the load metric reads real, uneven loads
    moved = _biases(ref_params)
    assert moved and all(np.abs(b).max() > 0 for b in moved)  # the step moved them
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sizes", [{"expert": 8}, {"data": 2, "expert": 2, "tensor": 2}, {"fsdp": 4, "expert": 2},
                                   {"stage": 2, "fsdp": 2, "expert": 2},
                                   {"stage": 2, "data": 2, "expert": 2, "schedule": "interleaved_1f1b"}],
                         ids=lambda s: "x".join(f"{a}{n}" for a, n in s.items()))
def test_dense_first_layers_train_like_one_device(sizes):
    """`model.first_dense_layers=1`: one dense layer (model.mlp_dim wide) before the MoE layers (three; four
    on two stages); in a slot-table pipeline stage 0 runs it before its chunk (and again, from the lookup,
    before its backward)."""
    overrides = DENSE_FIRST + ((("model.n_layers", 5),) if "stage" in sizes else ())
    got, params = _trained(tuple(sorted(sizes.items())), overrides)
    want, ref_params = _trained((), overrides)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)
    config = _config({}, **dict(overrides))
    assert params["dense_layers"]["mlp"]["w_gate"].shape == (1, config.model.d_model, config.model.mlp_dim)
    assert params["layers"]["moe_layer"]["moe"]["w_gate"].shape[0] == config.model.n_layers - 1


def test_uneven_moe_stages_train_like_one_device():
    """Three MoE layers on two stages (2 + 1: one empty slot, which routes nothing): the balance loss's
    gradient, the loads and the max / mean load metric (over the real layers) of one device."""
    uneven = (("model.moe_every", 1), ("model.n_layers", 3))
    got, _ = _trained((("expert", 2), ("fsdp", 2), ("stage", 2)), uneven)
    want, _ = _trained((), uneven)
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_bias_balances_the_load_where_the_frozen_bias_does_not(capsys):
    """The tiny MoE on the embedded corpus, no auxiliary or z-loss: max / mean expert load over the last 10
    of 60 steps, with the bias moving (0.01 a step) and frozen (rate 0)."""
    def max_load(rate: float) -> float:
        c = utils.load_config_file("tiny_moe")
        c.model.dtype = "float32"
        for axis in utils.AXES:
            c.mesh[axis] = 1
        c.train.seq_len, c.train.batch_size, c.train.warmup_steps, c.steps = 64, 8, 5, 60
        utils.apply_overrides(c, {**ROUTER_KEYS, "model.moe_groups": 1, "model.moe_topk_groups": 0,
                                  "model.moe_routed_scale": 1.0, "model.moe_bias_rate": rate,
                                  "model.aux_loss_weight": 0.0, "model.router_z_loss_weight": 0.0})
        it = data.make_iterator(utils.resolve(c))
        records, _, _ = utils.train(c, [next(it) for _ in range(c.steps)])
        return float(np.mean([r["moe_max_load"] for r in records[-10:]]))

    moving, frozen = max_load(0.01), max_load(0.0)
    with capsys.disabled():
        print(f"\nmax / mean expert load, last 10 of 60 steps: bias moving {moving:.3f}, frozen {frozen:.3f}")
    assert moving < frozen


def test_bias_resumes_bit_for_bit(tmp_path, monkeypatch, compilation_cache):
    """6 steps straight vs stopped (SIGTERM) after step 3 and resumed: the same losses and final state,
    the moved biases among it, bit for bit."""
    overrides = {"steps": 6, "checkpoint.every": 3, "model.num_experts": 8, "model.experts_per_token": 2,
                 "model.moe_every": 2, "model.moe_mlp_dim": 64, "mesh.fsdp": 1, "mesh.expert": 8,
                 **ROUTER_KEYS}
    straight = tmp_path / "straight"
    train.run(utils.config_for(straight, **overrides))
    hook_data(monkeypatch, lambda step, batch: (os.kill(os.getpid(), signal.SIGTERM) if step == 3 else None)
              or batch)
    resumed = tmp_path / "resumed"
    config = utils.config_for(resumed, **overrides)
    assert train.run(config)["step"] == 3
    assert train.run(config)["step"] == 6
    assert utils.losses_of(resumed) == utils.losses_of(straight)
    abstract = utils.abstract_state(config)
    a, b = utils.load(resumed, 6, abstract).state, utils.load(straight, 6, abstract).state
    biases = _biases(a.params)
    assert biases and all(np.abs(np.asarray(x)).max() > 0 for x in biases)
    utils.assert_bitwise(a, b)


@pytest.mark.parametrize("key, value, match", [
    ("model.moe_router", "relu", "must be one of"),
    ("model.moe_groups", 3, "must divide model.num_experts=8"),
    ("model.moe_groups", 8, "groups of at least 2"),
    ("model.moe_topk_groups", 5, "between 0 \\(every group\\) and model.moe_groups=4"),
    ("model.moe_bias_rate", -0.1, "must be >= 0"),
    ("model.moe_routed_scale", 0.0, "must be > 0"),
])
def test_validation_names_key_value_and_rule(key, value, match):
    config = utils.apply_overrides(_config({"expert": 8}), {key: value})
    with pytest.raises(ConfigError, match=match) as err:
        validate(config, 8)
    assert key in str(err.value)


def test_topk_groups_must_hold_the_choices():
    config = utils.apply_overrides(_config({"expert": 8}), {"model.moe_topk_groups": 1, "model.experts_per_token": 4})
    with pytest.raises(ConfigError, match="1 groups of 2 experts cannot hold model.experts_per_token=4"):
        validate(config, 8)
