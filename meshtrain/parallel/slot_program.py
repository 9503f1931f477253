"""A slot table as the executor's static program (`SlotPlan`): which branch, micro-batch, chunk and buffer
slot every stage uses at every tick, and which transfers the tick makes.

Playbook, "Pipeline Parallelism". `schedules.executed` gives a schedule's table (who runs which operation
when); `slot_plan` turns it into integer arrays the slot-table loop (`pipeline_tables`) indexes with the
stage and the tick, assigning buffer slots from the values' lifetimes so that buffer sizes are the table's
peak occupancy. Host numpy only: the runtime's `Pipeline.plan`, the planner and the kernel model read it
without devices.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from meshtrain.parallel import schedules

# the name scope of an uneven stage's `lax.cond` that skips its empty slots (`pipeline.skipping`): its
# conditionals in the compiled step (forward, recomputed, transposed) carry it in their op_name, and the
# kernel model prices them by the share of the stage's slots that run (`plan.kernel_model.kernels`, `slot_shares`)
EMPTY_SLOT_SCOPE = "empty_slot"
# branch indices of the tick's `lax.switch`
IDLE, FORWARD, FORWARD_FIRST, FORWARD_LAST, BACKWARD, BACKWARD_FIRST, WEIGHTS = range(7)
BRANCHES = 7
FIELDS = ("branch", "micro", "chunk", "stash", "wstash", "read_f", "read_b", "dy", "recv_f", "recv_b", "part",
          "put_stash", "put_inputs", "put_g", "keep_stash", "keep_inputs", "keep_g", "send_forward")
# the program fields with the slot a tick writes each slot buffer's `put` into, and whether it writes
# back what the slot holds instead (`SlotPlan`)
PUT_FIELD = {"stash": "stash", "inputs": "inputs", "gs": "g"}


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """The static program of a slot table: `program[t, s]` holds, for stage s at tick t, the FIELDS:
    the branch, micro-batch and chunk of its operation, the residual slot it writes (F) or reads
    (B, W), the inbox slots its input activation (F) or output gradient (B) comes from, the gradient
    inbox slot where the last stage's forward leaves its loss gradient, the inbox slots where the
    activation and gradient arriving after the tick go, which slice of the chunk's layers a W part
    computes, and the slots the tick writes into the residual, matmul-input and output-gradient
    buffers after its switch (`put_*`: the operation's own slot where it fills the buffer, else a slot
    holding nothing still to be read, or, `keep_*` set, where every slot does, the slot's own value
    written back; `_put_slots`). An inbox slot index equal to the inbox size is its trash slot
    (nothing arrives)."""

    program: np.ndarray  # int32 [ticks, p, len(FIELDS)]
    stash_slots: int  # vjp residuals, F to B (gemms: the records, residuals then output gradients, F to W)
    weight_slots: int  # split: what W needs beyond the residuals (`split_backward`): the buffers' size
    inbox_f_slots: int
    inbox_b_slots: int
    split: bool  # B and W are separate operations (`schedules.SPLIT_BACKWARD`)
    wraps: bool  # activations go p-1 -> 0 (and gradients back) between chunks
    # split: "gemms" (W: the weight GEMMs from the matmuls' inputs, F to W, and output gradients,
    # B to W) or "pullback" (W: the stage's pullback again, from the residuals, kept until W, and the
    # stage's output gradient, B to W)
    split_backward: str = "gemms"
    weight_parts: int = 1  # each W as this many operations, each on 1/weight_parts of the chunk's layers
    # ticks an output spends between stages beyond the next (`pipeline.overlap_transfers`: 1, sent while
    # the next tick computes, put in its inbox slot at that tick's end; `recv_*` name that tick's row)
    latency: int = 0
    # one `ppermute` a tick where the table allows and the transfers are not behind compute
    # (`parity_sends`): pairs[k] are the (source, destination) stages of the ticks t with t % 2 == k,
    # each stage sending its activation (the program's `send_forward`) or its input gradient, two ticks a
    # loop step; None: two a tick, the activations one stage on and the gradients one back
    pairs: tuple[tuple[tuple[int, int], ...], ...] | None = None
    chunks: int = 1  # v: chunks a stage
    # gemms: W's matmul inputs come from B's pullback (`fp8.SPLIT_TAPS`; `pipeline.inputs_at_b`: full
    # remat, or transfers overlapped) and stay with the output gradients from B to W, in the weight slots
    # or handed over (`handoff`); the stash holds the residuals from F to B only. Otherwise F records
    # them, and each record lives from F to W.
    inputs_at_b: bool = False
    # inputs_at_b in an aligned table whose every W runs in its B's round (`schedules.defers_w`): a loop
    # step is one round of the table's tick kinds (F, B, ..., W's parts: `span`), each tick a switch over the
    # branches of its kind only, and B's switches hand their records straight to the W ticks of the step. No
    # weight slots are carried: a record held in the loop's state would be held twice, in its slot and
    # in the put the switch returns (XLA gives a conditional's output a buffer of its own).
    handoff: bool = False
    # handoff: a loop step is `span` F and B ticks in turn, then W's parts, each W covering the step's B's
    # (`schedules.aligned`): W's switch reads the `span` records B's switches hand it
    span: int = 1

    @property
    def gemms(self) -> bool:
        return self.split and self.split_backward == "gemms"

    @property
    def ticks(self) -> int:
        return self.program.shape[0]

    @functools.cached_property
    def segments(self) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """(start, stop, sizes) tick ranges covering the program in order, each run as its own loop: a
        loop step runs len(sizes) ticks, its j-th tick a `lax.switch` over the first sizes[j] branches.

        All of them (BRANCHES) where a stage may run a backward or W, and only those ticks (and, under
        `handoff`, the B ticks' WEIGHTS) add the gradients (the sums' window; the embedding's scatter only
        after a switch that can run stage 0's first backward: `pipeline_tables._table_loop`); the
        idle one and the forwards (BACKWARD of them) elsewhere, adding nothing:
        * before the first backward and after the last (a forward warm-up: 405B interleaved in 4 chunks
          on 16 stages, the first 127 of 284 ticks);
        * between, in two ticks a step where every backward and W falls in ticks of one parity, as the
          interleaved tables' lock-step ticks alternate (forwards in one, backwards in the next): the
          other tick of each step (405B: 79 of the 158 ticks from tick 126).
        With `pairs` (two ticks a loop step, one `ppermute` a parity) every range starts and stops on an
        even tick and a step is always two ticks. The kernel model tells the switches apart by their size
        (`segment_rows`). One loop with one chunk a stage, whose switch adds the gradients in place (the
        executor's `sums_outside`): nothing is added outside it to skip (a warm-up loop there lowers
        1F1B's temporaries, not zero bubble's: the tiny model overlapped, docs/pipeline.md)."""
        step = 1 if self.pairs is None else 2  # outside the range of gradients
        if self.handoff:  # forwards and backwards in turn, then W's parts: each position its kind's branches
            return ((0, self.ticks, (BACKWARD, WEIGHTS) * self.span + (BRANCHES,) * self.weight_parts),)
        if self.chunks == 1:
            return ((0, self.ticks, (BRANCHES,) * step),)
        grads = (self.program[:, :, 0] >= BACKWARD).any(axis=1)
        if not grads.any():
            return ((0, self.ticks, (BACKWARD,) * step),)
        first, last = int(np.argmax(grads)), self.ticks - int(np.argmax(grads[::-1]))
        parities = {int(t) % 2 for t in np.flatnonzero(grads)}
        inner = 2 if len(parities) == 1 and last - first > 1 else step
        if inner == 2:  # from an even tick, in whole steps where the table has the ticks
            first -= first % 2
            last = min(self.ticks, last + (last - first) % 2)

        def sizes(start: int, n: int) -> tuple[int, ...]:
            return tuple(BRANCHES if len(parities) > 1 or (start + j) % 2 in parities else BACKWARD
                         for j in range(n))
        whole = first + (last - first) // inner * inner  # a last odd tick runs one a step
        cuts = [(0, first, (BACKWARD,) * step), (first, whole, sizes(first, inner)),
                (whole, last, sizes(whole, 1)), (last, self.ticks, (BACKWARD,) * step)]
        return tuple(cut for cut in cuts if cut[1] > cut[0])


def _allocate(intervals: list[tuple[float, float, object]]) -> tuple[dict, int]:
    """Slots for (write time, last read time, key) lifetimes on one stage: the lowest slot free at
    the write (a slot read at time r is free for writes after r). Returns ({key: slot}, slots used)."""
    slots, busy, used = {}, [], 0
    for start, end, key in sorted(intervals, key=lambda x: x[0]):
        busy = [(e, k) for e, k in busy if e >= start]
        taken = {k for _, k in busy}
        slot = next(i for i in range(len(taken) + 1) if i not in taken)
        slots[key], used = slot, max(used, slot + 1)
        busy.append((end, slot))
    return slots, used


def _put_slots(ticks: int, p: int, live: list[list[tuple[int, int, int]]]) -> tuple[np.ndarray, np.ndarray, int]:
    """([ticks, p] the slot each tick writes a buffer's `put` into, [ticks, p] whether it writes back
    the slot's own value instead, the buffer's size: its peak of values held at once).

    `live[s]`: (write tick, last read tick, slot) of every value stage s keeps in the buffer, written
    by the operation of its write tick, which fills that slot. Every other operation puts zeros into the
    lowest slot whose value, if any, is not read after the tick (the switch reads before the tick
    writes); where every slot holds a value still to be read (a stage idle at its peak), it writes
    slot 0's value back: a slot read, instead of a slot more in the buffer."""
    size = max([slot + 1 for intervals in live for _, _, slot in intervals], default=1)
    slots, keep = np.zeros((ticks, p), np.int32), np.zeros((ticks, p), np.int32)
    fills = {(start, s): slot for s in range(p) for start, _, slot in live[s]}
    for s in range(p):
        for t in range(ticks):
            if (t, s) in fills:
                slots[t, s] = fills[t, s]
                continue
            busy = {slot for start, end, slot in live[s] if start < t < end}
            free = [k for k in range(size) if k not in busy]
            slots[t, s], keep[t, s] = (free[0], 0) if free else (0, 1)
    return slots, keep, size


@functools.lru_cache(maxsize=256)
def slot_plan(schedule: str, p: int, m: int, v: int = 1, split_backward: str = "gemms",
              weight_parts: int = 1, latency: int = 0, inputs_at_b: bool = False, span: int = 1) -> SlotPlan:
    """The executable program of `schedule`'s table (see `SlotPlan`). A W in parts keeps what it reads
    until its last part (the table's later ticks overwrite the earlier in `when`). `span`: the
    micro-batches a W covers where B hands W its records (`SlotPlan.span`; 1 elsewhere). Built once per
    arguments (the planner's search asks for the same few thousands of times): its program is read-only."""
    split = schedule in schedules.SPLIT_BACKWARD
    inputs_at_b = inputs_at_b and split and split_backward == "gemms"
    defer_w = schedules.defers_w(latency, inputs_at_b)
    span = 1 if defer_w else span
    table = schedules.executed(schedule, p, m, v, weight_parts, latency, defer_w, span)
    handoff = inputs_at_b and latency > 0 and _hands_off(table, weight_parts, span)  # no `pairs` (two-tick steps)
    if handoff:  # whole steps of the kinds' round: idle ticks at the end
        table = table + ((None,) * p,) * (-len(table) % (2 * span + weight_parts))
    elif span > 1:
        raise ValueError(f"{schedule}: a W of {span} micro-batches needs B to hand it their records")
    sends = None if latency else parity_sends(schedule, p, m, v, weight_parts)  # overlapped: they hide anyway
    arrive = 0.5 + latency  # after the tick that sends (latency 1: at the end of the next one)
    when = {(one.kind, s, one.micro, one.chunk): t for t, row in enumerate(table) for s, op in enumerate(row) if op
            for one in op.covers()}
    stash_iv = [[] for _ in range(p)]
    weight_iv = [[] for _ in range(p)]
    inbox_f_iv = [[] for _ in range(p)]
    inbox_b_iv = [[] for _ in range(p)]
    for (kind, s, j, c), t in when.items():
        if kind == schedules.F:
            # the residuals live until B (W under the split's pullback); the gemms split's inputs until W
            last = schedules.W if split and split_backward == "pullback" else schedules.B
            stash_iv[s].append((t, when[(last, s, j, c)], (s, j, c)))
            if split and split_backward == "gemms" and not inputs_at_b:
                weight_iv[s].append((t, when[(schedules.W, s, j, c)], (s, j, c)))
            if s == p - 1 and c == v - 1:  # the loss gradient, left during the tick for this stage's B
                inbox_b_iv[s].append((t + 0.25, when[(schedules.B, s, j, c)], (s, j, c)))
            else:  # the activation arrives at the next stage after the tick
                dst, dc = (s + 1, c) if s < p - 1 else (0, c + 1)
                inbox_f_iv[dst].append((t + arrive, when[(schedules.F, dst, j, dc)], (dst, j, dc)))
        elif kind == schedules.B and split and (split_backward == "pullback" or inputs_at_b):  # to W
            weight_iv[s].append((t, when[(schedules.W, s, j, c)], (s, j, c)))
        if kind == schedules.B and not (s == 0 and c == 0):
            dst, dc = (s - 1, c) if s > 0 else (p - 1, c - 1)
            inbox_b_iv[dst].append((t + arrive, when[(schedules.B, dst, j, dc)], (dst, j, dc)))
    gemms = split and split_backward == "gemms" and not inputs_at_b  # records F to W
    stash, weight, inbox_f, inbox_b = ({}, {}, {}, {})
    sizes = []
    # gemms: one record a micro-batch, F to W (its residuals until B, its output gradients after): the
    # records take the weight slots
    records_iv = weight_iv if gemms else stash_iv
    for intervals, slots in ((records_iv, stash), (weight_iv, weight), (inbox_f_iv, inbox_f), (inbox_b_iv, inbox_b)):
        most = 0
        for s in range(p):
            got, used = _allocate(intervals[s])
            slots.update(got)
            most = max(most, used)
        sizes.append(max(most, 1))
    n_stash, n_weight, n_f, n_b = sizes
    program = np.zeros((len(table), p, len(FIELDS)), np.int32)
    program[:, :, FIELDS.index("recv_f")] = n_f
    program[:, :, FIELDS.index("recv_b")] = n_b
    program[:, :, FIELDS.index("dy")] = n_b
    every = [(op.kind, s, op.micro, op.chunk, op.part, t)
             for t, row in enumerate(table) for s, op in enumerate(row) if op]
    for kind, s, j, c, part, t in every:
        row = program[t, s]
        key = (s, j, c)
        row[FIELDS.index("part")] = part
        first, last = s == 0 and c == 0, s == p - 1 and c == v - 1
        if kind == schedules.F:
            branch = FORWARD_FIRST if first else FORWARD_LAST if last else FORWARD
            row[FIELDS.index("read_f")] = 0 if first else inbox_f[key]
            if last:
                row[FIELDS.index("dy")] = inbox_b[key]
            else:
                dst, dc = (s + 1, c) if s < p - 1 else (0, c + 1)
                program[t + latency, dst, FIELDS.index("recv_f")] = inbox_f[(dst, j, dc)]
        elif kind == schedules.B:
            branch = BACKWARD_FIRST if first else BACKWARD
            row[FIELDS.index("read_b")] = inbox_b[key]
            if not first:
                dst, dc = (s - 1, c) if s > 0 else (p - 1, c - 1)
                program[t + latency, dst, FIELDS.index("recv_b")] = inbox_b[(dst, j, dc)]
        else:
            branch = WEIGHTS if split else IDLE  # fused schedules ran W inside B
        row[FIELDS.index("branch")] = branch
        row[FIELDS.index("micro")], row[FIELDS.index("chunk")] = j, c
        row[FIELDS.index("stash")] = stash[key]
        row[FIELDS.index("wstash")] = weight.get(key, 0)
    # the residual (gemms: record), matmul-input (gemms) and output-gradient (pullback) buffers: what
    # lives in which slot from its write (by the operation that fills it) to its last read

    def slotted(intervals, slots):
        return [[(start, end, slots[key]) for start, end, key in intervals[s]] for s in range(p)]
    # gemms: the output gradients take the residuals' slot (the micro-batch's record), from B to W;
    # pullback: weight_iv is B to W
    g_iv = [[(when[(schedules.B, *key)], end, key) for _, end, key in weight_iv[s]] for s in range(p)]
    if gemms:
        records = [a + b for a, b in zip(slotted(stash_iv, stash), slotted(g_iv, weight), strict=True)]
        live = {"stash": records, "inputs": slotted(weight_iv, weight), "g": [[]] * p}
    elif inputs_at_b:  # the residuals F to B; the inputs and output gradients B to W
        live = {"stash": slotted(stash_iv, stash), "inputs": slotted(g_iv, weight), "g": [[]] * p}
    else:
        live = {"stash": slotted(stash_iv, stash), "inputs": [[]] * p,
                "g": slotted(g_iv, weight) if split else [[]] * p}
    n_stash = 0
    for name in live:
        slots, keep, size = _put_slots(len(table), p, live[name])
        program[:, :, FIELDS.index(f"put_{name}")] = slots
        program[:, :, FIELDS.index(f"keep_{name}")] = keep
        if name == "stash":
            n_stash = size
        elif name == "inputs" and (gemms or inputs_at_b) or name == "g" and split:
            n_weight = max(n_weight, size)
    pairs, forward = sends if sends is not None else (None, None)
    if forward is not None:  # read at run time: a constant would let XLA drop one output per parity's switch
        program[:, :, FIELDS.index("send_forward")] = [forward[t % 2] for t in range(len(table))]
    program.flags.writeable = False
    return SlotPlan(program, n_stash, n_weight, n_f, n_b, split, wraps=v > 1, split_backward=split_backward,
                    weight_parts=weight_parts, latency=latency, pairs=pairs, chunks=v, inputs_at_b=inputs_at_b,
                    handoff=handoff, span=span if handoff else 1)


def _hands_off(table, weight_parts: int, span: int = 1) -> bool:
    """Whether every tick t of `table` runs only operations of kind ((F, B) * span + (W,) * weight_parts)[t %
    (2 span + weight_parts)] and every B's W parts run on its stage in the W ticks of the same round
    (`SlotPlan.handoff`)."""
    kinds = (schedules.F, schedules.B) * span + (schedules.W,) * weight_parts
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            if op.kind != kinds[t % len(kinds)]:
                return False
            if op.kind == schedules.B:
                first_w = t - t % len(kinds) + 2 * span
                ws = [table[first_w + i][s] if first_w + i < len(table) else None for i in range(weight_parts)]
                if not all(w is not None and w.kind == schedules.W and w.part == i and w.chunk == op.chunk
                           and w.micro <= op.micro < w.micro + w.span for i, w in enumerate(ws)):
                    return False
    return True


@functools.lru_cache(maxsize=512)
def parity_sends(schedule: str, p: int, m: int, v: int = 1, weight_parts: int = 1):
    """`_alternating_sends` of the schedule's plain table (`schedules.executed`, latency 0), once per arguments."""
    return _alternating_sends(schedules.executed(schedule, p, m, v, weight_parts, 0), p, v)


def _alternating_sends(table, p: int, v: int):
    """(pairs, forward) when every tick's transfers fit one `ppermute` whose pairs depend only on the
    tick's parity (`SlotPlan.pairs`), else None. They do where each stage sends one way in the ticks of a
    parity and each receives from one neighbour: 1F1B's neighbours in opposite phases (stage s sends its
    activation on ticks of s's parity and its gradient on the others), and the alternating tables (a
    forward tick sends activations only, a backward tick gradients only). Then one activation crosses each
    link a tick instead of two, one of them zeros: one exposed transfer a tick, not two after another. The
    loop then runs two ticks a step: an odd number of ticks keeps two ppermutes a tick."""
    if len(table) % 2:
        return None
    dest: list[dict[int, tuple[int, bool]]] = [{}, {}]  # per parity: stage -> (destination, forward)
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            if op.kind == schedules.F and not (s == p - 1 and op.chunk == v - 1):
                send = ((s + 1) % p, True)
            elif op.kind == schedules.B and not (s == 0 and op.chunk == 0):
                send = ((s - 1) % p, False)
            else:
                continue
            if dest[t % 2].setdefault(s, send) != send:
                return None
    if any(len({to for to, _ in d.values()}) < len(d) or not d for d in dest):
        return None  # two sources into one stage; or a parity that sends nothing (1F1B on 2 stages)
    pairs = tuple(tuple((s, to) for s, (to, _) in sorted(d.items())) for d in dest)
    forward = tuple(tuple(d.get(s, (0, False))[1] for s in range(p)) for d in dest)
    return pairs, forward


def segment_rows(plan: SlotPlan, field: str = "branch") -> dict[int, np.ndarray]:
    """{switch size: rows [n, p] of the branch each stage takes (or another of the FIELDS)}: the ticks of
    the loops whose switch has that many branches (`SlotPlan.segments`), in order."""
    column = FIELDS.index(field)
    rows: dict[int, list[np.ndarray]] = {}
    for start, stop, sizes in plan.segments:
        for j, branches in enumerate(sizes):
            rows.setdefault(branches, []).append(plan.program[start + j:stop:len(sizes), :, column])
    return {n: np.concatenate(r) for n, r in rows.items()}


def branch_share(plan: SlotPlan) -> dict[int, tuple[float, ...]]:
    """{switch size: the share of its loops' (tick, stage) pairs that take each of its branches} (the HLO
    byte count's conditional weights: `plan.hlo.collectives`)."""
    return {n: tuple(float(c) for c in np.bincount(rows.ravel(), minlength=n) / rows.size)
            for n, rows in segment_rows(plan).items()}
