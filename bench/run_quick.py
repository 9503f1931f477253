"""Every benchmark's `--quick` smoke run, one after another: each must exit 0 and end with its JSON line.

    python bench/run_quick.py                 # bench/*.py and bench/gpu/*.py, one at a time
    python bench/run_quick.py --jobs 2        # two at a time (CI: a smoke run's seconds are not figures)
    python bench/run_quick.py comm pipeline   # only these

A benchmark nothing runs rots (an import moved, a function renamed). CI runs every one in its quick
mode, with JAX's persistent compilation cache in the per-user cache folder (`meshtrain.compile_cache`:
a program an earlier quick run compiled is read back; a smoke run's times are not figures).
`bench/aot.py` needs XLA's GPU compiler (the `gpu` extra) and runs with it, in `.ci/run`'s gpu_aot
part, when the extra is not installed here. Prints a table and one JSON line; exits 1 if any
benchmark failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

BENCH = pathlib.Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
NEEDS_GPU_COMPILER = ("aot",)  # run by .ci/run's gpu_aot part where the gpu extra is not installed
# A benchmark run as a script, with the shared compilation cache guarded first (as every meshtrain
# command guards it: `compile_cache.guard_jax_cache`).
GUARDED = ("import runpy, sys; from meshtrain import compile_cache; compile_cache.guard_jax_cache(); "
           "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def benchmarks() -> list[pathlib.Path]:
    """Every benchmark script: bench/*.py and bench/gpu/*.py, this runner and helpers (`_*.py`) excepted."""
    found = sorted(BENCH.glob("*.py")) + sorted((BENCH / "gpu").glob("*.py"))
    return [p for p in found if p.name != pathlib.Path(__file__).name and not p.name.startswith("_")]


def name_of(path: pathlib.Path) -> str:
    return str(path.relative_to(BENCH).with_suffix(""))


def has_gpu_compiler() -> bool:
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


def run_one(path: pathlib.Path, timeout: float) -> dict:
    from meshtrain import compile_cache

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           **compile_cache.jax_cache_env(compile_cache.cache_dir() / "jax")}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", GUARDED, str(path), "--quick"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"bench": name_of(path), "ok": False, "seconds": round(time.perf_counter() - start, 1),
                "error": f"timed out after {timeout:.0f} s"}
    seconds = round(time.perf_counter() - start, 1)
    lines = proc.stdout.strip().splitlines()
    error = ""
    if proc.returncode != 0:
        error = f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
    else:
        try:
            json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            error = "its last line is not a JSON line"
    return {"bench": name_of(path), "ok": not error, "seconds": seconds, "error": error[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all), e.g. comm gpu/mfu")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per benchmark")
    parser.add_argument("--jobs", type=int, default=1, help="benchmarks run at once (CI: 2, one a core)")
    args = parser.parse_args()
    every = {name_of(p): p for p in benchmarks()}
    unknown = sorted(set(args.names) - set(every))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {sorted(every)}")
    chosen = args.names or [n for n in every if n not in NEEDS_GPU_COMPILER or has_gpu_compiler()]
    def one(name: str) -> dict:
        print(f"python bench/{name}.py --quick ...", file=sys.stderr, flush=True)
        return run_one(every[name], args.timeout)

    with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        rows = list(pool.map(one, chosen))
    print(f"{'benchmark':<18} {'seconds':>8}  result")
    for r in rows:
        print(f"{r['bench']:<18} {r['seconds']:>8.1f}  {'ok' if r['ok'] else 'FAILED: ' + r['error']}")
    left = sorted(set(every) - set(chosen))
    if left:
        print(f"not run here: {', '.join(left)} (needs the gpu extra: .ci/run's gpu_aot part runs it)")
    print(json.dumps({"bench": "run_quick", "rows": rows, "not_run": left,
                      "seconds": round(sum(r["seconds"] for r in rows), 1)}))
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
