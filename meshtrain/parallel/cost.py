"""The pipeline step as the SPMD loop executes it: lock-step ticks, each as long as its slowest stage.

Playbook, "Pipeline Parallelism". The schedules' tables (`schedules.simulate`) count ticks as if
every operation cost one unit; the loops that run them (`pipeline.py`, `pipeline_tables.py`) are
one SPMD program in which every tick ends at a `ppermute` all stages take part in. A tick therefore
lasts as long as the slowest branch any stage runs in it, plus the transfer after it (the next tick
reads what it sends: nothing hides it). This module prices that execution:

    costs = BranchCosts.from_compiler(config, sizes, gpu)     # XLA's cost analysis of each branch
    modeled = step_time("zero_bubble", p=4, m=16, v=1, costs)  # seconds per step, as executed

Branches, per stage and micro-batch (a chunk of 1/v of the stage's layers under interleaving):

* F: the forward, keeping its vjp residuals;
* B: the fused backward (input and weight gradients): 1f1b, interleaved 1F1B (whose W ticks then
  idle), and gpipe / circular's transposed loop (which also recomputes the forward under remat);
* B split (zero_bubble): the pullback for the input gradient only (every matmul's weight a
  constant); W: each matmul's weight GEMM from its recorded input and output gradient
  (`pipeline.SplitStage`), about one forward.

`BranchCosts.from_compiler` compiles each branch on one CPU device at the per-device micro-batch
shape and turns XLA's FLOP and byte counts into seconds on a GPU (the roofline: the larger of FLOPs
at the peak and bytes at HBM bandwidth); `BranchCosts.analytic` gives the same structure from the
planner's compute estimate (F = a third of a micro-batch's forward + backward).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections

from meshtrain.parallel import schedules

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")


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

    @classmethod
    def analytic(cls, forward: float, transfer: float = 0.0, recompute_share: float = 0.0,
                 recompute: bool = True, split_backward: str = "gemms") -> BranchCosts:
        """From a forward's seconds: B = 2F (two matmuls per forward one), the input gradient F and W
        F (the weight GEMMs); the backwards also recompute `recompute_share` of the forward (remat
        `full`: 1; W reads recorded inputs and recomputes nothing); `recompute`: gpipe / circular
        recompute each stage from its input (any remat policy but `none`). `split_backward`
        pullback: W runs the input-gradient chain again on its way to the weights, 2F + the recompute."""
        r = recompute_share * forward
        w = forward if split_backward == "gemms" else 2 * forward + r
        return cls(forward, 2 * forward + r, forward + r, w, transfer, recompute)

    def units(self) -> BranchCosts:
        """The same costs in units of the forward."""
        f = self.forward
        return dataclasses.replace(self, forward=1.0, backward=self.backward / f, input_grad=self.input_grad / f,
                                   weight_grad=self.weight_grad / f, transfer=self.transfer / f)

    @classmethod
    def from_compiler(cls, config: ml_collections.ConfigDict, sizes, gpu, *, in_node: bool = True) -> BranchCosts:
        """Each branch of one stage compiled on one CPU device at the per-device micro-batch shape
        (rows = batch / (microbatches x data-parallel size), the stage's n_layers / stage layers, `tensor`
        and `sequence` not split), priced on `gpu` (`plan.hardware.Gpu`) by XLA's FLOP and byte counts."""
        from meshtrain import attention, config as config_lib, model as model_lib
        from meshtrain.mesh import single_device_mesh
        from meshtrain.parallel.pipeline import SplitStage, stage_function
        from meshtrain.sharding_rules import Rules

        cfg = config_lib.ModelConfig.from_config(config)
        p, m = sizes["stage"], config.pipeline.microbatches
        rows = max(1, config.train.batch_size // (m * config_lib.data_parallel_size(sizes)))
        mesh = single_device_mesh(jax.devices("cpu")[0])
        rules = Rules.for_mesh(mesh)
        stack = stage_function(cfg, rules, attention.xla_attention)
        split = SplitStage.build(cfg, rules, attention.xla_attention)
        units = model_lib.scan_unit(cfg)[1] // p
        boxed = model_lib.abstract_params(cfg)["layers"]
        layers = jax.tree.map(lambda box: jax.ShapeDtypeStruct((units, *box.value.shape[1:]), box.value.dtype),
                              boxed, is_leaf=lambda a: hasattr(a, "names"))
        w = {"params": layers}
        x = jax.ShapeDtypeStruct((rows, config.train.seq_len, cfg.d_model), cfg.dtype)
        pos = jax.ShapeDtypeStruct((rows, config.train.seq_len), jnp.int32)

        def forward(w, x, pos):
            return stack(w, x, pos, pos * 0 + 1)[0]

        def fused(w, x, pos, g):
            return jax.vjp(lambda w, x: forward(w, x, pos), w, x)[1](g)

        def split_forward(w, x, pos, probes):  # F under the split: the matmul inputs recorded
            return split.forward(w, x, pos, pos * 0 + 1, probes)

        def input_grad(w, x, pos, probes, g):  # F and B: input gradients, the probes' output gradients
            (y, _), pullback, recorded = jax.vjp(lambda w, x, q: split_forward(w, x, pos, q), w, x, probes,
                                                 has_aux=True)
            return pullback((g, {})), recorded

        def weight_grad(w, recorded, x, pos, dys):  # W: the weight GEMMs
            return jax.vjp(lambda w: split.weights(w, recorded, x, pos, pos * 0 + 1), w)[1](dys)

        with jax.set_mesh(mesh):
            seconds = {"forward": _roofline(forward, (w, x, pos), gpu), "fused": _roofline(fused, (w, x, pos, x), gpu)}
            if config.pipeline.split_backward == "pullback":  # B and W: the stage's pullback for dx, then for dw
                pullback_x = lambda w, x, pos, g: jax.vjp(lambda x: forward(w, x, pos), x)[1](g)  # noqa: E731
                pullback_w = lambda w, x, pos, g: jax.vjp(lambda w: forward(w, x, pos), w)[1](g)  # noqa: E731
                seconds["split_forward"] = seconds["forward"]
                seconds["input_grad"] = _roofline(pullback_x, (w, x, pos, x), gpu)
                seconds["weight_grad"] = _roofline(pullback_w, (w, x, pos, x), gpu) - seconds["forward"]
            else:
                probes = jax.eval_shape(lambda w, x, pos: split.probes(w, x, pos, pos * 0 + 1), w, x, pos)
                recorded = jax.eval_shape(split_forward, w, x, pos, probes)[1]
                seconds["split_forward"] = _roofline(lambda *a: (lambda out: (out[0][0], out[1]))(split_forward(*a)),
                                                     (w, x, pos, probes), gpu)
                seconds["input_grad"] = _roofline(input_grad, (w, x, pos, probes, x), gpu)
                seconds["weight_grad"] = _roofline(weight_grad, (w, recorded, x, pos, probes), gpu)
        f = seconds["forward"]  # each backward was compiled with its forward: take it out
        nbytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        link = gpu.nvlink_bandwidth if in_node else gpu.network_bandwidth
        return cls(f, seconds["fused"] - f, seconds["input_grad"] - seconds["split_forward"], seconds["weight_grad"],
                   nbytes / link, recompute=cfg.remat_policy != "none")


def _roofline(fn, args, gpu) -> float:
    """Seconds of `fn` on `gpu`: XLA's FLOPs at the bf16 peak or its bytes at HBM bandwidth, the larger."""
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return max(analysis.get("flops", 0.0) / gpu.peak_flops, analysis.get("bytes accessed", 0.0) / gpu.hbm_bandwidth)


@dataclasses.dataclass(frozen=True)
class Execution:
    """A modeled step: its seconds, the ticks (slots for 1f1b) the loop runs, and the busy share."""

    schedule: str
    seconds: float
    ticks: int
    work: float  # seconds of real work summed over stages, divided by p: the step without any wait

    @property
    def efficiency(self) -> float:
        return self.work / self.seconds


def step_time(schedule: str, p: int, m: int, v: int, costs: BranchCosts) -> Execution:
    """The pipeline part of a step as the lock-step loop runs it (module docstring)."""
    c = costs
    v = v if schedule in ("circular", "interleaved_1f1b") else 1  # chunks per stage
    if schedule in ("gpipe", "circular"):
        ticks = v * m + p - 1
        backward = c.backward + (c.forward if c.recompute else 0.0)
        # every tick runs the stack on every stage (the bubble computes too), then one ppermute
        seconds = ticks * (c.forward / v + c.transfer) + ticks * (backward / v + c.transfer)
        return Execution(schedule, seconds, 2 * ticks, m * (c.forward + backward))
    if schedule == "1f1b":
        from meshtrain.parallel.pipeline import one_f_one_b_slot

        slots, seconds = 2 * (m + p - 1), 0.0
        for u in range(slots):
            busy = [0.0]
            for s in range(p):
                op, j = one_f_one_b_slot(p, s, u)
                if 0 <= j < m:
                    busy.append(c.forward if op == 1 else c.backward)
            seconds += max(busy) + c.transfer  # one ppermute after every slot
        return Execution(schedule, seconds, slots, m * (c.forward + c.backward))
    table = schedules.simulate(schedule, p, m, v)
    split = schedule in schedules.SPLIT_BACKWARD
    price = {schedules.F: c.forward / v, schedules.B: (c.input_grad if split else c.backward) / v,
             schedules.W: c.weight_grad / v if split else 0.0}  # fused tables' W ticks idle
    seconds = sum(max([0.0] + [price[op.kind] for op in row if op is not None]) + c.transfer for row in table)
    per_micro = c.forward + (c.input_grad + c.weight_grad if split else c.backward)
    return Execution(schedule, seconds, len(table), m * per_micro)


def table(p: int, m: int, v: int, costs: BranchCosts, names=SCHEDULES) -> list[Execution]:
    return [step_time(name, p, m, v, costs) for name in names]


def ideal(m: int, costs: BranchCosts) -> float:
    """A micro-batch's forward and fused backward, m times: the step with no bubble and no wait."""
    return m * (costs.forward + costs.backward)


def ratios(p: int, m: int, v: int, costs: BranchCosts) -> dict[str, float]:
    """Each schedule's modeled step over 1f1b's."""
    base = step_time("1f1b", p, m, v, costs).seconds
    return {name: step_time(name, p, m, v, costs).seconds / base for name in SCHEDULES}

