"""Checkpoint cost: save (blocking part and total), restore (same mesh and resharded) vs state size,
and the step-time overhead of saving asynchronously vs synchronously.

    python bench/checkpoint.py [--sizes tiny,100m] [--repeats 3] [--steps 40] [--every 5] [--dir /tmp/x]

Runs on whatever devices JAX sees (8 fake CPU devices when the platform is CPU). Prints a
table and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if jax.config.jax_platforms == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtrain import (  # noqa: E402
    checkpoint as checkpoint_lib,
    config as config_lib,
    data,
    mesh as mesh_lib,
    train_step as train_step_lib,
)
from meshtrain.config import ModelConfig  # noqa: E402

SIZES = {  # name -> model overrides (configs/tiny.py is the base)
    "tiny": {},
    "100m": {"vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4,
             "head_dim": 64, "mlp_dim": 2048},
}


def make_config(size: str, mesh: dict, steps: int = 100):
    config = config_lib.default_config()
    config.steps, config.train.batch_size, config.train.seq_len = steps, 8, 64
    config.model.vocab_size, config.model.d_model, config.model.n_layers = 264, 64, 4
    config.model.n_heads, config.model.n_kv_heads, config.model.head_dim, config.model.mlp_dim = 8, 4, 8, 192
    config.data.source = "synthetic"
    for key, value in SIZES[size].items():
        config.model[key] = value
    for axis in config_lib.MESH_AXES:
        config.mesh[axis] = mesh.get(axis, 1)
    config_lib.validate(config, math.prod(mesh.values()))
    return config


def setup(config, devices):
    mesh = mesh_lib.make_mesh(config, devices)
    factory, step_fn, _ = train_step_lib.build(config, mesh)
    return mesh, factory, step_fn


def state_bytes(abstract) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def bench_save_restore(size: str, repeats: int, root: str) -> dict:
    n = len(jax.devices())
    config = make_config(size, {"fsdp": n})
    _, factory, _ = setup(config, jax.devices())
    state = jax.block_until_ready(factory.create(0))
    other = make_config(size, {"data": 2, "fsdp": 2, "tensor": 2} if n >= 8 else {"fsdp": n})
    _, other_factory, _ = setup(other, jax.devices())
    out = {"size": size, "params": ModelConfig.from_config(config).num_params(),
           "state_bytes": state_bytes(factory.abstract), "mesh": f"fsdp={n}"}
    figures = {k: [] for k in ("async_blocking_s", "async_total_s", "sync_total_s", "restore_s",
                               "restore_resharded_s")}
    for r in range(repeats + 1):  # the first round warms up (orbax and tensorstore set-up)
        directory = os.path.join(root, f"{size}_{r}")
        for async_save in (True, False):
            ckpt = checkpoint_lib.Checkpointer(os.path.join(directory, str(async_save)), keep=1,
                                               async_save=async_save)
            t0 = time.perf_counter()
            ckpt.save(1, state, {"next_row": 0}, {"size": size})
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            if r:
                if async_save:
                    figures["async_blocking_s"].append(t1 - t0)
                    figures["async_total_s"].append(t2 - t0)
                else:
                    figures["sync_total_s"].append(t2 - t0)
            for key, abstract in (("restore_s", factory.abstract), ("restore_resharded_s", other_factory.abstract)):
                t0 = time.perf_counter()
                jax.block_until_ready(ckpt.restore(abstract).state)
                if r and async_save:
                    figures[key].append(time.perf_counter() - t0)
            ckpt.close()
        shutil.rmtree(directory)
    out.update({k: statistics.median(v) for k, v in figures.items()})
    out["write_gb_per_s"] = out["state_bytes"] / out["async_total_s"] / 1e9
    return out


def bench_step_overhead(steps: int, every: int, root: str) -> dict:
    """Mean step time of the tiny model with no checkpoints, async saves and sync saves every `every` steps."""
    config = make_config("tiny", {"fsdp": len(jax.devices())}, steps=steps)
    mesh, factory, step_fn = setup(config, jax.devices())
    batches = []
    it = data.make_iterator(config, mesh)
    for _ in range(steps):
        batches.append(next(it))
    it.close()
    out = {}
    for mode in ("none", "async", "sync", "none"):  # "none" twice: the first run also compiles
        state = factory.create(0)
        ckpt = None if mode == "none" else checkpoint_lib.Checkpointer(
            os.path.join(root, f"steps_{mode}"), keep=2, async_save=mode == "async")
        with jax.set_mesh(mesh):
            t0 = time.perf_counter()
            for step, batch in enumerate(batches, start=1):
                state, metrics = step_fn(state, batch)
                if ckpt and step % every == 0:
                    ckpt.save(step, state, {"next_row": step}, {})
            jax.block_until_ready(state)
            elapsed = time.perf_counter() - t0
        if ckpt:
            ckpt.close()
        out[f"step_ms_{mode}"] = elapsed / steps * 1e3
    out["async_overhead_pct"] = (out["step_ms_async"] / out["step_ms_none"] - 1) * 100
    out["sync_overhead_pct"] = (out["step_ms_sync"] / out["step_ms_none"] - 1) * 100
    out.update({"steps": steps, "every": every})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--dir", default="", help="where checkpoints are written (default: a temporary dir)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="meshtrain_ckpt_bench_")
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}, writing to {root}")
    results = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "save_restore": []}
    print(f"{'size':>6} {'params':>10} {'state MB':>9} {'blocking s':>11} {'async total s':>14} "
          f"{'sync s':>8} {'GB/s':>6} {'restore s':>10} {'resharded s':>12}")
    for size in args.sizes.split(","):
        r = bench_save_restore(size, args.repeats, root)
        results["save_restore"].append(r)
        print(f"{size:>6} {r['params'] / 1e6:>9.1f}M {r['state_bytes'] / 1e6:>9.1f} {r['async_blocking_s']:>11.3f} "
              f"{r['async_total_s']:>14.3f} {r['sync_total_s']:>8.3f} {r['write_gb_per_s']:>6.2f} "
              f"{r['restore_s']:>10.3f} {r['restore_resharded_s']:>12.3f}")
    s = bench_step_overhead(args.steps, args.every, root)
    results["step_overhead"] = s
    print(f"tiny step time, save every {s['every']} steps: none {s['step_ms_none']:.1f} ms, async "
          f"{s['step_ms_async']:.1f} ms ({s['async_overhead_pct']:+.1f}%), sync {s['step_ms_sync']:.1f} ms "
          f"({s['sync_overhead_pct']:+.1f}%)")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
