"""Slot-table schedules in one SPMD loop: interleaved 1F1B and zero bubble (ZB-H1).

Playbook, "Interleaving stages" and "Zero Bubble and DualPipe". `schedules.executed` gives, per
tick, the operation each stage runs: F (forward of a micro-batch through one of the stage's
model chunks), B (its input gradient; interleaved 1F1B: its whole backward) and W (zero bubble:
its weight gradient). This module turns that table
into static integer programs (`SlotPlan`) and runs them in one `lax.scan` over ticks inside the
pipeline's `shard_map`: at each tick every stage runs its own operation (`lax.switch`), then two
`ppermute`s move the outputs one stage on, activations forward and input gradients back (with the
wrap-around p-1 -> 0 and back when a stage holds several chunks). Nothing in the loop depends on
data: which operation, which micro-batch and chunk, and which buffer slot every value is read from
and written to are fixed by the table, so the loop is one program on every device.

* interleaved_1f1b (Megatron's virtual stages): stage s holds v = `pipeline.repeats` chunks, chunk
  c being virtual stage c*p + s (the circular schedule's layout, so checkpoints move freely between
  them); micro-batches run in groups of p chunk by chunk. Bubble (p-1)/(v m) of the ideal time.
  Stage s holds at most (p - s - 1)*2 + (v - 1)*p + 1 chunk activations, each 1/v of a 1F1B stage's:
  bounded independent of m (`schedules.in_flight` counts them from the table). Its ticks alternate
  (`schedules.alternating`): every stage runs a forward, then every stage a backward (input and weight
  gradients in one operation), so no tick waits for a backward beside forwards.
* zero_bubble (ZB-H1): B sends the input gradient upstream at once and W, in ticks that would
  otherwise idle, computes the weight gradient. Bubble (p-1)/(3m) of the ideal time, a third of
  1F1B's, with 1F1B's residuals (p micro-batches per stage at most).

Zero bubble runs the split backward (`pipeline.SplitStage`, `schedules.SPLIT_BACKWARD`): F records every
matmul's input; B is the pullback of a forward whose matmul weights are constants and whose matmul
outputs carry zero probes, so it computes the input gradients only and the probes' cotangents are
the matmuls' output gradients; W is each matmul's weight GEMM x^T dy from what F and B kept. The
price is memory: each chunk waiting for its W keeps its matmuls' inputs and output gradients. The
output gradients take the buffers of the residuals B has consumed where their shapes match
(`SlotUnion`: one record a chunk from F to W, its residuals until B, its output gradients after): under
selective and full remat the residuals are matmul outputs and the layer input, so per chunk the split
holds the larger of the two beside the inputs, where two buffers would hold both (under none, both).

Transfers behind compute (`pipeline.overlap_transfers`): the table reads a result no earlier than two
ticks after it was computed (zero bubble's aligned table, `schedules.aligned`: F, B and W ticks in turn
with the warm-up doubled; interleaved 1F1B's alternating table is the same with it), and the loop keeps
a tick's outputs in its carry and sends them at the start of the next tick, beside its operation,
which reads nothing of them.

Buffers. Every value waiting between ticks sits in a slot of a statically sized buffer: the vjp
residuals of a forward until its backward, the split backward's matmul inputs (F to W) and output
gradients (B to W), arriving activations and gradients until the operation that consumes them.
Slots are assigned from the table's lifetimes, so buffer sizes are the table's peak occupancy, not
m (gemms split: the residuals and output gradients in one record buffer, slotted F to W). The tick
reads and writes them outside its `lax.switch`: XLA copies a buffer that a branch updates whole, a
slot read or written outside costs one slot. Likewise the float32 gradient sums: XLA gives a
conditional's results their own buffers, so an operand a branch returns is copied in every branch, the
idle ones too, every tick (405B on 16 H100 stages in 2 chunks: 20.6 ms of copies a tick). The input
embedding's sums are added after the switch (stage 0's micro-batch rows, a scatter); with several chunks
a stage the layers' sums are too, from the chunk gradient the operation returns (`_TableWork.sums_outside`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshtrain import fp8 as fp8_lib
from meshtrain.parallel import schedules
from meshtrain.parallel.pipeline import (
    FP8,
    STAGE,
    Residuals,
    SlotWork,
    SplitStage,
    aux_cotangents,
    pmean,
    reduce_layer_grads,
    run_gradient_loop,
)
from meshtrain.sharding_rules import vary

# branch indices of the tick's `lax.switch`
IDLE, FORWARD, FORWARD_FIRST, FORWARD_LAST, BACKWARD, BACKWARD_FIRST, WEIGHTS = range(7)
FIELDS = ("branch", "micro", "chunk", "stash", "wstash", "read_f", "read_b", "dy", "recv_f", "recv_b", "part",
          "put_stash", "put_inputs", "put_g", "keep_stash", "keep_inputs", "keep_g")
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

    @property
    def gemms(self) -> bool:
        return self.split and self.split_backward == "gemms"

    @property
    def ticks(self) -> int:
        return self.program.shape[0]


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


def slot_plan(schedule: str, p: int, m: int, v: int = 1, split_backward: str = "gemms",
              weight_parts: int = 1, latency: int = 0) -> SlotPlan:
    """The executable program of `schedule`'s table (see `SlotPlan`). A W in parts keeps what it reads
    until its last part (the table's later ticks overwrite the earlier in `when`)."""
    table = schedules.executed(schedule, p, m, v, weight_parts, latency)
    arrive = 0.5 + latency  # after the tick that sends (latency 1: at the end of the next one)
    split = schedule in schedules.SPLIT_BACKWARD
    when = {(op.kind, s, op.micro, op.chunk): t for t, row in enumerate(table) for s, op in enumerate(row) if op}
    stash_iv = [[] for _ in range(p)]
    weight_iv = [[] for _ in range(p)]
    inbox_f_iv = [[] for _ in range(p)]
    inbox_b_iv = [[] for _ in range(p)]
    for (kind, s, j, c), t in when.items():
        if kind == schedules.F:
            # the residuals live until B (W under the split's pullback); the gemms split's inputs until W
            last = schedules.W if split and split_backward == "pullback" else schedules.B
            stash_iv[s].append((t, when[(last, s, j, c)], (s, j, c)))
            if split and split_backward == "gemms":
                weight_iv[s].append((t, when[(schedules.W, s, j, c)], (s, j, c)))
            if s == p - 1 and c == v - 1:  # the loss gradient, left during the tick for this stage's B
                inbox_b_iv[s].append((t + 0.25, when[(schedules.B, s, j, c)], (s, j, c)))
            else:  # the activation arrives at the next stage after the tick
                dst, dc = (s + 1, c) if s < p - 1 else (0, c + 1)
                inbox_f_iv[dst].append((t + arrive, when[(schedules.F, dst, j, dc)], (dst, j, dc)))
        elif kind == schedules.B and split and split_backward == "pullback":  # its output gradient, to W
            weight_iv[s].append((t, when[(schedules.W, s, j, c)], (s, j, c)))
        if kind == schedules.B and not (s == 0 and c == 0):
            dst, dc = (s - 1, c) if s > 0 else (p - 1, c - 1)
            inbox_b_iv[dst].append((t + arrive, when[(schedules.B, dst, j, dc)], (dst, j, dc)))
    gemms = split and split_backward == "gemms"
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
        elif name == "inputs" and gemms or name == "g" and split:
            n_weight = max(n_weight, size)
    return SlotPlan(program, n_stash, n_weight, n_f, n_b, split, wraps=v > 1, split_backward=split_backward,
                    weight_parts=weight_parts, latency=latency)


def branch_share(plan: SlotPlan) -> tuple[float, ...]:
    """The share of (tick, stage) pairs that take each branch (the HLO byte count's conditional weights)."""
    counts = np.bincount(plan.program[:, :, 0].ravel(), minlength=7)
    return tuple(float(c) for c in counts / counts.sum())


class SplitResiduals(Residuals):
    """B's vjp residuals under the split backward (`SplitStage.forward`: matmul weights constant,
    probes on the matmul outputs, inputs recorded for W)."""

    def __init__(self, split: SplitStage, layers, probes):
        super().__init__(None, layers)
        self.split, self.probes = split, probes

    def vjp_recording(self, x, mb, w):
        """((y, stats), pullback (w, x, probes), recorded matmul inputs)."""
        def run(w, x, probes):
            if FP8 in w:
                w = {**w, FP8: fp8_lib.for_grad(w[FP8])}
            return self.split.forward(w, x, mb["positions"], mb["segment_ids"], probes)
        return jax.vjp(run, w, x, self.probes, has_aux=True)

    def vjp(self, x, mb, w=None, chunk=0):
        del chunk  # the split backward runs one chunk a stage (`schedules.SPLIT_BACKWARD`)
        out, pullback, _ = self.vjp_recording(x, mb, self._layers if w is None else w)
        return out, pullback

    def _constants(self, w) -> list:
        # the probes are zeros, the same arrays in every slot: the remat keeps them as inputs, the stash does not
        return super()._constants(w) + jax.tree.leaves(self.probes)


class SlotUnion:
    """(Playbook, "Zero Bubble and DualPipe": the memory of the split backward.) Pytrees that never
    occupy a slot at the same time, in one list of slot buffers: a leaf of one
    tree takes a buffer of its shape and dtype that no other leaf of the same tree has taken, so each
    (shape, dtype) has as many buffers as the tree with the most such leaves. Zero bubble's record
    of a micro-batch (gemms): its vjp residuals from F to B, then its matmuls' output gradients from B
    to W, in the same bytes where shapes match (selective and full remat keep matmul outputs and the
    layer input: the output gradients' shapes; none keeps other intermediates, and shares little), where
    two buffers would hold both kinds of every slot at once. Leaves keep their shapes: nothing is
    reshaped across a sharded dimension (a flat vector would be, and the partitioner would gather it)."""

    def __init__(self, *trees):
        self.kinds: list[tuple[tuple[int, ...], object]] = []  # each buffer's (shape, dtype)
        self._layouts = []
        for tree in trees:
            leaves, treedef = jax.tree.flatten(tree)
            taken = []
            for a in leaves:
                kind = (tuple(a.shape), a.dtype)
                free = [i for i, k in enumerate(self.kinds) if k == kind and i not in taken]
                if not free:
                    self.kinds.append(kind)
                taken.append(free[0] if free else len(self.kinds) - 1)
            self._layouts.append((treedef, taken))

    def zeros(self, slots: int) -> list[jax.Array]:
        return [jnp.zeros((slots, *shape), dtype) for shape, dtype in self.kinds]

    def pack(self, which: int, tree) -> list[jax.Array]:
        """Tree `which` (its position in the constructor) as one slot of every buffer (zeros where it
        has no leaf)."""
        values = dict(zip(self._layouts[which][1], jax.tree.leaves(tree), strict=True))
        return [values[i] if i in values else jnp.zeros(shape, dtype) for i, (shape, dtype) in enumerate(self.kinds)]

    def unpack(self, which: int, slot: list[jax.Array]):
        """The tree `which` from one slot of every buffer (`pack`'s inverse)."""
        treedef, taken = self._layouts[which]
        return jax.tree.unflatten(treedef, [slot[i] for i in taken])


def _store(buffers, values, slot):
    return jax.tree.map(lambda buf, a: lax.dynamic_update_index_in_dim(buf, a, slot, 0), buffers, values)


def _load(buffers, slot):
    return jax.tree.map(lambda buf: lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False), buffers)


class _TableWork(SlotWork):
    """The operations of a slot table on one stage, as `lax.switch` branches (the branch constants
    above). Each takes (carry, x_in, g_in, j, c, slot, weight slot, W part, buffers) -> (carry,
    activation out, gradient out, dy, put).

    The carry holds float32 gradient sums of the stage's chunks (`g_layers` [v, k, ...]) and of the
    embedding / head, the summed loss and MoE statistics. What lives from one operation to a later
    one is kept in slot buffers outside the switch (`slot_buffers`): the vjp residuals (F to B) and,
    split, the matmuls' inputs (F to W) and output gradients (B to W). A branch reads the slots it
    needs from the buffers and returns what it fills as `put`, which the tick writes after the
    switch: XLA copies a buffer that a branch updates whole, a slot written outside costs one slot."""

    def __init__(self, stack, model, layers, outer, micro, total_tokens, *, p, m, v, manual, units, plan,
                 counts=None):
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers)
        super().__init__(stack, model, chunks, outer, micro, total_tokens, p=p, m=m, manual=manual, units=units)
        self.plan, self.v = plan, v
        if plan.gemms:  # B computes input gradients only; W the weight GEMMs from what B and F kept
            self.split = SplitStage.build(model.cfg, model.rules, model.attention_fn, counts)
            mb, act = self._pick(0), self.activation()
            shapes = jax.eval_shape(lambda: self.split.probes(self._chunk(0), self._varying(act), mb["positions"],
                                                              mb["segment_ids"]))
            probes = jax.tree.map(lambda a: self._varying(jnp.zeros(a.shape, a.dtype)), shapes)
            self.residuals = SplitResiduals(self.split, chunks, probes)

    def _chunk(self, c):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, c, 0, keepdims=False), self.layers)

    def initial_carry(self) -> dict:
        act = self.activation()
        chunk = jax.tree.map(lambda a: a[0], self.layers)
        x = lax.pcast(act, self.manual, to="varying")

        def probe(x):
            (_, stats), _ = self.residuals.vjp(x, self._pick(0), chunk)
            self._stats_vma = jax.tree.map(lambda a: tuple(sorted(jax.typeof(a).manual_axis_type.varying)), stats)
            return stats
        stats = jax.eval_shape(probe, x)
        zeros32 = functools.partial(jax.tree.map, lambda a: jnp.zeros(a.shape, jnp.float32))
        carry = dict(g_layers=self._layer_sums(), g_outer=zeros32(self._head_params(self.outer)),
                     loss=jnp.zeros((), jnp.float32), stats=zeros32(stats))
        return self._varying(carry)

    def _head_params(self, outer: dict) -> dict:
        """The outer parameters the last stage's head and loss read (all but the input embedding, unless
        the head is tied to it): the gradient sums the tick's switch carries. The embedding's gradient is
        summed outside it (`add_embedding_grads`): in the switch it would be copied in every branch of
        every tick (405B: 8 GiB of float32)."""
        return {k: v for k, v in outer.items() if k != "embedding" or self.model.cfg.tie_embeddings}

    @property
    def embedding_outside(self) -> bool:
        return "embedding" not in self._head_params(self.outer)

    def add_embedding_grads(self, sums: jax.Array, dx: jax.Array, j, taken) -> jax.Array:
        """The input embedding's float32 gradient sums [V, D] plus, where `taken` (stage 0's first chunk
        ran micro-batch j's backward this tick), the gradient of its lookup: dx [b, T, D] (the stage's
        input gradient) added at the rows of the micro-batch's tokens. One micro-batch's rows a tick,
        in place; the embedding is a lookup of the table in the compute dtype (`Transformer.embed`)."""
        tokens = lax.dynamic_index_in_dim(self.micro["inputs"], j, 1, keepdims=False)  # [b, T]
        rows = jnp.where(taken, dx, jnp.zeros_like(dx)).astype(jnp.float32)
        return sums.at[tokens.reshape(-1)].add(rows.reshape(-1, rows.shape[-1]))

    def slot_buffers(self) -> dict:
        """Zeroed slot buffers of the plan's sizes: "stash" (residuals; gemms: the records, `SlotUnion`
        of the residuals and the output gradients); split, "inputs" (gemms) or "gs" (pullback)."""
        act = self.activation()
        chunk = jax.tree.map(lambda a: a[0], self.layers)
        x = lax.pcast(act, self.manual, to="varying")
        if self.plan.gemms:  # a micro-batch's residuals (F to B), then its output gradients (B to W)
            residuals = self.residuals.structure(x, self._pick(0), self.manual, chunk)
            self.records = SlotUnion(residuals, self.residuals.probes)
            buffers = {"stash": self._varying(self.records.zeros(self.plan.stash_slots))}
        else:
            buffers = {"stash": self.residuals.stash(self.plan.stash_slots, x, self._pick(0), self.manual, chunk)}
        if self.plan.split and not self.plan.gemms:  # the stage's output gradient, B to W
            buffers["gs"] = lax.pcast(jnp.zeros((self.plan.weight_slots, *act.shape), act.dtype), self.manual,
                                      to="varying")
        elif self.plan.split:
            _, _, recorded = jax.eval_shape(lambda x: self.residuals.vjp_recording(x, self._pick(0), chunk), x)
            slots = functools.partial(jax.tree.map,
                                      lambda a: jnp.zeros((self.plan.weight_slots, *a.shape), a.dtype))
            buffers["inputs"] = self._varying(slots(recorded))
        return buffers

    def inboxes(self) -> tuple[jax.Array, jax.Array]:
        """Zeroed activation and gradient inboxes, one trash slot each beyond the plan's slots."""
        act = self.activation()
        return tuple(lax.pcast(jnp.zeros((n + 1, *act.shape), act.dtype), self.manual, to="varying")
                     for n in (self.plan.inbox_f_slots, self.plan.inbox_b_slots))

    def branches(self, used: set[int] | None = None) -> list:
        """The `lax.switch` branches (the constants above); those the plan never takes are idle, neither
        traced nor compiled (`used` defaults to the plan's)."""
        used = {int(b) for b in np.unique(self.plan.program[:, :, 0])} if used is None else used
        every = [self._idle, self._forward(False, False), self._forward(True, False), self._forward(False, True),
                 self._backward(False), self._backward(True), self._weights if self.plan.split else self._idle]
        return [branch if index in used else self._idle for index, branch in enumerate(every)]

    def _outputs(self, like, buffers, y=None, dx=None, dy=None, g_w=None, **put):
        """(activation, gradient, dy, chunk gradient, put): zeros where not given (the chunk gradient's
        FP8 amaxes -inf: `_chunk_grads`); `put` holds a slot's value for every buffer, zeros for those the
        operation does not fill (written where they overwrite nothing still to be read: the plan's `put_*`
        slots)."""
        zeros = jnp.zeros_like(like)
        put = {name: put.get(name, jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), buf))
               for name, buf in buffers.items()}
        if not self.sums_outside:
            g_w = ()
        elif g_w is None:
            g_w = self._chunk_grads()
        return (*(self._varying(a if a is not None else zeros) for a in (y, dx, dy)), self._varying(g_w),
                self._varying(put))

    def _idle(self, c, x, g, j, chunk, slot, wslot, part, buffers):
        return (c, *self._outputs(x, buffers))

    @property
    def sums_outside(self) -> bool:
        """Whether the layers' gradient sums stay out of the tick's switch (`_chunk_grads`): with several
        chunks a stage. With one the switch updates them in place of the whole, which XLA did not copy
        (llama3_8b on 2 stages under zero bubble: 122.49 GiB compiled that way, 130.95 outside)."""
        return self.v > 1

    def _add_grads(self, c, chunk, grads, start=0):
        """(carry, the operation's chunk-gradient output): `grads` [layers, ...] of chunk `chunk`'s layers
        start, start + 1, ... added to the sums in the carry, or, kept outside the switch
        (`sums_outside`), returned for `_table_loop` to add after it."""
        if self.sums_outside:
            return c, self._chunk_grads(grads, start)
        return self._add_layers(c, chunk, grads, start), None

    def _add_layers(self, c, chunk, grads, start=0):
        """The gradient sums of chunk `chunk`'s layers start, start + 1, ... plus `grads` [layers, ...]."""
        def window(a):  # [v, k, ...] -> the (chunk, layers) window `grads` covers
            size = (1, jax.tree.leaves(grads)[0].shape[0], *a.shape[2:])
            return lax.dynamic_slice(a, (chunk, start) + (0,) * (a.ndim - 2), size)[0]
        new = self._acc_layers(jax.tree.map(window, c["g_layers"]), grads)
        return {**c, "g_layers": jax.tree.map(
            lambda a, n: lax.dynamic_update_slice(a, n[None], (chunk, start) + (0,) * (a.ndim - 2)),
            c["g_layers"], new)}

    def _chunk_grads(self, grads=None, start=0):
        """One chunk's [k, ...] float32 layer gradients (FP8: amaxes), what an operation adds to the chunk's
        sums: `grads` [layers, ...] at layers start, start + 1, ..., zeros (amaxes -inf) elsewhere.

        The sums themselves stay out of the tick's `lax.switch` (`_table_loop` adds this after it): an
        operand a branch returns updated makes XLA copy it in every branch, the idle ones included, every
        tick (405B on 16 H100 stages in 2 chunks: 20 ms a tick of 14 modeled seconds a step, 3 s)."""
        sums = jax.tree.map(lambda a: a[0], self._layer_sums())
        if grads is None:
            return sums
        grads = {"params": grads["params"], **({FP8: fp8_lib.from_grad(grads[FP8])} if FP8 in grads else {})}

        def place(zero, g):
            g = g.astype(zero.dtype)
            return g if g.shape == zero.shape else lax.dynamic_update_slice_in_dim(zero, g, start, 0)
        return jax.tree.map(place, sums, grads)

    def _forward(self, first: bool, last: bool):
        def run(c, x, g, j, chunk, slot, wslot, part, buffers):
            mb = self._pick(j)
            w = self._chunk(chunk)
            x_in = self._embed(self.outer, mb["inputs"]) if first else x
            put = {}
            if self.plan.gemms:
                (y, stats), pullback, put["inputs"] = self.residuals.vjp_recording(x_in, mb, w)
            else:
                (y, stats), pullback = self.residuals.vjp(x_in, mb, w, chunk)
            put["stash"] = self.residuals.keep(pullback, w)
            if self.plan.gemms:
                put["stash"] = self._varying(self.records.pack(0, put["stash"]))
            c = {**c, "stats": self._acc(c["stats"], self._varying(stats))}
            if not last:
                return (c, *self._outputs(x, buffers, y=y, **put))
            loss, head_vjp = jax.vjp(lambda o, y: self._head_loss(o, y, mb), self.outer, y)
            g_head, dy = head_vjp(self._varying((1.0 / self.total_tokens).astype(loss.dtype)))
            c = {**c, "loss": c["loss"] + loss, "g_outer": self._acc(c["g_outer"], self._head_params(g_head))}
            return (c, *self._outputs(x, buffers, dy=dy, **put))
        return run

    def _cotangents(self, c, g):
        g_stats = {k: self._varying(v, self._stats_vma[k])
                   for k, v in aux_cotangents(c["stats"], self.model.cfg, self.units, self.m).items()}
        return (g, g_stats)

    def _backward(self, first: bool):
        def run(c, x, g, j, chunk, slot, wslot, part, buffers):
            mb = self._pick(j)
            w = self._chunk(chunk)
            kept = _load(buffers["stash"], slot)
            pullback = self.residuals.rebuild(self.records.unpack(0, kept) if self.plan.gemms else kept, w)
            put = {}
            if self.plan.gemms:  # the matmuls' weight gradients come later (W), from their dy kept here
                g_w, dx, dys = pullback(self._cotangents(c, g))
                put["stash"] = self._varying(self.records.pack(1, dys))  # in the record's slot, over the residuals
            else:
                g_w, dx = pullback(self._cotangents(c, g))
            if self.plan.split and not self.plan.gemms:  # W runs the pullback again for g_w (dead code here)
                put["gs"] = g
                g_w = None
            else:  # fused (interleaved): every weight gradient; gemms split: those no matmul reads (norm scales)
                c, g_w = self._add_grads(c, chunk, g_w)
            if self.embedding_outside:  # dx is the lookup's output gradient: `add_embedding_grads` takes it
                return (c, *self._outputs(x, buffers, dx=dx, g_w=g_w, **put))  # (sent upstream, to no inbox)
            _, embed_vjp = jax.vjp(lambda o: self._embed(o, mb["inputs"]), self.outer)
            (g_embed,) = embed_vjp(dx)
            c = {**c, "g_outer": self._acc(c["g_outer"], self._head_params(g_embed))}
            return (c, *self._outputs(x, buffers, g_w=g_w, **put))
        return run

    def _weights(self, c, x, g, j, chunk, slot, wslot, part, buffers):
        """W: each matmul's weight gradient x^T dy from its recorded input and output gradient
        (gemms), for the `part`-th 1/weight_parts of the chunk's layers; or the stage's pullback again,
        from its residuals and output gradient (pullback)."""
        mb, w = self._pick(j), self._chunk(chunk)
        if not self.plan.gemms:
            pullback = self.residuals.rebuild(_load(buffers["stash"], slot), w)
            g_w, _ = pullback(self._cotangents(c, _load(buffers["gs"], wslot)))
            c, g_w = self._add_grads(c, chunk, g_w)
            return (c, *self._outputs(x, buffers, g_w=g_w))
        held = {"inputs": _load(buffers["inputs"], wslot),
                "dys": self.records.unpack(1, _load(buffers["stash"], wslot))}
        size = jax.tree.leaves(w)[0].shape[0] // self.plan.weight_parts  # layers of one part
        start = part * size
        if self.plan.weight_parts > 1:  # every value here is [k layers, ...]: the part's window of them
            w, held = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, size, 0), (w, held))

        def outputs(w):
            if FP8 in w:
                w = {**w, FP8: fp8_lib.for_grad(w[FP8])}
            return self.split.weights(w, held["inputs"], x, mb["positions"], mb["segment_ids"], start)
        _, pullback = jax.vjp(outputs, w)
        (g_w,) = pullback(held["dys"])
        c, g_w = self._add_grads(c, chunk, g_w, start)
        return (c, *self._outputs(x, buffers, g_w=g_w))


def loss_and_grads(params, histories, batch, model, total_tokens, accum_steps):
    """(loss_sum, aux, grads, amaxes) of a slot-table schedule; the train step's drop-in for autodiff
    (the contract of `pipeline.loss_and_grads`)."""
    del accum_steps  # the validator requires train.grad_accum_steps == 1 with a pipeline
    pipe = model.pipeline
    plan = slot_plan(pipe.schedule, pipe.stages, pipe.microbatches, pipe.repeats, pipe.split_backward,
                     pipe.weight_parts, latency=int(pipe.overlap))
    return run_gradient_loop(_table_loop, params, histories, batch, model, total_tokens, plan=plan, v=pipe.repeats,
                             counts=pipe.counts)


def _ring(p: int, step: int, wraps: bool) -> list[tuple[int, int]]:
    return [(s, (s + step) % p) for s in range(p) if wraps or 0 <= s + step < p]


def _add_chunk(sums: dict, grads: dict, chunk) -> dict:
    """`sums` [v, k, ...] with `grads` [k, ...] (`_TableWork._chunk_grads`) added to chunk `chunk`'s
    gradients and maximised into its FP8 amaxes, in place (one chunk read and written)."""
    def update(op):
        def run(total, g):
            start = (chunk,) + (0,) * (total.ndim - 1)
            window = lax.dynamic_slice(total, start, (1, *total.shape[1:]))
            return lax.dynamic_update_slice(total, op(window, g[None]), start)
        return run
    out = {"params": jax.tree.map(update(jnp.add), sums["params"], grads["params"])}
    if FP8 in sums:
        out[FP8] = jax.tree.map(update(jnp.maximum), sums[FP8], grads[FP8])
    return out


def _table_loop(stack, model, layers, outer, micro, total_tokens, *, plan, p, m, v, axes, units, specs,
                counts=None):
    """One stage's ticks of `plan`: its operation (`lax.switch`), then the activation one stage on and
    the input gradient one stage back (`ppermute`), each put in its inbox slot. With `plan.latency` 1
    the outputs stay in the carry and leave at the start of the next tick, travelling while its
    operation runs (which reads nothing of them: the table was simulated with the latency)."""
    s = lax.axis_index(STAGE)
    rest = tuple(a for a in axes if a != STAGE)
    outer = lax.pcast(outer, axes, to="varying")
    layers = vary(layers, rest)
    work = _TableWork(stack, model, layers, outer, micro, total_tokens, p=p, m=m, v=v, manual=axes, units=units,
                      plan=plan, counts=counts)
    branches = work.branches()
    forward_pairs, backward_pairs = _ring(p, 1, plan.wraps), _ring(p, -1, plan.wraps)
    field = {name: i for i, name in enumerate(FIELDS)}
    keeps = {name: bool(plan.program[:, :, field["keep_" + PUT_FIELD[name]]].any()) for name in PUT_FIELD}

    def tick(carry, program):
        c, buffers, inbox_f, inbox_b, embedded, sent = carry
        if plan.latency:  # last tick's outputs, in flight while this tick's operation runs
            arriving = (lax.ppermute(sent[0], STAGE, forward_pairs), lax.ppermute(sent[1], STAGE, backward_pairs))
        row = lax.dynamic_index_in_dim(program, s, 0, keepdims=False)
        branch = row[field["branch"]]
        x = lax.dynamic_index_in_dim(inbox_f, row[field["read_f"]], 0, keepdims=False)
        g = lax.dynamic_index_in_dim(inbox_b, row[field["read_b"]], 0, keepdims=False)
        sums = c.pop("g_layers") if work.sums_outside else None  # (`_TableWork._chunk_grads`)
        c, y, dx, dy, g_w, put = lax.switch(branch, branches, c, x, g, row[field["micro"]], row[field["chunk"]],
                                            row[field["stash"]], row[field["wstash"]], row[field["part"]], buffers)
        if work.sums_outside:
            c = {**c, "g_layers": _add_chunk(sums, g_w, row[field["chunk"]])}
        if work.embedding_outside:
            embedded = work.add_embedding_grads(embedded, dx, row[field["micro"]], branch == BACKWARD_FIRST)
        for name, buf in buffers.items():
            slot, value = row[field["put_" + PUT_FIELD[name]]], put[name]
            if keeps[name]:  # the program writes some slot's value back: read it (one slot), not a slot more
                keep = row[field["keep_" + PUT_FIELD[name]]] == 1
                value = jax.tree.map(functools.partial(jnp.where, keep), _load(buf, slot), value)
            buffers = {**buffers, name: _store(buf, value, slot)}
        inbox_b = lax.dynamic_update_index_in_dim(inbox_b, dy, row[field["dy"]], 0)
        if not plan.latency:
            arriving, sent = (lax.ppermute(y, STAGE, forward_pairs), lax.ppermute(dx, STAGE, backward_pairs)), ()
        else:
            sent = (y, dx)
        inbox_f = lax.dynamic_update_index_in_dim(inbox_f, arriving[0], row[field["recv_f"]], 0)
        inbox_b = lax.dynamic_update_index_in_dim(inbox_b, arriving[1], row[field["recv_b"]], 0)
        return (c, buffers, inbox_f, inbox_b, embedded, sent), None

    inbox_f, inbox_b = work.inboxes()
    sent = (inbox_f[0], inbox_b[0]) if plan.latency else ()
    # the input embedding's float32 gradient sums, outside the switch (`_TableWork.add_embedding_grads`)
    embedded = (lax.pcast(jnp.zeros(work.outer["embedding"].shape, jnp.float32), axes, to="varying")
                if work.embedding_outside else ())
    init = (work.initial_carry(), work.slot_buffers(), inbox_f, inbox_b, embedded, sent)
    (c, _, _, _, embedded, _), _ = lax.scan(tick, init, jnp.asarray(plan.program))
    g_outer = {**c["g_outer"], **({"embedding": embedded} if work.embedding_outside else {})}
    g_layers = jax.tree.map(lambda g: g.reshape(g.shape[0] * g.shape[1], *g.shape[2:]), c["g_layers"])
    g_layers = reduce_layer_grads(g_layers, specs, rest)
    stats = jax.tree.map(lambda a: pmean(lax.psum(a, STAGE), rest) / (units * m), c["stats"])
    return lax.psum(c["loss"], axes), stats, lax.psum(g_outer, axes), g_layers
