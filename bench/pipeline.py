"""Pipeline step time on CPU for p stages and m micro-batches, measured bubble beside the formula.

    python bench/pipeline.py [--stages 4] [--microbatches 4,8,16,32]
                             [--schedules gpipe,circular,1f1b,interleaved_1f1b,zero_bubble]

Playbook, "Pipeline Parallelism". The micro-batch size is fixed (`--rows` rows of `--seq_len`
tokens), so the global batch grows with m. Each (schedule, m) runs the real train step
(`train_step.build`) on p fake CPU devices: compile, one warm-up step, then the median of
`--steps` timed steps.

Measured bubble. In the gpipe / circular tick loops every stage computes in every tick, so the
step time is t(m) = tau * ticks(m) + c. The 1f1b loop skips idle slots (`lax.switch`): on fake
CPU devices, which share the host's cores, an idle slot then costs nothing and the time-based
bubble of 1f1b shows only the fixed costs; on real devices a slot waits for its neighbours.
The slope dt/dm of a least-squares line through the m values is the cost of one more
micro-batch in steady state; the time-based bubble of a point is
1 - m * slope / t(m), the share of the step that the micro-batches' own work does not
explain (the fixed cost c, embedding, head and optimizer included). It is printed beside
the schedule's tick formula 1 - v*m/ticks (slot tables: the idle share of the table's cells).
`temp MiB` is the compiled step's temporary memory per device (XLA's memory analysis): it grows
with m under gpipe and circular, and stays flat under 1f1b, interleaved_1f1b and zero_bubble.
The slot-table pictures: `python bench/schedules.py --draw DIR`.

Modeled on a GPU (`parallel/cost.py`). Fake CPU devices cannot show what lock-step costs on real
ones, so each row also carries the step as the SPMD loop would run it on H100s: each branch of
one stage (forward, fused backward, input-gradient-only and weight-gradient-only pullbacks) is
compiled in bf16 and priced by XLA's FLOP and byte counts, then every tick lasts as long as its
slowest stage plus the transfer after it. `modeled` is that step in units of one stage's forward
on one micro-batch, `vs 1f1b` its ratio to 1f1b's at the same p and m. `--modeled` prints only
the model, for a grid of p (`--stages 2,4`) and m, in seconds. `--compiled` (with the `gpu` extra)
prices each branch instead from XLA's GPU compile of it for `--gpu`, kernel by kernel
(`cost.BranchCosts.from_gpu_compile`): the launches and the HBM traffic of every fusion, which is
what the measured branch times follow.

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from meshtrain import config as config_lib, train_step  # noqa: E402
from meshtrain.parallel import cost, layout, pipeline, schedules  # noqa: E402
from meshtrain.plan import hardware, kernel_model  # noqa: E402
from meshtrain.run import Run


def make_config(args, schedule: str, microbatches: int, stages: int | None = None):
    c = config_lib.default_config()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = 1
    c.mesh.stage = int(args.stages) if stages is None else stages
    c.model.update(vocab_size=264, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                   head_dim=args.d_model // 8, mlp_dim=3 * args.d_model, dtype="float32")
    c.train.update(batch_size=args.rows * microbatches, seq_len=args.seq_len)
    c.pipeline.update(schedule=schedule, microbatches=microbatches,
                      repeats=2 if schedule in pipeline.CHUNKED_SCHEDULES else 1)
    return c


def batch_for(config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    b, t = config.train.batch_size, config.train.seq_len
    tokens = rng.integers(3, config.model.vocab_size, size=(b, t + 1), dtype=np.int32)
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions,
            "segment_ids": np.ones((b, t), np.int32), "loss_mask": np.ones((b, t), np.float32)}


def step_seconds(config, steps: int) -> tuple[float, int]:
    """(median step seconds, compiled temp bytes per device)."""
    run = Run.resolve(config, jax.devices()[: config.mesh.stage])
    factory, step_fn = train_step.build(run)
    mesh = run.mesh
    state = factory.create(0)
    batch = batch_for(config)
    times = []
    with jax.set_mesh(mesh):
        compiled = step_fn.lower(state, batch).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        step_fn = compiled
        state, metrics = step_fn(state, batch)  # warm-up
        jax.block_until_ready(metrics)
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = step_fn(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
    return statistics.median(times), temp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="4", help="p; --modeled takes a list (2,4)")
    parser.add_argument("--microbatches", default="4,8,16,32")
    parser.add_argument("--schedules", default=",".join(config_lib.PIPELINE_SCHEDULES))
    parser.add_argument("--rows", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: 2 stages, m 2 and 4, 4 layers, 2 steps")
    parser.add_argument("--modeled", action="store_true", help="only the modeled GPU step, no CPU timing")
    parser.add_argument("--gpu", default="h100", help="the GPU of the model (plan.hardware)")
    parser.add_argument("--compiled", action="store_true",
                        help="price the branches kernel by kernel from XLA's GPU compile for --gpu (the gpu extra; "
                             "cost.BranchCosts.from_gpu_compile) instead of the whole-branch roofline")
    args = parser.parse_args()
    if args.quick:
        args.stages, args.microbatches, args.layers, args.steps = "2", "2,4", 4, 2
    ms = [int(m) for m in args.microbatches.split(",")]
    if args.modeled:
        return print_modeled(args, [int(p) for p in args.stages.split(",")], ms)
    args.stages = int(args.stages)
    results, gpu = [], hardware.get_gpu(args.gpu)
    print(f"p={args.stages}, micro-batch {args.rows} x {args.seq_len} tokens, d_model {args.d_model}, "
          f"{args.layers} layers, {jax.devices()[0].platform}")
    print(f"{'schedule':16} {'m':>3} {'ticks':>5} {'step ms':>8} {'ms/micro':>8} {'bubble meas':>11} "
          f"{'formula':>8} {'temp MiB':>9} {'modeled':>8} {'vs 1f1b':>8}")
    for schedule in args.schedules.split(","):
        rows = []
        for m in ms:
            config = make_config(args, schedule, m)
            pipe = layout.pipeline_plan(config, {**{a: 1 for a in config_lib.MESH_AXES}, "stage": args.stages})
            print(f"running {schedule} m={m} ...", file=sys.stderr, flush=True)
            rows.append((m, pipe, *step_seconds(config, args.steps)))
        slope = np.polyfit([m for m, *_ in rows], [t for _, _, t, _ in rows], 1)[0]
        for m, pipe, t, temp in rows:
            measured = 1 - m * slope / t
            costs = modeled_costs(args, m, args.stages, gpu)
            model = cost.step_time(schedule, args.stages, m, pipe.repeats, costs, pipe.weight_parts,
                                   overlap=pipe.overlap, defer_w=pipe.defers_w, span=pipe.span)
            vs = model.seconds / cost.step_time(schedules.BASELINE, args.stages, m, 1, costs).seconds
            results.append({"schedule": schedule, "stages": args.stages, "microbatches": m, "ticks": pipe.ticks,
                            "step_s": t, "bubble_measured": measured, "bubble_formula": pipe.bubble,
                            "temp_bytes": temp, "modeled_units": model.seconds / costs.forward,
                            "modeled_vs_1f1b": vs})
            print(f"{schedule:16} {m:3d} {pipe.ticks:5d} {t * 1e3:8.1f} {t / m * 1e3:8.2f} "
                  f"{measured:11.1%} {pipe.bubble:8.1%} {temp / 2**20:9.2f} {model.seconds / costs.forward:8.1f} "
                  f"{vs:8.3f}")
    print(json.dumps(results))
    if args.quick:  # the modeled table too (with the overlapped loops' rows), so that it does not rot
        print_modeled(args, [args.stages], ms[-1:])


_COSTS: dict[tuple, cost.BranchCosts] = {}
SPAN = 2  # `pipeline.weight_span` the modeled table weighs against one W a micro-batch


def modeled_costs(args, m: int, p: int, gpu) -> cost.BranchCosts:
    """One stage's branch costs of the benchmark's model in bf16 (what a GPU runs), priced on `gpu`
    (compiled once per shape: every schedule's row reuses them)."""
    key = (m, p, args.rows, args.seq_len, args.d_model, args.layers, gpu.name, args.compiled)
    if key not in _COSTS:
        config = make_config(args, schedules.BASELINE, m, stages=p)
        config.model.dtype = "bfloat16"
        config.pipeline.weight_span = SPAN  # the W over two micro-batches priced too, for the split's pick
        sizes = {**{a: 1 for a in config_lib.MESH_AXES}, "stage": p}
        if args.compiled:
            from meshtrain import aot

            device = aot.target_devices(args.gpu, 1)[0]
            _COSTS[key] = cost.BranchCosts.from_gpu_compile(config, sizes, gpu, device,
                                                          module_seconds=kernel_model.module_seconds(gpu))
        else:
            _COSTS[key] = cost.BranchCosts.from_compiler(config, sizes, gpu)
    return _COSTS[key]


def print_modeled(args, stages: list[int], ms: list[int]) -> None:
    """The modeled GPU step of every schedule for each (p, m): seconds, units of F, ratio to 1f1b. The
    split schedules run W in the parts the model picks for their chunk's layers (`cost.weight_parts`), and
    where W's take B's records in their loop step (overlapped zero bubble) over one or two micro-batches,
    whichever the model finds faster (`cost.fastest_split`; `pipeline.weight_span`)."""
    gpu, rows = hardware.get_gpu(args.gpu), []
    how = "kernel by kernel from its GPU compile" if args.compiled else "by the whole-branch roofline"
    print(f"modeled on {gpu.name} ({how}): micro-batch {args.rows} x {args.seq_len} tokens, d_model {args.d_model}, "
          f"{args.layers} layers, bf16, interleaved v=2")
    print(f"{'p':>2} {'m':>3} {'schedule':24} {'W parts':>7} {'W span':>6} {'ticks':>5} {'step ms':>8} "
          f"{'units':>7} {'vs 1f1b':>8} {'busy':>6}")
    for p in stages:
        for m in ms:
            costs = modeled_costs(args, m, p, gpu)
            base = cost.step_time(schedules.BASELINE, p, m, 1, costs).seconds
            names = args.schedules.split(",")
            # then the schedules that can send during the next tick (`pipeline.overlap_transfers`), as "+overlap"
            runs = [(n, False) for n in names] + [(n, True) for n in names if n in pipeline.OVERLAPPING]
            for schedule, overlap in runs:
                v = 2 if schedule in pipeline.CHUNKED_SCHEDULES else 1
                c = make_config(args, schedule, m, stages=p)  # the table the trainer runs (W deferred or not)
                split, policy = c.pipeline.split_backward, c.remat.policy
                spans = tuple(sorted({1, pipeline.w_span(schedule, split, policy, overlap, SPAN)}))
                span, parts, e = cost.fastest_split(schedule, p, m, 2, costs, args.layers // (p * v), overlap,
                                                    pipeline.defers_w(split, policy, overlap), spans)
                name = schedule + ("+overlap" if overlap else "")
                rows.append({"stages": p, "microbatches": m, "schedule": name, "weight_parts": parts,
                             "weight_span": span,
                             "ticks": e.ticks, "seconds": e.seconds, "units": e.seconds / costs.forward,
                             "vs_1f1b": e.seconds / base, "busy": e.efficiency})
                print(f"{p:2d} {m:3d} {name:24} {parts:7d} {span:6d} {e.ticks:5d} {e.seconds * 1e3:8.3f} "
                      f"{e.seconds / costs.forward:7.1f} {e.seconds / base:8.3f} {e.efficiency:6.1%}")
    units = costs.units()
    print(f"branch costs (units of F): fused backward {units.backward:.2f}, split forward {units.forward_split:.2f}, "
          f"input gradient {units.input_grad:.2f}, weight gradient {units.weight_grad:.2f}"
          + (f" (over {units.weight_grad_span[0]} micro-batches {units.weight_grad_span[1]:.2f})"
             if units.weight_grad_span else "") + f", transfer {units.transfer:.3f}")
    print(json.dumps({"bench": "pipeline_modeled", "gpu": gpu.name,
                      "priced": "kernels" if args.compiled else "roofline", "rows": rows,
                      "branch_units": dataclasses.asdict(units)}))


if __name__ == "__main__":
    main()
