"""Restarts without recompiling, and a killed run's wall clock accounted: a run killed twice.

    python bench/restart.py [--quick] [--dir /tmp/x]

Trains `configs/tiny.py` for 16 steps (a checkpoint every 4) on one CPU device with an empty compile
cache folder (`train.compile_cache_dir`). The first process stops itself once step 7 is dispatched
(`MESHTRAIN_INJECT=stop:step:7`) and is killed; the same command resumes from step 4, reading its
compiled programs back from the cache, and is killed at step 14 the same way; the third resumes from
step 12 and finishes. Each process's log line "first step (N) done X s after the process started:
compile C s (H program(s) read back from the compile cache, M compiled)" gives its figures, and
`python -m meshtrain.report`'s goodput and badput parts (`meshtrain.badput`) are set against the
processes' wall clock measured from outside. One CPU device: XLA:CPU cannot run a program read back
whose collectives sit in more than one computation (`meshtrain.compile_cache`), so a CPU run on
several devices compiles such a step again; on a GPU every program is read back.

Targets: each restart reaches its first step in at most half the cold start's time, having read its
programs back (none compiled); the report's parts add up to its wall clock, and that to the
processes' own within 2% (what it cannot see: the interpreter's teardown after its last exit
handler, and the moments between a killed process's last step and its end). Prints a table and one
JSON line; exits 1 on a miss. `--quick`: the same (it is short), for CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from meshtrain import faults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.5  # warm / cold time to the first step
WALL_TOLERANCE = 0.02  # the report's wall clock against the processes'
STEPS, EVERY, STOPS = 16, 4, (7, 14)
FIRST_STEP = re.compile(r"first step \((\d+)\) done ([\d.]+) s after the process started: compile ([\d.]+) s "
                        r"\((?:(\d+) program\(s\) read back from the compile cache, (\d+) compiled|no persistent "
                        r"compile cache)\)")


def command(workdir: str, cache: str, steps: int, every: int) -> list[str]:
    return [sys.executable, "-m", "meshtrain.train", "--config", os.path.join(ROOT, "configs", "tiny.py"),
            f"--config.workdir={workdir}", f"--config.steps={steps}", f"--config.checkpoint.every={every}",
            "--config.log_every=1", "--config.cpu_devices=1", "--config.mesh.data=1",
            f"--config.train.compile_cache_dir={cache}"]


def launch(argv: list[str], log_path: str, stop_at: int = 0, timeout: float = 600) -> dict:
    """Runs `argv` to its end, or (stop_at > 0) until it stops itself once step `stop_at` is dispatched,
    then SIGKILLs it. Returns {"wall_s" (from the start to its exit or its stop), "returncode", "log",
    "first_step": the first-step line's figures or None}."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the folder on the command line is the one measured
    if stop_at:
        env["MESHTRAIN_INJECT"] = f"stop:step:{stop_at}"
    else:
        env.pop("MESHTRAIN_INJECT", None)
    start = time.time()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        while proc.poll() is None:
            if stop_at and faults.stopped(proc.pid):
                end = time.time()
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                break
            if time.time() - start > timeout:
                proc.kill()
                raise RuntimeError(f"{' '.join(argv)}: no end after {timeout:.0f} s (log: {log_path})")
            time.sleep(0.02)
        else:
            end = time.time()
    with open(log_path) as f:
        text = f.read()
    found = FIRST_STEP.search(text)
    first = None if not found else {"step": int(found[1]), "seconds": float(found[2]), "compile_s": float(found[3]),
                                    "read_back": int(found[4] or 0), "compiled": int(found[5] or 0)}
    return {"wall_s": end - start, "returncode": proc.returncode, "log": text, "first_step": first}


def measure(folder: str) -> dict:
    """The three processes (module docstring): their figures and the workdir."""
    os.makedirs(folder, exist_ok=True)
    workdir, cache = os.path.join(folder, "run"), os.path.join(folder, "cache")
    argv = command(workdir, cache, STEPS, EVERY)
    runs = [launch(argv, os.path.join(folder, f"process_{i}.log"), stop_at=stop)
            for i, stop in enumerate((*STOPS, 0))]
    for run in runs:
        if run["first_step"] is None:
            raise RuntimeError(f"a process reached no first step (exit {run['returncode']}):\n{run['log'][-3000:]}")
    if runs[-1]["returncode"] != 0:
        raise RuntimeError(f"the last restart failed (exit {runs[-1]['returncode']}):\n{runs[-1]['log'][-3000:]}")
    return {"runs": runs, "workdir": workdir}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the same measurement (it is short), for CI")
    parser.add_argument("--dir", default="", help="working folder (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.dir or tmp)
        from meshtrain import badput  # after the runs: this process starts nothing of JAX's before them

        goodput = badput.summarize(result["workdir"])
        report = subprocess.run([sys.executable, "-m", "meshtrain.report", result["workdir"]], capture_output=True,
                                text=True, cwd=ROOT)
    runs = result["runs"]
    cold = runs[0]["first_step"]
    rows = [("process", "ended", "first step", "to first step (s)", "compile (s)", "read back", "compiled", "wall (s)")]
    for i, run in enumerate(runs):
        f = run["first_step"]
        rows.append((str(i), "killed" if i < len(STOPS) else f"exit {run['returncode']}", str(f["step"]),
                     f"{f['seconds']:.2f}", f"{f['compile_s']:.2f}", str(f["read_back"]), str(f["compiled"]),
                     f"{run['wall_s']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(report.stdout.split("goodput", 1)[-1].join(("goodput", "")) if "goodput" in report.stdout else report.stderr)
    ratios = [run["first_step"]["seconds"] / cold["seconds"] for run in runs[1:]]
    read_back = all(run["first_step"]["compiled"] == 0 and run["first_step"]["read_back"] > 0 for run in runs[1:])
    outside = sum(run["wall_s"] for run in runs)
    parts = goodput["productive_s"] + sum(goodput["badput_s"].values())
    wall_error = abs(goodput["wall_s"] - outside) / outside
    met = max(ratios) <= TARGET and read_back and abs(parts - goodput["wall_s"]) <= 1e-6 * goodput["wall_s"] \
        and wall_error <= WALL_TOLERANCE and report.returncode == 0
    print(f"restart / cold start to the first step: {', '.join(f'{r:.2f}' for r in ratios)} (target <= {TARGET}); "
          f"report's wall clock {goodput['wall_s']:.2f} s against the processes' {outside:.2f} s: "
          f"{wall_error:.1%} apart (target <= {WALL_TOLERANCE:.0%})")
    print(json.dumps({"bench": "restart", "cold_first_step_s": cold["seconds"],
                      "restart_first_step_s": [run["first_step"]["seconds"] for run in runs[1:]],
                      "cold_compile_s": cold["compile_s"],
                      "restart_compile_s": [run["first_step"]["compile_s"] for run in runs[1:]],
                      "ratios": ratios, "read_back": read_back, "target": TARGET, "processes_wall_s": outside,
                      "wall_error": wall_error, "goodput": goodput, "met": met}))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
