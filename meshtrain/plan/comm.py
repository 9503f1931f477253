"""Communication model per step: the collectives meshtrain's step runs, and the bytes per mesh axis.

Playbook, appendix A0 (ring collectives) and A3 ("Math for Compute/Communication Overlap"),
applied to meshtrain's implementation (`train_step.py`, `model.py`, `sharding_rules.py`):

* batch axes (`data`, `fsdp`, `expert` for dense layers, and `sequence`, over which the
  parameters are replicated): gradient all-reduce; under ZeRO a reduce-scatter over ZeRO's axes
  (`fsdp`, and `sequence` when it splits: `sharding_rules.ZERO_AXES`) first, then the all-reduce
  of the shard over the other axes; with a pipeline the layer gradients once per step (the stage
  loop is manual over the batch axes);
* ZeRO-1/2: all-gather of the updated parameters over ZeRO's axes; ZeRO-3: all-gather of every
  weight in the forward pass and of each rematerialised layer again in the backward pass,
  per micro-batch (the playbook's 3 Psi against 2 Psi);
* `tensor`: two all-reduces of the [t, D] residual per layer forward (attention and MLP
  row-parallel outputs), their transposes backward; with sequence parallelism each becomes
  reduce-scatter + all-gather;
* `sequence`: ring attention passes the K/V block s-1 times per layer forward, and K/V plus
  their gradients backward; Ulysses four all-to-alls per layer forward (q, k, v, output) and
  their transposes backward, a ring across its groups when it has several; `stage`: one
  activation forward and one gradient backward per
  pipeline tick; `expert`: all-to-all dispatch and combine per MoE layer, forward and back.

Bytes are what each device sends. A collective over several axes is attributed axis by axis
as the hierarchical algorithm moves it (innermost, fastest axis first: reduce-scatter there,
the reduced shard over the next axis, ...), so per-axis bytes add up to the flat ring's total.

The playbook's A3 is corrected where its arithmetic is off: its data-parallel ratio
t_comm / t_compute = num_params / (2 num_tokens) ... keeps a stray num_params (the parameters
cancel: the ratio is (DP-1)/DP * peak_flops / (2 num_tokens peak_bw) in elements); ZeRO-3's
"all-gather 16h^2/DP bytes per rank" and TP's "seq mbs h / TP bytes per rank" are what each
rank *holds*: a ring all-gather sends (N-1)/N of the gathered buffer per rank, as the same
section's own t_comm formulas use (and elements, times 2 for bf16 bytes).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

from meshtrain.mesh import MESH_ORDER
from meshtrain.parallel import schedules
from meshtrain.plan.memory import Step, dtype_bytes, local_size, param_table
from meshtrain.sharding_rules import ZERO_AXES

# schedules whose loop computes loss and gradients itself (the slot-table executor, no autodiff of a tick loop)
SLOT_SCHEDULES = schedules.TABLE_SCHEDULES


@dataclasses.dataclass(frozen=True)
class Backend:
    """What the compiler emits. GPU: reduce-scatters as such.

    The CPU backend (used by `--verify`) writes the partitioner's reduce-scatters (ZeRO-3, sequence
    parallelism) as all-reduce + dynamic-slice, and runs bf16 collectives in float32; a
    reduce-scatter written by hand (`lax.psum_scatter`) stays one.
    """

    name: str = "gpu"
    reduce_scatter_as_all_reduce: bool = False
    min_collective_bytes: int = 1


GPU = Backend()
CPU = Backend("cpu", reduce_scatter_as_all_reduce=True, min_collective_bytes=4)


@dataclasses.dataclass(frozen=True)
class Coll:
    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    full_bytes: float  # all-reduce/all-to-all: buffer; all-gather: output; reduce-scatter: input
    axes: dict[str, int]
    count: float
    what: str
    manual: bool = False  # written by hand in a shard_map (a reduce-scatter stays one on every backend)


def attribute(kind: str, full_bytes: float, axes: dict[str, int]) -> dict[str, float]:
    """Bytes one device sends for a ring collective over `axes`, split per axis (innermost first)."""
    if kind == "collective-permute":
        return {a: full_bytes / len(axes) for a in axes}
    factor = 2.0 if kind == "all-reduce" else 1.0
    out, inner = {}, 1
    for axis in sorted(axes, key=MESH_ORDER.index, reverse=True):
        k = axes[axis]
        out[axis] = factor * (k - 1) / k * full_bytes / inner
        inner *= k
    return out


@functools.lru_cache(maxsize=1 << 16)
def _spec_axes(leaf, rules) -> frozenset[str]:
    spec = rules.spec(leaf.names, leaf.shape, what=leaf.path)
    return frozenset(a for e in spec if e for a in ((e,) if isinstance(e, str) else e))


def _gradient_and_zero(run: Step, remat: str, backend: Backend) -> list[Coll]:
    s, place = run.sizes, run.placement()
    pb = max(dtype_bytes(run.model.param_dtype), backend.min_collective_bytes)
    batch_axes = [a for a in ("data", "fsdp", "expert", "sequence") if s[a] > 1]
    per_micro = run.grad_accum if run.zero_stage >= 3 else 1  # ZeRO-3 has no manual accumulation loop
    out = []
    pipelined = s["stage"] > 1
    slot_table = pipelined and run.pipeline_schedule in SLOT_SCHEDULES
    for leaf in param_table(run.stored_model):
        runs = per_micro
        full = local_size(leaf, place["compute"]) * pb
        used = _spec_axes(leaf, place["compute"])
        reduce = {a: s[a] for a in batch_axes if a not in used}
        if (pipelined and leaf.in_layers) or slot_table:
            # A pipeline's loop is manual over every batch axis and the weights enter it per device:
            # each layer gradient is all-reduced once, as the loop's input is transposed. The slot-table loop
            # also holds the embedding, final norm and head: theirs are reduced with `stage` (first and
            # last stage meet). Under ZeRO-3 the weights are gathered once, as they enter.
            axes = reduce if leaf.in_layers else {"stage": s["stage"], **reduce}
            if axes:
                out.append(Coll("all-reduce", full, axes, 1, f"grad {leaf.path}"))
            reduce = {}
            runs = 1
        # ZeRO's axes (`sharding_rules.ZERO_AXES`: sequence, fsdp, expert) that this leaf's state is split on
        # beyond its compute sharding (an expert weight's `expert` split is not ZeRO's)
        zero = {a: s[a] for a in ZERO_AXES if a in reduce and a in _spec_axes(leaf, place["grads"])}
        by_hand = run.zero_stage < 3  # the accumulation loop's psum_scatter; ZeRO-3's comes from the partitioner
        if zero:
            out.append(Coll("reduce-scatter", full, zero, runs, f"grad {leaf.path}", by_hand))
            rest = {a: n for a, n in reduce.items() if a not in zero}
            if rest:
                out.append(Coll("all-reduce", full / math.prod(zero.values()), rest, runs, f"grad {leaf.path}"))
        elif reduce:
            out.append(Coll("all-reduce", full, reduce, runs, f"grad {leaf.path}"))
        gathered = {a: s[a] for a in ZERO_AXES if s[a] > 1 and a not in used}
        if gathered and run.zero_stage in (1, 2) and set(gathered) & _spec_axes(leaf, place["optimizer"]):
            axes = {a: n for a, n in gathered.items() if a in _spec_axes(leaf, place["optimizer"])}
            out.append(Coll("all-gather", full, axes, 1, f"updated {leaf.path}"))
        if gathered and run.zero_stage >= 3 and set(gathered) & _spec_axes(leaf, place["params"]):
            axes = {a: n for a, n in gathered.items() if a in _spec_axes(leaf, place["params"])}
            passes = 2 if (leaf.in_layers and remat != "none" and not pipelined) else 1
            out.append(Coll("all-gather", full, axes, passes * runs, f"gather {leaf.path}"))
    return out


def _activations(run: Step, remat: str, backend: Backend) -> list[Coll]:
    s, m = run.sizes, run.model
    a = max(dtype_bytes(m.dtype), backend.min_collective_bytes)
    t = run.micro_tokens
    layers = run.stored_model.stacked_layers // s["stage"]  # the largest stage's
    micro = run.grad_accum
    x = t * m.d_model * a  # the [t, D] residual of one micro-batch on one device
    out = []
    if s["tensor"] > 1:
        tp = {"tensor": s["tensor"]}
        backward = 2  # the fused q,k,v and gate,up projections: one input gradient each (`model.column_parallel`)
        # full remat recomputes the layer forward in the backward: the attention output's reduction is
        # needed again (the MLP input depends on it), the layer's final MLP reduction is not (dead code).
        recompute = 1 if remat == "full" else 0
        reductions = layers * (2 + backward + recompute) + 1  # + the vocabulary-split head's input-gradient
        if s["stage"] > 1 and run.pipeline_schedule in SLOT_SCHEDULES and not m.sequence_parallel:
            # each stage runs m forward slots (a jax.vjp whose residuals wait for the backward) and m
            # backward slots (from the residuals; under full remat each layer's forward is recomputed
            # first) on one micro-batch each; idle slots are skipped. The last stage's forward slots
            # add the vocabulary-split head's input-gradient. Under the split backward (zero bubble)
            # B holds the input gradients and their reductions; W's weight GEMMs reduce
            # nothing, W as the pullback again runs the backward's reductions a second time.
            again = backward if _pullback_w(run) else 0
            per_micro = layers * (2 + backward + recompute + again)
            count = per_micro * run.microbatches + run.microbatches / s["stage"]
            out.append(Coll("all-reduce", x // run.microbatches, tp, count, "TP all-reduce"))
        elif m.sequence_parallel:
            gathers = layers * (4 + (2 if remat != "none" else 0)) + 1
            rs_kind = "all-reduce" if backend.reduce_scatter_as_all_reduce else "reduce-scatter"
            out.append(Coll(rs_kind, x, tp, reductions * micro, "SP reduce-scatter"))
            out.append(Coll("all-gather", x, tp, gathers * micro, "SP all-gather"))
        else:
            out.append(Coll("all-reduce", x, tp, reductions * micro, "TP all-reduce"))
    u, n = run.context  # Ulysses' all-to-all group, the K/V ring
    if u > 1:  # q, k, v and the output forward, their transposes backward, the forward again under remat
        qkvo = t * (2 * m.n_heads + 2 * m.n_kv_heads) // s["tensor"] * m.head_dim * a
        passes = 2 + (1 if remat != "none" else 0)
        out.append(Coll("all-to-all", qkvo, {"sequence": u}, layers * passes * micro, "Ulysses q, k, v, output"))
        out.append(Coll("all-gather", u * t * 4, {"sequence": u}, micro, "Ulysses segment ids"))
    if n > 1:
        kv = 2 * t * (m.n_kv_heads // s["tensor"]) * m.head_dim * a
        # forward ring (N-1 K/V hops), again when the layer is recomputed (a ring of two: the backward's
        # hop, merged), the backward ring's K/V (N-1) and its dK/dV, which travel one more hop home (N).
        # Under Ulysses the ring joins the groups: N of them, blocks U times longer over 1/U of the heads.
        if s["stage"] > 1 and run.pipeline_schedule in SLOT_SCHEDULES:
            # inside slot-table ticks: one all-gather of the blocks forward, one backward (the recomputed
            # forward shares it), and one reduce-scatter of dK/dV, written by hand (under the split
            # backward in B: W runs no attention, or, as the pullback again, the backward's pair again)
            seq = {"sequence": n}
            backs = 2 if _pullback_w(run) else 1
            out.append(Coll("all-gather", kv * n, seq, layers * (1 + backs) * micro, "ring K/V (gathered)",
                            manual=True))
            out.append(Coll("reduce-scatter", kv * n, seq, layers * backs * micro, "ring dK/dV (scattered)",
                            manual=True))
        else:
            hops = (n - 1) * (2 + (1 if remat != "none" and n > 2 else 0)) + n
            out.append(Coll("collective-permute", kv, {"sequence": n}, layers * hops * micro, "ring K/V"))
    if s["stage"] > 1:
        xm = x * run.grad_accum // run.microbatches
        if m.sequence_parallel and s["tensor"] > 1:  # the activation leaves a stage split over `tensor` along its
            xm //= s["tensor"]  # length (405B on TP 8, compiled for H100s: bf16[1,1024,16384] per device, 32 MiB)
        p = s["stage"]
        # 1F1B's transfers do not wrap around (the last stage sends nowhere): p - 1 of p devices send;
        # nor do zero_bubble's; interleaved_1f1b's do (stage p-1 feeds stage 0 its next chunk). The
        # slot-table loop moves an activation and a gradient each tick, or one of them in one ppermute
        # (`Pipeline.transfers`)
        wraps = schedules.REGISTRY[run.pipeline_schedule].wraps or run.pipeline_schedule not in SLOT_SCHEDULES
        share = 1.0 if wraps else (p - 1) / p
        out.append(Coll("collective-permute", xm * share, {"stage": p}, run.pipeline.transfers[0],
                        "pipeline activations"))
        if run.pipeline_schedule not in SLOT_SCHEDULES:  # the stack's output summed over `stage`, and its gradient
            out.append(Coll("all-reduce", x, {"stage": s["stage"]}, 2, "pipeline output"))
    if m.num_experts and run.ep > 1:
        tokens = t * m.experts_per_token * (1.0 if m.moe_dropless else m.capacity_factor)
        moe_layers = math.ceil(layers / m.moe_every) if s["stage"] > 1 else m.moe_layers
        # dispatch and return, forward and backward; a rebuilt forward (full remat) exchanges again
        passes = 6 if remat in ("full", "offload") else 4
        out.append(Coll("all-to-all", tokens * m.d_model * a, run.expert_axes, passes * moe_layers * micro, EXCHANGE))
    return out


EXCHANGE = "expert dispatch/combine"  # the MoE exchange's `Coll.what`


def step_collectives(run: Step, remat: str, backend: Backend = GPU) -> list[Coll]:
    """Every collective of one optimizer step, with how many times it runs."""
    colls = _gradient_and_zero(run, remat, backend) + _activations(run, remat, backend)
    if backend.reduce_scatter_as_all_reduce:
        colls = [dataclasses.replace(c, kind="all-reduce") if c.kind == "reduce-scatter" and not c.manual else c
                 for c in colls]
    return colls


def bytes_by_axis(colls: list[Coll]) -> dict[str, float]:
    total: dict[str, float] = collections.defaultdict(float)
    for c in colls:
        for axis, nbytes in attribute(c.kind, c.full_bytes, c.axes).items():
            total[axis] += nbytes * c.count
    return dict(total)


def _pullback_w(run) -> bool:
    """Whether the slot table's W runs the stage's pullback again (`pipeline.split_backward=pullback`)."""
    return run.pipeline_schedule in schedules.SPLIT_BACKWARD and run.split_backward == "pullback"
