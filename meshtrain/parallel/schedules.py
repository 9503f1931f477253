"""Pipeline schedules as slot tables: which stage runs which operation on which micro-batch when.

Playbook, "Pipeline Parallelism": "GPipe", "One-forward-one-backward", "Interleaving stages",
"Zero Bubble and DualPipe". A schedule is, per stage, an ordered list of operations

* F(j, c): the forward of micro-batch j through the stage's model chunk c (of v chunks; chunk c of
  stage s holds the layers of virtual stage c * p + s),
* B(j, c): the input-gradient part of its backward (on the critical path: sent upstream at once),
* W(j, c): the weight-gradient part (needed only by the optimizer step; in an aligned table it may
  cover several micro-batches, the B's of its round: `aligned`'s `span`); under the split backward
  it may run as `weight_parts` operations W(j, c, part), each the weight GEMMs of 1/parts of the
  chunk's layers, so that a W tick is no longer than an F or B tick (`parallel/cost.py` picks the
  count from the compiler's branch costs: a W that reads and writes the float32 gradient sums costs
  about two forwards when a micro-batch is small),

and `simulate` runs those lists tick by tick (every operation one unit of time, a result usable
by a neighbour on the next tick, or `latency` ticks later when transfers travel beside the next
tick's compute: `pipeline.overlap_transfers`), each stage taking its next operation as soon as what
it needs exists. The result is the executed table [ticks, p]; `check` verifies it against every dependency
and `bubble` counts its idle share. Schedules that fuse B and W (gpipe, 1f1b, interleaved_1f1b)
run W right after its B.

Bubble ratios (idle time of a stage over its busy time, F = B = W = one unit):

* gpipe and 1f1b: (p - 1) / m, the playbook's formula (1F1B changes memory, not the bubble);
* interleaved_1f1b: (p - 1) / (v m);
* zero_bubble (ZB-H1): (p - 1) / (3 m): a stage idles only for the F + B - W = 1 unit per
  upstream stage that the delayed W slots cannot fill, a third of 1F1B's 3 units.

Activations held: a stage holds a micro-batch's activations from its F to its W. 1f1b holds at most
p - s on stage s, zero_bubble at most p on every stage (1F1B's peak: ZB-H1's "same memory as
1F1B"; `defers_w` false, each W in its B's round: one B-to-W record, and overlapped 2(p - s) - 1, the
overlapped 1F1B's, to their B's, 2(p - s) to W with W's over two B's: `aligned`), interleaved_1f1b at
most (p - s - 1) * 2 + (v - 1) * p + 1 chunk activations, each 1/v of a stage's layers: about
(1 + (p - 1)/(v p)) times 1F1B's, independent of m. `in_flight` counts them from the table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

F, B, W = "F", "B", "W"
AUTODIFF, TABLE = "autodiff", "table"  # how the trainer runs a schedule (`Schedule.loop`)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One pipeline schedule (`pipeline.schedule`): how the trainer runs it and the facts the runtime,
    the validator, the planner and the cost model read. A new schedule is a `stage_orders` branch (its
    per-stage operations), a table builder (the ticks the trainer runs them in) and one entry in `REGISTRY`;
    the table executor (`pipeline_tables`) runs it."""

    name: str
    # AUTODIFF: a tick loop JAX differentiates (`pipeline._ring_loop`); TABLE: its executed slot table
    # (`executed`, run by `pipeline_tables`)
    loop: str
    chunked: bool = False  # v = pipeline.repeats chunks a stage, chunk r of stage s the virtual stage r*p + s
    overlapping: bool = False  # can send each tick's outputs while the next tick computes (overlap_transfers)
    split_backward: bool = False  # B (input gradients) and W (weight gradients) separate operations
    alternating: bool = False  # its ticks alternate: a forward on every stage, then a backward (`alternating`)
    wraps: bool = False  # activations go from stage p-1 back to stage 0 (the next chunk or lap)
    grouped: bool = False  # micro-batches run in groups of p: m must divide by p
    # (p, m, v, latency, defer_w) -> each stage's operations in order (`stage_orders`); None: no table
    # (circular's only loop is its ring)
    orders: Callable[[int, int, int, int, bool], list[list[Op]]] | None = None
    # (p, m, v, weight_parts, latency, defer_w, span) -> the table the trainer runs (`executed`); None: not
    # run from a table
    table: Callable[[int, int, int, int, int, bool, int], list[list[Op | None]]] | None = None
    baseline: bool = False  # what the other schedules' steps are compared with (`BASELINE`: 1F1B)

    def bubble(self, p: int, m: int, v: int = 1) -> float:
        """The bubble ratio, idle over busy time of a stage (module docstring)."""
        if self.chunked:
            return (p - 1) / (v * m)
        if self.split_backward:
            return (p - 1) / (3 * m)
        return (p - 1) / m




@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # F | B | W
    micro: int
    chunk: int = 0
    part: int = 0  # W: which of the `weight_parts` slices of the chunk's layers
    # W: how many micro-batches' weight gradients it computes, micro to micro + span - 1 (the B's of one
    # loop step of an aligned table, `aligned`'s `span`)
    span: int = 1

    def covers(self) -> list[Op]:
        """One operation a micro-batch: a W of several micro-batches as one W each."""
        return [dataclasses.replace(self, micro=self.micro + i, span=1) for i in range(self.span)]


def _fused(order: list[Op]) -> list[Op]:
    """B immediately followed by its W (schedules that do not split the backward)."""
    out = []
    for op in order:
        out.append(op)
        if op.kind == B:
            out.append(Op(W, op.micro, op.chunk))
    return out


def stage_orders(schedule: str, p: int, m: int, v: int = 1, weight_parts: int = 1,
                 latency: int = 0, defer_w: bool = True) -> list[list[Op]]:
    """Each stage's operations in the order it runs them; under the split backward each W as
    `weight_parts` consecutive operations. `latency`: ticks a result spends between stages (`simulate`);
    the warm-up forwards grow with it (a hop of 1 + latency ticks per stage). `defer_w` False: each W
    right after its B in the stage's order (`defers_w`)."""
    entry = REGISTRY.get(schedule)
    if entry is None or entry.orders is None:
        raise ValueError(f"schedule {schedule!r}: expected one of {SCHEDULES}")
    if weight_parts > 1:
        if not entry.split_backward:
            raise ValueError(f"weight_parts={weight_parts}: only {SPLIT_BACKWARD} run W on its own")
        return [[dataclasses.replace(op, part=i) for op in order
                 for i in (range(weight_parts) if op.kind == W else (0,))]
                for order in stage_orders(schedule, p, m, v, latency=latency, defer_w=defer_w)]
    return entry.orders(p, m, v if entry.chunked else 1, latency, defer_w)


def _gpipe_orders(p: int, m: int, v: int, latency: int, defer_w: bool) -> list[list[Op]]:
    """All forwards, then all backwards."""
    return [_fused([Op(F, j) for j in range(m)] + [Op(B, j) for j in range(m)]) for _ in range(p)]


def _one_f_one_b_orders(p: int, m: int, v: int, latency: int, defer_w: bool) -> list[list[Op]]:
    """p - s - 1 warm-up forwards on stage s (a hop of 1 + latency ticks each), then one forward and one
    backward alternately."""
    forwards, backwards = [Op(F, j) for j in range(m)], [Op(B, j) for j in range(m)]
    return [_fused(_one_f_one_b(forwards, backwards, min((p - s - 1) * (1 + latency), m))) for s in range(p)]


def _interleaved_orders(p: int, m: int, v: int, latency: int, defer_w: bool) -> list[list[Op]]:
    """Megatron's interleaved 1F1B (`_interleaved`): (p - s - 1)*2 + (v - 1)*p warm-up forwards."""
    if m % p:
        raise ValueError(f"interleaved_1f1b needs micro-batches divisible by stages: m={m}, p={p}")
    forwards, backwards = _interleaved(p, m, v, forward=True), _interleaved(p, m, v, forward=False)
    return [_fused(_one_f_one_b(forwards, backwards, min(((p - s - 1) * 2 + (v - 1) * p) * (1 + latency), m * v)))
            for s in range(p)]


def _zero_bubble_orders(p: int, m: int, v: int, latency: int, defer_w: bool) -> list[list[Op]]:
    return [_zero_bubble_order(p, m, s, latency, defer_w) for s in range(p)]


def _interleaved(p: int, m: int, v: int, forward: bool) -> list[Op]:
    """Megatron's interleaved order: groups of p micro-batches run chunk by chunk (backward: last chunk first)."""
    ops = []
    for i in range(m * v):
        chunk = (i // p) % v
        ops.append(Op(F if forward else B, (i // (p * v)) * p + i % p, chunk if forward else v - 1 - chunk))
    return ops


def _one_f_one_b(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    """warmup forwards, then one forward and one backward alternately, then the remaining backwards."""
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards[:steady], strict=True):
        order += (f, b)
    return order + backwards[steady:]


def _zero_bubble_order(p: int, m: int, s: int, latency: int = 0, defer_w: bool = True) -> list[Op]:
    """ZB-H1 (Qi et al. 2023): 1F1B's F / B order with each W split off and deferred: stage s runs
    its first s backwards without their W (B is on the critical path, W is not), then one W after
    each B, and the deferred W last, in the ticks where 1F1B would idle. A stage then holds at most
    p micro-batches' activations (1F1B's peak, on its stage 0). With `latency`, (1 + latency) times the
    warm-up forwards. `defer_w` False: none deferred, each W right after its B (`defers_w`)."""
    deferred = s if defer_w else 0
    warmup = min((p - s - 1) * (1 + latency), m)
    order = [Op(F, j) for j in range(warmup)]
    next_f, next_b, next_w = warmup, 0, 0
    while next_b < m:
        if next_f < m:
            order.append(Op(F, next_f))
            next_f += 1
        order.append(Op(B, next_b))
        next_b += 1
        if next_b > deferred or next_f == m:  # the first s W are deferred
            order.append(Op(W, next_w))
            next_w += 1
    return order + [Op(W, j) for j in range(next_w, m)]


def _one_f_one_b_table(p: int, m: int, v: int, weight_parts: int, latency: int,
                       defer_w: bool, span: int = 1) -> list[list[Op | None]]:
    """1F1B's executed table. Plain (`latency` 0): stage s runs the forward of micro-batch j in tick
    s + 2j and its whole backward in tick 2p - 1 - s + 2j, so neighbours always sit in opposite phases
    (an activation moves one stage a tick, so does a gradient); stage s holds p - s micro-batches; 2(m + p
    - 1) ticks. With transfers behind compute (`latency` 1): the orders with their warm-up doubled in
    alternating ticks (`alternating`: a forward on every stage, then a backward), 2(m + 2p - 2) ticks,
    2(p - s) - 1 micro-batches held on stage s."""
    # the overlapped table in closed form: what `alternating` makes of the orders with latency 1
    # (tests/test_schedules.py checks the two agree), without simulating every tick
    # stage s's first forward and first backward tick; each stage runs one of each every two ticks
    if latency:
        ticks, first_f, first_b = 2 * (m + 2 * p - 2), lambda s: 2 * s, lambda s: 2 * (2 * p - 2 - s) + 1
    else:
        ticks, first_f, first_b = 2 * (m + p - 1), lambda s: s, lambda s: 2 * p - 1 - s
    table: list[list[Op | None]] = [[None] * p for _ in range(ticks)]
    for s in range(p):
        for j in range(m):
            table[first_f(s) + 2 * j][s] = Op(F, j)
            table[first_b(s) + 2 * j][s] = Op(B, j)
    return table


def _alternating_table(schedule: str):
    def build(p: int, m: int, v: int, weight_parts: int, latency: int, defer_w: bool,
              span: int = 1) -> list[list[Op | None]]:
        return alternating(schedule, p, m, v, latency)
    return build


def _zero_bubble_table(p: int, m: int, v: int, weight_parts: int, latency: int,
                       defer_w: bool, span: int = 1) -> list[list[Op | None]]:
    """`aligned` with transfers behind compute, else `simulate`'s (each W its own micro-batch's)."""
    if span > 1 and not latency:
        raise ValueError(f"zero_bubble: a W over {span} micro-batches runs in aligned ticks (transfers behind "
                         "compute) only")
    if latency:
        return aligned("zero_bubble", p, m, weight_parts, latency, defer_w, span)
    return simulate("zero_bubble", p, m, v, weight_parts, latency, defer_w)


# The schedules, each defined once: every list of names below is read off it.
REGISTRY = {s.name: s for s in (
    Schedule("gpipe", AUTODIFF, orders=_gpipe_orders),
    Schedule("circular", AUTODIFF, chunked=True, wraps=True),
    Schedule("1f1b", TABLE, overlapping=True, orders=_one_f_one_b_orders, table=_one_f_one_b_table, baseline=True),
    Schedule("interleaved_1f1b", TABLE, chunked=True, overlapping=True, alternating=True, wraps=True, grouped=True,
             orders=_interleaved_orders, table=_alternating_table("interleaved_1f1b")),
    Schedule("zero_bubble", TABLE, overlapping=True, split_backward=True, orders=_zero_bubble_orders,
             table=_zero_bubble_table),
)}


def _named(fact) -> tuple[str, ...]:
    return tuple(name for name, schedule in REGISTRY.items() if fact(schedule))


SCHEDULES = _named(lambda s: s.orders is not None)  # those with stage orders (`stage_orders`, `simulate`)
TABLE_SCHEDULES = _named(lambda s: s.loop == TABLE)  # the trainer runs these from their tables
SPLIT_BACKWARD = _named(lambda s: s.split_backward)  # B and W as separate operations (`pipeline_tables`)
ALTERNATING = _named(lambda s: s.alternating)  # forward ticks and backward ticks (`alternating`)
CHUNKED = _named(lambda s: s.chunked)  # v = pipeline.repeats chunks a stage
OVERLAPPING = _named(lambda s: s.overlapping)  # `pipeline.overlap_transfers`
BASELINE = _named(lambda s: s.baseline)[0]  # 1F1B: what the other schedules' steps are compared with


def _ready(op: Op, s: int, p: int, v: int, done: dict, split: bool, now: int, latency: int = 0) -> bool:
    """Whether what `op` on stage `s` at tick `now` needs finished on an earlier tick, and, when it comes
    from another stage, `latency` ticks earlier still (done: (kind, stage, j, c) -> tick).

    A gradient leaves a stage after its B when the backward is split (zero_bubble), after its W
    when B and W are one backward (the others)."""
    sent = B if split else W

    def arrived(key):  # from a neighbour: sent after its tick, in flight for `latency` more
        return key in done and done[key] + latency < now

    if op.kind == F:
        if s > 0:
            return arrived((F, s - 1, op.micro, op.chunk))
        return op.chunk == 0 or arrived((F, p - 1, op.micro, op.chunk - 1))
    if op.kind == B:
        if done.get((F, s, op.micro, op.chunk), now) >= now:
            return False
        if s < p - 1:
            return arrived((sent, s + 1, op.micro, op.chunk))
        return op.chunk == v - 1 or arrived((sent, 0, op.micro, op.chunk + 1))
    return done.get((B, s, op.micro, op.chunk), now) < now


def defers_w(latency: int, inputs_at_b: bool) -> bool:
    """Whether a split schedule defers W's past later B's (ZB-H1: s on stage s), or runs each W right
    after its B (`stage_orders(..., defer_w=False)`).

    Deferred, a W fills a tick where 1F1B would idle, but what it reads stays held: under F's records
    (`pipeline.inputs_at_b` false) that is the residuals a stage keeps anyway, from F, and the most held
    at once is stage 0's whichever the order (in one SPMD program every stage's buffers are the largest
    stage's). Where B hands W the matmuls' inputs and output gradients (`inputs_at_b`), each
    deferred W holds a record of its own. In the aligned table (transfers behind compute) W has ticks of
    its own, so running each W in the first W tick after its B costs only W ticks: one record slot
    instead of four at p = 4, and, compiled for H100s, lower temporaries and a shorter kernel-modeled step
    for llama3_8b and for 405B. The plain table's ticks each last their longest operation, so there it
    would cost whole ticks (llama3_8b: less memory but a longer step): deferred. The compiled figures:
    docs/pipeline.md ("At real shapes") and docs/405b.md."""
    return not (latency and inputs_at_b)


@functools.lru_cache(maxsize=512)
def executed(schedule: str, p: int, m: int, v: int = 1, weight_parts: int = 1,
             latency: int = 0, defer_w: bool = True, span: int = 1) -> tuple[tuple[Op | None, ...], ...]:
    """The table the trainer runs (`slot_program.slot_plan`), from the schedule's own builder
    (`Schedule.table`: 1F1B's slots, `alternating` for the ALTERNATING schedules, `aligned` for
    zero_bubble with transfers behind compute, `simulate`'s otherwise, gpipe's too). Built once per arguments (the
    planner prices thousands of layouts on a few tables): read-only, rows of tuples. `defer_w`: `defers_w`;
    `span`: the micro-batches a W covers (`aligned`; the others' tables take 1)."""
    return tuple(tuple(row) for row in _executed(schedule, p, m, v, weight_parts, latency, defer_w, span))


@functools.lru_cache(maxsize=512)
def executed_in_flight(schedule: str, p: int, m: int, v: int = 1, weight_parts: int = 1,
                       latency: int = 0, defer_w: bool = True, span: int = 1) -> tuple[int, ...]:
    """`in_flight` of the `executed` table, once per arguments."""
    return tuple(in_flight(executed(schedule, p, m, v, weight_parts, latency, defer_w, span)))


def _executed(schedule: str, p: int, m: int, v: int, weight_parts: int, latency: int,
              defer_w: bool, span: int = 1) -> list[list[Op | None]]:
    entry = REGISTRY.get(schedule)
    if entry is None or entry.table is None and entry.orders is None:
        raise ValueError(f"schedule {schedule!r}: expected one of {SCHEDULES}")
    if entry.table is None:  # not run from a table (gpipe's autodiff loop): the unit-time one
        return simulate(schedule, p, m, v, weight_parts, latency, defer_w)
    return entry.table(p, m, v if entry.chunked else 1, weight_parts, latency, defer_w, span)


def aligned(schedule: str, p: int, m: int, weight_parts: int = 1, latency: int = 1,
            defer_w: bool = True, span: int = 1) -> list[list[Op | None]]:
    """Zero bubble's orders with the warm-up forwards doubled (`stage_orders(..., latency=1)`) in aligned
    ticks: the ticks take F, B and W in turn (W as `weight_parts` ticks of one part each), and each stage
    runs its next operation when it is of the tick's kind and ready.

    In a lock-step loop a tick lasts as long as the slowest stage's operation. `simulate`'s table has,
    in steady state, a B on some stage in every tick, so every tick lasts a B; here an F tick lasts an
    F, a B tick a B and a W tick a W, and every stage works in each (F + B + W a micro-batch, 1F1B's
    F + B). The doubled warm-up is what keeps every stage busy in them (the first backward reaches stage
    s three ticks a hop later than in `simulate`'s table); it holds what the overlapped loop holds anyway,
    2p - 1 - s micro-batches on stage s with ZB-H1's deferred W's, 2(p - s) - 1 without (`defers_w`),
    each until its B (until W, `in_flight`: one more with `span` 2).
    A result reaches its neighbour's next tick of the same kind three
    ticks later, so a transfer sent while the next tick computes (`latency` 1) arrives in time: the orders
    are those of latency 1 whatever `latency` is, and `latency` only sets what `check`-style readiness the
    run demands (0 and 1 give the same table).

    `span` > 1 (`pipeline.weight_span`; W's not deferred): a round is `span` F and B ticks in turn, then
    W's parts, and each stage's W covers the B's it ran in the round, up to `span` micro-batches in one
    pass over the float32 gradient sums (an operation of `span` micro-batches: `Op.span`). The F and B
    ticks are those of `span` 1 with the W ticks between them gone."""
    if span == 1:
        orders = stage_orders(schedule, p, m, 1, weight_parts, latency=1, defer_w=defer_w)
        return _run(orders, p, 1, split=True, latency=latency, kinds=(F, B) + (W,) * weight_parts,
                    what=f"{schedule} p={p} m={m}: the aligned stage orders")
    if defer_w:
        raise ValueError(f"{schedule}: a W of {span} micro-batches runs in the round of their B's, not deferred")
    orders = [[op for op in order if op.kind != W] for order in stage_orders(schedule, p, m, 1, 1, latency=1)]
    kinds = (F, B) * span + (W,) * weight_parts
    table = _run(orders, p, 1, split=True, latency=latency, kinds=kinds,
                 what=f"{schedule} p={p} m={m} span={span}: the aligned stage orders")
    table += [[None] * p for _ in range(-len(table) % len(kinds))]  # whole rounds
    for start in range(0, len(table), len(kinds)):
        for s in range(p):
            done = [op.micro for op in (table[start + i][s] for i in range(2 * span)) if op and op.kind == B]
            for part in range(weight_parts if done else 0):
                table[start + 2 * span + part][s] = Op(W, done[0], 0, part, len(done))
    return table


def alternating(schedule: str, p: int, m: int, v: int = 1, latency: int = 0) -> list[list[Op | None]]:
    """The schedule's stage orders in balanced ticks: even ticks run forwards only, odd ticks backwards
    only (B and W as one operation, the fused backward), each stage its next operation when it is of
    the tick's kind and ready.

    In a lock-step loop a tick lasts as long as the slowest stage's operation; with forwards and
    backwards in the same tick (`simulate`'s table: in steady state half the stages run B while the
    other half run F) every tick costs a backward. Here a forward tick costs a forward and a backward
    tick a backward, a pair the F + B of 1F1B's steady state on every stage. The orders are the
    schedule's (interleaved 1F1B: Megatron's), so the in-flight activations are too. A result reaches
    its neighbour's next tick of the same kind two ticks later, so a transfer sent while the next
    tick computes (`latency` 1, `pipeline.overlap_transfers`) arrives in time: the table is the same.
    Bubble, time-weighted (`bubble`: a forward tick lasts F, a backward tick B = 2F): (p - 1) / (v m)."""
    v = v if REGISTRY[schedule].chunked else 1
    orders = [[op for op in order if op.kind != W] for order in stage_orders(schedule, p, m, v)]
    return _run(orders, p, v, split=True, latency=latency, kinds=(F, B),
                what=f"{schedule} p={p} m={m} v={v}: the alternating stage orders")


def _run(orders: list[list[Op]], p: int, v: int, split: bool, latency: int, kinds: tuple[str, ...] | None,
         what: str) -> list[list[Op | None]]:
    """Runs per-stage orders tick by tick: each stage its next operation when it is ready (and, with
    `kinds`, of the kind tick t takes: kinds[t % len(kinds)])."""
    position = [0] * p
    done: dict[tuple, int] = {}
    table: list[list[Op | None]] = []
    total = sum(len(o) for o in orders)
    while sum(position) < total:
        if len(table) > 4 * total + 4 * p:
            raise RuntimeError(f"{what} deadlock")
        row: list[Op | None] = []
        for s in range(p):
            op = orders[s][position[s]] if position[s] < len(orders[s]) else None
            ready = (op is not None and (kinds is None or op.kind == kinds[len(table) % len(kinds)])
                     and _ready(op, s, p, v, done, split, len(table), latency))
            row.append(op if ready else None)
        for s, op in enumerate(row):
            if op is not None:
                done[(op.kind, s, op.micro, op.chunk)] = len(table)
                position[s] += 1
        table.append(row)
    return table


def simulate(schedule: str, p: int, m: int, v: int = 1, weight_parts: int = 1,
             latency: int = 0, defer_w: bool = True) -> list[list[Op | None]]:
    """The unit-time table: table[t][s] the operation stage s runs in tick t (None: idle). A W split
    in parts counts as done when its last part is. `latency`: ticks a result sent to a neighbour
    spends in flight beyond the next tick (1: sent while the next tick computes, read the tick after)."""
    v = v if REGISTRY[schedule].chunked else 1
    orders = stage_orders(schedule, p, m, v, weight_parts, latency, defer_w)
    return _run(orders, p, v, split=REGISTRY[schedule].split_backward, latency=latency, kinds=None,
                what=f"{schedule} p={p} m={m} v={v}: the stage orders")


def check(table: list[list[Op | None]], p: int, m: int, v: int = 1, split: bool = False, latency: int = 0) -> None:
    """Raises AssertionError unless every F, B and W of every (micro-batch, chunk) runs exactly once
    on every stage and never before what it needs (from a neighbour: `latency` ticks earlier still)."""
    seen: dict[tuple, int] = {}
    parts = weight_parts(table)
    # a table without W (`alternating`, split False): its B is the whole backward and sends the gradient
    kinds = (F, B, W) if split or _has_w(table) else (F, B)
    split = split or kinds == (F, B)
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            earlier = {k[:4]: when for k, when in seen.items() if when < t and (k[0] != W or k[4] == parts - 1)}
            for one in op.covers():  # a W of several micro-batches: each of them
                key = (one.kind, s, one.micro, one.chunk, one.part)
                assert key not in seen, f"{key} runs twice (ticks {seen[key]} and {t})"
                assert _ready(one, s, p, v, earlier, split, t, latency), f"{key} at tick {t} runs before its inputs"
                seen[key] = t
    expected = {(k, s, j, c, i) for k in kinds for s in range(p) for j in range(m) for c in range(v)
                for i in range(parts if k == W else 1)}
    missing, extra = sorted(expected - set(seen))[:4], sorted(set(seen) - expected)[:4]
    assert not missing and not extra, f"missing {missing}, extra {extra}"


def _has_w(table: list[list[Op | None]]) -> bool:
    """Whether the table runs W operations (an alternating table's B includes the weight gradient)."""
    return any(op is not None and op.kind == W for row in table for op in row)


def weight_parts(table: list[list[Op | None]]) -> int:
    """How many operations each W runs as in `table`."""
    return 1 + max((op.part for row in table for op in row if op is not None), default=0)


def bubble(table: list[list[Op | None]]) -> float:
    """Idle over busy time of a stage (the playbook's t_bubble / t_ideal), from the executed table:
    F, B and W one unit each; in a table without W (`alternating`) B is the whole backward, two units,
    a tick lasts its longest operation and a tick nobody works in takes no time."""
    p = len(table[0])
    if _has_w(table):
        busy = sum(op is not None for row in table for op in row)
        return (len(table) * p - busy) / busy
    cost = {F: 1, B: 2}
    busy = sum(cost[op.kind] for row in table for op in row if op is not None)
    return sum(p * max([0] + [cost[op.kind] for op in row if op is not None]) for row in table) / busy - 1


def formula(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The schedule's bubble ratio (module docstring)."""
    return REGISTRY[schedule].bubble(p, m, v)


def in_flight(table: list[list[Op | None]]) -> list[int]:
    """Per stage, the most micro-batch chunks whose activations it holds at once (from its F to its W;
    to its B in a table without W)."""
    p, last = len(table[0]), weight_parts(table) - 1
    release = W if _has_w(table) else B
    peak, live = [0] * p, [0] * p
    for row in table:
        for s, op in enumerate(row):
            if op is not None and op.kind == F:
                live[s] += 1
                peak[s] = max(peak[s], live[s])
            elif op is not None and op.kind == release and op.part == last:
                live[s] -= op.span
    return peak


def summary(schedule: str, p: int, m: int, v: int = 1, weight_parts: int = 1, latency: int = 0,
            defer_w: bool = True) -> str:
    """One line for a drawn table: ticks, bubble, in-flight activations per stage (the executed table;
    `defer_w`: `defers_w`)."""
    table = executed(schedule, p, m, v, weight_parts, latency, defer_w)
    return (f"{schedule}: p={p} m={m}" + (f" v={v}" if REGISTRY[schedule].chunked else "")
            + (f" W in {weight_parts} parts" if weight_parts > 1 else "")
            + f", {len(table)} ticks, bubble {bubble(table):.3f} of busy time, "
            f"in flight per stage {in_flight(table)}")
