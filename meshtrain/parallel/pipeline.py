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
Inside a slot-table tick (a `lax.switch` whose branch differs per stage) ring attention moves its
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
* 1f1b ("One-forward-one-backward"), interleaved_1f1b and zero_bubble: one executor of slot
  tables (`pipeline_tables`), a hand-written loss-and-gradient loop used by the train step instead
  of autodiff; their forward-only pass (evaluation) is the gpipe loop. 1F1B's table
  (`schedules.executed`): stage s runs the forward of micro-batch j in tick s + 2j (a `jax.vjp` of
  the stage whose residuals, the activations the remat policy keeps, are stashed) and its backward
  (the pullback, from the stash) in tick 2p - 1 - s + 2j, so neighbours always sit in opposite
  phases and an activation moves forward and a gradient back one stage a tick. Stage s holds the
  activations of p - s micro-batches at most, independent of m; 2(m + p - 1) ticks, bubble
  (p-1)/(m+p-1) as in the playbook. With `pipeline.overlap_transfers` the ticks alternate (a
  forward on every stage, then a backward) and each transfer travels beside the next tick's compute:
  2(m + 2p - 2) ticks, 2(p - s) - 1 micro-batches held on stage s. In lock-step SPMD a tick lasts
  as long as the slowest stage's work in it: a backward (about 2 forwards, 3 under full remat)
  while the neighbours run forwards, unless the ticks alternate.

Remat per stage per micro-batch (gpipe, circular): the backward recomputes a stage from its
input. The slot tables keep what the model's remat policy saves for their in-flight micro-batches.
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
from meshtrain.parallel import ring_attention, schedules, slot_program
from meshtrain.sharding_rules import vary

STAGE, SEQUENCE = Axis.STAGE.value, Axis.SEQUENCE.value
FP8 = fp8_lib.COLLECTION
TABLE_SCHEDULES = schedules.TABLE_SCHEDULES  # run from their slot tables (`pipeline_tables`)
SPLIT_BACKWARD = schedules.SPLIT_BACKWARD  # B and W separate operations (`pipeline.split_backward`)
CHUNKED_SCHEDULES = schedules.CHUNKED  # v = pipeline.repeats chunks per stage
# `pipeline.overlap_transfers`: each tick's outputs travel while the next tick computes
OVERLAPPING = schedules.OVERLAPPING


SPLIT_MODES = ("gemms", "pullback")  # `pipeline.split_backward`


def inputs_at_b(split_backward: str, remat_policy: str, overlap: bool) -> bool:
    """Whether the gemms split takes W's matmul inputs from B (`Pipeline.inputs_at_b`), so the records W
    reads live from B to W instead of from F:
    * under full remat, where B rebuilds the layers' forward anyway and F's stash holds only their inputs;
    * with transfers behind compute, under every policy: there each W runs in its B's round
      (`schedules.defers_w`) and B's switch hands it the record in the same loop step
      (`slot_program.SlotPlan.handoff`), so a record is held only until the step's W (which covers the
      step's `pipeline.weight_span` B's). Compiled for H100s, zero bubble's temporaries then stay within
      a record of 1F1B's under every policy (docs/pipeline.md, "At real shapes").
    Without overlap under the other policies, F's residuals hold the inputs anyway and W's deferred past
    later B's would each hold a record more (the compiled figures: docs/pipeline.md)."""
    return split_backward == "gemms" and (remat_policy == "full" or overlap)


def defers_w(split_backward: str, remat_policy: str, overlap: bool) -> bool:
    """Whether the table the trainer runs defers W's past later B's (`schedules.defers_w`), for the cost
    model's callers (`parallel.cost.step_time`'s `defer_w`) that price a configuration without a `Pipeline`."""
    return schedules.defers_w(int(overlap), inputs_at_b(split_backward, remat_policy, overlap))


def w_span(schedule: str, split_backward: str, remat_policy: str, overlap: bool, weight_span: int) -> int:
    """Micro-batches one W covers (`Pipeline.span`), for the cost model's callers without a `Pipeline`:
    `weight_span` where each W runs in its B's loop step, handed B's records (the split's gemms W with
    transfers behind compute: `slot_program.SlotPlan.handoff`), else 1."""
    hands = (schedule in SPLIT_BACKWARD and split_backward == "gemms"
             and not defers_w(split_backward, remat_policy, overlap))
    return weight_span if hands else 1


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
    split_backward: str = "gemms"  # slot tables' W (`slot_program.SlotPlan.split_backward`)
    weight_parts: int = 1  # split W as this many operations on slices of the chunk's layers
    # scanned units (layers, or MoE groups of model.moe_every) each chunk runs, in execution order: chunk
    # c = r*p + s is stage s's r-th chunk (the virtual stage c; v = 1: one chunk a stage); () = even.
    # Uneven chunks (`stage_layers`) store max(units) rows each; the rows past a chunk's count are
    # empty slots: zeros in the state, skipped by a `lax.cond` in the chunk's scan.
    units: tuple[int, ...] = ()
    # the slot tables: each tick's outputs travel while the next tick computes (a hop of two
    # ticks, `pipeline.overlap_transfers`): deeper warm-up, more micro-batches in flight
    overlap: bool = False
    # split_backward gemms: W's matmul inputs from B's pullback (full remat, or transfers overlapped:
    # `slot_program.SlotPlan.inputs_at_b`; `inputs_at_b` above)
    inputs_at_b: bool = False
    # `pipeline.weight_span`: micro-batches a W covers where B's switch hands W its record (`span`)
    weight_span: int = 1

    @classmethod
    def of(cls, schedule: str, stages: int, microbatches: int, repeats: int, n_units: int, given=(),
           **fields) -> Pipeline:
        """The schedule as configured (`pipeline.*`): `repeats` only where it is chunked, the `n_units`
        scanned units split over its chunks by `stage_layers` (`given`: `pipeline.layers_per_stage` in
        units). The runtime (`layout.pipeline_plan`) and the planner (`plan.memory.Step.pipeline`) both
        build it here, so they read the same ticks, tables and in-flight counts."""
        repeats = repeats if schedule in CHUNKED_SCHEDULES else 1
        units = stage_layers(n_units, stages, tuple(given), repeats)
        return cls(schedule, stages, microbatches, repeats, units=units, **fields)

    @property
    def defers_w(self) -> bool:
        """Whether a split schedule's W's are deferred past later B's (`schedules.defers_w`)."""
        return schedules.defers_w(int(self.overlap), self.inputs_at_b)

    @property
    def hands_over(self) -> bool:
        """Whether each W runs in its B's loop step, handed B's records (the split's gemms W, transfers
        behind compute: `slot_program.SlotPlan.handoff`)."""
        return self.schedule in SPLIT_BACKWARD and self.split_backward == "gemms" and not self.defers_w

    @property
    def span(self) -> int:
        """Micro-batches one W covers: `weight_span` where W's are handed B's records (`hands_over`), else 1."""
        return self.weight_span if self.hands_over else 1

    @functools.cached_property
    def _table(self):
        """The slot table a table schedule runs (`schedules.executed`)."""
        return schedules.executed(self.schedule, self.stages, self.microbatches, self.repeats, self.weight_parts,
                                  int(self.overlap), self.defers_w, self.span)

    @functools.cached_property
    def plan(self):
        """The slot-table executor's program (`slot_program.SlotPlan`) of a table schedule, else None."""
        if self.schedule not in TABLE_SCHEDULES:
            return None
        return slot_program.slot_plan(self.schedule, self.stages, self.microbatches, self.repeats,
                                      self.split_backward, self.weight_parts, int(self.overlap), self.inputs_at_b,
                                      self.span)

    @property
    def transfers(self) -> tuple[int, int]:
        """(stage-to-stage `ppermute`s a step, of them a tick): the autodiff ring one a tick forward and
        one transposed; a slot table two a tick (activations on, gradients back) or one (`SlotPlan.pairs`)."""
        if self.schedule not in TABLE_SCHEDULES:
            return 2 * self.ticks, 1
        paired = not self.overlap and slot_program.parity_sends(self.schedule, self.stages, self.microbatches,
                                                                  self.repeats, self.weight_parts) is not None
        per_tick = 1 if paired else 2
        return per_tick * self.ticks, per_tick

    @property
    def ticks(self) -> int:
        """Trip count of the tick loop (a slot table: one F, B or W per stage per tick; 1F1B with transfers
        behind compute and interleaved 1F1B alternate ticks of forwards and of backwards; under
        `SlotPlan.handoff` the table padded with idle ticks to whole rounds of its tick kinds)."""
        if self.schedule in TABLE_SCHEDULES:  # the slot program only where it may pad (the planner asks often:
            # 1F1B over 512 micro-batches builds its program in 40 s)
            return self.plan.ticks if self.hands_over else len(self._table)
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle fraction of the ticks: gpipe (p-1)/(m+p-1), circular (p-1)/(v*m+p-1) (1 - v*m/ticks; the
        playbook's (p-1)/(v*m) is relative to the ideal time). Slot tables: the idle share of the stages'
        time (`schedules.bubble`: F, B and W one unit each; tables without W: F one, the whole backward two,
        a tick as long as its longest operation).
        """
        if self.schedule in TABLE_SCHEDULES:
            ratio = schedules.bubble(self._table)
            return ratio / (1 + ratio)
        return 1 - self.repeats * self.microbatches / self.ticks

    def in_flight(self) -> tuple[int, ...]:
        """Per stage: micro-batch activations held for the backward at the peak (slot tables: chunk
        activations, each 1/v of a stage's layers)."""
        if self.schedule in TABLE_SCHEDULES:
            return schedules.executed_in_flight(self.schedule, self.stages, self.microbatches, self.repeats,
                                                self.weight_parts, int(self.overlap), self.defers_w, self.span)
        return (self.repeats * self.microbatches,) * self.stages

    def describe(self) -> str:
        """One line for the start-of-run log: schedule, ticks, bubble, in-flight micro-batches per stage."""
        line = (f"pipeline {self.schedule}: {self.stages} stages x {self.repeats} repeats, {self.microbatches} "
                f"micro-batches, {self.ticks} ticks, bubble {self.bubble:.1%}, "
                f"in flight per stage {list(self.in_flight())}")
        if self.schedule in TABLE_SCHEDULES:  # the playbook's ratio: idle over busy time of a stage
            line += f", idle/busy {schedules.bubble(self._table):.3f}"
        if self.weight_parts > 1:
            line += f", W in {self.weight_parts} parts"
        if self.schedule in SPLIT_BACKWARD and not self.defers_w:
            line += (f", each W over the {self.span} B's of a round, in its W ticks" if self.span > 1
                     else ", each W in the first W tick after its B")
        if self.overlap:
            line += ", transfers behind the next tick's compute"
        if self.uneven:
            per = "stage" if self.repeats == 1 else "chunk (virtual stage)"
            line += f", scanned units per {per} {list(self.units)} ({max(self.units)} rows each)"
        return line

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

        Differentiable (gpipe, circular); the slot tables use this loop for their forward-only pass.
        """
        rules = model.rules.with_manual(self.axes)
        stack = _chunk_function(stage_function(model.cfg, rules, model.attention_fn, self.counts))
        if model.cfg.remat_policy != "none":  # remat per stage per micro-batch: keep only its input
            stack = jax.checkpoint(stack, prevent_cse=False)
        layers, specs = stage_variables(model), {"params": layer_specs(model.cfg, self.axes, model.rules)}
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


def layer_specs(cfg, axes: tuple[str, ...], rules):
    """In-specs of the scanned layer parameters [L, ...] for a loop manual over `axes`: layers over
    `stage`, experts over those of their axes (`expert`, and `fsdp` where the experts rest whole on its
    devices: `rules`) the loop is manual over (the MoE exchange runs inside); everything else enters whole
    (ZeRO-3 `fsdp` shards are gathered once, on entry)."""
    return _kept_specs(cfg, axes, rules, {"layers": STAGE})["layers"]


def outer_specs(cfg, axes: tuple[str, ...], rules) -> dict:
    """In-specs of the parameters outside the scanned layers for a loop manual over `axes`: whole, but for
    the experts of an MoE block among them (multi-token prediction's), split as `layer_specs` splits them."""
    return {k: v for k, v in _kept_specs(cfg, axes, rules, {}).items() if k != "layers"}


def _kept_specs(cfg, axes, rules, kept: dict) -> dict:
    experts = tuple(a for a in rules.split_axes("expert") if a in axes)
    kept = {**kept, **({"expert": experts[0] if len(experts) == 1 else experts} if experts else {})}
    return jax.tree.map(lambda box: P(*(kept.get(name) for name in box.names)),
                        model_lib.abstract_params(cfg), is_leaf=lambda x: isinstance(x, nn.Partitioned))


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
    # Under remat `none` the block is a remat too (`_stage_block`, keeping all but dtype and layout copies:
    # `model.copies_not_kept`): kept, the weights' compute-dtype copies would be held a micro-batch in
    # flight. Without one, jax 0.10's transpose of the layer scan inside the slot tables' `jax.vjp` also
    # types an MoE layer's router-statistic cotangent as varying over the batch axes and tracing fails.
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
    branches' x varies over every manual axis of the region, and the empty slot's zeros over what the unit's
    outputs vary over (a `lax.cond` needs equal types).

    The `lax.cond` sits in a `jax.checkpoint` with the model's remat policy: differentiated bare, a
    cond returns every residual of its branch as an output, the unit's weights among them (a copy of
    the stage's weights per micro-batch in flight); under the checkpoint the weights stay inputs and
    the residuals are what the policy saves, as without the cond."""
    policy = model_lib.REMAT_POLICIES.get(cfg.remat_policy, _none_policy(cfg))

    def body(x, scanned):
        variables, j = scanned
        real = j < jnp.asarray(counts, jnp.int32)[lax.axis_index(STAGE), chunk]
        manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
        # the outputs' types: the empty slot's zeros vary over what the unit's outputs vary over. Made varying
        # instead, an output invariant over some axes (a router statistic reduced over the batch axes) would
        # get its cotangent summed over them by the cast's transpose
        out = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(layer, x, variables)),
                                 jax.make_jaxpr(layer)(x, variables).out_avals)

        def like(a, aval):
            return vary(a, tuple(aval.manual_axis_type.varying))

        def run(x, variables):
            y, outputs = layer(x, variables)
            return vary(y, manual), jax.tree.map(like, outputs, out[1])

        def empty(x, variables):
            return vary(x, manual), jax.tree.map(lambda aval: like(jnp.zeros(aval.shape, aval.dtype), aval), out[1])
        with jax.named_scope(slot_program.EMPTY_SLOT_SCOPE):  # how the kernel model tells this cond from others
            return jax.checkpoint(lambda real, x, variables: lax.cond(real, run, empty, x, variables),
                                  policy=policy, prevent_cse=False)(real, x, variables)
    return body


def _none_policy(cfg):
    """A stage's remat policy under `none`: `model.copies_not_kept`. An MoE layer keeps everything: there the
    copies' policy keeps the dispatch's padding mask as a bool in the slot's forward but as its float32
    broadcasts where the stash's structure is traced (`Residuals.structure`), and the two must agree. (FP8
    is refused under `none`: `validate_config`.)"""
    return jax.checkpoint_policies.everything_saveable if cfg.num_experts else model_lib.copies_not_kept


def _stage_block(cfg, rules, attention_fn):
    """The stage's scanned unit (the model's block with its remat policy; under `none`, remat keeping all
    but dtype and layout copies: `model.copies_not_kept`), unbound."""
    if cfg.remat_policy == "none":
        block_class = nn.remat(model_lib.scan_unit(cfg)[0], policy=_none_policy(cfg), prevent_cse=False)
    else:
        block_class = model_lib.remat_block(cfg)
    return block_class(cfg, rules, attention_fn, parent=None)


@dataclasses.dataclass(frozen=True)
class SplitStage:
    """A stage's chunk of layers run for the split backward (zero bubble; playbook, "Zero Bubble"):

    * `forward(chunk, x, positions, segment_ids, probes, taps=None) -> ((x, stats), recorded)`: the
      forward whose vjp is B: every matmul's weight a constant, a zero probe added to its output (the
      probes' cotangents are the matmuls' output gradients), its input recorded for W, or, with
      `taps` (zeros shaped as the recorded inputs, `fp8.SPLIT_TAPS`), returned by the pullback as the
      taps' cotangents (recorded None);
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

        def forward(chunk, x, positions, segment_ids, probes, taps=None):
            def layer(x, scanned):
                variables, probe, tap = scanned
                if tap is not None:  # the inputs come back as the taps' gradients (B's pullback)
                    y, stats = block.apply({**variables, probes_key: probe, fp8_lib.SPLIT_TAPS: tap}, x,
                                           positions, segment_ids)
                    return y, (stats, None)
                (y, stats), recorded = block.apply({**variables, probes_key: probe}, x, positions, segment_ids,
                                                   mutable=[inputs])
                return y, (stats, recorded[inputs])
            x, (stats, recorded) = scan(layer, x, (chunk, probes, taps))
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
    Under FP8 the chunk's amaxes count only when `working` (a bubble tick runs on no micro-batch); outside
    it every token is padding (segment 0), so that an MoE router counts none of them in the expert loads
    its bias cotangent carries (`moe.choose_with_bias`, which autodiff's zero cotangent does not stop)."""
    def run(chunks, r, i, x, positions, segment_ids, working):
        chunk = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, r, 0, keepdims=False), chunks)
        if FP8 in chunk:
            chunk = {**chunk, FP8: jax.tree.map(lambda h: fp8_lib.recorded_if(h, working), chunk[FP8])}
        segments = lax.dynamic_index_in_dim(segment_ids, i, 1, keepdims=False)
        return stack(chunk, x, lax.dynamic_index_in_dim(positions, i, 1, keepdims=False),
                     jnp.where(working, segments, 0), r)
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
# The slot loops' shared frame: the stage's `shard_map`, its variables and its gradient reduction.
# ---------------------------------------------------------------------------------------------


def run_gradient_loop(loop, params, histories, batch, model, total_tokens, **static):
    """`loop`(stack, stage model, layers, outer params, micro-batches, total_tokens, *, p, m, axes, units,
    specs, outer_specs, aux_scale, **static) -> ({"loss": loss sum, and under multi-token prediction "mtp":
    its [sum, tokens]}, MoE stats, outer grads, layer grads), run in the pipeline's `shard_map` (the outer
    parameters whole but for an MoE block's experts, `outer_specs`; `aux_scale`: `unchecked_aux_scale`);
    returns the train step's (loss_sum, aux, grads, amaxes): the slot-table executor's
    frame (`pipeline_tables`). `layers` are the stage's variables (`stage_variables`: parameters, in several
    chunks a stage the matmul weights in the compute dtype, and under FP8 the amax histories, float32); its
    gradients are float32 gradient sums and largest amaxes."""
    pipe = model.pipeline
    inner = model.clone(rules=model.rules.with_manual(pipe.axes), pipeline=None,
                        attention_fn=ring_attention.in_conditional_slots(model.attention_fn))
    stack = stage_function(inner.cfg, inner.rules, inner.attention_fn, pipe.counts)
    outer = {k: v for k, v in params.items() if k != "layers"}
    micro = jax.tree.map(functools.partial(_split, m=pipe.microbatches), batch)
    units = moe_units(model.cfg)
    layers = {"params": params["layers"]}
    if pipe.repeats > 1:
        # several chunks a stage: every tick slices its chunk out of the [v, k, ...] stacks, so the stacks
        # hold the matmul weights in the compute dtype, cast once a step (`model.in_compute_dtype`): half
        # the slice's bytes and no cast per layer and micro-batch (405B on 16 H100 stages, v 4: the kernel
        # model's step 9.54 -> 8.06 s). With one chunk the layers are read whole, and the copy only adds
        # memory (the tiny zero-bubble acceptance point: temporaries 66.5 -> 78.5 MiB, 1F1B's 72.1 -> 75.6).
        layers = {"params": model_lib.in_compute_dtype(params["layers"], jnp.dtype(model.cfg.dtype))}
    specs = {"params": layer_specs(model.cfg, pipe.axes, model.rules)}
    o_specs = outer_specs(model.cfg, pipe.axes, model.rules)
    if histories:  # all of them belong to the layers: the embedding and the head are not quantised
        layers[FP8] = histories["layers"]
        specs[FP8] = jax.tree.map(lambda _: P(STAGE), histories["layers"])
    body = functools.partial(loop, stack, inner, p=pipe.stages, m=pipe.microbatches, axes=pipe.axes, units=units,
                             specs=specs, outer_specs=o_specs, aux_scale=unchecked_aux_scale(pipe, model.rules),
                             **static)
    sums, stats, outer_grads, layer_grads = jax.shard_map(
        body, in_specs=(specs, o_specs, pipe.micro_spec(0), P()), out_specs=(P(), P(), o_specs, specs),
        axis_names=set(pipe.axes), check_vma=pipe.checked,
    )(layers, outer, micro, total_tokens)
    grads = {**outer_grads, "layers": layer_grads["params"]}
    amaxes = {"layers": layer_grads[FP8]} if FP8 in layer_grads else {}
    aux, logged = moe_lib.loss_terms(stats or None, model.cfg)
    if "mtp" in sums:  # multi-token prediction's loss, logged as `Transformer.loss` logs it
        logged["mtp_loss"] = sums["mtp"][0] / jnp.maximum(sums["mtp"][1], 1.0)
    return (sums["loss"], {**aux, **logged}, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params),
            amaxes)


def moe_units(cfg) -> int:
    """The MoE units the router losses average over: the scanned units, and multi-token prediction's block
    in an MoE model (one more)."""
    return model_lib.scan_unit(cfg)[1] + (1 if cfg.mtp_depth and cfg.num_experts else 0)


def reduce_layer_grads(g_layers: dict, specs: dict, rest: tuple[str, ...]) -> dict:
    """A stage's layer gradient sums and amaxes, reduced over the loop's other axes once: a gradient
    summed over the axes its weight is replicated on (not the experts' own: `expert`, and `fsdp` where its
    devices own whole experts), an amax maximised."""
    out = {"params": reduce_grads(g_layers["params"], specs["params"], rest)}
    if FP8 in g_layers:
        out[FP8] = jax.tree.map(lambda a: lax.pmax(a, rest) if rest else a, g_layers[FP8])
    return out


def reduce_grads(grads, specs, axes: tuple[str, ...]):
    """Gradient sums each summed over those of `axes` its weight is replicated on (those its spec does not
    split it over)."""
    def split_on(spec: P) -> set[str]:
        return {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}

    return jax.tree.map(lambda g, spec: psum(g, tuple(a for a in axes if a not in split_on(spec))),
                        grads, specs, is_leaf=lambda x: isinstance(x, P))


def aux_cotangents(stats: dict, cfg, units: int, m: int, scale: float = 1.0) -> dict:
    """d(MoE losses) / d(one unit's stats of one micro-batch): the losses average the stats over the
    `units` MoE units and the `m` micro-batches (`moe.loss_terms`), so each is a constant; times `scale`
    (`unchecked_aux_scale`)."""
    weights = {"balance": cfg.aux_loss_weight, "z": cfg.router_z_loss_weight}
    return {k: jnp.full(v.shape, scale * weights.get(k, 0.0) / (units * m), v.dtype) for k, v in stats.items()}


def unchecked_aux_scale(pipe, rules) -> float:
    """The router statistics' cotangent scale in a slot-table loop: 1 where the loop is variance-checked; in
    an unchecked one (Pallas kernels in the stages) 1 / the devices of its other axes. A layer's statistics
    are psums over those axes (`moe.router_stats`: every device of the region holds the same), and the
    cotangent the loop sets on each device's copy is its share of the loss's: checked, a psum's transpose
    hands each device the cotangent as it is; unchecked it is a psum again, which counts every device's."""
    if pipe.checked:
        return 1.0
    return 1.0 / math.prod(rules.size(a) for a in pipe.axes if a != STAGE)


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


def psum(x, axes):
    return lax.psum(x, axes) if axes else x


def pmean(x, axes):
    return lax.pmean(x, axes) if axes else x


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
        stacked = config.model.n_layers - config.model.first_dense_layers
        req(tuple(pipe.layers_per_stage) in ((), (stacked,)), "pipeline.layers_per_stage",
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
    # the scanned stack's layers (the dense first ones run before it: on stage 0 under a slot table)
    n_layers, given = config.model.n_layers - config.model.first_dense_layers, tuple(pipe.layers_per_stage)
    chunked = pipe.schedule in CHUNKED_SCHEDULES and v > 1
    if given:
        entries = f"chunk: mesh.stage*pipeline.repeats={p}*{v}" if chunked else f"stage: mesh.stage={p}"
        req(len(given) == p * (v if chunked else 1), "pipeline.layers_per_stage", given,
            f"needs one entry per {entries}")
        req(all(isinstance(n, int) and n >= 0 and n % unit == 0 for n in given), "pipeline.layers_per_stage", given,
            "entries must be integers >= 0" + (f" and multiples of model.moe_every={unit}" if unit > 1 else ""))
        req(sum(given) == n_layers, "pipeline.layers_per_stage", given,
            f"must sum to model.n_layers={config.model.n_layers}"
            + (f" - model.first_dense_layers={config.model.first_dense_layers}" if config.model.first_dense_layers
               else "") + f" (it sums to {sum(given)})")
    req(bool(given) or n_layers // unit >= p, "model.n_layers", n_layers,
        f"its {n_layers // unit} scanned units of {unit} layer(s) are fewer than mesh.stage={p}: every stage "
        "needs one (or give pipeline.layers_per_stage with empty stages)")
    # A stage's remat that keeps the FP8 operands for the backward (everything but copies) makes JAX's
    # partial evaluation of it compute the step's loss as NaN (a `reduce_precision` to e4m3 of an unclipped
    # value, `fp8.scaled_dot` under `jax.checkpoint(..., policy=everything_saveable)`); one that makes them
    # again keeps float32 copies of the weights instead, one a micro-batch in flight
    req(not (config.model.matmul_precision == "fp8" and (config.model.first_dense_layers or config.model.mtp_depth)),
        "model.matmul_precision", "fp8", "FP8 amax histories ride through a pipeline for the layer stack only: not "
        "with model.first_dense_layers or model.mtp_depth (their blocks run outside it) and mesh.stage > 1")
    req(not (config.model.matmul_precision == "fp8" and config.remat.policy == "none"), "remat.policy", "none",
        "FP8 matmuls in a pipeline need a policy that recomputes their FP8 operands: 'selective', 'attention', "
        "'full' or 'offload' (under 'none' the stage keeping them computes the loss as NaN)")
    units = stage_layers(n_layers // unit, p, tuple(n // unit for n in given), v if chunked else 1)
    if len(set(units)) > 1:
        chunk_units = max(units)
        slots = pipe.schedule in TABLE_SCHEDULES
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
