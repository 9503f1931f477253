"""The pipeline's slot-table executor: 1F1B, interleaved 1F1B and zero bubble (ZB-H1) in one SPMD loop.

Playbook, "One-forward-one-backward", "Interleaving stages" and "Zero Bubble and DualPipe".
`schedules.executed` gives, per tick, the operation each stage runs (each schedule's own table
builder, `schedules.REGISTRY`): F (forward of a micro-batch through one of the stage's model
chunks), B (its input gradient; 1F1B and interleaved 1F1B: its whole backward) and W (zero bubble:
its weight gradient). This module turns that table
into static integer programs (`SlotPlan`) and runs them in one `lax.scan` over ticks inside the
pipeline's `shard_map`: at each tick every stage runs its own operation (`lax.switch`), then two
`ppermute`s move the outputs one stage on, activations forward and input gradients back (with the
wrap-around p-1 -> 0 and back when a stage holds several chunks). Nothing in the loop depends on
data: which operation, which micro-batch and chunk, and which buffer slot every value is read from
and written to are fixed by the table, so the loop is one program on every device.

* 1f1b: stage s runs the forward of micro-batch j in tick s + 2j and its backward in tick
  2p - 1 - s + 2j (neighbours in opposite phases); p - s micro-batches held on stage s. With
  transfers behind compute its ticks alternate as interleaved 1F1B's do (v = 1).
* interleaved_1f1b (Megatron's virtual stages): stage s holds v = `pipeline.repeats` chunks, chunk
  c being virtual stage c*p + s (the circular schedule's layout, so checkpoints move freely between
  them); micro-batches run in groups of p chunk by chunk. Bubble (p-1)/(v m) of the ideal time.
  Stage s holds at most (p - s - 1)*2 + (v - 1)*p + 1 chunk activations, each 1/v of a 1F1B stage's:
  bounded independent of m (`schedules.in_flight` counts them from the table). Its ticks alternate
  (`schedules.alternating`): every stage runs a forward, then every stage a backward (input and weight
  gradients in one operation), so no tick waits for a backward beside forwards.
* zero_bubble (ZB-H1): B sends the input gradient upstream at once and W, in ticks that would
  otherwise idle (overlapped: in the W ticks of its B's loop step, over the step's B's, `schedules.defers_w`,
  `pipeline.weight_span`), computes the
  weight gradient. Bubble (p-1)/(3m) of the ideal time, a third of
  1F1B's, with 1F1B's residuals (p micro-batches per stage at most).

Zero bubble runs the split backward (`pipeline.SplitStage`, `schedules.SPLIT_BACKWARD`): F records every
matmul's input (or B returns it: `pipeline.inputs_at_b`); B is the pullback of a forward whose matmul
weights are constants and whose matmul outputs carry zero probes, so it computes the input gradients
only and the probes' cotangents are the matmuls' output gradients; W is each matmul's weight GEMM
x^T dy from what F and B kept. The
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
idle ones too, every tick (at 405B a large share of the step: docs/405b.md). The input
embedding's sums are added after the switch (stage 0's micro-batch rows, a scatter); with several chunks
a stage the layers' sums are too, from the chunk gradient the operation returns (`_TableWork.sums_outside`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshtrain import fp8 as fp8_lib
from meshtrain.parallel import slot_program
from meshtrain.parallel.pipeline import (
    FP8,
    STAGE,
    Residuals,
    SplitStage,
    aux_cotangents,
    pmean,
    reduce_grads,
    reduce_layer_grads,
    run_gradient_loop,
)
from meshtrain.parallel.slot_program import BACKWARD, BACKWARD_FIRST, BRANCHES, FIELDS, FORWARD_LAST, PUT_FIELD, WEIGHTS
from meshtrain.sharding_rules import vary, varying

DENSE = "dense_layers"  # the outer parameters of `model.first_dense_layers` (stage 0's stem)


class SplitResiduals(Residuals):
    """B's vjp residuals under the split backward (`SplitStage.forward`: matmul weights constant,
    probes on the matmul outputs, inputs recorded for W)."""

    def __init__(self, split: SplitStage, layers, probes, taps=None):
        super().__init__(None, layers)
        self.split, self.probes, self.taps = split, probes, taps

    def vjp_recording(self, x, mb, w):
        """((y, stats), pullback (w, x, probes[, taps]), recorded matmul inputs): with `taps` (W's inputs
        from B) the pullback also returns the matmuls' inputs, and nothing is recorded (None)."""
        def run(w, x, probes, *taps):
            if FP8 in w:
                w = {**w, FP8: fp8_lib.for_grad(w[FP8])}
            return self.split.forward(w, x, mb["positions"], mb["segment_ids"], probes, *taps)
        taps = () if self.taps is None else (self.taps,)
        return jax.vjp(run, w, x, self.probes, *taps, has_aux=True)

    def vjp(self, x, mb, w=None, chunk=0):
        del chunk  # the split backward runs one chunk a stage (`schedules.SPLIT_BACKWARD`)
        out, pullback, _ = self.vjp_recording(x, mb, self._layers if w is None else w)
        return out, pullback

    def _constants(self, w) -> list:
        # the probes and taps are zeros, the same arrays in every slot: the remat keeps them as inputs, the
        # stash does not
        return super()._constants(w) + jax.tree.leaves(self.probes) + jax.tree.leaves(self.taps)


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


# `SlotPlan.handoff`: the operand under which W's switch reads the record B's switch of the same loop
# step returned (one slot, read-only: no switch returns a put for it)
HANDED = "handed"


def _store(buffers, values, slot):
    return jax.tree.map(lambda buf, a: lax.dynamic_update_index_in_dim(buf, a, slot, 0), buffers, values)


def _load(buffers, slot):
    return jax.tree.map(lambda buf: lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False), buffers)


class _TableWork:
    """The operations of a slot table on one stage, as `lax.switch` branches (the branch constants
    above). Each takes (carry, x_in, g_in, j, c, slot, weight slot, W part, buffers) -> (carry,
    activation out, gradient out, dy, chunk gradient, put).

    The carry holds float32 gradient sums of the stage's chunks (`g_layers` [v, k, ...]) and of the
    head (`g_outer`), the summed loss and MoE statistics; every entry differs per stage and per
    data-parallel rank. What lives from one operation to a later one is kept in slot buffers outside
    the switch (`slot_buffers`): the vjp residuals (F to B) and, split, the matmuls' inputs (F to W)
    and output gradients (B to W). A branch reads the slots it needs from the buffers and returns what
    it fills as `put`, which the tick writes after the switch: XLA copies a buffer that a branch updates
    whole, a slot written outside costs one slot."""

    def __init__(self, stack, model, layers, outer, micro, total_tokens, *, p, m, v, manual, units, plan,
                 counts=None, aux_scale=1.0):
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers)
        self.model, self.layers, self.outer, self.micro = model, chunks, outer, micro
        self.total_tokens, self.p, self.m, self.manual, self.units = total_tokens, p, m, manual, units
        self.aux_scale = aux_scale  # `pipeline.aux_cotangents`' scale in this region
        self.residuals = Residuals(stack, chunks)
        self.plan, self.v = plan, v
        if plan.gemms:  # B computes input gradients only; W the weight GEMMs from what B and F kept
            self.split = SplitStage.build(model.cfg, model.rules, model.attention_fn, counts)
            mb, act = self._pick(0), self.activation()
            shapes = jax.eval_shape(lambda: self.split.probes(self._chunk(0), self._varying(act), mb["positions"],
                                                              mb["segment_ids"]))
            probes = jax.tree.map(lambda a: self._varying(jnp.zeros(a.shape, a.dtype)), shapes)
            self.residuals = SplitResiduals(self.split, chunks, probes)
            if plan.inputs_at_b:  # zeros shaped as the recorded inputs: their cotangents are the inputs
                x = self._varying(act)
                _, _, recorded = jax.eval_shape(lambda x: self.residuals.vjp_recording(x, mb, self._chunk(0)), x)
                taps = jax.tree.map(lambda a: self._varying(jnp.zeros(a.shape, a.dtype)), recorded)
                self.residuals = SplitResiduals(self.split, chunks, probes, taps)

    def _embed(self, o, tokens):
        return self.model.apply({"params": o}, tokens, method="embed")

    def _dense(self, o, x, mb):
        """x through the dense first layers (`model.first_dense_layers`), which stage 0 runs before its chunk."""
        return self.model.apply({"params": o}, x, mb["positions"], mb["segment_ids"], method="dense")

    @property
    def _has_dense(self) -> bool:
        return bool(self.model.cfg.first_dense_layers)

    def _head_loss(self, o, y, mb):
        """The last stage's loss: the head's cross-entropy sum, and under `model.mtp_depth` multi-token
        prediction's (sum, tokens, router statistics) (`Transformer.head_and_mtp`)."""
        if self.model.cfg.mtp_depth:
            return self.model.apply({"params": o}, y, mb, method="head_and_mtp")
        return self.model.apply({"params": o}, y, mb, method="head_loss"), None

    def _pick(self, i):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 1, keepdims=False), self.micro)

    def _varying(self, x, axes: tuple[str, ...] | None = None):
        """`x` varying over `axes` (default: every manual axis): a carry entry, or a cotangent."""
        return vary(x, self.manual if axes is None else axes)

    @staticmethod
    def _acc(sums, grads):
        return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), sums, grads)

    @classmethod
    def _acc_layers(cls, sums, grads):
        """Layer gradients summed, FP8 amaxes maximised (`_layer_sums`)."""
        out = {"params": cls._acc(sums["params"], grads["params"])}
        if FP8 in sums:
            out[FP8] = jax.tree.map(jnp.maximum, sums[FP8], fp8_lib.from_grad(grads[FP8]))
        return out

    def _layer_sums(self) -> dict:
        """Zeroed float32 gradient sums of the stage's layers and, under FP8, amaxes (-inf: none yet)."""
        sums = {"params": jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), self.layers["params"])}
        if FP8 in self.layers:
            sums[FP8] = jax.tree.map(lambda a: jnp.full(a.shape, -jnp.inf, jnp.float32), self.layers[FP8])
        return sums

    def activation(self) -> jax.Array:
        """Zeros shaped like one micro-batch's activation [b, T, D]."""
        example = jax.eval_shape(self._embed, self.outer, self._pick(0)["inputs"])
        return jnp.zeros(example.shape, example.dtype)

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
        if self.model.cfg.mtp_depth:  # multi-token prediction's cross-entropy sum and the tokens it counted
            carry["mtp"] = jnp.zeros((2,), jnp.float32)
        return self._varying(carry)

    def _head_params(self, outer: dict) -> dict:
        """The outer parameters the switch's branches add gradients to (all but the input embedding, unless
        the head is tied to it or multi-token prediction reads it on the last stage): the gradient sums the
        tick's switch carries. The embedding's gradient is otherwise summed outside it
        (`add_embedding_grads`): in the switch its float32 [V, D] sum would be copied in every branch of every
        tick (docs/405b.md)."""
        cfg = self.model.cfg
        return {k: v for k, v in outer.items() if k != "embedding" or cfg.tie_embeddings or cfg.mtp_depth}

    def _add_outer(self, sums: dict, grads: dict) -> dict:
        """The outer sums plus `grads`, which covers some of their entries (what one branch differentiated):
        each branch reads and writes only the sums it adds to (DeepSeek-V3's outer parameters, 4.1e9 on every
        stage: adding the whole tree in each branch moved it all four times a micro-batch; docs/moe.md)."""
        return {**sums, **self._acc({k: sums[k] for k in grads}, grads)}

    @property
    def embedding_outside(self) -> bool:
        return "embedding" not in self._head_params(self.outer)

    @property
    def first_adds_outer(self) -> bool:
        """Whether stage 0's backward adds to the outer sums the switch carries: the embedding's (not summed
        outside) or the dense first layers'."""
        return not self.embedding_outside or self._has_dense

    def add_embedding_grads(self, sums: jax.Array, dx: jax.Array, j, taken) -> jax.Array:
        """The input embedding's float32 gradient sums [V, D] plus, where `taken` (stage 0's first chunk
        ran micro-batch j's backward this tick), the gradient of its lookup: dx [b, T, D] (the gradient at
        the lookup's output: the stage's input gradient, through the dense first layers' backward where
        there are some) added at the rows of the micro-batch's tokens. One micro-batch's rows a tick,
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
        if self.plan.gemms and not self.plan.inputs_at_b:  # a record: residuals (F to B), output gradients (to W)
            residuals = self.residuals.structure(x, self._pick(0), self.manual, chunk)
            self.records = SlotUnion(residuals, self.residuals.probes)
            buffers = {"stash": self._varying(self.records.zeros(self.plan.stash_slots))}
        else:
            buffers = {"stash": self.residuals.stash(self.plan.stash_slots, x, self._pick(0), self.manual, chunk)}
        if self.plan.split and not self.plan.gemms:  # the stage's output gradient, B to W
            buffers["gs"] = lax.pcast(jnp.zeros((self.plan.weight_slots, *act.shape), act.dtype), self.manual,
                                      to="varying")
        elif self.plan.split:
            slots = functools.partial(jax.tree.map,
                                      lambda a: jnp.zeros((self.plan.weight_slots, *a.shape), a.dtype))
            if self.plan.handoff:  # none kept: B's switch returns them and W's reads them (`SlotPlan.handoff`)
                self.unslotted = self._varying(jax.tree.map(lambda a: jnp.zeros((0, *a.shape), a.dtype),
                                                            (self.residuals.taps, self.residuals.probes)))
            elif self.plan.inputs_at_b:  # the matmuls' inputs and output gradients, B to W
                buffers["inputs"] = self._varying(slots((self.residuals.taps, self.residuals.probes)))
            else:
                _, _, recorded = jax.eval_shape(lambda x: self.residuals.vjp_recording(x, self._pick(0), chunk), x)
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
               for name, buf in buffers.items() if name != HANDED}
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
        chunks a stage. With one the switch updates them in place of the whole, which XLA did not copy, and
        the step compiles smaller than with the sums outside (llama3_8b under zero bubble: docs/pipeline.md)."""
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
        """One chunk's [k, ...] layer gradients in the weights' dtypes (FP8: float32 amaxes), what an
        operation adds to the chunk's float32 sums: `grads` [layers, ...] at layers start, start + 1, ...,
        zeros (amaxes -inf) elsewhere.

        The sums themselves stay out of the tick's `lax.switch` (`_table_loop` adds this after it): an
        operand a branch returns updated makes XLA copy it in every branch, the idle ones included, every
        tick (at 405B a large share of the modeled step: docs/405b.md)."""
        sums = {"params": jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), self.layers["params"]),
                **({FP8: jax.tree.map(lambda a: a[0], self._layer_sums()[FP8])} if FP8 in self.layers else {})}
        if grads is None:
            return sums
        grads = {"params": grads["params"], **({FP8: fp8_lib.from_grad(grads[FP8])} if FP8 in grads else {})}

        def place(zero, g):
            g = g.astype(zero.dtype)  # the weight's dtype: the compute dtype's gradients travel unwidened
            return g if g.shape == zero.shape else lax.dynamic_update_slice_in_dim(zero, g, start, 0)
        return jax.tree.map(place, sums, grads)

    def _forward(self, first: bool, last: bool):
        def run(c, x, g, j, chunk, slot, wslot, part, buffers):
            mb = self._pick(j)
            w = self._chunk(chunk)
            x_in = x
            if first:  # the stem: the embedding, and the dense first layers, recomputed by the backward
                x_in = self._dense(self.outer, self._embed(self.outer, mb["inputs"]), mb)
            put = {}
            records = self.plan.gemms and not self.plan.inputs_at_b  # the record: F's inputs, F to W
            if records:
                (y, stats), pullback, put["inputs"] = self.residuals.vjp_recording(x_in, mb, w)
            else:
                (y, stats), pullback = self.residuals.vjp(x_in, mb, w, chunk)
            put["stash"] = self.residuals.keep(pullback, w)
            if records:
                put["stash"] = self._varying(self.records.pack(0, put["stash"]))
            c = {**c, "stats": self._acc(c["stats"], self._varying(stats))}
            if not last:
                return (c, *self._outputs(x, buffers, y=y, **put))
            # differentiated by what the head reads alone: the dense first layers' sums are left as they are
            read = {k: v for k, v in self._head_params(self.outer).items() if k != DENSE}
            (loss, mtp), head_vjp = jax.vjp(lambda o, y: self._head_loss({**self.outer, **o}, y, mb), read, y)
            scale = (1.0 / self.total_tokens).astype(loss.dtype)
            g_mtp = None
            if mtp is not None:  # its weighted sum joins the loss; its router statistics the MoE units' mean
                mtp_sum, tokens, mtp_stats = mtp
                like = functools.partial(jax.tree.map, lambda g, a: vary(g.astype(a.dtype), tuple(varying(a))))
                g_mtp = (like(self.model.cfg.mtp_loss_weight * scale, mtp_sum), jnp.zeros_like(tokens),
                         None if mtp_stats is None else like(
                             aux_cotangents(mtp_stats, self.model.cfg, self.units, self.m, self.aux_scale), mtp_stats))
                c = {**c, "mtp": c["mtp"] + self._varying(jnp.stack([mtp_sum, tokens]).astype(jnp.float32))}
                if mtp_stats is not None:
                    c = {**c, "stats": self._acc(c["stats"], self._varying(mtp_stats))}
            g_head, dy = head_vjp((self._varying(scale), g_mtp))
            c = {**c, "loss": c["loss"] + loss, "g_outer": self._add_outer(c["g_outer"], g_head)}
            return (c, *self._outputs(x, buffers, dy=dy, **put))
        return run

    def _cotangents(self, c, g):
        g_stats = {k: self._varying(v, self._stats_vma[k])
                   for k, v in aux_cotangents(c["stats"], self.model.cfg, self.units, self.m, self.aux_scale).items()}
        return (g, g_stats)

    def _backward(self, first: bool):
        def run(c, x, g, j, chunk, slot, wslot, part, buffers):
            mb = self._pick(j)
            w = self._chunk(chunk)
            kept = _load(buffers["stash"], slot)
            records = self.plan.gemms and not self.plan.inputs_at_b
            pullback = self.residuals.rebuild(self.records.unpack(0, kept) if records else kept, w)
            put = {}
            if records:  # the matmuls' weight gradients come later (W), from their dy kept here
                g_w, dx, dys = pullback(self._cotangents(c, g))
                put["stash"] = self._varying(self.records.pack(1, dys))  # in the record's slot, over the residuals
            elif self.plan.gemms:  # ... and their inputs, from the forward the pullback rebuilt
                g_w, dx, dys, inputs = pullback(self._cotangents(c, g))
                put["inputs"] = self._varying((inputs, dys))
            else:
                g_w, dx = pullback(self._cotangents(c, g))
            if self.plan.split and not self.plan.gemms:  # W runs the pullback again for g_w (dead code here)
                put["gs"] = g
                g_w = None
            else:  # fused (interleaved): every weight gradient; gemms split: those no matmul reads (norm scales)
                c, g_w = self._add_grads(c, chunk, g_w)
            if not first:  # dx goes upstream
                return (c, *self._outputs(x, buffers, dx=dx, g_w=g_w, **put))
            if self._has_dense:  # the dense first layers again from the lookup, then their backward
                looked_up = self._embed(self.outer, mb["inputs"])
                _, dense_vjp = jax.vjp(lambda o, x: self._dense({**self.outer, **o}, x, mb),
                                       {DENSE: self.outer[DENSE]}, looked_up)
                g_dense, dx = dense_vjp(dx)
                c = {**c, "g_outer": self._add_outer(c["g_outer"], g_dense)}
            if self.embedding_outside:  # dx is the lookup's output gradient: `add_embedding_grads` takes it
                return (c, *self._outputs(x, buffers, dx=dx, g_w=g_w, **put))  # (sent upstream, to no inbox)
            sums = c["g_outer"]["embedding"]  # the lookup's gradient, added at the micro-batch's token rows
            rows = dx.astype(jnp.float32).reshape(-1, dx.shape[-1])
            c = {**c, "g_outer": {**c["g_outer"], "embedding": sums.at[mb["inputs"].reshape(-1)].add(rows)}}
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
        if self.plan.handoff:  # the records of the round's B's (`SlotPlan.span`), zeros where a B tick idled
            records = [_load(record, 0) for record in buffers[HANDED]]
            held = {"inputs": [inputs for inputs, _ in records], "dys": [dys for _, dys in records]}
        elif self.plan.inputs_at_b:
            inputs, dys = _load(buffers["inputs"], wslot)
            held = {"inputs": [inputs], "dys": [dys]}
        else:
            held = {"inputs": [_load(buffers["inputs"], wslot)],
                    "dys": [self.records.unpack(1, _load(buffers["stash"], wslot))]}
        size = jax.tree.leaves(w)[0].shape[0] // self.plan.weight_parts  # layers of one part
        start = part * size
        if self.plan.weight_parts > 1:  # every value here is [k layers, ...]: the part's window of them
            w, held = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, size, 0), (w, held))

        def outputs(w, inputs):
            if FP8 in w:
                w = {**w, FP8: fp8_lib.for_grad(w[FP8])}
            return self.split.weights(w, inputs, x, mb["positions"], mb["segment_ids"], start)
        g_w = None
        # a micro-batch a record; the positions are those of `j` for every one, which no weight GEMM reads
        for inputs, dys in zip(held["inputs"], held["dys"], strict=True):
            _, pullback = jax.vjp(lambda w, inputs=inputs: outputs(w, inputs), w)
            (g,) = pullback(dys)
            g_w = g if g_w is None else _combined(g_w, g)
        c, g_w = self._add_grads(c, chunk, g_w, start)
        return (c, *self._outputs(x, buffers, g_w=g_w))


def _combined(a: dict, b: dict) -> dict:
    """Two micro-batches' chunk gradients as one: the weights' summed, FP8's amaxes maximised."""
    return {key: jax.tree.map(jnp.maximum if key == FP8 else jnp.add, a[key], b[key]) for key in a}


def loss_and_grads(params, histories, batch, model, total_tokens, accum_steps):
    """(loss_sum, aux, grads, amaxes) of a slot-table schedule; the train step's drop-in for autodiff.

    The differentiated loss is loss_sum / total_tokens plus the MoE losses in `aux`, each averaged over
    the MoE units and the micro-batches as under gpipe (`moe.loss_terms`); under FP8, `amaxes` are the
    largest amaxes each quantised matmul saw (the cotangents of its amax `histories`). The loop is manual
    over `Pipeline.axes`: each device sums its own gradients over its micro-batches and the data-parallel
    reduction runs once, after the loop (playbook, "Data Parallelism" with gradient accumulation), not in
    every backward; under ZeRO-3 the weights are gathered once, when they enter the loop (playbook,
    "ZeRO-3": a stage keeps its weights gathered across its micro-batches)."""
    del accum_steps  # the validator requires train.grad_accum_steps == 1 with a pipeline
    pipe = model.pipeline
    return run_gradient_loop(_table_loop, params, histories, batch, model, total_tokens, plan=pipe.plan,
                             v=pipe.repeats, counts=pipe.counts)


def _ring(p: int, step: int, wraps: bool) -> list[tuple[int, int]]:
    return [(s, (s + step) % p) for s in range(p) if wraps or 0 <= s + step < p]


def _add_chunk(sums: dict, grads: dict, chunk) -> dict:
    """`sums` [v, k, ...] with `grads` [k, ...] (`_TableWork._chunk_grads`) added to chunk `chunk`'s
    gradients and maximised into its FP8 amaxes, in place (one chunk read and written)."""
    def update(op):
        def run(total, g):
            start = (chunk,) + (0,) * (total.ndim - 1)
            window = lax.dynamic_slice(total, start, (1, *total.shape[1:]))
            return lax.dynamic_update_slice(total, op(window, g[None].astype(total.dtype)), start)
        return run
    out = {"params": jax.tree.map(update(jnp.add), sums["params"], grads["params"])}
    if FP8 in sums:
        out[FP8] = jax.tree.map(update(jnp.maximum), sums[FP8], grads[FP8])
    return out


def _table_loop(stack, model, layers, outer, micro, total_tokens, *, plan, p, m, v, axes, units, specs, outer_specs,
                counts=None, aux_scale=1.0):
    """One stage's ticks of `plan`: its operation (`lax.switch`), then the activation one stage on and
    the input gradient one stage back (`ppermute`; one for both where `plan.pairs`), each put in its
    inbox slot. With `plan.latency` 1
    the outputs stay in the carry and leave at the start of the next tick, travelling while its
    operation runs (which reads nothing of them: the table was simulated with the latency). The ticks
    run as a loop per `SlotPlan.segments`: those where no stage runs a backward or W (the warm-up, and
    between the first and the last backward the ticks of the other parity, where a table alternates)
    switch over the forward branches only and add no gradients, which every tick of one loop would (the
    gradient sums' window and the embedding's scatter, every tick: docs/405b.md)."""
    s = lax.axis_index(STAGE)
    rest = tuple(a for a in axes if a != STAGE)
    outer = vary(outer, axes)
    layers = vary(layers, rest)
    work = _TableWork(stack, model, layers, outer, micro, total_tokens, p=p, m=m, v=v, manual=axes, units=units,
                      aux_scale=aux_scale,
                      plan=plan, counts=counts)
    # {switch size: (its branches, whether the outer sums stay out of it, whether it can run stage 0's first
    # backward: the embedding's scatter follows it)}. Every switch of a size has the
    # same branches, those its rows take somewhere (the others idle: `_TableWork.branches`), as the kernel
    # model and the collective counts price a switch from the rows of its size (`slot_program.segment_rows`).
    # The head's (and an embedding's) float32 sums ride through a switch only where a branch adds to them:
    # a branch passing them through copies them (405B in 8 chunks a stage: 2.1 GB a tick).
    # The embedding's sums (`add_embedding_grads`) take a scatter only after a switch that can run stage 0's
    # first backward (under `SlotPlan.handoff` not the W ticks').
    adds_outer = {FORWARD_LAST} | ({BACKWARD_FIRST} if work.first_adds_outer else set())
    switches = {}
    for size, rows in slot_program.segment_rows(plan).items():
        used = {int(b) for b in np.unique(rows)}
        switches[size] = (work.branches(used)[:size], not used & adds_outer, BACKWARD_FIRST in used)
    forward_pairs, backward_pairs = _ring(p, 1, plan.wraps), _ring(p, -1, plan.wraps)
    field = {name: i for i, name in enumerate(FIELDS)}
    keeps = {name: bool(plan.program[:, :, field["keep_" + PUT_FIELD[name]]].any()) for name in PUT_FIELD}

    def send(outputs, row, parity):
        """What arrives after a tick of this parity (the one that computed `outputs`, whose program row is
        `row`), (for the inbox of activations, for the inbox of gradients): the program puts whatever
        arrives from a direction nothing comes from into that inbox's trash slot."""
        y, dx = outputs
        if plan.pairs is None:
            return lax.ppermute(y, STAGE, forward_pairs), lax.ppermute(dx, STAGE, backward_pairs)
        # one ppermute: each stage sends one way in the ticks of a parity (`SlotPlan.pairs`)
        arrived = lax.ppermute(jnp.where(row[field["send_forward"]] == 1, y, dx), STAGE, list(plan.pairs[parity]))
        return arrived, arrived

    def tick(carry, program, parity, size, handed):
        c, buffers, inbox_f, inbox_b, embedded, sent = carry
        grads = size > BACKWARD  # a backward or W may run: the gradients are added
        branches, outer, embeds = switches[size]
        g_outer = c.pop("g_outer") if outer else None
        if plan.latency:  # last tick's outputs, in flight while this tick's operation runs (two a tick)
            arriving = send(sent, None, None)
        row = lax.dynamic_index_in_dim(program, s, 0, keepdims=False)
        branch = row[field["branch"]]
        x = lax.dynamic_index_in_dim(inbox_f, row[field["read_f"]], 0, keepdims=False)
        g = lax.dynamic_index_in_dim(inbox_b, row[field["read_b"]], 0, keepdims=False)
        sums = c.pop("g_layers") if work.sums_outside else None  # (`_TableWork._chunk_grads`)
        operands = buffers
        if plan.handoff and size == WEIGHTS:  # B's position: its put of the record is handed to the W ticks
            operands = {**buffers, "inputs": work.unslotted}
        elif plan.handoff and size == BRANCHES:
            operands = {**buffers, HANDED: handed}
        c, y, dx, dy, g_w, put = lax.switch(branch, branches, c, x, g, row[field["micro"]],
                                            row[field["chunk"]], row[field["stash"]], row[field["wstash"]],
                                            row[field["part"]], operands)
        if plan.handoff and size == WEIGHTS:  # one record a B tick of the round (`SlotPlan.span`)
            handed = (*(handed or ()), jax.tree.map(lambda a: a[None], put.pop("inputs")))
        if outer:
            c = {**c, "g_outer": g_outer}
        if work.sums_outside:  # outside the backward's loop g_w is zeros, neither read nor computed
            c = {**c, "g_layers": _add_chunk(sums, g_w, row[field["chunk"]]) if grads else sums}
        if work.embedding_outside and embeds:
            embedded = work.add_embedding_grads(embedded, dx, row[field["micro"]], branch == BACKWARD_FIRST)
        for name, buf in buffers.items():
            slot, value = row[field["put_" + PUT_FIELD[name]]], put[name]
            if keeps[name]:  # the program writes some slot's value back: read it (one slot), not a slot more
                keep = row[field["keep_" + PUT_FIELD[name]]] == 1
                value = jax.tree.map(functools.partial(jnp.where, keep), _load(buf, slot), value)
            buffers = {**buffers, name: _store(buf, value, slot)}
        inbox_b = lax.dynamic_update_index_in_dim(inbox_b, dy, row[field["dy"]], 0)
        if not plan.latency:
            arriving, sent = send((y, dx), row, parity), ()
        else:
            sent = (y, dx)
        inbox_f = lax.dynamic_update_index_in_dim(inbox_f, arriving[0], row[field["recv_f"]], 0)
        inbox_b = lax.dynamic_update_index_in_dim(inbox_b, arriving[1], row[field["recv_b"]], 0)
        return (c, buffers, inbox_f, inbox_b, embedded, sent), handed

    def ticks(carry, programs, sizes):  # a loop step: one tick, two from an even tick (parities 0, 1), or
        handed = None  # `span` F and B ticks, then W's parts (`SlotPlan.handoff`: B's records, to the W ticks)
        for parity, size in enumerate(sizes):
            carry, handed = tick(carry, programs[parity], parity, size, handed)
        return carry, None

    inbox_f, inbox_b = work.inboxes()
    sent = (inbox_f[0], inbox_b[0]) if plan.latency else ()
    # the input embedding's float32 gradient sums, outside the switch (`_TableWork.add_embedding_grads`)
    embedded = (lax.pcast(jnp.zeros(work.outer["embedding"].shape, jnp.float32), axes, to="varying")
                if work.embedding_outside else ())
    init = (work.initial_carry(), work.slot_buffers(), inbox_f, inbox_b, embedded, sent)
    carry = init
    for start, stop, sizes in plan.segments:  # a loop a segment, len(sizes) ticks a step
        program = jnp.asarray(plan.program[start:stop])
        program = program.reshape((stop - start) // len(sizes), len(sizes), *program.shape[1:])
        carry, _ = lax.scan(functools.partial(ticks, sizes=sizes), carry, program)
    c, _, _, _, embedded, _ = carry
    g_outer = {**c["g_outer"], **({"embedding": embedded} if work.embedding_outside else {})}
    g_layers = jax.tree.map(lambda g: g.reshape(g.shape[0] * g.shape[1], *g.shape[2:]), c["g_layers"])
    g_layers = reduce_layer_grads(g_layers, specs, rest)
    stats = jax.tree.map(lambda a: pmean(lax.psum(a, STAGE), rest) / (units * m), c["stats"])
    sums = {"loss": c["loss"], **({"mtp": c["mtp"]} if "mtp" in c else {})}
    return lax.psum(sums, axes), stats, reduce_grads(g_outer, outer_specs, axes), g_layers
