"""The bytes a step must move, axis by axis: the playbook's minimum, and the figures of named choices.

`bench/comm.py` sets these beside the compiler's bytes (`verify.compiler_bytes`). Each figure is a
`Term`: bytes one device sends per step over one mesh axis, with its formula and its kind:

* "minimum": what the playbook's algorithm must send (appendix A0's ring collectives; sections
  "Data Parallelism", "ZeRO", "Tensor Parallelism", "Context Parallelism", "Pipeline
  Parallelism", "Expert parallelism");
* "choice": what a design choice adds beyond that minimum, named with its memory or schedule
  price (e.g. ZeRO-3 re-gathering the weights for each micro-batch instead of keeping them);
* "cpu": what XLA:CPU emits where the GPU compiler emits the minimum (the ledger runs on CPU:
  its partitioner writes a reduce-scatter as all-reduce + slice, and does not sum a layer's
  input gradients before reducing them).

Notation: N_a the size of axis a; Psi_l the bytes of parameter l on one device (after the tensor,
stage and expert splits; float32 gradients); A gradient-accumulation steps; x the [tokens, D]
residual of one device's micro-batch; L the layers on one stage; p stages, m micro-batches, v
repeats. A ring all-reduce over N devices sends 2(N-1)/N of its buffer per device, an all-gather
or reduce-scatter (N-1)/N of the whole; a reduction over several axes runs hierarchically (the
innermost axis at full size, the next on the reduced shard: `comm.attribute`).

The playbook's A3 arithmetic is corrected where it is off (see `comm.py`'s module docstring).
"""

from __future__ import annotations

import collections
import dataclasses
import math

from meshtrain.parallel import schedules
from meshtrain.plan.comm import SLOT_SCHEDULES, attribute
from meshtrain.plan.memory import Step, dtype_bytes, local_size, param_table
from meshtrain.sharding_rules import ZERO_AXES

BATCH = ("data", "fsdp", "expert", "sequence")


@dataclasses.dataclass(frozen=True)
class Term:
    axis: str
    kind: str  # minimum | choice | cpu
    what: str
    formula: str
    bytes: float


def _ring(n: int) -> float:
    return (n - 1) / n


def _axes(spec) -> set[str]:
    return {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}


class Ledger:
    """The terms of one configured step (`Step` from the config and the mesh sizes)."""

    def __init__(self, step: Step, remat: str, schedule: str, cpu: bool = True):
        self.step, self.remat, self.schedule, self.cpu = step, remat, schedule, cpu
        self.s = step.sizes
        self.terms: list[Term] = []
        # the slot-table executor (`schedules.TABLE`): the embedding and the head run on the first and last stage
        self._slots = schedules.REGISTRY[schedule].loop == schedules.TABLE

    def add(self, axis: str, kind: str, what: str, formula: str, nbytes: float) -> None:
        if nbytes > 0 and self.s.get(axis, 1) > 1:
            self.terms.append(Term(axis, kind, what, formula, nbytes))

    def by_axis(self, kinds: tuple[str, ...] = ("minimum", "choice", "cpu")) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for t in self.terms:
            if t.kind in kinds:
                out[t.axis] += t.bytes
        return dict(out)

    @classmethod
    def of(cls, config, sizes: dict[str, int], cpu: bool = True) -> Ledger:
        ledger = cls(Step.from_config(config, sizes), config.remat.policy, config.pipeline.schedule, cpu)
        ledger.gradients()
        ledger.tensor()
        ledger.sequence()
        ledger.stage()
        ledger.expert()
        return ledger

    # ---- gradients and ZeRO ------------------------------------------------------------------

    def gradients(self) -> None:
        """Data parallelism and ZeRO: each parameter's gradient reduced over the batch axes it is
        replicated on, once per step; ZeRO's reduce-scatters and gathers over its axes (`sequence`
        and `fsdp`, `sharding_rules.ZERO_AXES`), each axis's share as the hierarchical ring moves it."""
        st, s = self.step, self.s
        place = st.placement()
        a, z = st.grad_accum, st.zero_stage
        # the slot tables keep the embedding/norm/head on every stage: their gradients are summed over stage too
        outer_over_stage = self._slots and s["stage"] > 1
        grouped: dict[tuple, float] = collections.defaultdict(float)
        for leaf in param_table(st.stored_model):
            psi = local_size(leaf, place["compute"]) * 4
            used = _axes(place["compute"].spec(leaf.names, leaf.shape))
            reduce = tuple(x for x in BATCH if s[x] > 1 and x not in used)
            if outer_over_stage and not leaf.in_layers:  # mesh order: stage sits between data and fsdp
                reduce = tuple(x for x in ("data", "stage") + BATCH[1:] if x in reduce or x == "stage")
            sharded = _axes(place["optimizer"].spec(leaf.names, leaf.shape)) if z >= 1 else set()
            zero = tuple(x for x in ZERO_AXES if x in reduce and x in sharded)
            rest = tuple(x for x in reduce if x not in zero)
            grouped[(reduce, rest, zero, z >= 3 and bool(zero), leaf.in_layers)] += psi
        for (reduce, rest, zero, zero3, in_layers), psi in grouped.items():
            where = "layer" if in_layers else "embedding/norm/head"
            if not zero:
                for axis, b in attribute("all-reduce", psi, dict((x, s[x]) for x in reduce)).items():
                    self._reduction(axis, b, f"{where} gradient all-reduce",
                                    f"2(N-1)/N Psi over {'x'.join(reduce)}, hierarchical")
                continue
            group = {x: s[x] for x in zero}
            nz, names = math.prod(group.values()), "x".join(zero)
            self._zero(group, "minimum", f"{where} gradient reduce-scatter over {names}", "(N_z-1)/N_z Psi", psi)
            if zero3 and a > 1:
                self._zero(group, "choice", f"{where} gradient reduce-scatter per micro-batch",
                           "(A-1)(N_z-1)/N_z Psi: gradient shards accumulate (a whole-size accumulator would "
                           "cost Psi (1-1/N_z) of memory)", (a - 1) * psi)
            for axis, b in attribute("all-reduce", psi / nz, dict((x, s[x]) for x in rest)).items():
                self._reduction(axis, b, f"{where} gradient shard all-reduce",
                                f"2(N-1)/N Psi/N_z over {'x'.join(rest)}")
            if not zero3:
                self._zero(group, "minimum", f"{where} updated-parameter all-gather (ZeRO-1/2) over {names}",
                           "(N_z-1)/N_z Psi", psi)
                continue
            self._zero(group, "minimum", f"{where} weight all-gathers (ZeRO-3: forward, backward) over {names}",
                       "2 (N_z-1)/N_z Psi", 2 * psi)
            if a > 1:
                self._zero(group, "choice", f"{where} weights re-gathered per micro-batch",
                           "2(A-1)(N_z-1)/N_z Psi (keeping them gathered would cost Psi (1-1/N_z) of memory)",
                           2 * (a - 1) * psi)
            if self.cpu and s["stage"] == 1:
                self._zero(group, "cpu", f"{where} reduce-scatter written as all-reduce + slice",
                           "A (N_z-1)/N_z Psi (the GPU compiler's ReduceScatterCreator forms a reduce-scatter)",
                           a * psi)

    def _zero(self, group: dict[str, int], kind: str, what: str, formula: str, nbytes: float) -> None:
        """A ZeRO gather or reduce-scatter of `nbytes` over the ZeRO axes `group`, axis by axis."""
        for axis, b in attribute("all-gather", nbytes, group).items():
            self.add(axis, kind, what, formula, b)

    def _reduction(self, axis: str, nbytes: float, what: str, formula: str) -> None:
        """A gradient reduction's share on `axis`: the playbook's minimum over the batch axes; over
        `stage` (the slot tables' embedding/norm/head, present on every stage) a choice of the schedule."""
        if axis == "stage":
            self.add(axis, "choice", "embedding/norm/head gradients summed over stage",
                     f"{formula} (the slot tables keep them on every stage; the hierarchical reduction crosses stage "
                     "with the shard the batch axes inside it leave)", nbytes)
        else:
            self.add(axis, "minimum", what, formula, nbytes)

    # ---- activations -------------------------------------------------------------------------

    def _x(self) -> float:
        st = self.step
        return st.micro_tokens * st.model.d_model * dtype_bytes(st.model.dtype) * 1.0

    def tensor(self) -> None:
        """Megatron TP: per layer two all-reduces of x forward (attention and MLP outputs), two
        backward (their inputs' gradients); with SP each is a reduce-scatter + all-gather (same bytes).
        The vocabulary-split head adds its input gradient and the cross-entropy's per-token
        max / sum-exp / target (three reductions of [tokens] floats)."""
        st, s = self.step, self.s
        nt = s["tensor"]
        if nt == 1:
            return
        a, layers, x = st.grad_accum, st.stored_model.stacked_layers // s["stage"], self._x()
        # the head: on every device, except under the slot tables, where only the last stage runs it (1/p per device)
        head, per = (1 / s["stage"], "/p") if self._slots and s["stage"] > 1 else (1, "")
        count = a * (4 * layers + head)
        self.add("tensor", "minimum", "TP/SP activation reductions", f"A (4L+1{per}) 2(N_t-1)/N_t x",
                 count * 2 * _ring(nt) * x)
        lse = a * head * 3 * st.micro_tokens * 4
        self.add("tensor", "minimum", "vocab-parallel cross-entropy", f"A 3{per} 2(N_t-1)/N_t tokens 4B",
                 2 * _ring(nt) * lse)
        if self.remat == "full":
            self.add("tensor", "choice", "full remat re-runs the attention output's reduction",
                     "A L 2(N_t-1)/N_t x", a * layers * 2 * _ring(nt) * x)
        if not st.model.sequence_parallel:
            return
        if self.remat != "none":
            self.add("tensor", "choice", "remat re-gathers the attention and MLP inputs in the backward",
                     "A 2L (N_t-1)/N_t x (keeping them costs 2L x (N_t-1)/N_t of activation memory)",
                     a * 2 * layers * _ring(nt) * x)
        if self.cpu:
            self.add("tensor", "cpu", "SP reduce-scatters written as all-reduce + slice",
                     f"A (4L+1{per}) (N_t-1)/N_t x", count * _ring(nt) * x)

    def sequence(self) -> None:
        """Context parallelism (playbook, "Context Parallelism").

        Ring attention: K/V pass N-1 hops forward; backward K/V N-1 hops and dK/dV N hops (home).
        Inside slot-table ticks the blocks move by all-gather and dK/dV by reduce-scatter (`ring_attention`'s
        gathered transport): dK/dV cost N-1 blocks, and the backward's one gather serves the recomputed
        forward too (the compiler merges the two identical gathers). Remat re-runs the forward ring in
        the backward, except on a ring of two, whose backward hop is the forward's (merged).

        Ulysses over groups of U: four all-to-alls per layer forward (q, k, v, output), their transposes
        backward, each (U-1)/U of its buffer; the segment ids all-gathered once per micro-batch. With
        U < N a ring of R = N / U groups follows, its blocks U times longer over 1/U of the heads: the
        same bytes as a ring block of N devices, over R hops.
        """
        st, s = self.step, self.s
        u, r = st.context
        if u * r == 1:
            return
        m = st.model
        a, tp = dtype_bytes(m.dtype), s["tensor"]
        per = st.grad_accum * (st.stored_model.stacked_layers // s["stage"])
        if u > 1:
            qkvo = st.micro_tokens * (2 * m.n_heads + 2 * m.n_kv_heads) // tp * m.head_dim * a
            self.add("sequence", "minimum", "Ulysses all-to-alls of q, k, v and the output, and their transposes",
                     "A L 2 (U-1)/U (2H + 2K)/N_t d_h t", per * 2 * _ring(u) * qkvo)
            self.add("sequence", "minimum", "Ulysses segment-id all-gather (int32, every layer's)", "A (U-1) t 4B",
                     st.grad_accum * (u - 1) * st.micro_tokens * 4)
            if self.remat != "none":
                self.add("sequence", "choice", "remat re-runs the forward all-to-alls in the backward",
                         "A L (U-1)/U (2H + 2K)/N_t d_h t", per * _ring(u) * qkvo)
        if r == 1:
            return
        kv = 2 * st.micro_tokens * (m.n_kv_heads // tp) * m.head_dim * a
        if self.schedule in SLOT_SCHEDULES and s["stage"] > 1:
            self.add("sequence", "minimum", "gathered K/V and reduce-scattered dK/dV", "A L 3 (R-1) kv",
                     per * 3 * (r - 1) * kv)
            return
        self.add("sequence", "minimum", "ring K/V and dK/dV", "A L ((R-1) + (R-1) + R) kv", per * (3 * r - 2) * kv)
        if self.remat != "none" and r > 2:
            self.add("sequence", "choice", "remat re-runs the forward ring in the backward",
                     "A L (R-1) kv", per * (r - 1) * kv)

    def stage(self) -> None:
        """Pipeline: each micro-batch's activation crosses each stage boundary once forward, its
        gradient once backward: 2 m (p v - 1)/p act per device on average."""
        st, s = self.step, self.s
        p = s["stage"]
        if p == 1:
            return
        entry = schedules.REGISTRY[self.schedule]
        v = st.pipeline_repeats if entry.chunked and entry.loop == schedules.AUTODIFF else 1
        m = st.microbatches
        act = self._x() * st.grad_accum / m
        self.add("stage", "minimum", "activations and their gradients", "2 m (p v - 1)/p act",
                 2 * m * (p * v - 1) / p * act)
        ticks = v * m + p - 1
        if self._slots:  # the slot-table executor's permutes (`Pipeline.transfers`): every tick, idle ones too
            count = st.pipeline.transfers[0]
            share = 1.0 if entry.wraps else (p - 1) / p
            self.add("stage", "choice", "a permute every tick, idle warm-up/cool-down ticks included",
                     "T share act - minimum (T the loop's permutes: one or two a tick; one SPMD program: every "
                     "device takes part in every tick)", max(0.0, count * share * act - 2 * m * (p * v - 1) / p * act))
        else:
            self.add("stage", "choice", "a permute every tick on every stage, the wrap-around included",
                     "2 (v m + p - 1) act - minimum (the ring-buffer loop)",
                     2 * ticks * act - 2 * m * (p * v - 1) / p * act)
            self.add("stage", "choice", "stack output all-reduced over stage, and its gradient",
                     "2 2(p-1)/p x (the head runs replicated over stage)", 2 * 2 * _ring(p) * self._x())

    def expert(self) -> None:
        """EP: dispatch and combine all-to-alls forward, their transposes backward, per MoE layer."""
        st, s = self.step, self.s
        ne, m = st.ep, st.model
        if ne == 1 or not m.num_experts:
            return
        layers = math.ceil(st.stored_model.stacked_layers // s["stage"] / m.moe_every)
        slots = st.micro_tokens * m.experts_per_token * (1.0 if m.moe_dropless else m.capacity_factor)
        buf = slots * m.d_model * dtype_bytes(m.dtype)
        # over the experts' axes (`expert`, and `fsdp` where its devices own whole experts), split per axis as
        # a ring collective's bytes are (`comm.attribute`)
        shares = {a: n / _ring(ne) for a, n in attribute("all-to-all", 1.0, st.expert_axes).items()}
        minimum = st.grad_accum * layers * 4 * _ring(ne) * buf
        worst = ne * min(m.experts_per_token, m.num_experts // ne) / m.experts_per_token
        for axis, share in shares.items():
            self.add(axis, "minimum", "dispatch/combine all-to-alls", "A L_moe 4 (N_e-1)/N_e k cf tokens D",
                     share * minimum)
            if m.moe_dropless:
                self.add(axis, "choice", "dropless buffers sized for the worst case",
                         "(N_e min(k, E/N_e)/k - 1) x minimum (no ragged all-to-all on XLA:CPU; the counts travel "
                         "beside them)", share * (worst - 1) * minimum)
