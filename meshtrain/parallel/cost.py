"""The pipeline step as the SPMD loop executes it: lock-step ticks, each as long as its slowest stage.

Playbook, "Pipeline Parallelism". The schedules' tables (`schedules.simulate`, and
`schedules.executed` for the tables the trainer runs) count ticks as if every operation cost one
unit; the loops that run them (`pipeline.py`, `pipeline_tables.py`) are one SPMD program in which
every tick ends at a `ppermute` all stages take part in. A tick therefore lasts as long as the
slowest branch any stage runs in it, plus the transfer after it (the next tick reads what it sends:
nothing hides it). With `pipeline.overlap_transfers` a transfer travels beside the next slot's
compute and a slot lasts the longer of the two. This module prices that execution:

    costs = BranchCosts.from_compiler(config, sizes, gpu)     # XLA's cost analysis of each branch
    modeled = step_time(schedule, p=4, m=16, v=1, costs)       # seconds per step, as executed

Branches, per stage and micro-batch (a chunk of 1/v of the stage's layers under interleaving):

* F: the forward, keeping its vjp residuals (the split's F also records every matmul's input);
* B: the fused backward (input and weight gradients, added to the float32 gradient sums): 1f1b,
  interleaved_1f1b (in ticks of forwards alternating with ticks of backwards, `schedules.alternating`),
  and gpipe / circular's transposed loop (which also recomputes the forward under remat);
* B split (zero_bubble): the pullback for the input gradient only (every matmul's
  weight a constant); W: each matmul's weight GEMM from its recorded input and output gradient
  (`pipeline.SplitStage`), added to the sums, run as `weight_parts` operations on slices of the
  chunk's layers when W is the longest branch (`weight_parts` picks how many); overlapped, one W over
  the `pipeline.weight_span` B's of its loop step (`BranchCosts.weights_over`: the sums added once).

`BranchCosts.from_compiler` compiles each branch on one CPU device as the loops run it and prices
it on a GPU by the roofline: the larger of XLA's FLOP count (one scanned unit's, times the stage's
units: the analysis counts a loop's body once) at the bf16 peak and the bytes the branch must read
and write (its arguments and results) at HBM bandwidth. On micro-batches of a few hundred tokens
every branch is bound by those bytes: the float32 weights read by F and B, the float32 gradient sums
read and written by W (and the fused B), which makes W about two forwards. `BranchCosts.measured`
runs each branch on a device and times it instead (`bench/gpu/pipeline_branches.py` on a GPU).
`BranchCosts.analytic` gives the same structure from the planner's compute estimate (F = a third of
a micro-batch's forward + backward).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.extend import core as jex_core

from meshtrain import compile_cache
from meshtrain.parallel import schedules

SCHEDULES = tuple(schedules.REGISTRY)


@dataclasses.dataclass(frozen=True)
class BranchCosts:
    """Seconds of one stage's branches on one micro-batch, for the whole stage (v = 1): a chunk of an
    interleaved stage costs 1/v of them. `transfer`: one activation to the neighbour stage."""

    forward: float
    backward: float  # fused: input and weight gradients
    input_grad: float  # split (zero_bubble's B)
    weight_grad: float  # split (zero_bubble's W): the weight GEMMs
    transfer: float = 0.0
    recompute: bool = True  # gpipe / circular recompute the stage's forward in their backward (remat per stage)
    split_forward: float | None = None  # F of the split backward (it also records the matmul inputs); None: `forward`
    # (n, seconds of one W over n micro-batches' records, `pipeline.weight_span`: the sums read and written once)
    weight_grad_span: tuple[int, float] | None = None

    @property
    def forward_split(self) -> float:
        return self.forward if self.split_forward is None else self.split_forward

    def weights_over(self, span: int) -> float:
        """Seconds of one W over `span` micro-batches (`pipeline.weight_span`)."""
        if span == 1:
            return self.weight_grad
        if self.weight_grad_span is None or self.weight_grad_span[0] != span:
            raise ValueError(f"no price for a W over {span} micro-batches (priced: {self.weight_grad_span}); "
                             "price the branches of a config with that pipeline.weight_span")
        return self.weight_grad_span[1]

    @classmethod
    def analytic(cls, forward: float, transfer: float = 0.0, recompute_share: float = 0.0,
                 recompute: bool = True, split_backward: str = "gemms", accumulate: float = 0.0,
                 weight_span: int = 1) -> BranchCosts:
        """From a forward's seconds: B = 2F (two matmuls per forward one), the input gradient F and W
        F (the weight GEMMs); the backwards also recompute `recompute_share` of the forward (remat
        `full`: 1; W reads recorded inputs and recomputes nothing); `recompute`: gpipe / circular
        recompute each stage from its input (any remat policy but `none`). `split_backward`
        pullback: W runs the input-gradient chain again on its way to the weights, 2F + the recompute.
        `accumulate`: seconds to add a micro-batch's weight gradients into the stage's float32 sums (the
        backward's, or under the split W's: a read of the gradient, a read and a write of the sums).
        `weight_span` (n): a W over n micro-batches runs their GEMMs each and adds their summed gradients
        to the sums once: n + 2 passes over them against 3n for n adds (`pipeline_tables._combined`)."""
        r = recompute_share * forward
        w = (forward if split_backward == "gemms" else 2 * forward + r) + accumulate
        spanned = (weight_span, weight_span * (w - accumulate) + accumulate * (weight_span + 2) / 3) \
            if weight_span > 1 else None
        return cls(forward, 2 * forward + r + accumulate, forward + r, w, transfer, recompute,
                   weight_grad_span=spanned)

    def units(self) -> BranchCosts:
        """The same costs in units of the forward."""
        f = self.forward
        return dataclasses.replace(self, forward=1.0, backward=self.backward / f, input_grad=self.input_grad / f,
                                   weight_grad=self.weight_grad / f, transfer=self.transfer / f,
                                   weight_grad_span=None if self.weight_grad_span is None else
                                   (self.weight_grad_span[0], self.weight_grad_span[1] / f),
                                   split_forward=None if self.split_forward is None else self.split_forward / f)

    @classmethod
    def from_compiler(cls, config: ml_collections.ConfigDict, sizes, gpu, *, in_node: bool = True) -> BranchCosts:
        """Each branch of one stage (`stage_branches`) compiled on one CPU device and priced on `gpu`
        (`plan.hardware.Gpu`) by the roofline: the larger of its FLOPs (XLA's cost analysis) at the
        bf16 peak and its bytes at HBM bandwidth, the bytes being what it must read and write: its
        arguments and results (XLA's memory analysis). XLA:CPU's own "bytes accessed" adds every unfused
        instruction's operands (the float32 copies of bf16 dots among them), which a GPU's fusions never
        move.

        XLA's cost analysis counts a loop's body once, whatever its trip count, so a branch's FLOPs are
        those of the same branch on one scanned unit times the stage's units (the branches are the
        units' scan and per-unit sums: linear in the units); its bytes are the whole branch's."""
        from meshtrain import config as config_lib, model as model_lib
        from meshtrain.mesh import single_device_mesh

        cpu = jax.devices("cpu")[0]
        _, single, _ = stage_branches(config, sizes, cpu, units=1)
        units = model_lib.scan_unit(config_lib.ModelConfig.from_config(config))[1] // sizes["stage"]
        with jax.set_mesh(single_device_mesh(cpu)):
            flops = {name: units * _flops(fn, args) for name, (fn, args) in single.items()}
        return cls._priced(config, sizes, gpu, cpu, lambda name, fn, args: _roofline(fn, args, gpu, flops[name]),
                           in_node)

    @classmethod
    def from_gpu_compile(cls, config: ml_collections.ConfigDict, sizes, gpu, device: jax.Device, *,
                         module_seconds: Callable[[str], float], in_node: bool = True) -> BranchCosts:
        """Each branch of one stage (`stage_branches`) compiled by XLA's GPU compiler for `device` and
        priced by `module_seconds`, the compiled module's text to its seconds (`plan.kernel_model.module_seconds`:
        kernel by kernel, what the GPU launches, fusion by fusion, loops by their trip counts, rather than
        the whole branch's FLOPs and arguments). `device`: a GPU of this machine, or a target's without one
        (`aot.target_devices(target, 1)[0]`, the `gpu` extra). Attention is the einsum one, as in
        `from_compiler` (a Pallas kernel is a custom call whose FLOPs the module's text does not give)."""
        placed = jax.sharding.SingleDeviceSharding(device)

        def price(name, fn, args):
            lowered = jax.jit(fn, in_shardings=jax.tree.map(lambda _: placed, args)).lower(*args)
            return module_seconds(compile_cache.compile(lowered, [device]).as_text())

        return cls._priced(config, sizes, gpu, device, price, in_node)

    @classmethod
    def measured(cls, config: ml_collections.ConfigDict, sizes, gpu, device: jax.Device | None = None, *,
                 iterations: int = 20, in_node: bool = True) -> BranchCosts:
        """Each branch of one stage (`stage_branches`) run on `device` (default: the first) and timed:
        `iterations` runs inside one device loop, as the pipeline's tick loop runs them, the fastest of
        three such loops divided by `iterations` (`timed`). Attention is the configured one where it is
        a single-device kernel (`attention.impl` xla, cudnn or pallas, 'auto' resolved for `device`). The
        transfer stays `gpu`'s link bandwidth (one device has no neighbour to send to)."""
        from meshtrain import config as config_lib
        from meshtrain.parallel import layout

        device = device or jax.devices()[0]
        single = config_lib.attention_impl(config, device.platform) in ("xla", "cudnn", "pallas")
        attention_fn = layout.attention_fn(config, platform=device.platform) if single else None
        return cls._priced(config, sizes, gpu, device, lambda name, fn, args: timed(fn, args, device, iterations),
                           in_node, attention_fn)

    @classmethod
    def _priced(cls, config, sizes, gpu, device, price, in_node: bool, attention_fn=None) -> BranchCosts:
        mesh, branches, nbytes = stage_branches(config, sizes, device, attention_fn=attention_fn)
        with jax.set_mesh(mesh):
            seconds = {name: price(name, fn, args) for name, (fn, args) in branches.items()}
        link = gpu.nvlink_bandwidth if in_node else gpu.network_bandwidth
        span = config.pipeline.weight_span
        return cls(seconds["forward"], seconds["backward"], seconds["input_grad"], seconds["weight_grad"],
                   nbytes / link, recompute=config.remat.policy != "none", split_forward=seconds["split_forward"],
                   weight_grad_span=(span, seconds["weight_grad_span"]) if "weight_grad_span" in seconds else None)


def stage_branches(config: ml_collections.ConfigDict, sizes, device: jax.Device, units: int | None = None,
                   attention_fn=None):
    """(mesh, {name: (function, abstract arguments)}, bytes of one activation): each branch of one
    stage on `device` as the loops run it, at the per-device micro-batch shape (rows = batch /
    (microbatches x data-parallel size), the stage's n_layers / stage layers, or `units` scanned units,
    `tensor` and `sequence` not split):

    * forward (F): the stage's vjp, returning its output and the residuals a stash slot keeps;
      split_forward: the split's F, which also records the matmul inputs W reads;
    * backward (B, fused): the pullback rebuilt from those residuals and the weights, its weight
      gradients added to the float32 sums;
    * input_grad (the split's B): input gradients and the matmuls' output gradients, only the
      parameters no matmul reads summed;
    * weight_grad (W): the weight GEMMs from the recorded inputs and output gradients, added to the sums;
      weight_grad_span (`pipeline.weight_span` > 1): W over that many micro-batches' records, added once.

    Under `split_backward=pullback` the split's F is the plain forward, its B the pullback for the
    input gradient and its W the whole pullback again, for the weight gradients. Attention:
    `attention_fn`, or the einsum attention (`attention.xla_attention`)."""
    from meshtrain import attention, config as config_lib, model as model_lib
    from meshtrain.mesh import single_device_mesh
    from meshtrain.parallel.pipeline import Residuals, SplitStage, stage_function
    from meshtrain.parallel.pipeline_tables import SplitResiduals
    from meshtrain.sharding_rules import Rules

    cfg = config_lib.ModelConfig.from_config(config)
    p, m = sizes["stage"], config.pipeline.microbatches
    rows = max(1, config.train.batch_size // (m * config_lib.data_parallel_size(sizes)))
    mesh = single_device_mesh(device)
    rules = Rules.for_mesh(mesh)
    attention_fn = attention_fn or attention.xla_attention
    stack = stage_function(cfg, rules, attention_fn)
    split = SplitStage.build(cfg, rules, attention_fn)
    units = units or model_lib.scan_unit(cfg)[1] // p
    boxed = model_lib.abstract_params(cfg)["layers"]
    layers = jax.tree.map(lambda box: jax.ShapeDtypeStruct((units, *box.value.shape[1:]), box.value.dtype),
                          boxed, is_leaf=lambda a: hasattr(a, "names"))
    w = {"params": layers}
    x = jax.ShapeDtypeStruct((rows, config.train.seq_len, cfg.d_model), cfg.dtype)
    pos = jax.ShapeDtypeStruct((rows, config.train.seq_len), jnp.int32)

    def micro(pos):
        return {"positions": pos, "segment_ids": jnp.ones_like(pos)}

    def residuals(w, x, pos, split_backward: bool):
        r = SplitResiduals(split, w, split.probes(w, x, pos, jnp.ones_like(pos))) if split_backward \
            else Residuals(stack, w)
        r.structure(x, micro(pos))
        return r

    with jax.set_mesh(mesh):
        stats = jax.eval_shape(lambda w, x, pos: stack(w, x, pos, jnp.ones_like(pos))[1], w, x, pos)

        def cotangent(g):
            return g, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats)

        def forward(w, x, pos):  # F: output and the stash slot's residuals
            r = residuals(w, x, pos, False)
            (y, _), pullback = r.vjp(x, micro(pos), w)
            return y, r.keep(pullback, w)

        def backward(w, kept, g, pos, sums):  # B (fused): every gradient, summed
            g_w, dx = residuals(w, g, pos, False).rebuild(kept, w)(cotangent(g))
            return dx, _added(sums, g_w)

        def split_forward(w, x, pos):  # F of the split: the matmul inputs recorded too
            r = residuals(w, x, pos, True)
            (y, _), pullback, recorded = r.vjp_recording(x, micro(pos), w)
            return y, r.keep(pullback, w), recorded

        kept = jax.eval_shape(forward, w, x, pos)[1]
        _, split_kept, recorded = jax.eval_shape(split_forward, w, x, pos)
        dys = jax.eval_shape(lambda w, x, pos: split.probes(w, x, pos, jnp.ones_like(pos)), w, x, pos)

        def weight_grad(w, recorded, dys, pos):  # W's gradients: the weight GEMMs
            return jax.vjp(lambda w: split.weights(w, recorded, jnp.zeros(x.shape, x.dtype), pos,
                                                   jnp.ones_like(pos)), w)[1](dys)[0]

        # the parameters whose gradients W computes (the matmul weights); B sums the others
        from_w = [not zero for zero in _zero_outputs(weight_grad, w, recorded, dys, pos)]
        sums32 = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in jax.tree.leaves(w)]
        sums_w = [a for a, kept_w in zip(sums32, from_w, strict=True) if kept_w]
        sums_b = [a for a, kept_w in zip(sums32, from_w, strict=True) if not kept_w]

        def input_grad(w, kept, g, pos, sums):  # B (split): input and output gradients, non-matmul sums
            g_w, dx, dys = residuals(w, g, pos, True).rebuild(kept, w)(cotangent(g))
            rest = [a for a, kept_w in zip(jax.tree.leaves(g_w), from_w, strict=True) if not kept_w]
            return dx, dys, _added(sums, rest)

        def weights(w, recorded, dys, pos, sums):  # W: the weight GEMMs, summed
            grads = jax.tree.leaves(weight_grad(w, recorded, dys, pos))
            produced = [a for a, kept_w in zip(grads, from_w, strict=True) if kept_w]
            return _added(sums, produced)

        sums = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), w)
        def weights_spanned(w, records, pos, sums):  # W over several micro-batches: the sums added once
            grads = [jax.tree.leaves(weight_grad(w, recorded, dys, pos)) for recorded, dys in records]
            produced = [sum(g) for g, kept_w in zip(zip(*grads, strict=True), from_w, strict=True) if kept_w]
            return _added(sums, produced)

        branches = {"forward": (forward, (w, x, pos)),
                    "backward": (backward, (w, kept, x, pos, sums)),
                    "split_forward": (split_forward, (w, x, pos)),
                    "input_grad": (input_grad, (w, split_kept, x, pos, sums_b)),
                    "weight_grad": (weights, (w, recorded, dys, pos, sums_w))}
        span = config.pipeline.weight_span
        if span > 1 and config.pipeline.split_backward == "gemms":
            branches["weight_grad_span"] = (weights_spanned, (w, [(recorded, dys)] * span, pos, sums_w))
        if config.pipeline.split_backward == "pullback":  # B and W: the stage's pullback, for dx, then for dw
            def pullback(w, kept, g, pos):
                return residuals(w, g, pos, False).rebuild(kept, w)(cotangent(g))

            def weights_again(w, kept, g, pos, sums):
                return _added(sums, pullback(w, kept, g, pos)[0])

            branches["split_forward"] = branches["forward"]
            branches["input_grad"] = (lambda *a: pullback(*a)[1], (w, kept, x, pos))
            branches["weight_grad"] = (weights_again, (w, kept, x, pos, sums))
    return mesh, branches, math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def _added(sums, grads):
    """Float32 gradient sums plus this branch's gradients (what a branch's accumulation reads and writes)."""
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), sums, grads)


def _zero_outputs(fn, *args) -> list[bool]:
    """Per output leaf of `fn`: whether it is a structural zero (autodiff's instantiated zero
    cotangent of a parameter the function does not differentiate, `broadcast_in_dim 0.0`)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    zeros = {id(eqn.outvars[0]) for eqn in jaxpr.eqns
             if eqn.primitive.name == "broadcast_in_dim" and isinstance(eqn.invars[0], jex_core.Literal)
             and eqn.invars[0].val == 0}
    return [isinstance(v, jex_core.Literal) or id(v) in zeros for v in jaxpr.outvars]


def timed(fn, args, device: jax.Device, iterations: int = 20, repeats: int = 3) -> float:
    """Seconds of one run of `fn` on `device`, measured: `iterations` runs in one device loop (a
    `fori_loop`, as the pipeline's tick loop runs its branches: no host dispatch between them), the
    fastest of `repeats` loops after a warm-up, divided by `iterations`. The arguments are filled on
    the device (normal values for floats, zeros for integers); each run reads them through an
    optimization barrier with the previous run's results, so XLA can neither hoist the branch out of
    the loop nor drop an unread result."""
    import time

    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(args))))

    def fill(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return (0.02 * jax.random.normal(next(keys), a.shape, jnp.float32)).astype(a.dtype)
        return jnp.zeros(a.shape, a.dtype)

    sharding = jax.sharding.SingleDeviceSharding(device)
    concrete = jax.device_put(jax.tree.map(fill, args), sharding)
    outs = jax.device_put(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn, *args)), sharding)

    compiled = jax.jit(repeated(fn, iterations)).lower(concrete, outs).compile()
    jax.block_until_ready(compiled(concrete, outs))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(concrete, outs))
        best = min(best, time.perf_counter() - start)
    return best / iterations


def _flops(fn, args) -> float:
    """XLA's FLOP count of `fn` compiled (a loop's body counted once)."""
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return analysis.get("flops", 0.0)


def repeated(fn, iterations: int):
    """(args, outs) -> `fn(*args)` computed `iterations` times in one `fori_loop`, each run reading its
    arguments through an optimization barrier with the previous run's results (`outs` the first's)."""
    def loop(args, outs):
        def body(_, carry):
            args, _ = jax.lax.optimization_barrier(carry)
            return args, fn(*args)

        return jax.lax.fori_loop(0, iterations, body, (args, outs))[1]
    return loop


def _roofline(fn, args, gpu, flops: float) -> float:
    """Seconds of `fn` on `gpu`: `flops` at the bf16 peak or the bytes of its arguments and results
    at HBM bandwidth, the larger."""
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    nbytes = memory.argument_size_in_bytes + memory.output_size_in_bytes
    return max(flops / gpu.peak_flops, nbytes / gpu.hbm_bandwidth)


@dataclasses.dataclass(frozen=True)
class Execution:
    """A modeled step: its seconds, the ticks the loop runs, and the busy share."""

    schedule: str
    seconds: float
    ticks: int
    work: float  # seconds of real work summed over stages, divided by p: the step without any wait

    @property
    def efficiency(self) -> float:
        return self.work / self.seconds


def step_time(schedule: str, p: int, m: int, v: int, costs: BranchCosts, weight_parts: int = 1,
              overlap: bool = False, defer_w: bool = True, span: int = 1) -> Execution:
    """The pipeline part of a step as the lock-step loop runs it (module docstring); a split W run as
    `weight_parts` operations costs 1/weight_parts of W each. `overlap` (`pipeline.overlap_transfers`,
    the slot tables): each transfer travels beside a tick of compute, which then lasts the longer of
    the two. `defer_w`: `schedules.defers_w` (`Pipeline.defers_w`); `span`: `Pipeline.span`, a W over
    that many micro-batches (`BranchCosts.weights_over`)."""
    c = costs
    entry = schedules.REGISTRY[schedule]
    v = v if entry.chunked else 1  # chunks per stage
    if entry.loop == schedules.AUTODIFF:
        ticks = v * m + p - 1
        backward = c.backward + (c.forward if c.recompute else 0.0)
        # every tick runs the stack on every stage (the bubble computes too), then one ppermute
        seconds = ticks * (c.forward / v + c.transfer) + ticks * (backward / v + c.transfer)
        return Execution(schedule, seconds, 2 * ticks, m * (c.forward + backward))
    split = schedule in schedules.SPLIT_BACKWARD
    forward = c.forward_split if split else c.forward
    # a W tick of a loop whose W's cover `span` micro-batches runs the branch over that many records, zeros
    # for a B tick that idled (`pipeline_tables._TableWork._weights`): priced as such whatever it covers
    price = {schedules.F: forward / v, schedules.B: (c.input_grad if split else c.backward) / v,
             schedules.W: c.weights_over(span) / (v * weight_parts) if split else 0.0}  # fused tables' W ticks idle
    rows, w_ops = _table_rows(schedule, p, m, v, weight_parts if split else 1, int(overlap), defer_w, span)
    if overlap:  # each tick's operation beside the transfer of the tick before's outputs
        seconds = sum(n * max([c.transfer] + [price[k] for k in kinds]) for kinds, n in rows)
    else:
        seconds = sum(n * (max([0.0] + [price[k] for k in kinds]) + c.transfer) for kinds, n in rows)
    ticks = sum(n for _, n in rows)
    weights = w_ops * price[schedules.W] / p if split else 0.0  # a stage's W's, on average
    return Execution(schedule, seconds, ticks, m * (forward + (c.input_grad if split else c.backward)) + weights)


# A tick's length depends only on which kinds of operation run in it: the loops' ticks grouped by
# that, once per (schedule, p, m, ...), so pricing a schedule is a few sums (the planner's search
# prices tens of thousands of candidates on the same few tables).
@functools.lru_cache(maxsize=256)
def _table_rows(schedule: str, p: int, m: int, v: int, weight_parts: int, latency: int, defer_w: bool,
                span: int = 1) -> tuple[tuple[tuple[frozenset, int], ...], int]:
    """((the kinds of operation in a tick, how many ticks), the W operations of every stage) over
    `schedules.executed`'s table."""
    table = schedules.executed(schedule, p, m, v, weight_parts, latency, defer_w, span)
    kinds = collections.Counter(frozenset(op.kind for op in row if op is not None) for row in table)
    return tuple(kinds.items()), sum(op.kind == schedules.W for row in table for op in row if op is not None)


def fastest_split(schedule: str, p: int, m: int, v: int, costs: BranchCosts, units: int, overlap: bool,
                  defer_w: bool, spans: tuple[int, ...] = (1,)) -> tuple[int, int, Execution]:
    """(span, W parts, its step) of the fastest of `spans` (each with the parts `weight_parts` picks for it)
    for a split schedule; (1, 1, the step) for the others. A span over 1 runs only where W's take B's
    records in their loop step (`pipeline.w_span`); `costs` must price it (`BranchCosts.weights_over`)."""
    if schedule not in schedules.SPLIT_BACKWARD:
        return 1, 1, step_time(schedule, p, m, v, costs, overlap=overlap, defer_w=defer_w)
    runs = []
    for span in spans:
        parts = weight_parts(costs, units, span)
        runs.append((span, parts, step_time(schedule, p, m, v, costs, parts, overlap=overlap, defer_w=defer_w,
                                            span=span)))
    return min(runs, key=lambda run: (run[2].seconds, run[0]))


def weight_parts(costs: BranchCosts, units: int, span: int = 1) -> int:
    """The W parts that balance a split schedule's ticks: W (over `span` micro-batches) cut into the divisor
    of the chunk's `units` scanned units nearest W's cost over the longer of F and B (1 when W is no longer
    than them)."""
    ratio = costs.weights_over(span) / max(costs.forward_split, costs.input_grad)
    return min((n for n in range(1, units + 1) if units % n == 0), key=lambda n: (abs(n - ratio), n))


def ideal(m: int, costs: BranchCosts) -> float:
    """A micro-batch's forward and fused backward, m times: the step with no bubble and no wait."""
    return m * (costs.forward + costs.backward)


def ratios(p: int, m: int, v: int, costs: BranchCosts, weight_parts: int = 1) -> dict[str, float]:
    """Each schedule's modeled step over 1F1B's (`schedules.BASELINE`)."""
    base = step_time(schedules.BASELINE, p, m, v, costs).seconds
    return {name: step_time(name, p, m, v, costs, weight_parts).seconds / base for name in SCHEDULES}

