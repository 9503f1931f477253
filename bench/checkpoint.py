"""Checkpoint cost: save (blocking part and total), restore (same mesh and resharded) vs state size,
the CRC-32 checksums a save writes and a restore verifies (timed alone; part of both totals), and
the step-time overhead of saving asynchronously vs synchronously.

    python bench/checkpoint.py [--sizes tiny,100m] [--repeats 3] [--steps 40] [--every 5] [--dir /tmp/x]
                               [--crash_trials 30]

`--crash_trials N` also kills a training process (async save after every step) with SIGKILL
N times at random moments and checks after each kill that the newest finished checkpoint is
bitwise the uninterrupted run's state at its step and that the next process resumes from it.

Runs on whatever devices JAX sees (8 fake CPU devices when the platform is CPU). Prints a
table and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if jax.config.jax_platforms == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

from meshtrain import (  # noqa: E402
    checkpoint as checkpoint_lib,
    config as config_lib,
    data,
    model as model_lib,
    run_loop,
    train_step as train_step_lib,
)
from meshtrain.config import ModelConfig  # noqa: E402
from meshtrain.run import Run  # noqa: E402
from meshtrain.validate import validate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    validate(config, math.prod(mesh.values()))
    return config


def setup(config, devices):
    run = Run.resolve(config, devices)
    factory, step_fn = train_step_lib.build(run)
    return run, factory, step_fn


def state_bytes(abstract) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def bench_save_restore(size: str, repeats: int, root: str) -> dict:
    n = len(jax.devices())
    config = make_config(size, {"fsdp": n})
    _, factory, _ = setup(config, jax.devices())
    state = jax.block_until_ready(factory.create(0))
    other = make_config(size, {"data": 2, "fsdp": 2, "tensor": 2} if n >= 8 else {"fsdp": n})
    _, other_factory, _ = setup(other, jax.devices())
    out = {"size": size, "params": model_lib.num_params(ModelConfig.from_config(config)),
           "state_bytes": state_bytes(factory.abstract), "mesh": f"fsdp={n}"}
    figures = {k: [] for k in ("async_blocking_s", "async_total_s", "sync_total_s", "restore_s",
                               "restore_resharded_s", "checksum_s", "verify_s")}
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
                    # the CRC-32s a save writes (inside both totals) and a restore checks, alone
                    t0 = time.perf_counter()
                    checkpoint_lib.write_checksums(ckpt.step_path(1), jax.process_index())
                    t1 = time.perf_counter()
                    assert checkpoint_lib.verify_checksums(ckpt.step_path(1)) == []
                    figures["checksum_s"].append(t1 - t0)
                    figures["verify_s"].append(time.perf_counter() - t1)
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
    run, factory, step_fn = setup(config, jax.devices())
    mesh = run.mesh
    batches = []
    it = data.make_iterator(run)
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


CRASH_RUN = {"mesh.data": 1, "mesh.fsdp": 8, "model.dtype": "float32", "model.n_layers": 2, "train.seq_len": 32,
             "train.batch_size": 8, "log_every": 1, "data.source": "text_files", "checkpoint.every": 1,
             "checkpoint.keep": 2}


def _crash_config(steps: int, workdir: str):
    spec = importlib.util.spec_from_file_location("tiny_config", os.path.join(ROOT, "configs", "tiny.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    for key, value in {**CRASH_RUN, "steps": steps, "workdir": workdir}.items():
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def _digest(tree) -> list[str]:
    return [hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest() for x in jax.tree.leaves(tree)]


def bench_crash_trials(trials: int, root: str, seed: int = 0) -> dict:
    """SIGKILL a training process `trials` times at random moments; verify every restart."""
    steps = 40 + 4 * trials
    workdir = os.path.join(root, "crash")
    config = _crash_config(steps, workdir)
    run, factory, step_fn = setup(config, jax.devices()[:8])
    state, it, reference = factory.create(config.seed), data.make_iterator(run), {}
    with jax.set_mesh(run.mesh):
        for step in range(1, steps + 1):
            state, _ = step_fn(state, next(it))
            reference[step] = _digest(state)
    it.close()
    cache = os.path.join(root, "jax_cache")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "float32", "PYTHONPATH": ROOT,
           "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    flags = [f"--config.{k}={v}" for k, v in {**CRASH_RUN, "steps": steps, "workdir": workdir}.items()]
    cmd = [sys.executable, "-m", "meshtrain.train", "--config", os.path.join(ROOT, "configs", "tiny.py"), *flags]
    rng, expected, out = np.random.default_rng(seed), 0, {"trials": 0, "killed_mid_save": 0, "bitwise_ok": 0,
                                                          "resumed_ok": 0, "no_checkpoint": 0}
    ckpt_root = checkpoint_lib.checkpoint_root(workdir)
    for trial in range(trials):
        log_path = os.path.join(root, "crash.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for, deadline = expected + (2 if trial == 0 else 0), time.monotonic() + 300
        while True:
            text = open(log_path).read()
            if any(s > wait_for for s in run_loop.logged_steps(text)) or proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"trial {trial}: no progress in 300 s:\n{text[-2000:]}")
            time.sleep(0.02)
        if proc.poll() is not None:
            break  # the run finished
        time.sleep(rng.uniform(0.0, 0.15))
        out["killed_mid_save"] += any("orbax-checkpoint-tmp" in name for name in os.listdir(ckpt_root))
        proc.kill()
        proc.wait()
        resumed = run_loop.resumed_step(open(log_path).read())
        out["resumed_ok"] += resumed == expected if resumed is not None else expected == 0
        ckpt = checkpoint_lib.Checkpointer(ckpt_root, read_only=True)
        latest = ckpt.latest_step()
        if latest is None:
            out["no_checkpoint"] += 1
        else:
            restored = ckpt.restore(factory.abstract, latest)
            out["bitwise_ok"] += _digest(restored.state) == reference[latest]
            expected = latest
        ckpt.close()
        out["trials"] += 1
    out["last_step"] = expected
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--dir", default="", help="where checkpoints are written (default: a temporary dir)")
    parser.add_argument("--crash_trials", type=int, default=0, help="SIGKILL trials (0: none)")
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: the tiny state once, 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.steps, args.every = "tiny", 1, 10, 5
    root = args.dir or tempfile.mkdtemp(prefix="meshtrain_ckpt_bench_")
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}, writing to {root}")
    results = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "save_restore": []}
    print(f"{'size':>6} {'params':>10} {'state MB':>9} {'blocking s':>11} {'async total s':>14} "
          f"{'sync s':>8} {'GB/s':>6} {'restore s':>10} {'resharded s':>12} {'crc32 s':>8} {'verify s':>9}")
    for size in args.sizes.split(","):
        r = bench_save_restore(size, args.repeats, root)
        results["save_restore"].append(r)
        print(f"{size:>6} {r['params'] / 1e6:>9.1f}M {r['state_bytes'] / 1e6:>9.1f} {r['async_blocking_s']:>11.3f} "
              f"{r['async_total_s']:>14.3f} {r['sync_total_s']:>8.3f} {r['write_gb_per_s']:>6.2f} "
              f"{r['restore_s']:>10.3f} {r['restore_resharded_s']:>12.3f} {r['checksum_s']:>8.3f} "
              f"{r['verify_s']:>9.3f}")
    s = bench_step_overhead(args.steps, args.every, root)
    results["step_overhead"] = s
    print(f"tiny step time, save every {s['every']} steps: none {s['step_ms_none']:.1f} ms, async "
          f"{s['step_ms_async']:.1f} ms ({s['async_overhead_pct']:+.1f}%), sync {s['step_ms_sync']:.1f} ms "
          f"({s['sync_overhead_pct']:+.1f}%)")
    if args.crash_trials:
        c = bench_crash_trials(args.crash_trials, root)
        results["crash_trials"] = c
        print(f"crash trials: {c['trials']} SIGKILLs ({c['killed_mid_save']} with a save in flight), newest checkpoint "
              f"bitwise correct {c['bitwise_ok']}/{c['trials']}, restarts resumed from it {c['resumed_ok']}/"
              f"{c['trials']}, kills leaving no checkpoint {c['no_checkpoint']}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results))
    if args.crash_trials:
        c = results["crash_trials"]
        failed = [f"{name} {c[key]}/{args.crash_trials}" for name, key in
                  (("trials run", "trials"), ("bitwise correct", "bitwise_ok"), ("resumed", "resumed_ok"))
                  if c[key] < args.crash_trials]
        if failed:  # a benchmark that ran fewer trials than asked proves nothing
            print(f"FAIL: crash trials: {', '.join(failed)}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
