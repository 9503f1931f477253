"""Pipeline parallelism over `stage` (playbook, "Pipeline Parallelism") against the single-device model.

Loss and gradients of every schedule equal the unpipelined model's; the compiled tick loop
runs the schedule's tick count and moves one micro-batch activation per tick; the layer
weights per device fall by p; 1F1B's temporary memory stays flat as m grows.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from meshtrain import (
    config as config_lib,
    mesh as mesh_lib,
    model as model_lib,
    train_step as train_step_lib,
)
from meshtrain.config import ModelConfig
from meshtrain.parallel import layout as layout_lib, pipeline as pipeline_lib, schedules
from meshtrain.sharding_rules import Placement, Rules
from meshtrain.validate import validate
from tests.hlo_utils import collectives_by_computation
from tests.utils import batch_sharding as utils_batch_sharding, resolve, synthetic_batches, tiny_config

SEQ, LAYERS, M = 16, 8, 4
CASES = [(schedule, mesh) for schedule in ("gpipe", "circular", "1f1b")
         for mesh in ({"stage": 2}, {"stage": 4}, {"stage": 2, "data": 2, "tensor": 2})]


def _config(schedule: str, mesh: dict, microbatches: int = M, batch: int = 8, **overrides):
    return tiny_config(mesh, **{"train.seq_len": SEQ, "train.batch_size": batch, "model.n_layers": LAYERS,
                                "pipeline.schedule": schedule, "pipeline.microbatches": microbatches,
                                "pipeline.repeats": 2 if schedule in ("circular", "interleaved_1f1b") else 1,
                                **overrides})


def _mesh(config):
    sizes = {a: max(int(config.mesh[a]), 1) for a in config_lib.MESH_AXES}
    n = int(np.prod(list(sizes.values())))
    validate(config, n)
    return mesh_lib.make_mesh(config, jax.devices()[:n])


def _sizes(**sizes) -> dict[str, int]:
    return {a: sizes.get(a, 1) for a in config_lib.MESH_AXES}


def _autodiff(params, histories, batch, model, total_tokens, accum_steps):
    del histories  # float32 matmuls: no FP8 amax histories
    loss_fn = lambda p: model.apply({"params": p}, batch, method="loss")[0]  # noqa: E731
    loss_sum, grads = jax.value_and_grad(loss_fn)(params)
    return loss_sum, {}, jax.tree.map(lambda g: g / total_tokens, grads), {}


@functools.cache
def _reference(model_items: tuple = ()):
    """Initial params, one batch, and the single-device jitted (params -> loss_sum, grads); `model_items`:
    (key, value) overrides of the model."""
    config = _config("gpipe", {}, **dict(model_items))
    mesh = _mesh(config)
    model = model_lib.Transformer(ModelConfig.from_config(config), Rules.for_mesh(mesh))
    batch = synthetic_batches(config, 1, seed=1)[0]
    with jax.set_mesh(mesh):
        params = nn.unbox(model.init(jax.random.key(0), batch["inputs"], batch["positions"],
                                     batch["segment_ids"])["params"])
        tokens = float(batch["loss_mask"].sum())
        fn = jax.jit(lambda p: _autodiff(p, {}, batch, model, tokens, 1))
        fn(params)
    params = jax.tree.map(np.asarray, params)

    def loss_and_grads(p):
        with jax.set_mesh(mesh):
            loss_sum, _, grads, _ = fn(p)
        return float(loss_sum), jax.tree.map(np.asarray, grads)
    return params, batch, tokens, loss_and_grads


@functools.cache
def _pipelined(schedule: str, mesh_items: tuple, microbatches: int = M, batch: int = 8, zero: int = 1, **overrides):
    """(pipeline, mesh, compiled (params, batch) -> (loss_sum, aux, grads)) as the train step builds it."""
    config = _config(schedule, dict(mesh_items), microbatches, batch, **{"train.zero_stage": zero, **overrides})
    mesh = _mesh(config)
    layout = layout_lib.Layout.plan(config, dict(mesh.shape))
    pipe = layout.pipeline
    model = model_lib.Transformer(ModelConfig.from_config(config), Rules.for_mesh(mesh), pipeline=pipe)
    fn = layout.grads_function(_autodiff)
    factory = train_step_lib.StateFactory(model, optax.sgd(0.1), mesh,
                                          Placement.for_zero_stage(model.rules, zero),
                                          (batch, SEQ))
    batch_sharding = utils_batch_sharding(mesh)
    example = synthetic_batches(config, 1)[0]
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda p, b: fn(p, {}, b, model, jnp.maximum(b["loss_mask"].sum(), 1.0), 1),
                           in_shardings=(factory.shardings.params, batch_sharding)).lower(
            factory.abstract.params, example).compile()
    return pipe, mesh, compiled


def _ids(case):
    schedule, mesh = case
    return schedule + "-" + "-".join(f"{a}{n}" for a, n in mesh.items())


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_loss_and_grads_equal_single_device(case):
    """float32 1e-5: loss and every gradient, circular's layers compared in execution order."""
    _assert_equal_single_device(*_pipelined(case[0], tuple(case[1].items())))


def _assert_equal_single_device(pipe, pmesh, compiled, model_items: tuple = ()):
    params, batch, tokens, reference = _reference(model_items)
    order = pipe.execution_order(LAYERS)  # order[q]: stored index of the q-th layer to run
    ref_params = {**params, "layers": jax.tree.map(lambda a: a[order], params["layers"])}
    ref_loss, ref_grads = reference(ref_params)
    ref_grads["layers"] = jax.tree.map(lambda a: a[np.argsort(order)], ref_grads["layers"])
    with jax.set_mesh(pmesh):
        loss_sum, _, grads, _ = compiled(params, batch)
    np.testing.assert_allclose(float(loss_sum) / tokens, ref_loss / tokens, rtol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        want = functools.reduce(lambda t, k: t[k.key], path, ref_grads)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def _tick_loops(hlo: str) -> list[tuple[int, list[tuple[str, int]]]]:
    """(trip count, collectives of the body) of every while loop whose body moves data."""
    collectives = collectives_by_computation(hlo)
    loops = []
    for line in hlo.splitlines():
        if " while(" in line:
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            if collectives.get(body):
                loops.append((int(trips.group(1)) if trips else -1, collectives[body]))
    return loops


@pytest.mark.parametrize("case", [c for c in CASES if "data" not in c[1]], ids=_ids)
def test_tick_loop_trip_count_and_one_transfer_per_tick(case):
    """Each tick loop runs its ticks and moves one micro-batch activation [b, T, D] per transfer: one a
    tick for gpipe / circular; 1f1b one a tick too where neighbours in opposite phases swap in one
    ppermute (`SlotPlan.pairs`, a loop of tick pairs), else (2 stages: the odd ticks send nothing) the
    table executor's two a tick, activations on and gradients back."""
    schedule, mesh = case
    pipe, _, compiled = _pipelined(schedule, tuple(mesh.items()))
    activation = (8 // M) * SEQ * 64
    loops = _tick_loops(compiled.as_text())
    # gpipe / circular: the forward loop and its autodiff transpose; 1f1b: a loop per segment of its table
    # (`SlotPlan.segments`: the forward warm-up's, then the rest)
    paired = schedule == "1f1b" and pipe.plan.pairs is not None
    assert paired == (schedule == "1f1b" and pipe.stages > 2)
    if schedule == "1f1b":
        step = 2 if paired else 1
        assert [trips for trips, _ in loops] == [(b - a) // step for a, b, _ in pipe.plan.segments], loops
        assert sum(trips for trips, _ in loops) * step == pipe.ticks
    else:
        assert [trips for trips, _ in loops] == [pipe.ticks] * 2, loops
    per_step = [("collective-permute", activation)] * (2 if schedule == "1f1b" else 1)
    for _, moved in loops:
        assert sorted(moved) == per_step, moved


def _nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layer_parameter_bytes_fall_by_stages(schedule):
    """memory_analysis: the argument bytes per device lose (1 - 1/p) of the layer weights."""
    params, batch, _, _ = _reference()
    layer_bytes, batch_bytes = _nbytes(params["layers"]), _nbytes(batch)
    for p in (2, 4):
        _, _, compiled = _pipelined(schedule, (("stage", p),))
        args = compiled.memory_analysis().argument_size_in_bytes
        assert args == _nbytes(params) - layer_bytes + layer_bytes // p + batch_bytes


@functools.cache
def _temp_bytes(schedule: str, microbatches: int) -> int:
    """Compiled temp bytes for p=2 at one row per micro-batch (the batch grows with m)."""
    _, _, compiled = _pipelined(schedule, (("stage", 2),), microbatches, microbatches)
    return compiled.memory_analysis().temp_size_in_bytes


def test_one_f_one_b_temp_memory_flat_while_gpipe_grows():
    """m = 2p -> 8p at p=2: gpipe keeps >= 1 more activation per extra micro-batch, 1f1b less than one in all."""
    activation = SEQ * 64 * 4  # one row's [T, D] float32
    table = {(s, m): _temp_bytes(s, m) for s in ("gpipe", "1f1b") for m in (4, 16)}
    print("temp bytes (schedule, m):", table)
    assert table["gpipe", 16] - table["gpipe", 4] >= 12 * activation
    assert abs(table["1f1b", 16] - table["1f1b", 4]) < activation


@pytest.mark.parametrize("overrides, key", [
    ({"model.n_layers": 1, "pipeline.schedule": "circular", "pipeline.repeats": 2}, "model.n_layers"),  # < stages
    ({"pipeline.microbatches": 1}, "pipeline.microbatches"),
    ({"train.batch_size": 6}, "train.batch_size"),
    ({"train.grad_accum_steps": 2, "train.batch_size": 16}, "train.grad_accum_steps"),
    ({"pipeline.repeats": 2, "pipeline.schedule": "gpipe"}, "pipeline.repeats"),
    ({"model.num_experts": 4, "model.moe_every": 2, "model.n_layers": 2}, "model.n_layers"),
    ({"model.num_experts": 4, "attention.impl": "pallas"}, "model.num_experts"),
    ({"pipeline.weight_parts": 2}, "pipeline.weight_parts"),  # gpipe runs no W of its own
    ({"pipeline.weight_parts": 3, "pipeline.schedule": "zero_bubble"}, "pipeline.weight_parts"),  # 4 layers a stage
    ({"pipeline.weight_parts": 2, "pipeline.schedule": "zero_bubble", "pipeline.split_backward": "pullback"},
     "pipeline.weight_parts"),
    ({"pipeline.weight_parts": 0, "pipeline.schedule": "zero_bubble"}, "pipeline.weight_parts"),
    ({"pipeline.overlap_transfers": True}, "pipeline.overlap_transfers"),  # gpipe: autodiff of a scan
    ({"pipeline.weight_parts": 2, "pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2,
      "model.n_layers": 8}, "pipeline.weight_parts"),  # its backward is one operation
])
def test_validation_names_the_key(overrides, key):
    config = _config("gpipe", {"stage": 2, "data": 2}, **overrides)
    with pytest.raises(config_lib.ConfigError, match=re.escape(f"config.{key}=")):
        validate(config, 4)


def test_describe_reports_ticks_bubble_in_flight():
    """1F1B's executed table: 2(m + p - 1) ticks, p - s micro-batches on stage s; in lock-step a tick that
    mixes forwards and backwards lasts a backward (B = 2F), so its idle share exceeds the playbook's
    (p-1)/m; with transfers behind compute its ticks alternate and it is the playbook's."""
    p, m = 4, 8
    pipe = layout_lib.pipeline_plan(_config("1f1b", {"stage": p}, microbatches=m), _sizes(stage=p))
    ratio = schedules.bubble(pipe._table)
    ticks = 2 * (m + p - 1)
    assert pipe.describe() == (f"pipeline 1f1b: {p} stages x 1 repeats, {m} micro-batches, {ticks} ticks, "
                               f"bubble {ratio / (1 + ratio):.1%}, in flight per stage {[p - s for s in range(p)]}, "
                               f"idle/busy {ratio:.3f}")
    assert ratio > (p - 1) / m
    overlapped = pipeline_lib.Pipeline("1f1b", p, m, overlap=True)
    assert schedules.bubble(overlapped._table) == pytest.approx((p - 1) / m)
    circular = pipeline_lib.Pipeline("circular", 4, 8, 2)
    assert (circular.ticks, round(circular.bubble, 4)) == (19, round(3 / 19, 4))
    assert layout_lib.pipeline_plan(_config("gpipe", {}), _sizes()) is None
    run = resolve(_config("gpipe", {"stage": 2}))
    assert run.describe() == ["mesh stage=2 (2 devices, 1 process(es))",
                              "attention: xla (attention.impl='auto' on cpu)", run.layout.pipeline.describe()]


def _done(table) -> dict:
    """(kind F | B, stage, micro-batch) -> the tick it runs in."""
    return {(op.kind, s, op.micro): t for t, row in enumerate(table) for s, op in enumerate(row) if op is not None}


@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (3, 7), (4, 4), (4, 16)])
def test_one_f_one_b_table_respects_dependencies_and_holds_at_most_p(p, m):
    """1F1B's table (`schedules.executed`): every dependency is one tick (one ppermute) away, stage s
    runs the forward of j in tick s + 2j and its backward in tick 2p - 1 - s + 2j, and never stashes
    more than p - s micro-batches (<= p). On more than 2 stages each tick's transfers fit one ppermute
    whose pairs follow the tick's parity (`SlotPlan.pairs`: neighbours in opposite phases swap), exactly
    the pairs the work needs."""
    pipe = pipeline_lib.Pipeline("1f1b", p, m)
    done = _done(pipe._table)
    assert len(done) == 2 * p * m and pipe.ticks == 2 * (m + p - 1)
    for s in range(p):
        for j in range(m):
            assert (done["F", s, j], done["B", s, j]) == (s + 2 * j, 2 * p - 1 - s + 2 * j)
            if s > 0:  # the activation arrives from the previous stage's forward, one tick earlier
                assert done["F", s, j] == done["F", s - 1, j] + 1
            nxt = ("F", s, j) if s == p - 1 else ("B", s + 1, j)  # the gradient: loss or next stage's backward
            assert done["B", s, j] == done[nxt] + 1
        held = [sum(done["F", s, j] <= t < done["B", s, j] for j in range(m)) for t in range(pipe.ticks)]
        assert max(held) == pipe.in_flight()[s] <= p
    if p == 2:  # the odd ticks send nothing (stage 0 runs a backward, stage 1 a forward and the loss)
        assert pipe.plan.pairs is None and pipe.transfers == (2 * pipe.ticks, 2)
        return
    for t in range(pipe.ticks):
        needed = {(s, s + 1) for (kind, s, _), u in done.items() if u == t and kind == "F" and s < p - 1}
        needed |= {(s, s - 1) for (kind, s, _), u in done.items() if u == t and kind == "B" and s > 0}
        assert needed <= set(pipe.plan.pairs[t % 2])
    assert pipe.transfers == (pipe.ticks, 1)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (3, 7), (4, 4), (4, 16)])
def test_overlapped_one_f_one_b_reads_every_transfer_a_tick_after_it_leaves(p, m):
    """`pipeline.overlap_transfers`: ticks alternate, a forward on every stage, then a backward; every
    result is read two ticks after the one that made it at the earliest (a tick of compute beside each
    transfer); stage s holds 2(p - s) - 1 micro-batches at most, in 2(m + 2p - 2) ticks."""
    pipe = pipeline_lib.Pipeline("1f1b", p, m, overlap=True)
    done = _done(pipe._table)
    assert len(done) == 2 * p * m and pipe.ticks == 2 * (m + 2 * p - 2)
    assert all(t % 2 == (kind == "B") for (kind, _, _), t in done.items())
    for s in range(p):
        for j in range(m):
            if s > 0:
                assert done["F", s, j] >= done["F", s - 1, j] + 2
            if s < p - 1:
                assert done["B", s, j] >= done["B", s + 1, j] + 2
            assert done["B", s, j] > done["F", s, j]
        held = [sum(done["F", s, j] <= t <= done["B", s, j] for j in range(m)) for t in range(pipe.ticks)]
        assert max(held) == pipe.in_flight()[s] == min(m, 2 * (p - s) - 1)
    assert pipe.transfers == (2 * pipe.ticks, 2)


OVERLAP_MESHES = [((("stage", 4), ("data", 2)), 1), ((("stage", 2), ("fsdp", 2), ("tensor", 2)), 3)]


@pytest.mark.parametrize("mesh, zero", OVERLAP_MESHES, ids=["stage4-data2", "stage2-fsdp2-tensor2-zero3"])
def test_overlapped_one_f_one_b_equals_single_device(mesh, zero):
    """float32 1e-5: 1F1B with transfers beside compute gives the loss and gradients of one device."""
    _assert_equal_single_device(*_pipelined("1f1b", mesh, zero=zero, **{"pipeline.overlap_transfers": True}))


@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (3, 7), (4, 4)])
def test_one_f_one_b_traces_only_the_branches_some_stage_takes(p, m):
    """The tick's switch keeps the branches some (stage, tick) takes; the rest are idle, not traced:
    2 stages have no middle stage, so no middle forward (the last stage's backward is a middle one: it
    starts from the loss gradient its forward left in its inbox)."""
    from meshtrain.parallel import slot_program

    taken = {int(b) for b in np.unique(pipeline_lib.Pipeline("1f1b", p, m).plan.program[:, :, 0])}
    assert (slot_program.FORWARD in taken) == (p > 2)
    assert {slot_program.FORWARD_FIRST, slot_program.FORWARD_LAST, slot_program.BACKWARD,
            slot_program.BACKWARD_FIRST} <= taken
    assert slot_program.WEIGHTS not in taken  # the whole backward is one operation


def test_one_f_one_b_reduces_gradients_over_data_once():
    """The 1f1b loop is manual over the batch axes the parameters are replicated on: every collective
    over `data` runs once per step (after the loop), none in the ticks."""
    from meshtrain.parallel import slot_program
    from meshtrain.plan import hlo

    pipe, mesh, compiled = _pipelined("1f1b", (("stage", 2), ("data", 2), ("tensor", 2)))
    found = hlo.collectives(compiled.as_text(), mesh.size, slot_program.branch_share(pipe.plan))
    over_data = [c for c in found if c.kind != "collective-permute"  # the stage transfers name their pairs
                 and "data" in hlo.group_axes(c.groups[0], dict(mesh.shape))]
    assert over_data and all(c.count == 1 for c in over_data), over_data


def test_one_f_one_b_stash_keeps_activations_not_weights():
    """Every stage weight among the vjp residuals is recognised and passed live, never stashed."""
    config = _config("1f1b", {})
    mesh = _mesh(config)
    model = model_lib.Transformer(ModelConfig.from_config(config), Rules.for_mesh(mesh))
    batch = synthetic_batches(config, 1)[0]
    with jax.set_mesh(mesh):
        params = nn.unbox(model.init(jax.random.key(0), batch["inputs"], batch["positions"],
                                     batch["segment_ids"])["params"])
        residuals = pipeline_lib.Residuals(pipeline_lib.stage_function(model.cfg, model.rules, model.attention_fn),
                                            {"params": params["layers"]})
        mb = {k: v[:2] for k, v in batch.items()}
        x = jnp.zeros((2, SEQ, config.model.d_model), jnp.float32)
        stash = residuals.stash(3, x, mb, ())
    weights = jax.tree.leaves(params["layers"])
    assert {k for k in residuals._kinds if k is not None} == set(range(len(weights)))
    assert len(stash) == sum(k is None for k in residuals._kinds) > 0


def test_one_f_one_b_zero3_gathers_weights_once_and_equals_single_device():
    """ZeRO-3 under 1f1b: each stage's weights are gathered once per step and kept across its
    micro-batches (every all-gather over `fsdp` runs once); loss and gradients equal one device."""
    from meshtrain.parallel import slot_program
    from meshtrain.plan import hlo

    pipe, mesh, compiled = _pipelined("1f1b", (("stage", 2), ("fsdp", 2), ("tensor", 2)), zero=3)
    _assert_equal_single_device(pipe, mesh, compiled)
    found = hlo.collectives(compiled.as_text(), mesh.size, slot_program.branch_share(pipe.plan))
    gathers = [c for c in found if c.kind == "all-gather" and "fsdp" in hlo.group_axes(c.groups[0], dict(mesh.shape))]
    assert gathers and all(c.count == 1 for c in gathers), gathers
