"""The tiny MoE model with expert parallelism: equal losses on every expert-parallel mesh, and the
compiled step's token exchange (all-to-all over `expert`, expert weights never all-reduced over it).

Each mesh's step is compiled once (module cache) and serves both the loss and the HLO tests.
"""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import pytest

from meshtrain import mesh as mesh_lib, model as model_lib, moe, train_step
from meshtrain.config import ModelConfig
from meshtrain.plan import hlo
from tests import utils

MESHES = [{"expert": 2}, {"expert": 4}, {"expert": 8}, {"data": 2, "expert": 2, "tensor": 2}]
STEPS = 3


def _config(sizes: dict):
    c = utils.load_config_file("tiny_moe")
    c.model.dtype = "float32"
    c.data.source = "synthetic"
    for axis in utils.AXES:
        c.mesh[axis] = sizes.get(axis, 1)
    c.train.seq_len = 32
    c.train.warmup_steps = 1
    c.model.moe_dropless = bool(sizes.get("dropless", False))  # not mesh axes: the dispatch and its matmuls
    c.model.moe_matmul = "pallas" if sizes.get("kernel", False) else "ragged_dot"
    c.train.zero_stage = sizes.get("zero", c.train.zero_stage)
    return c


@functools.cache
def _run(key: tuple) -> tuple[np.ndarray, list[dict], str]:
    """(losses, metrics per step, compiled HLO text) of STEPS steps on the mesh `dict(key)`."""
    config = _config(dict(key))
    run = utils.resolve(config)
    factory, step_fn = train_step.build(run)
    mesh = run.mesh
    batches = utils.synthetic_batches(config, STEPS)
    with jax.set_mesh(mesh):
        compiled = step_fn.lower(factory.abstract, batches[0]).compile()
        state = utils.initial_state(factory, config)
        metrics = []
        for batch in batches:
            state, m = compiled(state, batch)
            metrics.append(jax.tree.map(float, jax.device_get(m)))
    return np.array([m["loss"] for m in metrics]), metrics, compiled.as_text()


def _key(sizes: dict) -> tuple:
    return tuple(sorted(sizes.items()))


def test_single_device_run_logs_router_losses_and_drops():
    losses, metrics, _ = _run(())
    cfg = ModelConfig.from_config(_config({}))
    assert losses[-1] < losses[0]
    for m in metrics:
        np.testing.assert_allclose(m["moe_aux_loss"], cfg.aux_loss_weight * m["moe_load_balance"], rtol=1e-6)
        assert m["moe_load_balance"] >= 1.0 - 1e-6  # E * sum f_e P_e is at least 1
        assert m["moe_z_loss"] > 0.0
        assert 0.0 < m["moe_dropped_fraction"] < 0.5  # capacity factor 1.25 drops a few tokens


@pytest.mark.parametrize("sizes", MESHES, ids=lambda s: "x".join(f"{a}{n}" for a, n in s.items()))
def test_losses_equal_single_device(sizes):
    ref_losses, ref_metrics, _ = _run(())
    losses, metrics, _ = _run(_key(sizes))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for name in ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction"):
        np.testing.assert_allclose([m[name] for m in metrics], [m[name] for m in ref_metrics],
                                   rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("sizes", [{"expert": 8}, {"fsdp": 8}, {"fsdp": 4, "expert": 2, "zero": 3}],
                         ids=["expert8", "fsdp8", "fsdp4xexpert2-zero3"])
def test_dropless_model_under_expert_parallelism_equals_single_device(sizes):
    """The whole model with dropless dispatch on expert=8, and on fsdp meshes, whose devices own whole
    experts too (`model.moe_fsdp` auto; ZeRO-1's accumulation region manual over fsdp, ZeRO-3's not), trains
    the single-device dropless model's losses and router statistics; nothing is dropped, where capacity
    dispatch on the same data drops tokens (test above)."""
    ref_losses, ref_metrics, _ = _run((("dropless", True),))
    losses, metrics, _ = _run(_key({**sizes, "dropless": True}))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for name in ("moe_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose([m[name] for m in metrics], [m[name] for m in ref_metrics],
                                   rtol=1e-5, atol=1e-7, err_msg=name)
    assert all(m["moe_dropped_fraction"] == 0.0 for m in metrics + ref_metrics)
    assert all(m["moe_dropped_fraction"] > 0.0 for m in _run(())[1])


@pytest.mark.parametrize("sizes", [{"expert": 4, "data": 2}, {"expert": 2, "fsdp": 2, "tensor": 2}],
                         ids=["expert4xdata2", "expert2xfsdp2xtensor2"])
def test_grouped_kernel_model_equals_single_device(sizes):
    """The whole dropless model with the grouped matmul kernel (interpreted on the CPU; its region manual
    over every axis, the width split over `tensor`) trains the single-device losses and router statistics."""
    ref_losses, ref_metrics, _ = _run((("dropless", True),))
    losses, metrics, _ = _run(_key({**sizes, "dropless": True, "kernel": True}))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for name in ("moe_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose([m[name] for m in metrics], [m[name] for m in ref_metrics],
                                   rtol=1e-5, atol=1e-7, err_msg=name)
    assert all(m["moe_dropped_fraction"] == 0.0 for m in metrics)


def _collectives(text: str, sizes: dict):
    mesh = {axis: sizes.get(axis, 1) for axis in mesh_lib.MESH_ORDER}
    n = int(np.prod(list(mesh.values())))
    return [(c, hlo.group_axes(c.groups[0], mesh) if c.groups else {}) for c in hlo.collectives(text, n)], mesh


@pytest.mark.parametrize("sizes", [{"expert": 8}, {"data": 2, "expert": 2, "tensor": 2}],
                         ids=["expert8", "data2xexpert2xtensor2"])
def test_step_exchanges_tokens_by_all_to_all_over_expert(sizes):
    config = _config(sizes)
    cfg = ModelConfig.from_config(config)
    moe_layers = cfg.n_layers // cfg.moe_every
    found, _ = _collectives(_run(_key(sizes))[2], sizes)
    a2a = [(c, axes) for c, axes in found if c.kind == "all-to-all"]
    assert all(axes == {"expert": sizes["expert"]} for _, axes in a2a), a2a
    # per MoE layer: dispatch + return in the forward, their transposes in the backward (scan body x trips)
    assert sum(c.count for c, _ in a2a) == 4 * moe_layers
    # dispatch buffer per device: [b, E, C, D] float32
    rows = config.train.batch_size // (sizes.get("data", 1) * sizes["expert"])
    cap = moe.capacity(cfg, config.train.seq_len)
    assert all(c.result_bytes == rows * cfg.num_experts * cap * cfg.d_model * 4 for c, _ in a2a)


def test_forward_has_two_all_to_all_per_moe_layer():
    sizes = {"expert": 8}
    config = _config(sizes)
    run = utils.resolve(config)
    factory, _ = train_step.build(run)
    mesh = run.mesh
    batch = utils.synthetic_batches(config, 1)[0]

    def loss(params, batch):
        return factory.model.apply({"params": params}, batch, method=model_lib.Transformer.loss)

    with jax.set_mesh(mesh):
        text = jax.jit(loss).lower(factory.abstract.params, batch).compile().as_text()
    found, _ = _collectives(text, sizes)
    cfg = ModelConfig.from_config(config)
    assert sum(c.count for c, axes in found if c.kind == "all-to-all") == 2 * cfg.n_layers // cfg.moe_every


@pytest.mark.parametrize("sizes, axis", [({"expert": 8}, "expert"), ({"fsdp": 8, "dropless": True}, "fsdp")],
                         ids=["expert8", "fsdp8-dropless"])
def test_expert_weights_are_not_reduced_over_expert(sizes, axis):
    """Everything reduced over the experts' axis (`expert`; `fsdp` where its devices own whole experts) is
    the gradient of the other (non-expert) parameters, plus a few scalars: the expert weights' gradients
    stay on their devices. ZeRO (stage 1 here) shards the other parameters' state over that axis too, so
    theirs is reduce-scattered over it (counted by its input). The tokens travel over it by all-to-all."""
    found, _ = _collectives(_run(_key(sizes))[2], sizes)
    assert all(axes == {axis: 8} for c, axes in found if c.kind == "all-to-all")
    assert any(c.kind == "all-to-all" for c, _ in found)
    cfg = ModelConfig.from_config(_config(sizes))
    expert_params = (cfg.n_layers // cfg.moe_every) * 3 * cfg.num_experts * cfg.d_model * moe.expert_mlp_dim(cfg)
    replicated_bytes = 4 * (model_lib.num_params(cfg) - expert_params)
    reduced = sum(c.result_bytes * c.count * (len(c.groups[0]) if c.kind == "reduce-scatter" else 1)
                  for c, axes in found if c.kind in ("all-reduce", "reduce-scatter") and axis in axes)
    one_expert_weight = 4 * cfg.d_model * moe.expert_mlp_dim(cfg)
    assert replicated_bytes <= reduced < replicated_bytes + min(1024, one_expert_weight)


@pytest.mark.parametrize("dropless", [False, True], ids=["capacity", "dropless"])
def test_gradient_accumulation_with_expert_parallelism(dropless):
    """2 micro-batches on data=2, fsdp=2(ZeRO-1), expert=2 equal 1 batch on 1 device (dropless: the experts
    split over fsdp x expert, their weights entering the accumulation region split both ways). The router
    losses are taken per micro-batch (they are not linear in the batch), so they are switched off here."""
    losses = {}
    for name, sizes, accum in (("ref", {}, 1), ("accum", {"data": 2, "fsdp": 2, "expert": 2}, 2)):
        config = _config({**sizes, "dropless": dropless})
        config.train.grad_accum_steps = accum
        config.model.aux_loss_weight = config.model.router_z_loss_weight = 0.0
        losses[name] = utils.run_steps(config, utils.synthetic_batches(config, STEPS))[0]
    np.testing.assert_allclose(losses["accum"], losses["ref"], rtol=1e-5, atol=1e-5)


@functools.cache
def _composed_dropless(key: tuple):
    """(losses and gradient norms [STEPS, 2], final params) of the composed tiny MoE (`utils.composed_config`:
    1F1B with `stage`, ZeRO-3 with `fsdp`, the sequence-wise balance loss), dropless, on the mesh `dict(key)`."""
    config = utils.composed_config(dict(key), moe=True)
    config.model.moe_dropless = True
    records, state, _ = utils.train(config, utils.synthetic_batches(config, STEPS))
    return np.array([[r["loss"], r["grad_norm"]] for r in records]), jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize("sizes", [{"stage": 2, "fsdp": 2, "expert": 2}, {"stage": 2, "fsdp": 4}],
                         ids=["stage2xfsdp2xexpert2", "stage2xfsdp4"])
def test_experts_over_fsdp_in_pipeline_stages_train_like_data8(sizes):
    """Experts owned by fsdp x expert devices inside 1F1B's stage loop: their gradients stay on their owners
    (summed over the loop's other axes only): losses, gradient norms and parameters of data=8. (Adam's
    normalised update all but hides a gradient summed twice: the norm and the parameters do not.)"""
    got, params = _composed_dropless(_key(sizes))
    want, ref_params = _composed_dropless(_key({"data": 8}))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)
