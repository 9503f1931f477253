"""Slot-table schedules in one SPMD loop: interleaved 1F1B and zero bubble (ZB-H1).

Playbook, "Interleaving stages" and "Zero Bubble and DualPipe". `schedules.simulate` gives, per
tick, the operation each stage runs: F (forward of a micro-batch through one of the stage's
model chunks), B (its input gradient) and W (its weight gradient). This module turns that table
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
  bounded independent of m (`schedules.in_flight` counts them from the table).
* zero_bubble (ZB-H1): B and W are separate operations. B runs the stage's `jax.vjp` pullback for
  the input gradient only (the weight-gradient matmuls are dead code there) and sends it upstream
  at once; W runs the same pullback, from the same stashed residuals and the stashed output
  gradient, for the weight gradient only, in ticks that would otherwise idle. Bubble (p-1)/(3m) of
  the ideal time, a third of 1F1B's, at 1F1B's activation memory (p micro-batches per stage at
  most). The price: W re-traverses the stage's input-gradient chain to reach each layer's weights
  (the forward is never recomputed; storing every linear layer's output gradient would avoid it).

Buffers. Every value waiting between ticks sits in a slot of a statically sized buffer: the vjp
residuals of a forward until its backward (fused) or its W (split), arriving activations and
gradients until the operation that consumes them. Slots are assigned from the table's lifetimes,
so buffer sizes are the table's peak occupancy, not m.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshtrain.parallel import schedules
from meshtrain.parallel.pipeline import (
    STAGE,
    SlotWork,
    aux_cotangents,
    pmean,
    reduce_layer_grads,
    run_gradient_loop,
)
from meshtrain.sharding_rules import vary

# branch indices of the tick's `lax.switch`
IDLE, FORWARD, FORWARD_FIRST, FORWARD_LAST, BACKWARD, BACKWARD_FIRST, WEIGHTS = range(7)
FIELDS = ("branch", "micro", "chunk", "stash", "read_f", "read_b", "dy", "recv_f", "recv_b")


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """The static program of a slot table: `program[t, s]` holds, for stage s at tick t, the FIELDS:
    the branch, micro-batch and chunk of its operation, the residual slot it writes (F) or reads
    (B, W), the inbox slots its input activation (F) or output gradient (B) comes from, the gradient
    inbox slot where the last stage's forward leaves its loss gradient, and the inbox slots where the
    activation and gradient arriving after the tick go. A slot index equal to the buffer size is the
    trash slot (nothing to keep)."""

    program: np.ndarray  # int32 [ticks, p, len(FIELDS)]
    stash_slots: int
    inbox_f_slots: int
    inbox_b_slots: int
    split: bool  # B and W are separate operations (zero_bubble)
    wraps: bool  # activations go p-1 -> 0 (and gradients back) between chunks

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


def slot_plan(schedule: str, p: int, m: int, v: int = 1) -> SlotPlan:
    """The executable program of `schedule`'s table (see `SlotPlan`)."""
    table = schedules.simulate(schedule, p, m, v)
    split = schedule == "zero_bubble"
    when = {(op.kind, s, op.micro, op.chunk): t for t, row in enumerate(table) for s, op in enumerate(row) if op}
    stash_iv = [[] for _ in range(p)]
    inbox_f_iv = [[] for _ in range(p)]
    inbox_b_iv = [[] for _ in range(p)]
    for (kind, s, j, c), t in when.items():
        if kind == schedules.F:
            # residuals live until the backward that ends with them: B (fused) or W (split)
            stash_iv[s].append((t, when[(schedules.W if split else schedules.B, s, j, c)], (s, j, c)))
            if s == p - 1 and c == v - 1:  # the loss gradient, left during the tick for this stage's B
                inbox_b_iv[s].append((t + 0.25, when[(schedules.B, s, j, c)], (s, j, c)))
            else:  # the activation arrives at the next stage after the tick
                dst, dc = (s + 1, c) if s < p - 1 else (0, c + 1)
                inbox_f_iv[dst].append((t + 0.5, when[(schedules.F, dst, j, dc)], (dst, j, dc)))
        elif kind == schedules.B and not (s == 0 and c == 0):
            dst, dc = (s - 1, c) if s > 0 else (p - 1, c - 1)
            inbox_b_iv[dst].append((t + 0.5, when[(schedules.B, dst, j, dc)], (dst, j, dc)))
    stash, inbox_f, inbox_b = ({}, {}, {})
    sizes = []
    for intervals, slots in ((stash_iv, stash), (inbox_f_iv, inbox_f), (inbox_b_iv, inbox_b)):
        most = 0
        for s in range(p):
            got, used = _allocate(intervals[s])
            slots.update(got)
            most = max(most, used)
        sizes.append(max(most, 1))
    n_stash, n_f, n_b = sizes
    program = np.zeros((len(table), p, len(FIELDS)), np.int32)
    program[:, :, FIELDS.index("recv_f")] = n_f
    program[:, :, FIELDS.index("recv_b")] = n_b
    program[:, :, FIELDS.index("dy")] = n_b
    for (kind, s, j, c), t in when.items():
        row = program[t, s]
        key = (s, j, c)
        first, last = s == 0 and c == 0, s == p - 1 and c == v - 1
        if kind == schedules.F:
            branch = FORWARD_FIRST if first else FORWARD_LAST if last else FORWARD
            row[FIELDS.index("read_f")] = 0 if first else inbox_f[key]
            if last:
                row[FIELDS.index("dy")] = inbox_b[key]
            else:
                dst, dc = (s + 1, c) if s < p - 1 else (0, c + 1)
                program[t, dst, FIELDS.index("recv_f")] = inbox_f[(dst, j, dc)]
        elif kind == schedules.B:
            branch = BACKWARD_FIRST if first else BACKWARD
            row[FIELDS.index("read_b")] = inbox_b[key]
            if not first:
                dst, dc = (s - 1, c) if s > 0 else (p - 1, c - 1)
                program[t, dst, FIELDS.index("recv_b")] = inbox_b[(dst, j, dc)]
        else:
            branch = WEIGHTS if split else IDLE  # fused schedules ran W inside B
        row[FIELDS.index("branch")] = branch
        row[FIELDS.index("micro")], row[FIELDS.index("chunk")] = j, c
        row[FIELDS.index("stash")] = stash[key]
    return SlotPlan(program, n_stash, n_f, n_b, split, wraps=v > 1)


def branch_share(plan: SlotPlan) -> tuple[float, ...]:
    """The share of (tick, stage) pairs that take each branch (the HLO byte count's conditional weights)."""
    counts = np.bincount(plan.program[:, :, 0].ravel(), minlength=7)
    return tuple(float(c) for c in counts / counts.sum())


class _TableWork(SlotWork):
    """The operations of a slot table on one stage, as `lax.switch` branches (the branch constants
    above). Each takes (carry, x_in, g_in, j, c, slot) -> (carry, activation out, gradient out, dy).

    The carry holds the stash of vjp residuals (and, split, the output gradients W needs), float32
    gradient sums of the stage's chunks (`g_layers` [v, k, ...]) and of the embedding / head, the
    summed loss and MoE statistics."""

    def __init__(self, stack, model, layers, outer, micro, total_tokens, *, p, m, v, manual, units, plan):
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers)
        super().__init__(stack, model, chunks, outer, micro, total_tokens, p=p, m=m, manual=manual, units=units)
        self.plan, self.v = plan, v

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
        carry = dict(g_layers=self._layer_sums(), g_outer=zeros32(self.outer), loss=jnp.zeros((), jnp.float32),
                     stats=zeros32(stats))
        if self.plan.split:
            carry["g_stash"] = jnp.zeros((self.plan.stash_slots, *act.shape), act.dtype)
        stash = self.residuals.stash(self.plan.stash_slots, x, self._pick(0), self.manual, chunk)
        return {**self._varying(carry), "stash": stash}

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

    def _outputs(self, like, y=None, dx=None, dy=None):
        zeros = jnp.zeros_like(like)
        return tuple(self._varying(a if a is not None else zeros) for a in (y, dx, dy))

    def _idle(self, c, x, g, j, chunk, slot):
        return (c, *self._outputs(x))

    def _add_layers(self, c, chunk, grads):
        old = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, chunk, 0, keepdims=False), c["g_layers"])
        new = self._acc_layers(old, grads)
        return {**c, "g_layers": jax.tree.map(lambda a, n: lax.dynamic_update_index_in_dim(a, n, chunk, 0),
                                              c["g_layers"], new)}

    def _forward(self, first: bool, last: bool):
        def run(c, x, g, j, chunk, slot):
            mb = self._pick(j)
            w = self._chunk(chunk)
            x_in = self._embed(self.outer, mb["inputs"]) if first else x
            (y, stats), pullback = self.residuals.vjp(x_in, mb, w)
            c = {**c, "stash": self.residuals.store(c["stash"], pullback, slot, w),
                 "stats": self._acc(c["stats"], self._varying(stats))}
            if not last:
                return (c, *self._outputs(x, y=y))
            loss, head_vjp = jax.vjp(lambda o, y: self._head_loss(o, y, mb), self.outer, y)
            g_head, dy = head_vjp(self._varying((1.0 / self.total_tokens).astype(loss.dtype)))
            c = {**c, "loss": c["loss"] + loss, "g_outer": self._acc(c["g_outer"], g_head)}
            return (c, *self._outputs(x, dy=dy))
        return run

    def _cotangents(self, c, g):
        g_stats = {k: self._varying(v, self._stats_vma[k])
                   for k, v in aux_cotangents(c["stats"], self.model.cfg, self.units, self.m).items()}
        return (g, g_stats)

    def _backward(self, first: bool):
        def run(c, x, g, j, chunk, slot):
            mb = self._pick(j)
            w = self._chunk(chunk)
            pullback = self.residuals.load(c["stash"], slot, w)
            g_w, dx = pullback(self._cotangents(c, g))
            if self.plan.split:  # W comes later, from the same residuals and this output gradient
                c = {**c, "g_stash": lax.dynamic_update_index_in_dim(c["g_stash"], g, slot, 0)}
            else:
                c = self._add_layers(c, chunk, g_w)
            if not first:
                return (c, *self._outputs(x, dx=dx))
            _, embed_vjp = jax.vjp(lambda o: self._embed(o, mb["inputs"]), self.outer)
            (g_embed,) = embed_vjp(dx)
            return ({**c, "g_outer": self._acc(c["g_outer"], g_embed)}, *self._outputs(x))
        return run

    def _weights(self, c, x, g, j, chunk, slot):
        w = self._chunk(chunk)
        pullback = self.residuals.load(c["stash"], slot, w)
        g_out = lax.dynamic_index_in_dim(c["g_stash"], slot, 0, keepdims=False)
        g_w, _ = pullback(self._cotangents(c, g_out))
        return (self._add_layers(c, chunk, g_w), *self._outputs(x))


def loss_and_grads(params, histories, batch, model, total_tokens, accum_steps):
    """(loss_sum, aux, grads, amaxes) of a slot-table schedule; the train step's drop-in for autodiff
    (the contract of `pipeline.loss_and_grads`)."""
    del accum_steps  # the validator requires train.grad_accum_steps == 1 with a pipeline
    pipe = model.pipeline
    plan = slot_plan(pipe.schedule, pipe.stages, pipe.microbatches, pipe.repeats)
    return run_gradient_loop(_table_loop, params, histories, batch, model, total_tokens, plan=plan, v=pipe.repeats)


def _ring(p: int, step: int, wraps: bool) -> list[tuple[int, int]]:
    return [(s, (s + step) % p) for s in range(p) if wraps or 0 <= s + step < p]


def _table_loop(stack, model, layers, outer, micro, total_tokens, *, plan, p, m, v, axes, units, specs):
    """One stage's ticks of `plan`: its operation (`lax.switch`), then the activation one stage on and
    the input gradient one stage back (`ppermute`), each put in its inbox slot."""
    s = lax.axis_index(STAGE)
    rest = tuple(a for a in axes if a != STAGE)
    outer = lax.pcast(outer, axes, to="varying")
    layers = vary(layers, rest)
    work = _TableWork(stack, model, layers, outer, micro, total_tokens, p=p, m=m, v=v, manual=axes, units=units,
                      plan=plan)
    branches = work.branches()
    forward_pairs, backward_pairs = _ring(p, 1, plan.wraps), _ring(p, -1, plan.wraps)
    field = {name: i for i, name in enumerate(FIELDS)}

    def tick(carry, program):
        c, inbox_f, inbox_b = carry
        row = lax.dynamic_index_in_dim(program, s, 0, keepdims=False)
        x = lax.dynamic_index_in_dim(inbox_f, row[field["read_f"]], 0, keepdims=False)
        g = lax.dynamic_index_in_dim(inbox_b, row[field["read_b"]], 0, keepdims=False)
        c, y, dx, dy = lax.switch(row[field["branch"]], branches, c, x, g, row[field["micro"]],
                                  row[field["chunk"]], row[field["stash"]])
        inbox_b = lax.dynamic_update_index_in_dim(inbox_b, dy, row[field["dy"]], 0)
        inbox_f = lax.dynamic_update_index_in_dim(inbox_f, lax.ppermute(y, STAGE, forward_pairs),
                                                  row[field["recv_f"]], 0)
        inbox_b = lax.dynamic_update_index_in_dim(inbox_b, lax.ppermute(dx, STAGE, backward_pairs),
                                                  row[field["recv_b"]], 0)
        return (c, inbox_f, inbox_b), None

    inbox_f, inbox_b = work.inboxes()
    (c, _, _), _ = lax.scan(tick, (work.initial_carry(), inbox_f, inbox_b), jnp.asarray(plan.program))
    g_layers = jax.tree.map(lambda g: g.reshape(g.shape[0] * g.shape[1], *g.shape[2:]), c["g_layers"])
    g_layers = reduce_layer_grads(g_layers, specs, rest)
    stats = jax.tree.map(lambda a: pmean(lax.psum(a, STAGE), rest) / (units * m), c["stats"])
    return lax.psum(c["loss"], axes), stats, lax.psum(c["g_outer"], axes), g_layers
