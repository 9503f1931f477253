"""Pipeline slot tables (`meshtrain/parallel/schedules.py`): every dependency respected, every F / B / W of
every micro-batch exactly once, and the executed tables' bubble equal to each schedule's published formula
(`PAPER_BUBBLE`, written here, not read from the registry)."""

from __future__ import annotations

import pathlib

import pytest

from meshtrain.parallel import schedules

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]

# The bubble ratios as the literature gives them, written here independently of the registry: the playbook's
# (p - 1) / m for GPipe (AFAB) and 1F1B and (p - 1) / (v m) for interleaved 1F1B ("Pipeline Parallelism"),
# and ZB-H1's third of 1F1B's (Qi et al., "Zero Bubble Pipeline Parallelism": F, B and W one unit each).
PAPER_BUBBLE = {
    "gpipe": lambda p, m, v: (p - 1) / m,
    "1f1b": lambda p, m, v: (p - 1) / m,
    "interleaved_1f1b": lambda p, m, v: (p - 1) / (v * m),
    "zero_bubble": lambda p, m, v: (p - 1) / (3 * m),
}


@pytest.mark.parametrize("schedule", schedules.SCHEDULES)
@pytest.mark.parametrize("p, m", GRID)
def test_table_respects_dependencies_and_meets_its_bubble_formula(schedule, p, m):
    v = 2 if schedule == "interleaved_1f1b" else 1
    table = schedules.simulate(schedule, p, m, v)
    schedules.check(table, p, m, v, split=schedule == "zero_bubble")
    assert schedules.bubble(table) == pytest.approx(PAPER_BUBBLE[schedule](p, m, v), rel=1e-12)
    assert schedules.formula(schedule, p, m, v) == pytest.approx(PAPER_BUBBLE[schedule](p, m, v), rel=1e-12)


@pytest.mark.parametrize("p, m", GRID)
def test_zero_bubble_is_a_third_of_1f1b_at_the_same_peak_memory(p, m):
    zb, one = schedules.simulate("zero_bubble", p, m), schedules.simulate("1f1b", p, m)
    assert schedules.bubble(zb) <= 0.4 * schedules.bubble(one)
    assert max(schedules.in_flight(zb)) <= max(schedules.in_flight(one)) == p


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_interleaved_activations_are_bounded_independent_of_m(p, v):
    """Stage s holds at most (p - s - 1) * 2 + (v - 1) * p + 1 chunk activations, whatever m."""
    bound = [(p - s - 1) * 2 + (v - 1) * p + 1 for s in range(p)]
    for m in (p, 4 * p, 8 * p):
        held = schedules.in_flight(schedules.simulate("interleaved_1f1b", p, m, v))
        assert all(h <= b for h, b in zip(held, bound, strict=True)), (m, held, bound)
    assert schedules.in_flight(schedules.simulate("interleaved_1f1b", p, 8 * p, v)) == \
        schedules.in_flight(schedules.simulate("interleaved_1f1b", p, 4 * p, v))


@pytest.mark.parametrize("p, m", GRID)
@pytest.mark.parametrize("v", [1, 2, 4])
def test_alternating_ticks_keep_the_orders_bubble_and_memory(p, m, v):
    """Interleaved 1F1B as the trainer runs it: forward ticks and backward ticks alternate. Every
    dependency holds (also with a tick of transfer latency, which changes nothing: a result is read two
    ticks on at the earliest), each stage runs its Megatron order, the time-weighted bubble (F one unit,
    the whole backward two) is the formula's and the in-flight peak the unit-time table's."""
    table = schedules.alternating("interleaved_1f1b", p, m, v)
    schedules.check(table, p, m, v)
    schedules.check(table, p, m, v, latency=1)
    assert schedules.alternating("interleaved_1f1b", p, m, v, latency=1) == table
    assert all(op is None or op.kind == "FB"[t % 2] for t, row in enumerate(table) for op in row)
    orders = schedules.stage_orders("interleaved_1f1b", p, m, v)
    for s in range(p):
        assert [row[s] for row in table if row[s] is not None] == [op for op in orders[s] if op.kind != schedules.W]
    assert schedules.bubble(table) == pytest.approx(PAPER_BUBBLE["interleaved_1f1b"](p, m, v), rel=1e-12)
    assert schedules.in_flight(table) == schedules.in_flight(schedules.simulate("interleaved_1f1b", p, m, v))
    assert len(table) == 2 * (v * m + v * p + p - 2)  # ticks: v m + v p + p - 2 forward-backward pairs


@pytest.mark.parametrize("schedule", schedules.SPLIT_BACKWARD)
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16)])
def test_weight_parts_split_every_w_keeping_the_in_flight_peak(schedule, p, m, parts):
    """W in `parts` operations: each part of each W runs once, in order, after its B; the peak of
    micro-batches held (F to the last part of W) stays the one-part table's, and the table has one more
    tick per extra part of each W, less the idle ticks the parts fill."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    one, split = schedules.simulate(schedule, p, m, v), schedules.simulate(schedule, p, m, v, parts)
    schedules.check(split, p, m, v, split=True)
    assert schedules.weight_parts(split) == parts
    for s in range(p):
        ws = [(op.micro, op.chunk, op.part) for row in split for op in (row[s],) if op and op.kind == schedules.W]
        assert ws == [(j, c, i) for j, c, _ in ws[::parts] for i in range(parts)]
    assert schedules.in_flight(split) == schedules.in_flight(one)
    extra = (parts - 1) * m * v
    idle_one = sum(op is None for row in one for op in row) // p
    assert len(one) + extra - idle_one <= len(split) <= len(one) + extra


def test_weight_parts_need_a_split_backward():
    with pytest.raises(ValueError, match="weight_parts"):
        schedules.stage_orders("1f1b", 2, 4, weight_parts=2)


def test_check_rejects_a_split_table_without_its_w():
    """A table without W is an alternating one (B the whole backward), unless the backward is split."""
    table = [[op if op is None or op.kind != schedules.W else None for op in row]
             for row in schedules.simulate("zero_bubble", 2, 4)]
    with pytest.raises(AssertionError, match="missing"):
        schedules.check(table, 2, 4, split=True)


def test_check_rejects_a_table_that_uses_a_gradient_before_it_exists():
    table = schedules.simulate("1f1b", 2, 2)
    swapped = [list(row) for row in table]
    t = next(i for i, row in enumerate(swapped) if row[0] is not None and row[0].kind == schedules.B)
    swapped[t - 1][0], swapped[t][0] = swapped[t][0], swapped[t - 1][0]
    with pytest.raises(AssertionError):
        schedules.check(swapped, 2, 2)


def test_unknown_schedule_and_indivisible_interleaving_are_refused():
    with pytest.raises(ValueError, match="expected one of"):
        schedules.stage_orders("dualpipe", 2, 4)
    with pytest.raises(ValueError, match="divisible"):
        schedules.stage_orders("interleaved_1f1b", 4, 6, 2)


def test_bench_draws_every_schedule(tmp_path):
    """`python bench/schedules.py --draw DIR` writes one PNG per schedule and prints the JSON line."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "schedules.py"), "--stages", "2", "--microbatches",
                          "4", "--draw", str(tmp_path)], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert {r["schedule"] for r in rows} == set(schedules.SCHEDULES)
    for name in schedules.SCHEDULES:
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_registry_defines_each_schedule_the_config_offers():
    """`pipeline.schedule`'s choices are the registry's names; every derived list is read off it."""
    from meshtrain import config as config_lib

    assert config_lib.PIPELINE_SCHEDULES == tuple(schedules.REGISTRY)
    assert schedules.BASELINE in schedules.TABLE_SCHEDULES
    for name, entry in schedules.REGISTRY.items():
        assert entry.name == name and (name in schedules.SCHEDULES) == (entry.orders is not None)
        assert (name in schedules.TABLE_SCHEDULES) == (entry.table is not None)
        if name in PAPER_BUBBLE:  # circular's ring: interleaved's ratio at v = pipeline.repeats
            assert entry.bubble(4, 8, 2) == pytest.approx(PAPER_BUBBLE[name](4, 8, 2), rel=1e-12)
    assert set(schedules.SCHEDULES) <= set(PAPER_BUBBLE)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (3, 7), (4, 8), (4, 16), (8, 8), (16, 16)])
def test_one_f_one_b_overlapped_table_is_its_alternating_orders(p, m):
    """1F1B's overlapped table, built in closed form, is what `alternating` makes of its orders with the
    warm-up doubled (latency 1): interleaved 1F1B's table at v = 1 where p divides m; it passes `check`."""
    table = [list(row) for row in schedules.executed("1f1b", p, m, latency=1)]
    orders = [[op for op in order if op.kind != schedules.W]
              for order in schedules.stage_orders("1f1b", p, m, latency=1)]
    assert table == schedules._run(orders, p, 1, split=True, latency=1, kinds=(schedules.F, schedules.B), what="")
    schedules.check(table, p, m, latency=1)
    if m % p == 0:
        assert table == [list(row) for row in schedules.executed("interleaved_1f1b", p, m, 1, latency=1)]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (16, 16)])
@pytest.mark.parametrize("parts", [1, 2])
def test_zero_bubble_without_deferral_holds_one_record_in_the_same_aligned_ticks(p, m, parts):
    """Where B hands W its inputs (`defers_w`: full remat, transfers behind compute) each W runs in the
    first W tick after its B: the aligned table keeps its ticks and the forwards' in-flight peak, passes
    `check`, and the slot plan holds one record where ZB-H1's deferral holds p of them."""
    from meshtrain.parallel import slot_program

    assert not schedules.defers_w(1, True) and schedules.defers_w(0, True) and schedules.defers_w(1, False)
    deferred, prompt = (schedules.executed("zero_bubble", p, m, 1, parts, 1, defer) for defer in (True, False))
    schedules.check([list(row) for row in prompt], p, m, split=True, latency=1)
    assert len(prompt) == len(deferred)
    assert max(schedules.in_flight(prompt)) == max(schedules.in_flight(deferred))
    for s in range(p):  # nothing but F's between a B and its W's parts
        ops = [row[s] for row in prompt if row[s] is not None]
        for i, op in enumerate(ops):
            if op.kind == schedules.B:
                after = [o for o in ops[i + 1:] if o.kind != schedules.F][:parts]
                assert [(o.kind, o.micro) for o in after] == [(schedules.W, op.micro)] * parts, (s, ops)
    def records(table):  # the most B-to-W records a stage holds at once
        peak = live = 0
        for row in table:
            for op in row:
                if op is not None and op.kind == schedules.B:
                    live += 1
                elif op is not None and op.kind == schedules.W and op.part == parts - 1:
                    live -= 1
            peak = max(peak, live)
        return peak

    per_stage = [[[row[s]] for row in deferred] for s in range(p)]
    assert max(records(rows) for rows in per_stage) == p
    assert slot_program.slot_plan("zero_bubble", p, m, 1, "gemms", parts, 1, True).weight_slots == 1


def test_architecture_pages_worked_example_is_the_executed_table():
    """docs/architecture.md walks through 1F1B at p=2, m=2 tick by tick: its table is the one
    `schedules.executed` builds, and the in-flight counts it quotes are `in_flight`'s."""
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    block = page.split("<!-- table: 1f1b p=2 m=2", 1)[1].split("```", 2)[1]
    rows = [line.split()[1:] for line in block.strip().splitlines()[1:]]
    table = schedules.executed("1f1b", 2, 2)
    assert rows == [["-" if op is None else f"{op.kind}{op.micro}" for op in row] for row in table]
    assert f"`schedules.in_flight` gives `{list(schedules.in_flight(table))}`" in page
