"""Mixture of experts: training tokens/s of the tiny MoE by expert-parallel degree, and the share of
token-to-expert assignments dropped by the capacity limit; with `--modeled`, the real MoE shapes
compiled for H100s and priced by the kernel model.

    python bench/moe.py [--steps 10] [--seq_len 128] [--batch_size 16] [--dtype float32]
    python bench/moe.py --modeled [--quick]      # needs the `gpu` extra (XLA's GPU compiler)

Playbook, "Expert parallelism". On 8 fake CPU devices the mesh is expert=e, data=8/e for
e in {1, 2, 4, 8} (the experts split e ways, the batch 8 ways), with capacity dispatch
(capacity_factor 1.25) and dropless dispatch. CPU devices share the host's cores, so the
figures show the cost of the exchange and of the dispatch bookkeeping, not a GPU speed-up.
Then the dropped fraction (mean of the logged `moe_dropped_fraction` over the timed steps)
for capacity_factor in {1.0, 1.25, 2.0}. Prints a table and one JSON line.

`--modeled` (`bench/_moe_modeled.py`): the step of today's fine-grained MoE shapes compiled for 8 (and 64)
H100s without a GPU and priced kernel by kernel (`meshtrain.aot`), beside the planner's memory and step,
the expert exchange's bytes and its overlap, read from the compiled step; exits 1 when a row misses its
target.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import runpy
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if "--modeled" not in sys.argv:
    jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from meshtrain import config as config_lib, train_step  # noqa: E402
from meshtrain.run import Run
from tests import utils  # noqa: E402


def make_config(args, expert: int, dropless: bool, capacity_factor: float):
    c = utils.load_config_file("tiny_moe")
    c.data.source = "synthetic"
    c.model.dtype = args.dtype
    c.model.moe_dropless = dropless
    c.model.capacity_factor = capacity_factor
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = 1
    c.mesh.expert, c.mesh.data = expert, 8 // expert
    c.train.seq_len, c.train.batch_size = args.seq_len, args.batch_size
    return c


def measure(config, steps: int) -> dict:
    """Compiles the step, runs 2 warm-up steps, times `steps` more: tokens/s and the mean metrics."""
    run = Run.resolve(config, jax.devices()[:8])
    factory, step_fn = train_step.build(run)
    mesh = run.mesh
    batches = utils.synthetic_batches(config, steps + 2)
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        state = factory.create(config.seed)
        for batch in batches[:2]:
            state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - start
        timed = []
        start = time.perf_counter()
        for batch in batches[2:]:
            state, metrics = step_fn(state, batch)
            timed.append(metrics)
        timed = jax.device_get(timed)
        seconds = time.perf_counter() - start
    tokens = steps * config.train.batch_size * config.train.seq_len
    return {"tokens_per_sec": tokens / seconds, "step_s": seconds / steps, "compile_and_warmup_s": compile_s,
            "loss": float(timed[-1]["loss"]),
            "dropped_fraction": sum(float(m["moe_dropped_fraction"]) for m in timed) / steps}


def main() -> None:
    if "--modeled" in sys.argv:  # the GPU compiles: their own module (no fake CPU devices there)
        sys.argv.remove("--modeled")
        runpy.run_path(str(pathlib.Path(__file__).with_name("_moe_modeled.py")), run_name="__main__")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke run: expert 1 and 8, capacity factor 1.25, 2 steps")
    args = parser.parse_args()
    experts, factors = (1, 2, 4, 8), (1.0, 1.25, 2.0)
    if args.quick:
        experts, factors, args.steps = (1, 8), (1.25,), 2

    results = {"throughput": [], "capacity": []}
    print(f"tiny MoE (configs/tiny_moe.py), batch {args.batch_size} x {args.seq_len}, {args.dtype}, "
          f"{jax.device_count()} CPU devices, {args.steps} timed steps")
    print(f"{'mesh':<18}{'dispatch':<10}{'tokens/s':>10}{'step s':>9}{'dropped':>9}")
    measured = {}  # (expert, dropless, capacity factor) -> the run's figures: a row both tables show runs once
    for dropless in (False, True):
        for expert in experts:
            r = measured[expert, dropless, 1.25] = measure(make_config(args, expert, dropless, 1.25), args.steps)
            r.update(expert=expert, data=8 // expert, dispatch="dropless" if dropless else "capacity")
            results["throughput"].append(r)
            print(f"{f'expert={expert},data={8 // expert}':<18}{r['dispatch']:<10}{r['tokens_per_sec']:>10.0f}"
                  f"{r['step_s']:>9.3f}{r['dropped_fraction']:>9.4f}")
    print(f"\n{'capacity factor':<18}{'dropped fraction':>18}  (expert=8, data=1)")
    for factor in factors:
        r = dict(measured.get((8, False, factor)) or measure(make_config(args, 8, False, factor), args.steps))
        r.update(capacity_factor=factor)
        results["capacity"].append(r)
        print(f"{factor:<18}{r['dropped_fraction']:>18.4f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
