"""Uneven pipeline stages (`pipeline.layers_per_stage`, or the default when mesh.stage does not divide
the layers): the stored layer stack holds max(layers) rows per stage (per chunk, with
`pipeline.repeats` chunks a stage), the rows past a stage's count are empty slots skipped by a
`lax.cond`; checkpoints and initialisation hold the layers in execution order, so one seed is one model
and a checkpoint restores onto any split and any schedule.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from meshtrain import config as config_lib, data, train, train_step as train_step_lib
from meshtrain.parallel import layout, pipeline
from meshtrain.validate import validate
from tests import utils

STEPS = 3
SP_PIECES = {"model.sequence_parallel": True, "model.collective_matmul": True}


def _config(mesh: dict, **overrides):
    """Six layers, short sequences, 4 micro-batches: on 4 stages the default split is 1 + 2 + 2 + 1."""
    return utils.tiny_config(mesh, **{"model.n_layers": 6, "train.seq_len": 16, "pipeline.microbatches": 4,
                                      "pipeline.schedule": "1f1b", **overrides})


@pytest.fixture(scope="module")
def reference():
    config = _config({"data": 8})
    losses, params, _ = utils.run_steps(config, utils.synthetic_batches(config, STEPS))
    return losses, params


CASES = [
    pytest.param({"stage": 4, "data": 2}, {}, id="1f1b-default"),
    pytest.param({"stage": 4, "data": 2}, {"pipeline.schedule": "gpipe"}, id="gpipe-default"),
    pytest.param({"stage": 2, "data": 4}, {"pipeline.layers_per_stage": (2, 4)}, id="1f1b-2-4"),
    pytest.param({"stage": 4, "data": 2}, {"pipeline.schedule": "zero_bubble"}, id="zero_bubble-default"),
    pytest.param({"stage": 4, "data": 2}, {"pipeline.schedule": "zero_bubble", "pipeline.split_backward": "pullback"},
                 id="zero_bubble-pullback"),
    pytest.param({"stage": 4, "data": 2}, {"pipeline.schedule": "zero_bubble", "pipeline.weight_parts": 2},
                 id="zero_bubble-w2"),
    # full remat: W's matmul inputs come from B's pullback (`SlotPlan.inputs_at_b`), in parts, overlapped: each
    # W in its B's loop step, over the step's B's (`schedules.defers_w`, `pipeline.weight_span`)
    pytest.param({"stage": 4, "data": 2}, {"pipeline.schedule": "zero_bubble", "pipeline.weight_parts": 2,
                                           "remat.policy": "full", "pipeline.overlap_transfers": True},
                 id="zero_bubble-w2-full-remat-overlap"),
    pytest.param({"stage": 2, "data": 4},
                 {"pipeline.schedule": "interleaved_1f1b", "pipeline.layers_per_stage": (4, 2)},
                 id="interleaved-v1-4-2"),
    # the 405B config's layer path: sequence parallelism as collective matmuls, full remat, in 1F1B's
    # slots and the empty slots' `lax.cond`; and in zero bubble's split backward (W reruns the rings)
    pytest.param({"stage": 4, "tensor": 2}, {**SP_PIECES, "remat.policy": "full"}, id="1f1b-collective-matmul"),
    pytest.param({"stage": 4, "tensor": 2}, {**SP_PIECES, "pipeline.schedule": "zero_bubble"},
                 id="zero_bubble-collective-matmul"),
]


@pytest.mark.parametrize("mesh, overrides", CASES)
def test_uneven_stages_train_like_one_device(reference, mesh, overrides):
    _check_against(reference, _config(mesh, **overrides), n_layers=6)


def _check_against(reference, config, n_layers: int):
    """`config` trains as `reference` (its data=8 run); its state holds zeros in the empty rows and, in
    execution order, the one-device model's layers."""
    mesh = dict(config.mesh)
    plan = layout.pipeline_plan(config, {**{a: 1 for a in utils.AXES}, **mesh})
    assert plan.uneven and sum(plan.units) == n_layers
    losses, params, _ = utils.run_steps(config, utils.synthetic_batches(config, STEPS))
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    # the state holds the stored rows; its canonical form is the one-device model's
    rows = mesh["stage"] * plan.repeats * max(plan.units)
    order = plan.execution_order(n_layers)
    empty = np.setdiff1d(np.arange(rows), order)
    assert empty.size == rows - n_layers
    for leaf in _leaves(params["layers"]):  # empty slots: zeros, and zero gradients keep them so
        assert leaf.shape[0] == rows and not np.any(leaf[empty])
    canonical = _canonical(config, params)
    for got, want in zip(_leaves(canonical), _leaves(ref_params["layers"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def reference_10():
    config = _config({"data": 8}, **{"model.n_layers": 10})
    losses, params, _ = utils.run_steps(config, utils.synthetic_batches(config, STEPS))
    return losses, params


# Ten layers on four stages in v chunks a stage (Llama 3 405B's case: 126 on 16 in v = 2 is 3 + 30 x 4 + 3):
# v = 2 splits them 1 1 1 2 2 1 1 1 over the eight chunks in execution order (stage s's chunk r is the
# (r*4 + s)-th), v = 3 as 0 1 1 1 1 1 1 1 1 1 1 0 (the first and the last chunk empty)
CHUNKED_CASES = [
    pytest.param({"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2}, id="interleaved-v2"),
    pytest.param({"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 3}, id="interleaved-v3"),
    # ... with remat.policy=attention: the chunks' named residuals in the slot tables' stash
    pytest.param({"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2, "pipeline.overlap_transfers": True,
                  "remat.policy": "attention"}, id="interleaved-v2-overlap-remat-attention"),
    pytest.param({"pipeline.schedule": "circular", "pipeline.repeats": 2}, id="circular-v2"),
    pytest.param({"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2,
                  "pipeline.layers_per_stage": (2, 1, 1, 1, 1, 1, 1, 2)}, id="interleaved-v2-given"),
]


@pytest.mark.parametrize("overrides", CHUNKED_CASES)
def test_uneven_chunks_train_like_one_device(reference_10, overrides):
    config = _config({"stage": 4, "data": 2}, **{"model.n_layers": 10, **overrides})
    _check_against(reference_10, config, n_layers=10)


def _leaves(tree):
    return jax.tree.leaves(tree)


def _canonical(config, params):
    """The stored layer rows of `params` taken in execution order (empty rows dropped)."""
    plan = layout.pipeline_plan(config, dict(config.mesh))
    order = plan.execution_order(sum(plan.units))
    return jax.tree.map(lambda a: np.asarray(a)[order], params["layers"])


def test_default_split_gives_the_ends_one_layer_fewer():
    assert pipeline.stage_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    # in chunks: the first and the last chunk lightened first, so stages 0 and 15 again hold 7 layers
    two = pipeline.stage_layers(126, 16, repeats=2)
    assert two == (3,) + (4,) * 30 + (3,)
    assert [two[s] + two[16 + s] for s in range(16)] == [7] + [8] * 14 + [7]
    assert pipeline.stage_layers(126, 16, repeats=4) == (1,) + (2,) * 62 + (1,)
    assert pipeline.stage_layers(10, 4, repeats=3) == (0,) + (1,) * 10 + (0,)
    assert pipeline.stage_layers(6, 4) == (1, 2, 2, 1)
    assert pipeline.stage_layers(9, 4) == (2, 2, 3, 2)
    assert pipeline.stage_layers(8, 4) == (2, 2, 2, 2)
    assert pipeline.stage_layers(8, 4, (1, 3, 3, 1)) == (1, 3, 3, 1)


@pytest.mark.parametrize("mesh, overrides, key", [
    ({"stage": 4, "data": 2}, {"pipeline.layers_per_stage": (2, 2, 2)}, "pipeline.layers_per_stage"),
    ({"stage": 4, "data": 2}, {"pipeline.layers_per_stage": (1, 2, 2, 2)}, "pipeline.layers_per_stage"),
    ({"stage": 4, "data": 2}, {"pipeline.layers_per_stage": (-1, 3, 2, 2)}, "pipeline.layers_per_stage"),
    ({"stage": 4, "data": 2}, {"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2,
                               "pipeline.layers_per_stage": (1, 2, 2, 1)}, "pipeline.layers_per_stage"),
    ({"data": 8}, {"pipeline.layers_per_stage": (3, 3)}, "pipeline.layers_per_stage"),
    ({"stage": 2, "sequence": 2, "tensor": 2}, {"model.n_layers": 3, "attention.impl": "ring", "remat.policy": "none"},
     "remat.policy"),
])
def test_uneven_validation_names_the_key(mesh, overrides, key):
    config = _config(mesh, **overrides)
    with pytest.raises(config_lib.ConfigError) as err:
        validate(config, 8)
    assert key in str(err.value) and len(str(err.value).splitlines()) == 1


@pytest.mark.usefixtures("compilation_cache")
def test_uneven_checkpoint_restores_onto_an_even_split_and_onto_no_pipeline(tmp_path):
    """Saved by 6 layers on 4 stages (1 + 2 + 2 + 1, 1f1b): the checkpoint holds the 6 layers in
    execution order; 3 + 3 stages, no pipeline and interleaved 1F1B in 2 chunks a stage (0 1 1 1 1 1 1 0)
    restore the same values and continue the run."""
    extra = {"model.n_layers": 6, "pipeline.microbatches": 4, "pipeline.schedule": "1f1b", "steps": 4,
             "checkpoint.every": 2, "train.batch_size": 16}
    config = utils.config_for(tmp_path, {"stage": 4, "data": 2}, **extra)
    train.run(config)
    saved = utils.losses_of(tmp_path)
    own = utils.load(tmp_path, 2, utils.abstract_state(config)).state
    interleaved = {"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2}
    for mesh, schedule in (({"stage": 2, "data": 4}, {}), ({"data": 8}, {}), ({"stage": 4, "data": 2}, interleaved)):
        other = utils.config_for(tmp_path, mesh, **{**extra, **schedule})
        run = utils.resolve(other)
        factory, step_fn = train_step_lib.build(run)
        restored = utils.load(tmp_path, 2, factory.canonical)
        utils.assert_bitwise(restored.state.params, own.params)
        state, losses = factory.from_canonical(restored.state), []
        it = data.make_iterator(run, state=restored.data_state)
        with jax.set_mesh(run.mesh):
            for _ in range(2):
                state, metrics = step_fn(state, next(it))
                losses.append(float(metrics["loss"]))
        it.close()
        np.testing.assert_allclose(losses, [saved[3], saved[4]], rtol=1e-5, atol=1e-5)
