"""Composition of the six axes: every triple at size 2 on 8 fake CPU devices, and all six at once on 64.

Each mesh brings its feature (tests/utils.py `composed_config`: MoE with `expert`, ring attention with
`sequence`, 1F1B with `stage`, ZeRO-3 with `fsdp`) and trains 3 float32 steps; the table gives the
largest relative loss difference from the same config on `data=8`, the compile time and the mean
step time. Playbook, "5D parallelism in a nutshell". Prints a table and one JSON line.

    python bench/compose.py [--steps 3] [--no-triples]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "float32")
import jax

jax.config.update("jax_num_cpu_devices", 64)

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from meshtrain import config as config_lib, train_step
from meshtrain.run import Run
from tests.utils import composed_config, synthetic_batches

AXES = config_lib.MESH_AXES


def measure(config, steps: int) -> dict:
    """Losses of `steps` steps, compile seconds and mean step seconds of `config` on its mesh."""
    n = int(np.prod([config.mesh[a] for a in AXES]))
    run = Run.resolve(config, jax.devices()[:n])
    factory, step_fn = train_step.build(run)
    batches = synthetic_batches(config, steps)
    if run.layout.permutation is not None:
        batches = [{k: v[:, run.layout.permutation] for k, v in b.items()} for b in batches]
    with jax.set_mesh(run.mesh):
        state = factory.create(config.seed)
        start = time.perf_counter()
        compiled = step_fn.lower(factory.abstract, batches[0]).compile()
        compile_s = time.perf_counter() - start
        losses, times = [], []
        for batch in batches:
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
            times.append(time.perf_counter() - start)
    return {"losses": losses, "compile_s": compile_s, "step_s": float(np.mean(times[1:] or times))}


def reference(moe: bool, ring: bool, steps: int, cache: dict) -> list[float]:
    if (moe, ring) not in cache:
        config = composed_config({"expert": 2 if moe else 1, "sequence": 2 if ring else 1})
        for axis in AXES:
            config.mesh[axis] = 8 if axis == "data" else 1
        cache[moe, ring] = measure(config, steps)["losses"]
    return cache[moe, ring]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-triples", action="store_true", help="only the six-axis mesh on 64 devices")
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke run: one triple (data, fsdp, tensor), 2 steps")
    args = parser.parse_args()
    meshes = [] if args.no_triples else [dict.fromkeys(t, 2) for t in itertools.combinations(AXES, 3)]
    if args.quick:
        meshes, args.steps = meshes[:1], 2
    else:
        meshes.append(dict.fromkeys(AXES, 2))
    refs, rows = {}, []
    print(f"{'mesh':52} {'schedule':8} {'attention':9} {'MoE':4} {'ZeRO':4} {'max rel loss diff':>17} "
          f"{'compile s':>9} {'step s':>7}", flush=True)
    for mesh in meshes:
        config = composed_config(mesh)
        for axis in AXES:
            config.mesh[axis] = mesh.get(axis, 1)
        result = measure(config, args.steps)
        want = reference(mesh.get("expert", 1) > 1, mesh.get("sequence", 1) > 1, args.steps, refs)
        diff = float(np.max(np.abs(np.array(result["losses"]) / np.array(want) - 1)))
        row = {"mesh": ",".join(f"{a}={n}" for a, n in mesh.items()), "devices": int(np.prod(list(mesh.values()))),
               "schedule": config.pipeline.schedule if mesh.get("stage", 1) > 1 else "-",
               "attention": config.attention.impl, "moe": bool(config.model.num_experts),
               "zero_stage": config.train.zero_stage, "max_rel_loss_diff": diff,
               "compile_s": round(result["compile_s"], 2), "step_s": round(result["step_s"], 4)}
        rows.append(row)
        print(f"{row['mesh']:52} {row['schedule']:8} {row['attention']:9} {str(row['moe']):4} "
              f"{row['zero_stage']:4} {diff:17.2e} {row['compile_s']:9.1f} {row['step_s']:7.3f}", flush=True)
    print(json.dumps({"bench": "compose", "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
