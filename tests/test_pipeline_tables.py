"""Interleaved 1F1B and zero bubble (ZB-H1) run from their slot tables in one SPMD loop
(playbook, "Interleaving stages", "Zero Bubble and DualPipe"; `meshtrain/parallel/pipeline_tables.py`).

Loss and every gradient equal the single-device model's (float32, 1e-5) on stage 2 and 4, beside
`data`, `tensor` and ZeRO-3; the static program a table compiles to hands every operation the value
it needs (replayed in Python); its buffers and the compiled temp memory stay flat as m grows.
"""

from __future__ import annotations

import re

import pytest

from meshtrain import config as config_lib
from meshtrain.parallel import layout as layout_lib, pipeline as pipeline_lib, schedules, slot_program
from meshtrain.parallel.slot_program import FIELDS, SlotPlan, slot_plan
from meshtrain.validate import validate
from tests.test_pipeline import SEQ, _assert_equal_single_device, _config, _pipelined, _sizes, _temp_bytes

SCHEDULES = ("interleaved_1f1b", "zero_bubble")
# (mesh, ZeRO stage): stage 2 and 4, each beside data, tensor and ZeRO-3 (8 devices)
MESHES = [({"stage": 2, "data": 2, "tensor": 2}, 1), ({"stage": 2, "fsdp": 2, "tensor": 2}, 3),
          ({"stage": 4, "data": 2}, 1), ({"stage": 4, "tensor": 2}, 1), ({"stage": 4, "fsdp": 2}, 3)]
CASES = [(s, mesh, zero) for s in SCHEDULES for mesh, zero in MESHES]


def _id(case):
    schedule, mesh, zero = case
    return f"{schedule}-" + "-".join(f"{a}{n}" for a, n in mesh.items()) + f"-zero{zero}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_loss_and_grads_equal_single_device(case):
    schedule, mesh, zero = case
    _assert_equal_single_device(*_pipelined(schedule, tuple(mesh.items()), zero=zero))


PULLBACK = [("zero_bubble", mesh, zero) for mesh, zero in (MESHES[0], MESHES[-1])]


# W in parts (`pipeline.weight_parts`): each a slice of the chunk's layers
PARTS = [("zero_bubble", {"stage": 4, "fsdp": 2}, 3, 2), ("zero_bubble", {"stage": 2, "data": 2, "tensor": 2}, 1, 2)]


@pytest.mark.parametrize("case", PARTS, ids=[_id(c[:3]) + f"-parts{c[3]}" for c in PARTS])
def test_weight_parts_equal_single_device(case):
    """`pipeline.weight_parts`: W of a micro-batch runs as parts, each the weight GEMMs of a slice of
    the chunk's layers added to that slice's gradient sums."""
    schedule, mesh, zero, parts = case
    _assert_equal_single_device(*_pipelined(schedule, tuple(mesh.items()), zero=zero,
                                            **{"pipeline.weight_parts": parts}))


OVERLAP = [("zero_bubble", {"stage": 4, "fsdp": 2}, 3), ("zero_bubble", {"stage": 2, "data": 2, "tensor": 2}, 1),
           ("interleaved_1f1b", {"stage": 4, "data": 2}, 1)]


@pytest.mark.parametrize("case", OVERLAP, ids=[_id(c) for c in OVERLAP])
def test_overlapped_transfers_equal_single_device(case):
    """`pipeline.overlap_transfers`: each tick's outputs travel during the next tick (a table simulated
    with a tick of latency); loss and gradients still those of one device."""
    schedule, mesh, zero = case
    _assert_equal_single_device(*_pipelined(schedule, tuple(mesh.items()), zero=zero,
                                            **{"pipeline.overlap_transfers": True}))


# Tied embeddings: the embedding's gradient rides in the switch, from the head (last stage) and the lookup
# (stage 0's backward); every other backward still sends its input gradient upstream
TIED = [("zero_bubble", {"stage": 2, "data": 2, "tensor": 2}, 1), ("interleaved_1f1b", {"stage": 4, "fsdp": 2}, 3)]


@pytest.mark.parametrize("case", TIED, ids=[_id(c) for c in TIED])
def test_tied_embeddings_equal_single_device(case):
    schedule, mesh, zero = case
    tied = (("model.tie_embeddings", True),)
    _assert_equal_single_device(*_pipelined(schedule, tuple(mesh.items()), zero=zero, **dict(tied)), tied)


# `pipeline.weight_span`: each W over the B's of its loop step (one W a micro-batch, the default, in the cases
# above); two; three, in parts (4 micro-batches: W's over 1, 2 and 3 of them)
SPANS = [("zero_bubble", {"stage": 2, "data": 2, "tensor": 2}, 1, 2, 1, 4, 8),
         ("zero_bubble", {"stage": 4, "fsdp": 2}, 3, 3, 2, 4, 8)]


@pytest.mark.parametrize("case", SPANS, ids=[_id(c[:3]) + f"-span{c[3]}-parts{c[4]}-m{c[5]}" for c in SPANS])
def test_weight_span_equals_single_device(case):
    """`pipeline.weight_span`: with transfers behind compute each W computes the weight gradients of the
    micro-batches whose B's ran in its loop step, from the records they handed it, and adds them to the
    sums once; loss and gradients those of one device."""
    schedule, mesh, zero, span, parts, m, batch = case
    _assert_equal_single_device(*_pipelined(schedule, tuple(mesh.items()), microbatches=m, batch=batch, zero=zero,
                                            **{"pipeline.overlap_transfers": True, "pipeline.weight_span": span,
                                               "pipeline.weight_parts": parts}))


# remat `none`: a stage keeps every value its backward reads but dtype and layout copies (`model.copies_not_kept`)
NONE = [("zero_bubble", {"stage": 4, "fsdp": 2}, 3, {}),
        ("zero_bubble", {"stage": 2, "data": 2, "tensor": 2}, 1, {"pipeline.overlap_transfers": True}),
        ("interleaved_1f1b", {"stage": 4, "data": 2}, 1, {}),
        ("gpipe", {"stage": 4, "data": 2}, 1, {})]  # ring attention in the slots: tests/utils.COMPOSED_RIDERS


@pytest.mark.parametrize("case", NONE, ids=[_id(c[:3]) + "".join(f"-{v}" for v in c[3].values()) for c in NONE])
def test_remat_none_equals_single_device(case):
    """Remat `none` on the slot tables (fused and split backward, W's inputs from F and from B) and in the
    autodiff loop: loss and gradients those of one device, with the stages' dtype and layout copies made
    again in the backward (`model.copies_not_kept`)."""
    schedule, mesh, zero, overrides = case
    _assert_equal_single_device(*_pipelined(schedule, tuple(mesh.items()), zero=zero,
                                            **{"remat.policy": "none", **overrides}))


@pytest.mark.parametrize("branch", ["forward", "split_forward"])
def test_remat_none_stashes_no_copy_of_the_weights(branch):
    """What a stage's forward keeps for its backward under remat `none` (a stash slot's residuals,
    `cost.stage_branches`): no residual is a function of the weights alone (their compute-dtype copies,
    the gate and up weights joined), each is held a micro-batch in flight; every one that changes with the
    weights also changes with the input. Under `none` without `model.copies_not_kept` the joined and cast
    weights are among them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshtrain.parallel import cost

    config = _config("1f1b", {"stage": 2}, **{"remat.policy": "none", "model.dtype": "bfloat16"})
    sizes = {**{a: 1 for a in config_lib.MESH_AXES}, "stage": 2}
    mesh, branches, _ = cost.stage_branches(config, sizes, jax.devices()[0])
    fn, (w, x, pos) = branches[branch]
    keys = iter(jax.random.split(jax.random.key(0), 64))

    def filled(tree):
        return jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, jnp.float32).astype(a.dtype), tree)
    w0, w1, x0, x1 = filled(w), filled(w), filled(x), filled(x)
    positions = jnp.broadcast_to(jnp.arange(pos.shape[1], dtype=jnp.int32), pos.shape)
    with jax.set_mesh(mesh):
        kept = [jax.tree.leaves(jax.jit(fn)(wi, xi, positions)[1]) for wi, xi in ((w0, x0), (w1, x0), (w0, x1))]
    weights_only = [a.shape for a, by_w, by_x in zip(*kept, strict=True)
                    if not np.array_equal(a, by_w) and np.array_equal(a, by_x)]
    assert len(kept[0]) > 4 and not weights_only, weights_only


@pytest.mark.parametrize("case", PULLBACK, ids=[_id(c) for c in PULLBACK])
def test_pullback_split_equals_single_device(case):
    """`pipeline.split_backward=pullback`: W runs the stage's pullback again from the residuals."""
    schedule, mesh, zero = case
    _assert_equal_single_device(*_pipelined(schedule, tuple(mesh.items()), zero=zero,
                                            **{"pipeline.split_backward": "pullback"}))


def _replay(plan: SlotPlan, p: int, m: int, v: int) -> dict:
    """Runs the program on tags instead of arrays: every buffer slot holds the name of the value in
    it, and each operation checks it reads the value it needs. Returns {(kind, s, j, c): tick}.
    `SlotPlan.inputs_at_b`: B's record (matmul inputs and output gradients) in a weight slot until W, or
    under `SlotPlan.handoff` in no slot: W's parts then run in B's loop step (one round of tick kinds), over
    every record the step's B's handed (`SlotPlan.span`)."""
    f = {name: i for i, name in enumerate(FIELDS)}
    stash = [[None] * (plan.stash_slots) for _ in range(p)]  # vjp residuals, F to B (gemms: then dy, B to W)
    weight = [[None] * (plan.weight_slots) for _ in range(p)]  # gemms: matmul inputs (F to W); pullback: dy
    pullback = plan.split and not plan.gemms  # pullback: the stage's dy (B to W)
    at_b = plan.gemms and plan.inputs_at_b  # B's record, B to W
    gemms = plan.gemms and not at_b  # F's record, F to W
    step = 2 * plan.span + plan.weight_parts  # ticks of a loop step under the handoff
    handed = [[] for _ in range(p)]  # handoff: the records B's switches returned this loop step
    parts_run = {}  # (s, j, c) -> W parts run so far
    inbox_f = [[None] * (plan.inbox_f_slots + 1) for _ in range(p)]
    inbox_b = [[None] * (plan.inbox_b_slots + 1) for _ in range(p)]
    ran = {}
    in_flight = []  # latency 1: what the last tick sent, travelling during this one
    for t in range(plan.ticks):
        sent_f, sent_b = [None] * p, [None] * p
        if t % step == 0:  # a loop step hands nothing to the next
            handed = [[] for _ in range(p)]
        for s in range(p):
            row = plan.program[t, s]
            branch, j, c, slot, wslot = (int(row[f[k]]) for k in ("branch", "micro", "chunk", "stash", "wstash"))
            if branch in (slot_program.FORWARD, slot_program.FORWARD_FIRST, slot_program.FORWARD_LAST):
                if branch != slot_program.FORWARD_FIRST:
                    assert inbox_f[s][row[f["read_f"]]] == ("act", s, j, c), (t, s)
                assert stash[s][slot] is None, f"tick {t} stage {s}: residual slot {slot} still in use"
                stash[s][slot] = (s, j, c)
                if gemms:
                    assert weight[s][wslot] is None, f"tick {t} stage {s}: weight slot {wslot} still in use"
                    weight[s][wslot] = ("inputs", s, j, c)
                if branch == slot_program.FORWARD_LAST:
                    inbox_b[s][row[f["dy"]]] = ("grad", s, j, c)
                else:
                    sent_f[s] = ("act", (s + 1) % p, j, c + (s == p - 1))
                ran["F", s, j, c] = t
            elif branch in (slot_program.BACKWARD, slot_program.BACKWARD_FIRST):
                assert inbox_b[s][row[f["read_b"]]] == ("grad", s, j, c), (t, s)
                assert stash[s][slot] == (s, j, c), (t, s)
                if not pullback:  # the pullback split's W reads the residuals again
                    stash[s][slot] = None
                if gemms:  # the output gradients go over the residuals, in the micro-batch's record
                    assert slot == wslot and weight[s][wslot] == ("inputs", s, j, c), (t, s)
                    stash[s][slot] = ("dy", s, j, c)
                if pullback or at_b and not plan.handoff:
                    assert weight[s][wslot] is None, f"tick {t} stage {s}: weight slot {wslot} still in use"
                    weight[s][wslot] = ("inputs and dy", s, j, c)
                if plan.handoff:
                    handed[s].append(("inputs and dy", s, j, c, t // step))
                if branch == slot_program.BACKWARD:
                    sent_b[s] = ("grad", (s - 1) % p, j, c - (s == 0))
                ran["B", s, j, c] = t
            elif branch == slot_program.WEIGHTS:
                if gemms:
                    assert weight[s][wslot] == ("inputs", s, j, c) and stash[s][wslot] == ("dy", s, j, c), (t, s)
                elif plan.handoff:  # in B's loop step, after it, over every record its B's handed
                    assert handed[s] and handed[s][0] == ("inputs and dy", s, j, c, t // step), (t, s, handed[s])
                    assert len(handed[s]) <= plan.span
                else:
                    assert weight[s][wslot] == ("inputs and dy", s, j, c), (t, s)
                part = parts_run.get((s, j, c), 0)
                assert int(row[f["part"]]) == part, (t, s)  # the parts in order, each once
                parts_run[s, j, c] = part + 1
                if part + 1 < plan.weight_parts:  # the last part frees what W reads
                    _check_puts(plan, t, s, branch, stash[s], weight[s], gemms, pullback)
                    continue
                if not plan.handoff:
                    weight[s][wslot] = None
                if gemms:
                    stash[s][wslot] = None
                if pullback:
                    assert stash[s][slot] == (s, j, c), (t, s)
                    stash[s][slot] = None
                for record in handed[s] if plan.handoff else [(None, s, j, c)]:
                    ran["W", *record[1:4]] = t
            _check_puts(plan, t, s, branch, stash[s], weight[s], gemms, pullback)
        in_flight.append((sent_f, sent_b))
        if len(in_flight) <= plan.latency:
            continue
        sent_f, sent_b = in_flight.pop(0)
        for s in range(p):  # the two ppermutes, then the inbox writes
            arriving_f, arriving_b = sent_f[(s - 1) % p], sent_b[(s + 1) % p]
            if arriving_f is not None:
                assert arriving_f[1] == s and row_slot(plan, t, s, "recv_f") < plan.inbox_f_slots
            if arriving_b is not None:
                assert arriving_b[1] == s and row_slot(plan, t, s, "recv_b") < plan.inbox_b_slots
            inbox_f[s][row_slot(plan, t, s, "recv_f")] = arriving_f
            inbox_b[s][row_slot(plan, t, s, "recv_b")] = arriving_b
    return ran


def _check_puts(plan: SlotPlan, t: int, s: int, branch: int, stash: list, weight: list, gemms: bool,
                pullback: bool) -> None:
    """After stage s's operation at tick t: the tick writes each buffer's `put` into the program's slot,
    the operation's own where it fills the buffer, else one whose value nobody reads any more, or the
    slot's own value back (`keep_*`)."""
    forward = branch in (slot_program.FORWARD, slot_program.FORWARD_FIRST, slot_program.FORWARD_LAST)
    backward = branch in (slot_program.BACKWARD, slot_program.BACKWARD_FIRST)
    # gemms: the record (residuals, then dy) in "stash", the inputs in "inputs"; pullback: dy in "g";
    # inputs_at_b: B's inputs and dy in "inputs" (not carried under the handoff)
    at_b = plan.gemms and plan.inputs_at_b
    fills = {"stash": forward or gemms and backward, "inputs": backward if at_b else forward, "g": backward}
    for name in ("stash", "inputs", "g"):
        if name == "inputs" and not (gemms or at_b and not plan.handoff) or name == "g" and not pullback:
            continue
        k, keep = row_slot(plan, t, s, f"put_{name}"), row_slot(plan, t, s, f"keep_{name}")
        if fills[name]:
            assert not keep and k == row_slot(plan, t, s, "stash" if name == "stash" else "wstash"), (t, s, name)
        elif not keep:
            held = stash[k] if name == "stash" else weight[k]
            assert held is None, (t, s, name, k, held)  # nothing there still to be read


def row_slot(plan: SlotPlan, t: int, s: int, name: str) -> int:
    return int(plan.program[t, s, FIELDS.index(name)])


# zero bubble's splits; interleaved 1F1B's backward is one operation (alternating ticks)
SPLITS = {"zero_bubble": (("gemms", 1), ("gemms", 3), ("pullback", 1)), "interleaved_1f1b": (("gemms", 1),)}
PROGRAMS = [(schedule, *split, latency, False) for schedule in SCHEDULES for split in SPLITS[schedule]
            for latency in ((0, 1) if schedule in pipeline_lib.OVERLAPPING and split[0] == "gemms" else (0,))]
# W's inputs from B (`pipeline.inputs_at_b`): in weight slots (plain: deferred W's), or handed over
PROGRAMS += [("zero_bubble", "gemms", parts, latency, True) for parts in (1, 3) for latency in (0, 1)]
# handed over, each W over the B's of its loop step (`pipeline.weight_span`)
PROGRAMS += [("zero_bubble", "gemms", parts, 1, True, span) for parts in (1, 3) for span in (2, 3)]


@pytest.mark.parametrize("schedule, split_backward, parts, latency, inputs_at_b, span",
                         [case + (1,) * (6 - len(case)) for case in PROGRAMS])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_program_hands_every_operation_its_inputs(schedule, p, split_backward, parts, latency, inputs_at_b, span):
    """Every F and B of every micro-batch and chunk runs once, on the table's tick, reading the
    activation / gradient it needs from the slot the program names, never overwriting a value still
    waiting; every W runs once (its parts in order, the last freeing what they read). Buffer sizes
    do not grow with m. Latency 1 (`pipeline.overlap_transfers`): what a tick sends
    lands at the end of the next tick, and nothing reads it before. W's inputs from B with latency 1:
    the handoff, each W's parts in its B's loop step (`span` > 1: over all of the step's B's). m odd too."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    sizes = {}
    for m in (p, 2 * p, 4 * p) + ((2 * p + 1,) if span > 1 else ()):
        plan = slot_plan(schedule, p, m, v, split_backward, parts, latency, inputs_at_b, span)
        assert plan.handoff == (inputs_at_b and latency == 1) and plan.span == span
        ran = _replay(plan, p, m, v)
        table = schedules.executed(schedule, p, m, v, parts, latency, schedules.defers_w(latency, inputs_at_b), span)
        schedules.check(table, p, m, v, plan.split, latency)
        kinds = "FBW" if plan.split else "FB"
        want = {(one.kind, s, one.micro, one.chunk): t for t, row in enumerate(table) for s, op in enumerate(row)
                if op is not None and op.kind in kinds and (op.kind != schedules.W or op.part == parts - 1)
                for one in op.covers()}
        if span > 1 and m >= 2 * span:  # some W covers `span` micro-batches
            assert max(op.span for row in table for op in row if op is not None) == span
        assert ran == want
        sizes[m] = (plan.stash_slots, plan.weight_slots, plan.inbox_f_slots, plan.inbox_b_slots)
    assert sizes[2 * p] == sizes[4 * p], sizes


@pytest.mark.parametrize("schedule, v, latency", [("interleaved_1f1b", 2, 0), ("interleaved_1f1b", 4, 1),
                                                   ("zero_bubble", 1, 0), ("1f1b", 1, 1)])
@pytest.mark.parametrize("p", [2, 4, 16])
def test_segments_cover_the_program_and_skip_no_gradient(schedule, v, latency, p):
    """`SlotPlan.segments`: consecutive tick ranges, in order, covering the program in whole loop steps
    (two ticks from an even one, or one); with several chunks a stage only the ticks where some stage runs
    a backward or W switch over every branch (and add the gradients), the others over the idle and
    forward branches only; with one chunk, one loop (its switch adds in place)."""
    plan = slot_plan(schedule, p, 2 * p, v, "gemms", 1, latency)
    segments = plan.segments
    assert [a for a, _, _ in segments] == [0] + [b for _, b, _ in segments[:-1]]
    assert segments[-1][1] == plan.ticks
    step = 1 if plan.pairs is None else 2
    if v == 1:
        assert segments == ((0, plan.ticks, (slot_program.BRANCHES,) * step),)
        return
    grads = (plan.program[:, :, 0] >= slot_program.BACKWARD).any(axis=1)
    for a, b, sizes in segments:
        assert (b - a) % len(sizes) == 0 and (len(sizes) == 1 or a % 2 == 0)
        assert plan.pairs is None or (len(sizes) == 2 and a % 2 == b % 2 == 0)
        for j, size in enumerate(sizes):
            ticks = plan.program[a + j:b:len(sizes), :, 0]
            assert ticks.max() < size  # every operation has its branch in the loop's switch
            assert size in (slot_program.BACKWARD, slot_program.BRANCHES)
    rows = slot_program.segment_rows(plan)
    assert sum(r.shape[0] for r in rows.values()) == plan.ticks
    assert rows[slot_program.BRANCHES].shape[0] == grads.sum()  # the gradients added only where some arrive
    assert 0 < segments[0][1] < plan.ticks  # a warm-up of forwards only, without the gradient add


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_temp_memory_flat_as_microbatches_grow(schedule):
    """m = 2p -> 8p at p=2 (one row per micro-batch): the compiled temp memory grows by less than one
    micro-batch activation in all (gpipe grows by one or more per micro-batch: test_pipeline)."""
    activation = SEQ * 64 * 4  # one row's [T, D] float32
    small, large = _temp_bytes(schedule, 4), _temp_bytes(schedule, 16)
    print(f"{schedule} temp bytes m=4: {small}, m=16: {large}")
    assert abs(large - small) < activation


def test_describe_and_validation():
    line = layout_lib.pipeline_plan(_config("zero_bubble", {"stage": 4}, microbatches=8), _sizes(stage=4)).describe()
    table = schedules.simulate("zero_bubble", 4, 8)
    assert line.startswith(f"pipeline zero_bubble: 4 stages x 1 repeats, 8 micro-batches, {len(table)} ticks")
    assert line.endswith(f"in flight per stage {schedules.in_flight(table)}, idle/busy {schedules.bubble(table):.3f}")
    pipe = layout_lib.pipeline_plan(_config("interleaved_1f1b", {"stage": 2}), _sizes(stage=2))
    assert pipe.repeats == 2 and pipe.ticks == len(schedules.alternating("interleaved_1f1b", 2, 4, 2))
    config = _config("interleaved_1f1b", {"stage": 4, "data": 2}, microbatches=6, batch=12)
    with pytest.raises(config_lib.ConfigError, match=re.escape("config.pipeline.microbatches=6")):
        validate(config, 8)


@pytest.mark.parametrize("schedule, mesh", [("zero_bubble", {"stage": 2, "expert": 2, "data": 2}),
                                            ("interleaved_1f1b", {"stage": 2, "sequence": 2, "fsdp": 2})],
                         ids=["zero_bubble-stage-expert-data", "interleaved_1f1b-stage-sequence-fsdp"])
def test_composes_like_data8(schedule, mesh):
    """The slot-table loop with what the other axes bring (test_compose): MoE with expert parallelism,
    ring attention over `sequence` inside the slots, ZeRO-3: 3 steps train to the losses and
    parameters of `data=8` (parameters compared in execution order)."""
    import chex
    import jax
    import numpy as np

    from tests import test_compose
    from tests.utils import composed_config

    config = composed_config(mesh)
    config.pipeline.schedule = schedule
    config.pipeline.repeats = 2 if schedule == "interleaved_1f1b" else 1
    losses, params = test_compose._train(config)
    ref_losses, ref_params = test_compose._reference("expert" in mesh, "sequence" in mesh)
    pipe = pipeline_lib.Pipeline(schedule, 2, config.pipeline.microbatches, config.pipeline.repeats)
    units = config.model.n_layers // (config.model.moe_every if config.model.num_experts else 1)  # scanned units
    order = pipe.execution_order(units)
    params = {**params, "layers": jax.tree.map(lambda a: a[order], params["layers"])}
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)
