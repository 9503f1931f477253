"""The pipeline step as executed in lock-step (`parallel/cost.py`): ticks as long as their slowest
stage, priced from the programs the loops run and from XLA's cost analysis of each branch."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain import config as config_lib
from meshtrain.parallel import cost, layout, pipeline, schedules, slot_program
from meshtrain.plan import estimate, hardware
from tests.utils import load_config_file

GRID = [(p, m) for p in (2, 4) for m in (4, 8, 16)]


def _sizes(**axes) -> dict[str, int]:
    return {**dict.fromkeys(config_lib.MESH_AXES, 1), **axes}


def _pipeline(schedule: str, p: int, m: int, v: int = 2) -> pipeline.Pipeline:
    config = config_lib.default_config()
    config.pipeline.update(schedule=schedule, microbatches=m, repeats=v)
    return layout.pipeline_plan(config, _sizes(stage=p))


@pytest.mark.parametrize("p,m", GRID)
def test_with_every_operation_one_unit_the_model_counts_the_loops_ticks(p, m):
    """F = B = W = 1 and free transfers: a step is as many units as the loop has ticks (gpipe / circular:
    the forward loop and its transpose)."""
    unit = cost.BranchCosts(1.0, 1.0, 1.0, 1.0, recompute=False)
    for schedule in cost.SCHEDULES:
        pipe = _pipeline(schedule, p, m)
        executed = cost.step_time(schedule, p, m, pipe.repeats, unit)
        loop_ticks = pipe.ticks if schedule in pipeline.TABLE_SCHEDULES else 2 * pipe.ticks
        assert executed.ticks == loop_ticks
        if schedule in ("gpipe", "circular"):
            assert executed.seconds == pytest.approx(2 * pipe.ticks / pipe.repeats)  # chunks cost 1/v
        else:  # F, B and W each a tick's work; chunks cost 1/v
            busy = sum(any(op is not None for op in row) for row in pipe._table)
            assert executed.seconds == pytest.approx(busy / pipe.repeats)


@pytest.mark.parametrize("schedule", pipeline.TABLE_SCHEDULES)
@pytest.mark.parametrize("p,m", GRID)
def test_table_schedules_are_priced_by_the_program_the_loop_runs(schedule, p, m):
    """The model walks the schedule's table; the loop runs `slot_plan`'s integer program: per tick,
    the slowest branch any stage takes in it (idle, F, B, W), plus one transfer."""
    costs = cost.BranchCosts(1.0, 2.5, 1.3, 2.2, transfer=0.1)
    v = 2 if schedule == "interleaved_1f1b" else 1
    plan = slot_program.slot_plan(schedule, p, m, v)
    backward = costs.input_grad if plan.split else costs.backward
    price = {slot_program.IDLE: 0.0, slot_program.FORWARD: costs.forward,
             slot_program.FORWARD_FIRST: costs.forward, slot_program.FORWARD_LAST: costs.forward,
             slot_program.BACKWARD: backward, slot_program.BACKWARD_FIRST: backward,
             slot_program.WEIGHTS: costs.weight_grad}
    expected = sum(max(price[int(b)] / v for b in row[:, 0]) + costs.transfer for row in plan.program)
    assert cost.step_time(schedule, p, m, v, costs).seconds == pytest.approx(expected)


def _scaled_tiny(p: int, m: int, seq_len: int = 128):
    """The acceptance shape: the tiny model scaled to d_model 512, 8 layers, one row of `seq_len` tokens
    per micro-batch."""
    config = load_config_file("tiny")
    config.model.update(n_layers=8, d_model=512, head_dim=64, mlp_dim=1536)
    for axis in config_lib.MESH_AXES:
        config.mesh[axis] = 1
    config.mesh.stage, config.pipeline.microbatches, config.train.batch_size = p, m, m
    config.train.seq_len = seq_len
    return config


@pytest.fixture(scope="module")
def compiled_costs() -> cost.BranchCosts:
    """One stage's branches at the acceptance point: p=4, m=16, one row of the tiny config's 128 tokens (and
    the W over two micro-batches, `pipeline.weight_span=2`)."""
    config = _scaled_tiny(4, 16)
    config.pipeline.weight_span = 2
    return cost.BranchCosts.from_compiler(config, _sizes(stage=4), hardware.get_gpu("h100"))


def test_the_compiler_prices_the_branches_as_implemented(compiled_costs):
    """Each branch compiled as the loops run it (bf16, H100 roofline): the split backward's B and W
    each cost less than the fused backward and together about as much as it; the split F records the
    matmul inputs on top of F. At 128 tokens a micro-batch every branch is bound by HBM traffic, and W,
    which reads and writes the float32 gradient sums, costs more than F or B."""
    units = compiled_costs.units()
    assert 1.5 < units.backward < 4.0
    assert units.input_grad < units.backward and units.weight_grad < units.backward
    assert units.input_grad + units.weight_grad == pytest.approx(units.backward, rel=0.25)
    assert 1.0 <= units.forward_split < 1.25
    assert units.weight_grad > 1.5 * max(units.forward_split, units.input_grad)
    assert 0 < units.transfer < 0.1  # [1, 128, 512] bf16 over NVLink


def test_a_stage_of_twice_the_layers_costs_twice_as_much_when_flop_bound():
    """At 2,048 tokens a micro-batch the branches are FLOP-bound; XLA's cost analysis counts the layer
    scan's body once whatever its trip count, so the model prices one unit and multiplies: a stage of
    4 layers (p=2) costs twice a stage of 2 (p=4), branch by branch."""
    gpu = hardware.get_gpu("h100")
    two, four = (cost.BranchCosts.from_compiler(_scaled_tiny(p, 16, seq_len=2048), _sizes(stage=p), gpu)
                 for p in (4, 2))
    for branch in ("forward", "backward", "forward_split", "input_grad"):
        assert getattr(four, branch) == pytest.approx(2 * getattr(two, branch), rel=0.02), branch


def test_measured_branches_run_each_branch_in_a_loop_of_the_same_result():
    """`cost.timed`'s loop (`repeated`) computes the branch itself: after 3 runs its results equal one
    call's (the barrier passes the arguments through unchanged), on a stage's real fused backward."""
    import jax
    import jax.numpy as jnp

    config = _scaled_tiny(2, 4, seq_len=16)
    config.model.update(d_model=64, head_dim=8, mlp_dim=192)
    mesh, branches, _ = cost.stage_branches(config, _sizes(stage=2), jax.devices()[0])
    fn, shapes = branches["backward"]
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(shapes))))
    args = jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, jnp.float32).astype(a.dtype)
                        if jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros(a.shape, a.dtype), shapes)
    with jax.set_mesh(mesh):
        want = jax.jit(fn)(*args)
        outs = jax.tree.map(jnp.zeros_like, want)
        got = jax.jit(cost.repeated(fn, 3))(args, outs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jnp.array_equal(a, b)
    assert cost.timed(fn, shapes, jax.devices()[0], iterations=2, repeats=1) > 0


def test_zero_bubble_and_interleaved_beat_1f1b_as_executed(compiled_costs):
    """The acceptance point, p=4, m=16, at the compiler's branch costs in lock-step with the transfers:
    zero bubble, its W in the parts the model picks for its chunk of 2 layers (W's sums cost about two
    forwards here: two parts), takes at most 0.90 of 1F1B's step; interleaved 1F1B (v=2), its ticks
    alternating forwards and whole backwards, at most 0.95. Interleaved in `simulate`'s unit-time table
    (forwards and backwards of different stages in one tick, the split backward's W two forwards long)
    would take more than 0.95."""
    parts = cost.weight_parts(compiled_costs, 2)
    zero_bubble = cost.ratios(4, 16, 1, compiled_costs, parts)["zero_bubble"]
    one_part = cost.ratios(4, 16, 1, compiled_costs)["zero_bubble"]
    interleaved = cost.ratios(4, 16, 2, compiled_costs)["interleaved_1f1b"]
    c = compiled_costs
    price = {schedules.F: c.forward_split / 2, schedules.B: c.input_grad / 2, schedules.W: c.weight_grad / 2}
    mixed = sum(max([0.0] + [price[op.kind] for op in row if op is not None]) + c.transfer
                for row in schedules.simulate("interleaved_1f1b", 4, 16, 2))
    mixed /= cost.step_time("1f1b", 4, 16, 1, c).seconds
    print({"weight_parts": parts, "zero_bubble": round(zero_bubble, 3), "zero_bubble_one_part": round(one_part, 3),
           "interleaved_1f1b": round(interleaved, 3), "interleaved_unit_table": round(mixed, 3)})
    assert parts == 2
    assert zero_bubble <= 0.90 < one_part
    assert interleaved <= 0.95 < mixed


@pytest.mark.parametrize("schedule", pipeline.OVERLAPPING)
@pytest.mark.parametrize("p,m", GRID)
def test_overlapped_transfers_are_hidden_while_a_slot_outlasts_them(schedule, p, m):
    """`pipeline.overlap_transfers`: a transfer costs nothing while it is shorter than the slot beside
    it, and only the excess when longer; without the overlap every tick pays it whole. Only a slot in
    which no stage computes lasts the transfer."""
    costs = cost.BranchCosts(1.0, 2.5, 1.3, 2.2)
    v = 2 if schedule == "interleaved_1f1b" else 1  # chunks wrap from stage p-1 to stage 0
    free = cost.step_time(schedule, p, m, v, costs, overlap=True)
    hidden = cost.step_time(schedule, p, m, v, dataclasses.replace(costs, transfer=0.3), overlap=True)
    loop = pipeline.Pipeline(schedule, p, m, v, overlap=True)  # the loop's trip count
    # ticks in which no stage computes: 1f1b's 2(p - 1) (backward ticks of the warm-up, forward ticks of the
    # cool-down); interleaved 1F1B's alternating table has backward ticks in the warm-up too
    empty = sum(all(op is None for op in row) for row in loop._table)
    assert schedule != "1f1b" or empty == 2 * (p - 1)
    assert hidden.seconds == pytest.approx(free.seconds + 0.3 * empty)
    plain = cost.step_time(schedule, p, m, v, dataclasses.replace(costs, transfer=0.3))
    assert plain.seconds == pytest.approx(cost.step_time(schedule, p, m, v, costs).seconds + 0.3 * plain.ticks)
    # transfers longer than every slot: each slot lasts the transfer
    slow = cost.step_time(schedule, p, m, v, dataclasses.replace(costs, transfer=10.0), overlap=True)
    assert slow.seconds == pytest.approx(10.0 * slow.ticks)
    assert free.ticks == loop.ticks


def test_overlapped_1f1b_balances_its_slots(compiled_costs):
    """At the acceptance point the overlapped 1F1B runs a forward slot and a backward slot on every stage
    (no slot waits for a neighbour's heavier branch): under 0.80 of plain 1F1B's step at the compiler's
    costs, with 2p - 2 ticks more than it; zero bubble with overlap stays under 0.90."""
    parts = cost.weight_parts(compiled_costs, 2)
    base = cost.step_time("1f1b", 4, 16, 1, compiled_costs)
    one_f_one_b = cost.step_time("1f1b", 4, 16, 1, compiled_costs, overlap=True)
    config = _scaled_tiny(4, 16)  # overlapped, each W in its B's round (one micro-batch's: span 1)
    zero_bubble = cost.step_time("zero_bubble", 4, 16, 1, compiled_costs, parts, overlap=True,
                                 defer_w=pipeline.defers_w(config.pipeline.split_backward, config.remat.policy, True))
    print({"1f1b+overlap": round(one_f_one_b.seconds / base.seconds, 3),
           "zero_bubble+overlap": round(zero_bubble.seconds / base.seconds, 3)})
    assert one_f_one_b.ticks == base.ticks + 2 * 3
    assert one_f_one_b.seconds < 0.80 * base.seconds
    assert zero_bubble.seconds < 0.90 * base.seconds


def test_a_w_over_two_microbatches_reads_and_writes_the_sums_once(compiled_costs):
    """`pipeline.weight_span` at the acceptance point (the compiler's costs, where W is bound by its float32
    gradient sums): a W over two micro-batches' records costs more than one W and less than two, and the
    overlapped zero bubble the trainer runs (a W over the two B's of each loop step) takes less than with
    one W a micro-batch and than ZB-H1's W's deferred, each W in the parts that balance its ticks; the
    benchmark's pick (`cost.fastest_split`) is the span of two."""
    config = _scaled_tiny(4, 16)
    config.pipeline.weight_span = 2
    span = pipeline.w_span("zero_bubble", config.pipeline.split_backward, config.remat.policy, True,
                           config.pipeline.weight_span)
    assert span == 2 and compiled_costs.weight_grad_span[0] == span
    assert compiled_costs.weight_grad < compiled_costs.weights_over(2) < 2 * compiled_costs.weight_grad
    base = cost.step_time("1f1b", 4, 16, 1, compiled_costs).seconds

    def zero_bubble(span, defer_w=False):
        parts = cost.weight_parts(compiled_costs, 2, span)
        return cost.step_time("zero_bubble", 4, 16, 1, compiled_costs, parts, overlap=True, defer_w=defer_w,
                              span=span).seconds / base
    steps = {"span 2": zero_bubble(2), "span 1": zero_bubble(1), "deferred": zero_bubble(1, defer_w=True)}
    print({name: round(step, 3) for name, step in steps.items()})
    assert steps["span 2"] < steps["deferred"] < steps["span 1"]
    picked = cost.fastest_split("zero_bubble", 4, 16, 1, compiled_costs, 2, True, False, (1, 2))
    assert picked[0] == 2 and picked[2].seconds / base == pytest.approx(steps["span 2"])


def test_weight_parts_balance_w_against_f_and_b():
    """W cut into the divisor of the chunk's layers nearest W / max(F, B): none when W is no longer."""
    costs = cost.BranchCosts(1.0, 3.0, 1.0, 1.0)
    assert cost.weight_parts(costs, 4) == 1
    heavy = dataclasses.replace(costs, weight_grad=2.1)
    assert (cost.weight_parts(heavy, 4), cost.weight_parts(heavy, 3), cost.weight_parts(heavy, 1)) == (2, 3, 1)
    split = cost.step_time("zero_bubble", 4, 16, 1, heavy, 2)
    assert split.seconds < cost.step_time("zero_bubble", 4, 16, 1, heavy).seconds
    assert split.work == pytest.approx(cost.step_time("zero_bubble", 4, 16, 1, heavy).work)


def _planner_steps(p: int = 4, m: int = 16) -> dict[str, tuple]:
    """{schedule: (the planner's estimate, its analytic branch costs, the accumulation seconds)} of the tiny
    model scaled to p stages and m micro-batches, for 1F1B and zero bubble."""
    gpu, out = hardware.get_gpu("h100"), {}
    for schedule in ("1f1b", "zero_bubble"):
        config = _scaled_tiny(p, m)
        config.pipeline.schedule = schedule
        est = estimate.estimate(config, _sizes(stage=p), gpu)
        remat, accumulate = config.remat.policy, est.accumulate_seconds
        forward = (est.compute_seconds - m * accumulate) / (m * (3 + estimate.RECOMPUTE[remat]))
        costs = cost.BranchCosts.analytic(forward, recompute_share=estimate.RECOMPUTE[remat],
                                          recompute=remat != "none", accumulate=accumulate)
        out[schedule] = (est, costs, accumulate)
    return out


def test_the_planner_prices_the_pipeline_as_executed():
    """`plan`'s step time uses the lock-step model with the analytic branch costs (W = F, B = F + the
    recomputation, each backward adding the micro-batch's weight gradients into the float32 sums)."""
    for schedule, (est, costs, accumulate) in _planner_steps().items():
        assert accumulate > 0
        assert est.bubble_seconds == pytest.approx(cost.step_time(schedule, 4, 16, 1, costs).seconds
                                                   - est.compute_seconds)


def test_lockstep_model_on_flops_alone_gives_zero_bubble_the_shorter_step():
    """The lock-step model itself, on the planner's branch costs without the float32 accumulation (FLOPs
    alone): at p=4, m=16 zero bubble's step is shorter than 1F1B's (the playbook's claim)."""
    steps = {}
    for schedule, (_, costs, accumulate) in _planner_steps().items():
        flops_only = dataclasses.replace(costs, backward=costs.backward - accumulate,
                                         weight_grad=costs.weight_grad - accumulate)
        steps[schedule] = cost.step_time(schedule, 4, 16, 1, flops_only).seconds
    assert steps["zero_bubble"] < steps["1f1b"], steps


@pytest.mark.xfail(strict=True, reason="the planner prices this tiny model's zero bubble step at 1.103 ms against "
                   "1F1B's 0.955 ms (p=4, m=16, H100): each W adds its micro-batch's weight gradients into the float32 "
                   "sums, memory-bound and as long as a large share of this tiny model's backward, so W is far "
                   "longer than F where ZB-H1's table assumes F, B and W equal")
def test_the_planner_prices_zero_bubble_faster_than_1f1b():
    """The playbook's claim as the planner prices it, float32 accumulation included: zero bubble's step is
    shorter than 1F1B's at p=4, m=16."""
    steps = {schedule: est.compute_seconds + est.bubble_seconds for schedule, (est, _, _) in _planner_steps().items()}
    assert steps["zero_bubble"] < steps["1f1b"], steps


def test_the_pullback_split_prices_w_as_the_pullback_again():
    """`pipeline.split_backward=pullback`: W runs the stage's pullback again for the weight gradients
    (as heavy as the fused backward), B the pullback for the input gradient (reading the weights once,
    about a forward here); the planner's analytic W is 2F + the recompute."""
    config = _scaled_tiny(4, 16)
    config.pipeline.split_backward = "pullback"
    units = cost.BranchCosts.from_compiler(config, _sizes(stage=4), hardware.get_gpu("h100")).units()
    assert units.weight_grad == pytest.approx(units.backward, rel=0.05)
    assert 0.9 < units.input_grad < 0.5 * units.backward
    analytic = cost.BranchCosts.analytic(1.0, recompute_share=1.0, split_backward="pullback")
    assert (analytic.input_grad, analytic.weight_grad) == (2.0, 3.0)
