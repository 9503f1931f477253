"""Pipeline parallelism over the `stage` mesh axis: one SPMD scan over clock ticks.

Playbook, "Pipeline Parallelism": the layer stack is cut into p stages along depth, the
batch into m micro-batches, and every device of the `stage` axis runs its own stage on a
different micro-batch at each clock tick. Activations move to the next stage with one
`lax.ppermute` over `stage` per tick. The embedding and the output head stay outside the
pipelined stack (gpipe, circular).

The loop's region. The tick loop is one `jax.shard_map` manual over `stage`, every split batch
axis (`data`, `fsdp`, `expert`) and `sequence` when it is split (`Pipeline.axes`, from
`layout.pipeline_axes`); `tensor`
stays with the partitioner. So each device runs its own rows, the data-parallel gradient
reduction happens once, as the loop's inputs are transposed, and ZeRO-3 weights are gathered once
as they enter; the parts that need those axes manual run inside directly (regions compose by
axis): ring attention per device over `sequence`, the MoE exchange over `expert` (expert weights
enter split over it), the Pallas kernels per shard. MoE router statistics travel with the
activations and come out averaged over the MoE units and micro-batches, as the losses use them.
Inside a 1F1B slot (a `lax.switch` whose branch differs per stage) ring attention moves its
blocks by all-gather and reduce-scatter: a collective-permute there would wait for every device.

Layout. The scanned layer parameters [L, ...] are sharded over `stage` on their first
dimension (rule 'layers' -> stage), so stage s stores the contiguous block
[s*v*k, (s+1)*v*k) of v*k layers, seen as [v repeats, k layers]. Stage s runs its chunk r
as layers (r*p + s)*k ... : for gpipe and 1f1b (v = 1) this is the stored order; for the
circular schedule the stored order is a fixed permutation of the execution order
(`execution_order`), the price of keeping each stage's weights local. Initialisation,
checkpoints and exports hold the execution order (`StateFactory.to_canonical`), so a seed is one
model and a checkpoint one meaning whatever the schedule. Uneven stages (`Pipeline.units`, from
`pipeline.layers_per_stage` or `stage_layers`' default, which lightens the first and the last stage
as Llama 3 405B's run did) store k = the largest stage's count rows per stage; the rows past a
stage's count are empty slots (zeros) that its scan skips (`skipping`), and the canonical form drops
them. With v chunks a stage the split is over the p*v chunks ("Interleaving stages": chunk r of stage s
is the virtual stage r*p + s, stored at rows (s*v + r)*k), and the chunk a tick runs picks its count.

Schedules (`config.pipeline.schedule`):

* gpipe ("all-forward-all-backward"): micro-batch i runs stage s at tick i + s; the
  backward is the autodiff transpose of the tick scan. Ticks m + p - 1, bubble
  (p-1)/(m+p-1); every stage keeps the inputs of all m micro-batches for the backward.
* circular ("Interleaving stages"): each device holds v = `pipeline.repeats` chunks;
  micro-batches go round the ring v times (stage p-1 feeds stage 0, which parks them
  until their next lap). Ticks v*m + p - 1, bubble (p-1)/(v*m+p-1), v times the transfers.
* 1f1b ("One-forward-one-backward"): a hand-written loop of time slots, two per tick.
  Stage s runs the forward of micro-batch j in slot s + 2j (a `jax.vjp` of the stage whose
  residuals, the activations the remat policy keeps, are stashed) and its backward (the
  pullback, from the stash) in slot 2p - 1 - s + 2j, so every
  stage alternates forward and backward slots and neighbours always sit in opposite
  phases: after each slot one `ppermute` swaps neighbours' outputs, an activation moving
  forward and a gradient moving back one stage per slot. The last stage takes the loss as
  it finishes a micro-batch and starts its backward in the next slot. A slot runs only its
  own work (`lax.switch`; idle slots cost nothing). Stage s holds the activations of p - s
  micro-batches at most, independent of m; ticks m + p - 1, bubble (p-1)/(m+p-1) as in
  the playbook. With `pipeline.overlap_transfers` (`one_f_one_b_overlapped`) every tick is a
  forward slot on all stages then a backward slot on all stages, and each transfer travels beside
  the next slot's compute: m + 2p - 2 ticks, 2(p - s) - 1 micro-batches held on stage s.
  It is a loss-and-gradient function, `loss_and_grads`, used by the train step instead
  of autodiff; its forward-only pass (evaluation) is the gpipe loop. In lock-step SPMD a
  slot lasts as long as the slowest stage's work in it: a backward (about 2 forwards, 3
  under full remat) while the neighbours run forwards.

Remat per stage per micro-batch (gpipe, circular): the backward recomputes a stage from its
input. 1f1b keeps what the model's remat policy saves for its p in-flight micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain import config as config_lib, fp8 as fp8_lib, model as model_lib, moe as moe_lib
from meshtrain.config import BATCH_AXES, Axis
from meshtrain.parallel import ring_attention, schedules
from meshtrain.sharding_rules import vary, varying

STAGE, SEQUENCE, EXPERT = Axis.STAGE.value, Axis.SEQUENCE.value, Axis.EXPERT.value
FP8 = fp8_lib.COLLECTION
TABLE_SCHEDULES = schedules.TABLE_SCHEDULES  # run from their slot tables (`pipeline_tables`)
SPLIT_BACKWARD = schedules.SPLIT_BACKWARD  # B and W separate operations (`pipeline.split_backward`)
CHUNKED_SCHEDULES = schedules.CHUNKED  # v = pipeline.repeats chunks per stage
# `pipeline.overlap_transfers`: each tick's outputs travel while the next tick computes
OVERLAPPING = schedules.OVERLAPPING


SPLIT_MODES = ("gemms", "pullback")  # `pipeline.split_backward`
SLOT_BRANCHES = 7  # the `lax.switch` of a 1F1B slot or a slot-table tick: idle, three forwards, three backwards

@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline schedule: p stages, m micro-batches, v repeats (chunks per stage)."""

    schedule: str
    stages: int
    microbatches: int
    repeats: int = 1
    axes: tuple[str, ...] = (STAGE,)  # the loop is manual over these: stage, the split batch axes, sequence
    # The loop's shard_map type-checks how values vary over its axes, except around Pallas kernels:
    # a pallas_call declares no variance, and in interpret mode (CPU) fails inside a checked region.
    checked: bool = True
    split_backward: str = "gemms"  # slot tables' W (`pipeline_tables.SlotPlan.split_backward`)
    weight_parts: int = 1  # split W as this many operations on slices of the chunk's layers
    # scanned units (layers, or MoE groups of model.moe_every) each chunk runs, in execution order: chunk
    # c = r*p + s is stage s's r-th chunk (the virtual stage c; v = 1: one chunk a stage); () = even.
    # Uneven chunks (`stage_layers`) store max(units) rows each; the rows past a chunk's count are
    # empty slots: zeros in the state, skipped by a `lax.cond` in the chunk's scan.
    units: tuple[int, ...] = ()
    # 1f1b and the slot tables: each tick's outputs travel while the next tick computes (a hop of two
    # ticks, `pipeline.overlap_transfers`): deeper warm-up, more micro-batches in flight
    overlap: bool = False

    @functools.cached_property
    def _table(self):
        """The slot table a table schedule runs (`schedules.executed`)."""
        return schedules.executed(self.schedule, self.stages, self.microbatches, self.repeats, self.weight_parts,
                                  latency=int(self.overlap))

    @property
    def ticks(self) -> int:
        """Trip count of the tick loop (a slot table: one F, B or W per stage per tick; interleaved 1F1B's
        ticks alternate forwards and backwards)."""
        p, m, v = self.stages, self.microbatches, self.repeats
        if self.schedule in TABLE_SCHEDULES:
            return len(self._table)
        if self.slots and self.overlap:  # stage s: forwards at ticks s + j, backwards 2p - 2 - s + j
            return m + 2 * p - 2
        return v * m + p - 1  # 1f1b: one forward slot and one backward slot per tick

    @property
    def bubble(self) -> float:
        """Idle fraction of the ticks, 1 - v*m/ticks: gpipe and 1f1b (p-1)/(m+p-1), circular
        (p-1)/(v*m+p-1) (the playbook's (p-1)/(v*m) is relative to the ideal time). Slot tables:
        the idle share of the stages' time (`schedules.bubble`: F, B and W one unit each; interleaved
        1F1B's alternating ticks: F one, the whole backward two).
        """
        if self.schedule in TABLE_SCHEDULES:
            ratio = schedules.bubble(self._table)
            return ratio / (1 + ratio)
        return 1 - self.repeats * self.microbatches / self.ticks

    def in_flight(self) -> tuple[int, ...]:
        """Per stage: micro-batch activations held for the backward at the peak (slot tables: chunk
        activations, each 1/v of a stage's layers)."""
        p, m, v = self.stages, self.microbatches, self.repeats
        if self.schedule in TABLE_SCHEDULES:
            return tuple(schedules.in_flight(self._table))
        if self.slots:
            return tuple(min(m, (2 * (p - s) - 1) if self.overlap else p - s) for s in range(p))
        return (v * m,) * p

    def slot_branch_share(self) -> tuple[float, ...]:
        """1f1b: the share of slot calls, averaged over stages, that take each `lax.switch` branch."""
        counts = np.bincount(self.slot_rows().ravel(), minlength=SLOT_BRANCHES)
        return tuple(float(c) for c in counts / counts.sum())

    def slot_rows(self) -> np.ndarray:
        """1f1b: [2 x ticks, p] the `lax.switch` branch (`one_f_one_b_branch`'s index) stage s takes in
        each slot: plain, slot u; overlapped, a tick's forward switch then its backward switch."""
        p, m = self.stages, self.microbatches
        rows = np.zeros((2 * self.ticks, p), np.int32)
        for u in range(2 * self.ticks):
            for s in range(p):
                if self.overlap:
                    rows[u, s] = one_f_one_b_overlapped(p, m, s, u // 2)[u % 2][0]
                else:
                    op, j = one_f_one_b_slot(p, s, u)
                    role = 1 if s == 0 else 2 if s == p - 1 else 0
                    rows[u, s] = 1 + 3 * (op - 1) + role if 0 <= j < m else 0
        return rows

    def describe(self) -> str:
        """One line for the start-of-run log: schedule, ticks, bubble, in-flight micro-batches per stage."""
        line = (f"pipeline {self.schedule}: {self.stages} stages x {self.repeats} repeats, {self.microbatches} "
                f"micro-batches, {self.ticks} ticks, bubble {self.bubble:.1%}, "
                f"in flight per stage {list(self.in_flight())}")
        if self.schedule in TABLE_SCHEDULES:  # the playbook's ratio: idle over busy time of a stage
            line += f", idle/busy {schedules.bubble(self._table):.3f}"
        if self.weight_parts > 1:
            line += f", W in {self.weight_parts} parts"
        if self.overlap:
            line += ", transfers behind the next tick's compute"
        if self.uneven:
            per = "stage" if self.repeats == 1 else "chunk (virtual stage)"
            line += f", scanned units per {per} {list(self.units)} ({max(self.units)} rows each)"
        return line

    @property
    def slots(self) -> bool:
        """1F1B's loop of forward and backward slots (`loss_and_grads`), not a table or an autodiff loop."""
        return schedules.REGISTRY[self.schedule].loop == schedules.SLOTS

    @property
    def uneven(self) -> bool:
        return len(set(self.units)) > 1

    @property
    def counts(self) -> tuple[tuple[int, ...], ...] | None:
        """counts[s][r]: units of stage s's chunk r when the chunks are uneven (what `stage_function`
        skips past), else None."""
        if not self.uneven:
            return None
        p, v = self.stages, self.repeats
        return tuple(tuple(self.units[r * p + s] for r in range(v)) for s in range(p))

    def rows(self, n_units: int) -> int:
        """Rows of the stored layer stack: n_units, or p x v x the largest chunk when uneven."""
        return self.stages * self.repeats * max(self.units) if self.uneven else n_units

    def execution_order(self, n_units: int) -> np.ndarray:
        """order[q] = stored row of the scanned unit that runs q-th: the identity unless circular or
        interleaved (a permutation: chunk c = r*p + s runs stage s's r-th block of rows) or uneven
        (chunk r of stage s at rows (s*v + r)*k ..., k the largest chunk's count)."""
        p, v = self.stages, self.repeats
        if self.uneven:
            k = max(self.units)
            return np.array([(s * v + r) * k + j for c, n in enumerate(self.units)
                             for r, s in [divmod(c, p)] for j in range(n)], dtype=np.int64)
        k = n_units // (p * v)
        stored = np.arange(n_units).reshape(p, v, k)  # [stage, repeat, layer]
        return stored.transpose(1, 0, 2).reshape(-1)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in BATCH_AXES if a in self.axes)

    def micro_spec(self, trailing: int) -> P:
        """How a micro-batched [B/m, m, T, *trailing] operand enters the loop: rows over the batch
        axes, length over `sequence` (each device keeps its own block, no data moves)."""
        seq = tuple(a for a in self.axes if a == SEQUENCE)
        return P(self.batch_axes or None, None, seq or None, *([None] * trailing))

    def forward(self, model, x, positions, segment_ids):
        """The layer stack of a bound `Transformer` on x [B,T,D] -> ([B,T,D], MoE stats), pipelined
        over `stage` (stats: each MoE layer's {balance, z, dropped} averaged over the MoE units and
        the micro-batches; {} for a dense model).

        Differentiable (gpipe, circular); 1f1b uses this loop for its forward-only pass.
        """
        rules = model.rules.with_manual(self.axes)
        stack = _chunk_function(stage_function(model.cfg, rules, model.attention_fn, self.counts))
        if model.cfg.remat_policy != "none":  # remat per stage per micro-batch: keep only its input
            stack = jax.checkpoint(stack, prevent_cse=False)
        layers, specs = stage_variables(model), {"params": layer_specs(model.cfg, self.axes)}
        if FP8 in layers:  # one history per device of the batch axes: their amaxes combine once, after the loop
            rest = tuple(a for a in self.axes if a != STAGE)
            copies = math.prod(model.rules.size(a) for a in rest)
            layers[FP8] = jax.tree.map(lambda h: fp8_lib.per_device(h, copies), layers[FP8])
            specs[FP8] = jax.tree.map(lambda _: P(rest or None, STAGE), layers[FP8])
        m = self.microbatches
        split = functools.partial(_split, m=m)
        body = functools.partial(_ring_loop, stack, p=self.stages, m=m, v=self.repeats,
                                 units=model_lib.scan_unit(model.cfg)[1], axes=self.axes)
        rows, rows_d = self.micro_spec(0), self.micro_spec(1)
        out, stats = jax.shard_map(
            body, in_specs=(specs, rows_d, rows, rows), out_specs=(rows_d, P()),
            axis_names=set(self.axes), check_vma=self.checked,
        )(layers, split(x), split(positions), split(segment_ids))
        return out.reshape(x.shape), stats


def stage_variables(model) -> dict:
    """The scanned layers' variables of a bound `Transformer`: {"params": [L, ...]} and, under FP8,
    {"fp8": [L, 3, H] amax histories}; what a stage's chunk of layers is applied with."""
    variables = model.layers.variables
    return {name: variables[name] for name in ("params", FP8) if name in variables}


def layer_specs(cfg, axes: tuple[str, ...]):
    """In-specs of the scanned layer parameters [L, ...] for a loop manual over `axes`: layers over
    `stage`, experts over `expert` when the loop is manual over it (the MoE exchange runs inside);
    everything else enters whole (ZeRO-3 `fsdp` shards are gathered once, on entry)."""
    kept = {"layers": STAGE, **({"expert": EXPERT} if EXPERT in axes else {})}
    return jax.tree.map(lambda box: P(*(kept.get(name) for name in box.names)),
                        model_lib.abstract_params(cfg)["layers"], is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _split(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [B/m, m, ...]: micro-batch i is rows {j*m + i}; a free reshape, each device keeps its rows."""
    return a.reshape(a.shape[0] // m, m, *a.shape[1:])


def stage_function(cfg, rules, attention_fn, counts: tuple[tuple[int, ...], ...] | None = None):
    """(chunk variables, x [b,T,D], positions, segment_ids, chunk index) -> (x, stats): k scanned units of
    the model's block (with its remat policy), stats summed over the chunk's MoE units ({} if dense).
    The chunk's variables are `stage_variables` cut to k units ({"params": [k, ...]}, and under FP8
    {"fp8": [k, 3, H]}). `rules` are those of the loop's manual region.

    `counts` (uneven chunks, `Pipeline.counts`): stage s runs only the first counts[s][r] units of its
    chunk r (the chunk index, traced or not; 0 with one chunk a stage); the rest are empty slots, skipped
    by a `lax.cond` (no compute; their stored weights are zeros and get zero gradients). Called inside
    the loop's `shard_map`, where `lax.axis_index('stage')` is the stage."""
    # Under remat `none` the block is wrapped in a remat that saves everything (`_stage_block`): nothing is
    # recomputed and the memory is that of no remat. Without one, jax 0.10's transpose of the layer scan
    # inside 1F1B's and the slot tables' `jax.vjp` types an MoE layer's router-statistic cotangent as
    # varying over the batch axes and tracing fails.
    block = _stage_block(cfg, rules, attention_fn)

    def stack(chunk, x, positions, segment_ids, index=0):
        def layer(x, variables):
            return block.apply(variables, x, positions, segment_ids)
        if counts is None:
            x, stats = lax.scan(layer, x, chunk)
        else:
            x, stats = lax.scan(skipping(layer, counts, cfg, index), x, (chunk, jnp.arange(leading(chunk))))
        return x, jax.tree.map(lambda a: jnp.sum(a, axis=0), stats or {})
    return stack


def leading(tree) -> int:
    """The first dimension of a tree's leaves (the scanned units of a chunk)."""
    return jax.tree.leaves(tree)[0].shape[0]


def skipping(layer, counts: tuple[tuple[int, ...], ...], cfg, chunk=0):
    """A scan body (x, variables) -> (x, out) made (x, (variables, j)) -> (x, out) that runs unit j only
    when j < counts[this stage][chunk] and otherwise passes x through with zero outputs (an empty slot). Both
    branches' results vary over every manual axis of the region (a `lax.cond` needs equal types).

    The `lax.cond` sits in a `jax.checkpoint` with the model's remat policy: differentiated bare, a
    cond returns every residual of its branch as an output, the unit's weights among them (a copy of
    the stage's weights per micro-batch in flight); under the checkpoint the weights stay inputs and
    the residuals are what the policy saves, as without the cond."""
    policy = model_lib.REMAT_POLICIES.get(cfg.remat_policy, jax.checkpoint_policies.everything_saveable)

    def body(x, scanned):
        variables, j = scanned
        real = j < jnp.asarray(counts, jnp.int32)[lax.axis_index(STAGE), chunk]
        manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
        shapes = jax.eval_shape(layer, x, variables)

        def run(x, variables):
            return vary(layer(x, variables), manual)

        def empty(x, variables):
            return vary((x, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes[1])), manual)
        return jax.checkpoint(lambda real, x, variables: lax.cond(real, run, empty, x, variables), policy=policy,
                              prevent_cse=False)(real, x, variables)
    return body


def _stage_block(cfg, rules, attention_fn):
    """The stage's scanned unit (the model's block with its remat policy), unbound."""
    block_class = model_lib.remat_block(cfg)
    if cfg.remat_policy == "none":
        block_class = nn.remat(model_lib.scan_unit(cfg)[0], policy=jax.checkpoint_policies.everything_saveable,
                               prevent_cse=False)
    return block_class(cfg, rules, attention_fn, parent=None)


@dataclasses.dataclass(frozen=True)
class SplitStage:
    """A stage's chunk of layers run for the split backward (zero bubble; playbook, "Zero Bubble"):

    * `forward(chunk, x, positions, segment_ids, probes) -> ((x, stats), recorded)`: the forward
      whose vjp is B: every matmul's weight a constant, a zero probe added to its output (the
      probes' cotangents are the matmuls' output gradients), its input recorded for W;
    * `weights(chunk, recorded, x, positions, segment_ids) -> outputs`: every matmul again on its
      recorded input (`x` only gives shapes): the pullback of these outputs at the output gradients
      is the weight gradients, one GEMM per matmul, nothing else of a layer live;
    * `probes(chunk, x, positions, segment_ids)`: the probes' zeros, [k, ...] per matmul.

    Parameters that are not a matmul's weight (norm scales, MoE experts) get their gradients in B.
    """

    forward: object
    weights: object
    probes: object

    @classmethod
    def build(cls, cfg, rules, attention_fn, counts: tuple[tuple[int, ...], ...] | None = None) -> SplitStage:
        """`counts`: uneven stages' units per stage (`stage_function`; one chunk a stage): F and W skip the
        empty slots."""
        block = _stage_block(cfg, rules, attention_fn)
        inputs, probes_key, outputs = fp8_lib.SPLIT_INPUTS, fp8_lib.SPLIT_PROBES, fp8_lib.SPLIT_OUTPUTS

        def scan(body, init, xs, first=0):
            if counts is None:
                return lax.scan(body, init, xs)
            return lax.scan(skipping(body, counts, cfg), init, (xs, first + jnp.arange(leading(xs))))

        def forward(chunk, x, positions, segment_ids, probes):
            def layer(x, scanned):
                variables, probe = scanned
                (y, stats), recorded = block.apply({**variables, probes_key: probe}, x, positions, segment_ids,
                                                   mutable=[inputs])
                return y, (stats, recorded[inputs])
            x, (stats, recorded) = scan(layer, x, (chunk, probes))
            return (x, jax.tree.map(lambda a: jnp.sum(a, axis=0), stats or {})), recorded

        # W recomputes nothing: every matmul reads its recorded input, so attention's output is never
        # read and a stand-in of its shape replaces it (no attention kernel traced under W's vmap)
        plain = model_lib.scan_unit(cfg)[0](cfg, rules, _unread_attention, parent=None)

        def weights(chunk, recorded, x, positions, segment_ids, first=0):
            """`first`: the stage's unit index of the chunk's first row (W in parts: a slice of them).

            No unit's W depends on another's (each reads its own recorded inputs), so the units run as
            one batch (`jax.vmap`): each weight GEMM is one batched GEMM over the chunk's units, where a
            scan would launch every GEMM, slice and update once per unit. Uneven stages scan, skipping
            their empty slots."""
            def layer(variables, inputs_l):
                _, out = plain.apply({**variables, inputs: inputs_l}, jnp.zeros_like(x), positions, segment_ids,
                                     mutable=[outputs])
                return out[outputs]
            if counts is None:
                return jax.vmap(layer)(chunk, recorded)
            return scan(lambda _, scanned: (None, layer(*scanned)), None, (chunk, recorded), first)[1]

        def probe_shapes(chunk, x, positions, segment_ids):
            def layer(x, variables):
                (y, _), out = block.apply(variables, x, positions, segment_ids, mutable=[outputs])
                return y, jax.tree.map(lambda a: jnp.zeros_like(a), out[outputs])
            return lax.scan(layer, x, chunk)[1]

        return cls(forward, weights, probe_shapes)


def _unread_attention(q, k, v, segment_ids, window: int = 0):
    """Attention's shape without its work, for the weight-gradient pass (`SplitStage.weights`), whose
    matmuls read their recorded inputs instead of attention's output."""
    return jnp.zeros_like(q)


def _chunk_function(stack):
    """stack on chunk r and micro-batch i, both picked inside: a remat keeps (r, i, x), not weights.
    Under FP8 the chunk's amaxes count only when `working` (a bubble tick runs on no micro-batch)."""
    def run(chunks, r, i, x, positions, segment_ids, working):
        chunk = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, r, 0, keepdims=False), chunks)
        if FP8 in chunk:
            chunk = {**chunk, FP8: jax.tree.map(lambda h: fp8_lib.recorded_if(h, working), chunk[FP8])}
        return stack(chunk, x, lax.dynamic_index_in_dim(positions, i, 1, keepdims=False),
                     lax.dynamic_index_in_dim(segment_ids, i, 1, keepdims=False), r)
    return run


def _ring_loop(stack, layers, xs, positions, segment_ids, *, p, m, v, units, axes):
    """gpipe / circular tick loop on one stage. xs [b, m, T, D]; layers [v*k, ...] local.

    Stage 0 reads lap 0 from `buffer` (the embedded micro-batches) and later laps from the
    same buffer, where the activations arriving from stage p-1 are parked; after the last
    tick the buffer of stage 0 holds the stack's output. MoE statistics of the ticks that do real
    work (not the bubble) are summed, then averaged over the `units` MoE units and the micro-batches.

    The weights are made per-device over the loop's other axes as they enter: the transpose of that
    (a psum over the batch axes) then runs once per step, not in every tick's backward.
    """
    s = lax.axis_index(STAGE)
    layers = {**layers, "params": vary(layers["params"], axes)}
    if FP8 in layers:  # this device's own copy (`fp8.per_device`): [1, v*k, 3, H] -> [v*k, 3, H]
        layers[FP8] = jax.tree.map(lambda h: h[0], layers[FP8])
    chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers)
    ring = [(j, (j + 1) % p) for j in range(p)]
    buffer = lax.pcast(xs, (STAGE,), to="varying")  # [b, m, T, D]
    incoming = jnp.zeros_like(buffer[:, 0])  # [b, T, D] from the previous stage
    example = jax.eval_shape(stack, chunks, 0, 0, incoming, positions, segment_ids, True)[1]
    stats = jax.tree.map(lambda a: lax.pcast(jnp.zeros(a.shape, a.dtype), (STAGE,), to="varying"), example)

    def park(buffer, incoming, t):  # stage p-1 finished micro-batch t - p on the previous tick
        slot = (t - p) % m
        kept = jnp.where(t >= p, incoming, lax.dynamic_index_in_dim(buffer, slot, 1, keepdims=False))
        return lax.dynamic_update_index_in_dim(buffer, kept, slot, 1)

    def tick(carry, t):
        buffer, incoming, stats = carry
        buffer = park(buffer, incoming, t)
        i, r = (t - s) % m, jnp.clip((t - s) // m, 0, v - 1)  # micro-batch and lap of this stage
        x = jnp.where(s == 0, lax.dynamic_index_in_dim(buffer, t % m, 1, keepdims=False), incoming)
        working = (t >= s) & (t - s < v * m)
        y, tick_stats = stack(chunks, r, i, x, positions, segment_ids, working)
        stats = jax.tree.map(lambda a, b: a + jnp.where(working, b, 0), stats, tick_stats)
        return (buffer, lax.ppermute(y, STAGE, ring), stats), None

    ticks = v * m + p - 1
    (buffer, incoming, stats), _ = lax.scan(tick, (buffer, incoming, stats), jnp.arange(ticks))
    buffer = park(buffer, incoming, ticks)
    stats = jax.tree.map(lambda a: lax.psum(a, STAGE) / (units * m), stats)
    return lax.psum(jnp.where(s == 0, buffer, jnp.zeros_like(buffer)), STAGE), stats


# ---------------------------------------------------------------------------------------------
# 1F1B: loss and gradients in one hand-written tick loop.
# ---------------------------------------------------------------------------------------------


def loss_and_grads(params, histories, batch, model, total_tokens, accum_steps):
    """(loss_sum, aux, grads, amaxes) of the 1F1B schedule; the train step's drop-in for autodiff.

    Same contract as the train step's one-pass gradient: the differentiated loss is
    loss_sum / total_tokens plus the MoE losses in `aux`, each averaged over the MoE units and the
    micro-batches as under gpipe (`moe.loss_terms`); under FP8, `amaxes` are the largest amaxes each
    quantised matmul saw (the cotangents of its amax `histories`). The loop is manual over
    `Pipeline.axes`: each device sums its own gradients over its micro-batches and the data-parallel
    reduction runs once, after the loop (playbook, "Data Parallelism" with gradient accumulation),
    not in every backward slot; under ZeRO-3 the weights are gathered once, when they enter the loop
    (playbook, "ZeRO-3": a stage keeps its weights gathered across its micro-batches), not in every slot.
    """
    del accum_steps  # the validator requires train.grad_accum_steps == 1 with a pipeline
    loop = _one_f_one_b_overlapped_loop if model.pipeline.overlap else _one_f_one_b_loop
    return run_gradient_loop(loop, params, histories, batch, model, total_tokens)


def run_gradient_loop(loop, params, histories, batch, model, total_tokens, **static):
    """`loop`(stack, stage model, layers, outer params, micro-batches, total_tokens, *, p, m, axes, units,
    specs, **static) -> (loss sum, MoE stats, outer grads, layer grads), run in the pipeline's
    `shard_map`; returns the train step's (loss_sum, aux, grads, amaxes). Shared by 1F1B and the slot
    tables. `layers` are the stage's variables (`stage_variables`: parameters, and under FP8 the amax
    histories, float32); its gradients are their float32 gradient sums and largest amaxes."""
    pipe = model.pipeline
    inner = model.clone(rules=model.rules.with_manual(pipe.axes), pipeline=None,
                        attention_fn=ring_attention.in_conditional_slots(model.attention_fn))
    stack = stage_function(inner.cfg, inner.rules, inner.attention_fn, pipe.counts)
    outer = {k: v for k, v in params.items() if k != "layers"}
    micro = jax.tree.map(functools.partial(_split, m=pipe.microbatches), batch)
    units = model_lib.scan_unit(model.cfg)[1]
    layers, specs = {"params": params["layers"]}, {"params": layer_specs(model.cfg, pipe.axes)}
    if histories:  # all of them belong to the layers: the embedding and the head are not quantised
        layers[FP8] = histories["layers"]
        specs[FP8] = jax.tree.map(lambda _: P(STAGE), histories["layers"])
    body = functools.partial(loop, stack, inner, p=pipe.stages, m=pipe.microbatches, axes=pipe.axes, units=units,
                             specs=specs, **static)
    loss_sum, stats, outer_grads, layer_grads = jax.shard_map(
        body, in_specs=(specs, P(), pipe.micro_spec(0), P()), out_specs=(P(), P(), P(), specs),
        axis_names=set(pipe.axes), check_vma=pipe.checked,
    )(layers, outer, micro, total_tokens)
    grads = {**outer_grads, "layers": layer_grads["params"]}
    amaxes = {"layers": layer_grads[FP8]} if FP8 in layer_grads else {}
    aux, logged = moe_lib.loss_terms(stats or None, model.cfg)
    return loss_sum, {**aux, **logged}, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), amaxes


def reduce_layer_grads(g_layers: dict, specs: dict, rest: tuple[str, ...]) -> dict:
    """A stage's layer gradient sums and amaxes, reduced over the loop's other axes once: a gradient
    summed over the axes its weight is replicated on (not `expert` for experts), an amax maximised."""
    out = {"params": jax.tree.map(lambda g, spec: psum(g, tuple(a for a in rest if a not in spec)),
                                  g_layers["params"], specs["params"], is_leaf=lambda x: isinstance(x, P))}
    if FP8 in g_layers:
        out[FP8] = jax.tree.map(lambda a: lax.pmax(a, rest) if rest else a, g_layers[FP8])
    return out


def aux_cotangents(stats: dict, cfg, units: int, m: int) -> dict:
    """d(MoE losses) / d(one unit's stats of one micro-batch): the losses average the stats over the
    `units` MoE units and the `m` micro-batches (`moe.loss_terms`), so each is a constant."""
    weights = {"balance": cfg.aux_loss_weight, "z": cfg.router_z_loss_weight}
    return {k: jnp.full(v.shape, weights.get(k, 0.0) / (units * m), v.dtype) for k, v in stats.items()}


def one_f_one_b_slot(p: int, s, u):
    """(op, micro-batch) of stage s in time slot u of the 1F1B schedule; op 0 idle, 1 forward, 2 backward.

    Forward of j in slot s + 2j, backward of j in slot 2p - 1 - s + 2j: every stage alternates
    forward and backward slots, a forward moves one stage per slot and so does a gradient, and
    stage s holds the activations of micro-batches j .. j + p - 1 - s between a forward and its backward.
    Works on Python ints and on traced values alike.
    """
    forward = (u - s) % 2 == 0
    j_forward, j_backward = (u - s) // 2, (u - (2 * p - 1 - s)) // 2
    if isinstance(forward, bool):
        return (1, j_forward) if forward else (2, j_backward)
    return jnp.where(forward, 1, 2), jnp.where(forward, j_forward, j_backward)


def one_f_one_b_branches_used(p: int, m: int, overlap: bool = False) -> set[int]:
    """The `one_f_one_b_branch` indices some stage takes in some slot (host ints)."""
    used = {0}
    if overlap:
        return used | {branch for s in range(p) for t in range(m + 2 * p - 2)
                       for branch, _ in one_f_one_b_overlapped(p, m, s, t)}
    for s in range(p):
        role = 1 if s == 0 else 2 if s == p - 1 else 0
        for u in range(2 * (m + p - 1)):
            op, j = one_f_one_b_slot(p, s, u)
            if 0 <= j < m:
                used.add(1 + 3 * (op - 1) + role)
    return used


def one_f_one_b_branch(p: int, m: int, s, u):
    """(branch, micro-batch) of the slot's `lax.switch`: 0 idle; forward 1 on a middle stage, 2 on
    stage 0 (embedding), 3 on stage p-1 (head and loss); backward 4, 5 (embedding), 6 likewise."""
    op, j = one_f_one_b_slot(p, s, u)
    role = jnp.where(s == 0, 1, jnp.where(s == p - 1, 2, 0))
    return jnp.where((j >= 0) & (j < m), 1 + 3 * (op - 1) + role, 0), jnp.clip(j, 0, m - 1)


def one_f_one_b_overlapped(p: int, m: int, s, t):
    """((forward branch, micro-batch), (backward branch, micro-batch)) of stage s at tick t of 1F1B with
    transfers behind compute (`pipeline.overlap_transfers`); branch indices as `one_f_one_b_branch`'s.

    Every tick runs a forward slot on all stages, then a backward slot on all stages: stage s runs the
    forward of j at tick s + j and its backward at tick 2p - 2 - s + j. An activation sent after a
    forward slot travels during the backward slot and is read at the next tick; a gradient computed in
    a backward slot is sent at the start of the next tick, travels during its forward slot and is read
    by its backward slot. Each transfer has a slot of compute beside it; the price is a hop of two
    slots per stage: 2p - 2 ticks of warm-up and cool-down (m + 2p - 2 ticks in all, each one forward
    and one backward long) and 2(p - s) - 1 micro-batches in flight on stage s (1F1B: p - s).
    Works on Python ints and on traced values alike."""
    j_forward, j_backward = t - s, t - (2 * p - 2 - s)
    if isinstance(s, int) and isinstance(t, int):
        role = 1 if s == 0 else 2 if s == p - 1 else 0
        return ((1 + role if 0 <= j_forward < m else 0, min(max(j_forward, 0), m - 1)),
                (4 + role if 0 <= j_backward < m else 0, min(max(j_backward, 0), m - 1)))
    role = jnp.where(s == 0, 1, jnp.where(s == p - 1, 2, 0))
    return ((jnp.where((j_forward >= 0) & (j_forward < m), 1 + role, 0), jnp.clip(j_forward, 0, m - 1)),
            (jnp.where((j_backward >= 0) & (j_backward < m), 4 + role, 0), jnp.clip(j_backward, 0, m - 1)))


def _slot_pairs(p: int, parity: int) -> list[tuple[int, int]]:
    """Who sends to whom after a slot of this parity: forward slots to s+1, backward slots to s-1.

    Neighbours swap, so one `ppermute` carries both directions.
    """
    pairs = []
    for s in range(p):
        if (parity - s) % 2 == 0 and s + 1 < p:
            pairs.append((s, s + 1))
        elif (parity - s) % 2 == 1 and s >= 1:
            pairs.append((s, s - 1))
    return pairs


class Residuals:
    """The residuals of a stage's `jax.vjp` (what its backward needs), kept between a forward slot
    and its backward slot.

    The stage weights are residuals too; they are the same arrays in every slot, so they are not
    stashed: a backward rebuilds the pullback from the stashed activations and the live weights
    (`w`: the stage's layers by default, a chunk of them under a slot table).
    The pullback's structure comes from one abstract trace; every forward slot's vjp has the same.
    """

    def __init__(self, stack, layers):
        self._stack, self._layers = stack, layers

    def vjp(self, x, mb, w=None, chunk=0):
        """((y, stats), pullback) of the stage (variables `w`, its chunk number `chunk`) on x [b, T, D]
        for micro-batch `mb`. FP8 histories enter as `fp8.for_grad` values: their cotangents are the
        matmuls' amaxes."""
        w = self._layers if w is None else w

        def run(w, x):
            if FP8 in w:
                w = {**w, FP8: fp8_lib.for_grad(w[FP8])}
            return self._stack(w, x, mb["positions"], mb["segment_ids"], chunk)
        return jax.vjp(run, w, x)

    def _constants(self, w) -> list:
        """The residuals that are the same arrays in every slot (the weights): never stashed."""
        return jax.tree.leaves(self._layers if w is None else w)

    def _split(self, pullback, w):
        weights = self._constants(w)
        leaves, treedef = jax.tree.flatten(pullback)
        kinds = tuple(next((i for i, a in enumerate(weights) if leaf is a), None) for leaf in leaves)
        return [leaf for leaf, k in zip(leaves, kinds, strict=True) if k is None], kinds, treedef

    def structure(self, x, mb, axes: tuple[str, ...] = (), w=None) -> list[jax.ShapeDtypeStruct]:
        """Traces the pullback's structure once (what `keep` and `rebuild` follow) and returns the
        shapes of its non-weight residuals, which `keep` makes varying over the manual `axes`."""
        self._axes = axes

        def probe(w, x, mb):
            _, pullback = self.vjp(x, mb, w)
            kept, self._kinds, self._treedef = self._split(pullback, w)
            return kept
        return jax.eval_shape(probe, self._layers if w is None else w, x, mb)

    def stash(self, slots: int, x, mb, axes: tuple[str, ...], w=None) -> list[jax.Array]:
        """Zeroed [slots, ...] buffers for the non-weight residuals, varying over the manual `axes`
        (a slot index differs per stage, so every buffer does)."""
        zeros = [jnp.zeros((slots, *a.shape), a.dtype) for a in self.structure(x, mb, axes, w)]
        return [lax.pcast(z, axes, to="varying") for z in zeros] if axes else zeros

    def keep(self, pullback, w=None) -> list[jax.Array]:
        """The pullback's non-weight residuals, as a slot of the stash holds them."""
        kept, kinds, _ = self._split(pullback, w)
        if kinds != self._kinds:
            raise RuntimeError("pipeline: a forward slot's vjp residuals differ from the traced structure")
        return [vary(r, self._axes) for r in kept]

    def rebuild(self, kept: list[jax.Array], w=None):
        """The pullback from a slot's residuals (`keep`) and the weights `w`."""
        weights = self._constants(w)
        kept = iter(kept)
        leaves = [weights[k] if k is not None else next(kept) for k in self._kinds]
        return jax.tree.unflatten(self._treedef, leaves)

    def load(self, stash: list[jax.Array], slot, w=None):
        """The pullback of the forward stored in `slot` (weights `w`)."""
        return self.rebuild([lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False) for buf in stash], w)


class SlotWork:
    """What a 1F1B slot can do on one stage, as `lax.switch` branches (`one_f_one_b_branch` order):
    idle; a forward on a middle stage, on stage 0 (embedding first), on stage p-1 (head and loss
    after); a backward likewise. Each takes (carry, inbox, micro-batch, stash) -> (carry, outbox, put).

    The stash of vjp residuals (`stash_buffers`) stays out of the switch: a backward reads its slot, a
    forward returns its residuals as `put`, which the loop writes after the switch (`store`). XLA gives a
    conditional's results their own buffers, so a stash the branches returned was copied in every
    branch, every slot (405B on 16 H100 stages: 4 GiB, 3.95 ms a slot). The carry holds the last
    stage's head gradient `dy`, float32
    gradient sums of the stage's layers (`g_layers`) and of the embedding / head (`g_outer`), the
    summed loss and the summed MoE statistics of the stage's units; every entry differs per stage
    and per data-parallel rank.
    """

    def __init__(self, stack, model, layers, outer, micro, total_tokens, *, p: int, m: int,
                 manual: tuple[str, ...], units: int, stash_slots: int | None = None):
        self.model, self.layers, self.outer, self.micro = model, layers, outer, micro
        self.total_tokens, self.p, self.m, self.manual, self.units = total_tokens, p, m, manual, units
        self.stash_slots = stash_slots or p  # micro-batch j's residuals in slot j % stash_slots
        self.residuals = Residuals(stack, layers)

    def _embed(self, o, tokens):
        return self.model.apply({"params": o}, tokens, method="embed")

    def _head_loss(self, o, y, mb):
        return self.model.apply({"params": o}, y, mb, method="head_loss")

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

    def initial_carry(self) -> dict:
        act = self.activation()

        def probe(x):  # the stage's MoE statistics, and over which axes they vary (their cotangents must)
            (_, stats), _ = self.residuals.vjp(lax.pcast(x, self.manual, to="varying"), self._pick(0))
            self._stats_vma = jax.tree.map(lambda a: tuple(sorted(varying(a))), stats)
            return stats
        stats = jax.eval_shape(probe, act)
        zeros32 = functools.partial(jax.tree.map, lambda a: jnp.zeros(a.shape, jnp.float32))
        carry = dict(dy=act, g_layers=self._layer_sums(), g_outer=zeros32(self.outer),
                     loss=jnp.zeros((), jnp.float32), stats=zeros32(stats))
        self._stash = self.residuals.stash(self.stash_slots + 1, lax.pcast(act, self.manual, to="varying"),
                                           self._pick(0), self.manual)
        return self._varying(carry)

    def stash_buffers(self) -> list[jax.Array]:
        """The zeroed stash (after `initial_carry`): `stash_slots` slots of residuals, micro-batch j's in
        slot j % stash_slots, and a last slot that the slots without a forward write their zeros into."""
        return self._stash

    def store(self, stash: list[jax.Array], put: list[jax.Array], index, j) -> list[jax.Array]:
        """The stash after a slot that took branch `index` on micro-batch j: its forward's residuals `put`
        in j's slot, or (no forward) the zeros in the last slot."""
        forward = (index >= 1) & (index <= 3)
        slot = jnp.where(forward, j % self.stash_slots, self.stash_slots)
        return [lax.dynamic_update_index_in_dim(buf, value, slot, 0) for buf, value in zip(stash, put, strict=True)]

    def _nothing(self, stash: list[jax.Array]) -> list[jax.Array]:
        return [self._varying(jnp.zeros(buf.shape[1:], buf.dtype)) for buf in stash]

    def branches(self, used: set[int]) -> list:
        """The `lax.switch` branches; those no stage ever takes (`used`: the schedule's) are idle, so
        that they are neither traced nor compiled (a 2-stage pipeline has no middle stage)."""
        every = [self._idle, self._forward(False, False), self._forward(True, False), self._forward(False, True),
                 self._backward(False, False), self._backward(True, False), self._backward(False, True)]
        return [branch if index in used else self._idle for index, branch in enumerate(every)]

    def _idle(self, c, inbox, j, stash):
        return c, jnp.zeros_like(inbox), self._nothing(stash)

    def _forward(self, first: bool, last: bool):
        def run(c, inbox, j, stash):
            mb = self._pick(j)
            x = self._embed(self.outer, mb["inputs"]) if first else inbox
            (y, stats), stack_vjp = self.residuals.vjp(x, mb)
            put = self.residuals.keep(stack_vjp)
            c = {**c, "stats": self._acc(c["stats"], self._varying(stats))}
            if not last:
                return c, y, put
            # the last stage takes the loss at once; its backward slot (the next one) starts from dy
            loss, head_vjp = jax.vjp(lambda o, y: self._head_loss(o, y, mb), self.outer, y)
            g_head, dy = head_vjp(self._varying((1.0 / self.total_tokens).astype(loss.dtype)))
            c = {**c, "dy": dy, "loss": c["loss"] + loss, "g_outer": self._acc(c["g_outer"], g_head)}
            return c, jnp.zeros_like(y), put
        return run

    def _backward(self, first: bool, last: bool):
        def run(c, inbox, j, stash):
            mb = self._pick(j)
            g = c["dy"] if last else inbox
            pullback = self.residuals.load(stash, j % self.stash_slots)
            g_stats = {k: self._varying(g, self._stats_vma[k]) for k, g in
                       aux_cotangents(c["stats"], self.model.cfg, self.units, self.m).items()}
            g_layers, dx = pullback((g, g_stats))
            c = {**c, "g_layers": self._acc_layers(c["g_layers"], g_layers)}
            if not first:
                return c, dx, self._nothing(stash)
            _, embed_vjp = jax.vjp(lambda o: self._embed(o, mb["inputs"]), self.outer)
            (g_embed,) = embed_vjp(dx)
            return {**c, "g_outer": self._acc(c["g_outer"], g_embed)}, jnp.zeros_like(dx), self._nothing(stash)
        return run


def psum(x, axes):
    return lax.psum(x, axes) if axes else x


def pmean(x, axes):
    return lax.pmean(x, axes) if axes else x


def _one_f_one_b_loop(stack, model, layers, outer, micro, total_tokens, *, p, m, axes, units, specs):
    """One stage's 1F1B ticks: two slots per tick, each a forward or a backward (`one_f_one_b_slot`).

    A slot runs only its own work (`lax.switch` over `SlotWork.branches`), then one `ppermute`
    hands each slot's output to its neighbour: activations forward, input gradients back. A forward
    keeps what its backward needs (the stage's `jax.vjp` residuals: the activations the remat policy
    saves) in a stash of p slots (stage s uses p - s of them); the backward runs from them without
    a recompute. Returns (loss sum, MoE stats averaged over units and micro-batches, outer grads,
    layer grads), each reduced over the data-parallel axes once.
    """
    s = lax.axis_index(STAGE)
    rest = tuple(a for a in axes if a != STAGE)
    # differentiate per stage and per data-parallel rank; reduce once at the end
    outer = lax.pcast(outer, axes, to="varying")
    layers = vary(layers, rest)
    work = SlotWork(stack, model, layers, outer, micro, total_tokens, p=p, m=m, manual=axes, units=units)
    branches = work.branches(one_f_one_b_branches_used(p, m))

    def tick(carry, t):
        c, stash, inbox = carry
        for parity in (0, 1):  # slot u = 2t + parity; its senders and receivers are fixed by the parity
            index, j = one_f_one_b_branch(p, m, s, 2 * t + parity)
            c, out, put = lax.switch(index, branches, c, inbox, j, stash)
            stash = work.store(stash, put, index, j)
            inbox = lax.ppermute(out, STAGE, _slot_pairs(p, parity))
        return (c, stash, inbox), None

    inbox = lax.pcast(work.activation(), axes, to="varying")
    c = work.initial_carry()
    (c, _, _), _ = lax.scan(tick, (c, work.stash_buffers(), inbox), jnp.arange(m + p - 1))
    return _loop_results(c, specs, axes, units, m)


def _one_f_one_b_overlapped_loop(stack, model, layers, outer, micro, total_tokens, *, p, m, axes, units, specs):
    """One stage's 1F1B ticks with every transfer beside a slot of compute (`one_f_one_b_overlapped`):

        start sending the last tick's input gradient upstream  |  forward slot (`lax.switch`)
        start sending this forward's activation downstream     |  backward slot (reads the gradient)

    The gradient a backward slot computes stays in the carry and leaves at the start of the next
    tick, so neither `ppermute` is read by the slot right after it. Same results as
    `_one_f_one_b_loop`; residuals of 2(p - s) - 1 micro-batches on stage s."""
    s = lax.axis_index(STAGE)
    rest = tuple(a for a in axes if a != STAGE)
    outer = lax.pcast(outer, axes, to="varying")
    layers = vary(layers, rest)
    work = SlotWork(stack, model, layers, outer, micro, total_tokens, p=p, m=m, manual=axes, units=units,
                    stash_slots=min(m, 2 * p - 1))
    branches = work.branches(one_f_one_b_branches_used(p, m, overlap=True))
    downstream = [(i, i + 1) for i in range(p - 1)]
    upstream = [(i, i - 1) for i in range(1, p)]

    def tick(carry, t):
        c, stash, activation, gradient_out = carry
        gradient = lax.ppermute(gradient_out, STAGE, upstream)  # travels during the forward slot
        (f_index, f_micro), (b_index, b_micro) = one_f_one_b_overlapped(p, m, s, t)
        c, y, put = lax.switch(f_index, branches, c, activation, f_micro, stash)
        stash = work.store(stash, put, f_index, f_micro)
        activation = lax.ppermute(y, STAGE, downstream)  # travels during the backward slot
        c, gradient_out, _ = lax.switch(b_index, branches, c, gradient, b_micro, stash)
        return (c, stash, activation, gradient_out), None

    act = lax.pcast(work.activation(), axes, to="varying")
    c = work.initial_carry()
    (c, _, _, _), _ = lax.scan(tick, (c, work.stash_buffers(), act, act), jnp.arange(m + 2 * p - 2))
    return _loop_results(c, specs, axes, units, m)


def _loop_results(c, specs, axes, units, m):
    """(loss sum, MoE stats averaged over units and micro-batches, outer grads, layer grads) of a 1F1B
    loop's final carry, each reduced over the data-parallel axes once."""
    rest = tuple(a for a in axes if a != STAGE)
    g_layers = reduce_layer_grads(c["g_layers"], specs, rest)
    # every rank of a stage holds the same statistics (summed over the batch inside each layer)
    stats = jax.tree.map(lambda a: pmean(lax.psum(a, STAGE), rest) / (units * m), c["stats"])
    return lax.psum(c["loss"], axes), stats, lax.psum(c["g_outer"], axes), g_layers


# ---------------------------------------------------------------------------------------------
# Validation and the start-of-run description.
# ---------------------------------------------------------------------------------------------


def stage_layers(n_layers: int, p: int, given=(), repeats: int = 1) -> tuple[int, ...]:
    """Layers of each of the p*v chunks (virtual stages) in execution order, chunk c = r*p + s being stage
    s's r-th of v = `repeats` (v = 1: the stages): `given` (`pipeline.layers_per_stage`), else even, or
    when p*v does not divide `n_layers`, ceil(n_layers/(p*v)) each less one for the first chunk, the
    last, the second, the second to last, ... (the first stage also embeds, the last runs the head and
    the loss: Llama 3's 405B runs 126 layers on 16 stages as 7 + 14 x 8 + 7; interleaved in 2 chunks a
    stage, 3 + 30 x 4 + 3, so stages 0 and 15 again hold 7 layers and the others 8)."""
    if given:
        return tuple(int(n) for n in given)
    chunks = p * repeats
    k = -(-n_layers // chunks)
    counts = [k] * chunks
    ends = [c for pair in zip(range(chunks), range(chunks - 1, -1, -1), strict=True) for c in pair]
    for c in list(dict.fromkeys(ends))[:chunks * k - n_layers]:
        counts[c] -= 1
    return tuple(counts)


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """Pipeline rules (gathered by `meshtrain.validate`); raises ConfigError."""
    p = sizes[STAGE]
    pipe, req = config.pipeline, config_lib.require
    if p == 1:
        req(tuple(pipe.layers_per_stage) in ((), (config.model.n_layers,)), "pipeline.layers_per_stage",
            tuple(pipe.layers_per_stage), "splits the layers over mesh.stage, which is 1: must be ()")
        return
    v = pipe.repeats
    req(pipe.split_backward in SPLIT_MODES, "pipeline.split_backward", pipe.split_backward,
        f"must be one of {SPLIT_MODES}")
    parts = pipe.weight_parts
    req(parts == 1 or (pipe.schedule in SPLIT_BACKWARD and pipe.split_backward == "gemms"), "pipeline.weight_parts",
        parts, f"W runs in parts only under pipeline.schedule in {SPLIT_BACKWARD} with split_backward='gemms' "
        f"(got {pipe.schedule!r}, {pipe.split_backward!r}): must be 1")
    req(not pipe.overlap_transfers or pipe.schedule in OVERLAPPING, "pipeline.overlap_transfers",
        pipe.overlap_transfers, f"only {OVERLAPPING} send a tick's outputs during the next tick (got "
        f"pipeline.schedule={pipe.schedule!r}): must be False")
    req(pipe.schedule in CHUNKED_SCHEDULES or v == 1, "pipeline.repeats", v,
        f"repeats > 1 needs pipeline.schedule in {CHUNKED_SCHEDULES} (got {pipe.schedule!r})")
    req(not schedules.REGISTRY[pipe.schedule].grouped or pipe.microbatches % p == 0, "pipeline.microbatches",
        pipe.microbatches, f"{pipe.schedule} runs micro-batches in groups of mesh.stage={p}: must be divisible by it")
    unit = config.model.moe_every if config.model.num_experts else 1  # the scanned unit: moe_every layers
    n_layers, given = config.model.n_layers, tuple(pipe.layers_per_stage)
    chunked = pipe.schedule in CHUNKED_SCHEDULES and v > 1
    if given:
        entries = f"chunk: mesh.stage*pipeline.repeats={p}*{v}" if chunked else f"stage: mesh.stage={p}"
        req(len(given) == p * (v if chunked else 1), "pipeline.layers_per_stage", given,
            f"needs one entry per {entries}")
        req(all(isinstance(n, int) and n >= 0 and n % unit == 0 for n in given), "pipeline.layers_per_stage", given,
            "entries must be integers >= 0" + (f" and multiples of model.moe_every={unit}" if unit > 1 else ""))
        req(sum(given) == n_layers, "pipeline.layers_per_stage", given,
            f"must sum to model.n_layers={n_layers} (it sums to {sum(given)})")
    req(bool(given) or n_layers // unit >= p, "model.n_layers", n_layers,
        f"its {n_layers // unit} scanned units of {unit} layer(s) are fewer than mesh.stage={p}: every stage "
        "needs one (or give pipeline.layers_per_stage with empty stages)")
    units = stage_layers(n_layers // unit, p, tuple(n // unit for n in given), v if chunked else 1)
    if len(set(units)) > 1:
        chunk_units = max(units)
        slots = pipe.schedule in schedules.SLOT_SCHEDULES
        ring_heads = config.attention.impl == "ring" and sizes[SEQUENCE] > 1 and sizes["tensor"] > 1
        req(not (slots and ring_heads and config.remat.policy == "none"), "remat.policy", config.remat.policy,
            "uneven stages skip empty slots with a lax.cond, which JAX cannot differentiate when it saves ring "
            f"attention's gathered blocks inside {pipe.schedule}'s slots with the heads split over mesh.tensor: "
            "use 'selective' or 'full' (or an even split of model.n_layers)")
    else:
        chunk_units = units[0]
    req(chunk_units % parts == 0, "pipeline.weight_parts", parts,
        f"must divide the {chunk_units} scanned units of a stage's chunk (the largest chunk's"
        f"{' MoE groups of model.moe_every layers' if unit > 1 else ' layers'})")
    req(pipe.microbatches >= p, "pipeline.microbatches", pipe.microbatches,
        f"must be >= mesh.stage={p} (every stage needs a micro-batch to work on)")
    dp = config_lib.data_parallel_size(sizes)
    req(config.train.batch_size % (pipe.microbatches * dp) == 0, "train.batch_size", config.train.batch_size,
        f"must be divisible by pipeline.microbatches*mesh.(data*fsdp*expert)={pipe.microbatches}*{dp}")
    req(config.train.grad_accum_steps == 1, "train.grad_accum_steps", config.train.grad_accum_steps,
        "must be 1 with mesh.stage > 1: pipeline.microbatches splits the batch instead")
