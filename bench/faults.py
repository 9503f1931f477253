"""Fault injection, N trials per fault: is each one caught, is the run recovered, is anything lost?

    python bench/faults.py [--trials 10] [--kill_trials 10] [--disk_trials 2] [--hang_trials 2]
                           [--spike_trials 2] [--lock_trials 2] [--interrupt_trials 2]
                           [--save_fail_trials 2] [--dir /tmp/x]

Faults (each injected for real, on files and processes):

* checkpoint damage: a saved checkpoint gets, at random, a truncated array file, a flipped byte
  at a random offset of an array file, a missing metadata file or a garbled JSON item; `resume`
  must name it, move it aside unchanged and restore the previous checkpoint bitwise.
* data damage: a prepared text_files shard truncated or altered at a random offset; tokenizing
  must stop with one error naming the shard.
* SIGKILL at a random moment of a training process saving after every step (`bench/checkpoint.py`'s
  trials): the newest finished checkpoint must be bitwise the uninterrupted run's and the next
  process must resume from it.
* disk full: the checkpoint directory is a 3 MiB tmpfs in a private mount namespace; the run must
  stop with exit code 4, keep every finished checkpoint intact, and resume once the disk grows.
* hung peer: process 1 of a 2-process job stops itself (SIGSTOP) mid-step or mid-save; process 0
  must end with exit code 5 within `train.hang_timeout_s`, and the relaunched job resume from the
  newest finished checkpoint to the losses of an uninterrupted 1 x 8 run.
* loss spike: planted rows of random tokens; the guarded run must roll back, skip exactly those
  rows and train the losses of a run that never saw them.

* busy workdir: a second `python -m meshtrain.train` on a workdir another process holds must stop
  at once (exit 2, one line naming the holder's pid); once the holder is SIGKILLed the same command
  must train.
* Ctrl-C: SIGINT mid-run must save at the end of the step and exit 130 with one line, and the
  relaunch resume from that step; a second SIGINT while saving must abort at once.
* save fails: the training process may not write files over 256 KiB (RLIMIT_FSIZE, as a full disk
  fails a write); the run must stop before its next save with exit 4 and one line.

With `--crash-points` it runs the crash-point sweep instead (`meshtrain.crash_points`): a short job
(text_files data prepared on the way, a checkpoint every step) recorded once, then killed right before
each file operation it performed in its workdir and data folder (a write: after half its bytes),
relaunched, and compared bit for bit with the uninterrupted run; one process and two (`meshtrain.launch`
on 127.0.0.1). `--quick`: 12 points of one process and 4 of two, spread over every kind of operation
and file; `--crash-limit N`: N points of one process (at most 40 of two); without either: every point of one
process and 40 of two.
The table: per file kind, operations recorded, kill points tried, resumes bit-equal, anything lost
(must be 0), relaunches that ended unclear (must be 0), and trials that left an old checkpoint over (a
kill in the middle of deleting it, after the run's last save: the next save of that workdir deletes it).

The last six run their tests (`tests/test_checkpoint_crash.py`, `tests/test_launch.py`,
`tests/test_loss_spike.py`, `tests/test_reliability.py`), each case of a test one trial.

"data lost" counts finished checkpoints (or damaged bytes set aside) that a trial deleted or
changed: it must be 0. Prints a table and one JSON line; exits 1 if a trial was not recovered.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if jax.config.jax_platforms == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import numpy as np  # noqa: E402

from meshtrain import checkpoint as checkpoint_lib, config as config_lib  # noqa: E402
from meshtrain.data import sources  # noqa: E402


def _bench_checkpoint():
    spec = importlib.util.spec_from_file_location("bench_checkpoint", os.path.join(ROOT, "bench", "checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _array_files(step_dir: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
                  if f"{os.sep}d{os.sep}" in os.path.join(d, f))


def damage(step_dir: str, rng) -> str:
    """One random damage of a checkpoint step; returns what was done."""
    kind = ["truncate", "flip", "remove-metadata", "garble-json"][rng.integers(4)]
    files = _array_files(step_dir)
    path = files[rng.integers(len(files))]
    if kind == "truncate":
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(int(rng.integers(0, size)))
    elif kind == "flip":
        data = bytearray(open(path, "rb").read())
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        open(path, "wb").write(bytes(data))
    elif kind == "remove-metadata":
        path = os.path.join(step_dir, "state", "_METADATA")
        os.remove(path)
    else:
        path = os.path.join(step_dir, ("data", "meta")[rng.integers(2)], "metadata")
        with open(path, "r+b") as f:
            f.seek(int(rng.integers(max(1, os.path.getsize(path)))))
            f.write(b"\x00garbled")
    return f"{kind} {os.path.relpath(path, step_dir)}"


def checkpoint_trials(trials: int, root: str, rng) -> dict:
    bench = _bench_checkpoint()
    config = bench._crash_config(4, os.path.join(root, "unused"))
    _, factory, _ = bench.setup(config, jax.devices()[:8])
    pristine = os.path.join(root, "pristine")
    ckpt = checkpoint_lib.Checkpointer(pristine, keep=10)
    states = {}
    for step in (1, 2):
        state = jax.block_until_ready(factory.create(step))  # two different states
        ckpt.save(step, state, {"next_row": 8 * step}, {"step": step})
        states[step] = jax.tree.map(np.asarray, state)
    ckpt.close()
    out = {"fault": "checkpoint damage", "trials": 0, "caught": 0, "recovered": 0, "data_lost": 0, "kinds": {}}
    for trial in range(trials):
        work = os.path.join(root, f"damage_{trial}")
        shutil.copytree(pristine, os.path.join(work, "checkpoints"))
        what = damage(os.path.join(work, "checkpoints", "2"), rng)
        kind = what.split()[0]
        out["kinds"][kind] = out["kinds"].get(kind, 0) + 1
        damaged_copy = os.path.join(root, f"damaged_{trial}")
        shutil.copytree(os.path.join(work, "checkpoints", "2"), damaged_copy)
        config.workdir = work
        ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(work))
        restored = checkpoint_lib.resume(config, ckpt, factory.abstract)
        ckpt.close()
        out["trials"] += 1
        moved = os.path.join(checkpoint_lib.checkpoint_root(work) + ".damaged", "2")
        out["caught"] += restored.step == 1 and os.path.isdir(moved)
        same = all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(restored.state),
                                                                     jax.tree.leaves(states[1]), strict=True))
        out["recovered"] += restored.step == 1 and same
        cmp = filecmp.dircmp(moved, damaged_copy) if os.path.isdir(moved) else None
        kept = cmp is not None and not (cmp.diff_files or cmp.left_only or cmp.right_only)
        intact = checkpoint_lib.verify_checksums(os.path.join(checkpoint_lib.checkpoint_root(work), "1")) == []
        out["data_lost"] += (not kept) + (not intact)
        shutil.rmtree(work)
        shutil.rmtree(damaged_copy)
        print(f"  damage trial {trial}: {what} -> restored step {restored.step}", file=sys.stderr)
    return out


def data_trials(trials: int, root: str, rng) -> dict:
    corpus = os.path.join(root, "corpus")
    os.makedirs(corpus, exist_ok=True)
    with open(os.path.join(corpus, "docs.jsonl"), "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 17 + 1)}) + "\n")
    out = {"fault": "data damage", "trials": 0, "caught": 0, "recovered": 0, "data_lost": 0}
    for trial in range(trials):
        config = config_lib.default_config()
        config.data.source, config.data.files = "text_files", os.path.join(corpus, "docs.jsonl")
        config.data.data_dir = os.path.join(root, f"tfds_{trial}")
        result = sources.builder(config)
        shard = next(os.path.join(result.data_dir, n) for n in sorted(os.listdir(result.data_dir))
                     if "-train.array_record-" in n)
        data = bytearray(open(shard, "rb").read())
        if rng.integers(2):
            data = data[:int(rng.integers(len(data)))]
        else:
            data[int(rng.integers(len(data)))] ^= 0xFF
        open(shard, "wb").write(bytes(data))
        out["trials"] += 1
        try:
            sources.token_cache(sources.builder(config), "train", config)
        except config_lib.ConfigError as error:
            out["caught"] += os.path.basename(shard) in str(error)
            out["recovered"] += os.path.basename(shard) in str(error)  # stopped before training on it
        shutil.rmtree(config.data.data_dir)
    return out


def kill_trials(trials: int, root: str) -> dict:
    os.makedirs(root, exist_ok=True)
    c = _bench_checkpoint().bench_crash_trials(trials, root)
    return {"fault": "SIGKILL mid-run", "trials": c["trials"], "caught": c["trials"],
            "recovered": min(c["bitwise_ok"], c["resumed_ok"]), "data_lost": c["trials"] - c["bitwise_ok"],
            "killed_mid_save": c["killed_mid_save"]}


def test_trials(fault: str, test: str, trials: int, root: str) -> dict:
    """Runs the test that injects `fault` (a pytest node id; each of its cases is one trial) `trials` times."""
    out = {"fault": fault, "trials": 0, "caught": 0, "recovered": 0, "data_lost": 0}
    os.makedirs(root, exist_ok=True)
    for trial in range(trials):
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", test,
                                 "--basetemp", os.path.join(root, f"trial_{trial}")], cwd=ROOT,
                                capture_output=True, text=True)
        cases = [line for line in result.stdout.splitlines() if line.startswith(("PASSED ", "FAILED ", "ERROR "))]
        if not cases:
            print(result.stdout[-3000:], file=sys.stderr)
            cases = ["ERROR (no test ran)"]
        passed = sum(line.startswith("PASSED ") for line in cases)
        out["trials"] += len(cases)
        out["caught"] += passed
        out["recovered"] += passed
        if passed < len(cases):
            print(result.stdout[-3000:], file=sys.stderr)
    return out


def crash_point_sweep(root: str, limits: dict[int, int | None]) -> list[dict]:
    """`crash_points.sweep` for each process count in `limits` (None: every point); its summaries."""
    from meshtrain import compile_cache, crash_points

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "float32", "PYTHONPATH": ROOT,
           **compile_cache.jax_cache_env(compile_cache.cache_dir() / "jax")}
    out = []
    for processes, limit in limits.items():
        result = crash_points.sweep(os.path.join(root, f"processes_{processes}"), limit=limit, processes=processes,
                                    env=env, progress=lambda line: print(line, file=sys.stderr))
        out.append(result)
    return out


def print_crash_table(results: list[dict]) -> bool:
    """The sweep's table (per file kind) and JSON line; True when every point's kill fired (a point whose
    process ended before it tested nothing) and every relaunch resumed bit-equal, clearly."""
    print(f"{'processes':>9} {'file kind':<14} {'operations':>10} {'tried':>5} {'killed':>6} {'bit-equal':>9} "
          f"{'lost':>4} {'unclear':>7} {'left over':>9}")
    for result in results:
        for kind in sorted(result["file_kinds"]):
            rows = [r for r in result["rows"] if r["file_kind"] == kind]
            print(f"{result['processes']:>9} {kind:<14} {result['file_kinds'][kind]:>10} {len(rows):>5} "
                  f"{sum(r['reached'] for r in rows):>6} {sum(r['bit_equal'] for r in rows):>9} "
                  f"{sum(r['lost'] for r in rows):>4} {sum(not r['clear'] for r in rows):>7} "
                  f"{sum(bool(r['left_over']) for r in rows):>9}")
        print(f"{result['processes']:>9} {'all':<14} {result['operations']:>10} {result['tried']:>5} "
              f"{result['reached']:>6} {result['bit_equal']:>9} {result['lost']:>4} {result['unclear']:>7} "
              f"{result['left_over']:>9}"
              f"   ({result['seconds']:.0f} s; by kind of operation: {result['operations_by_kind']})")
    print(json.dumps({"bench": "faults", "crash_points": [{k: v for k, v in r.items() if k != "rows"}
                                                         for r in results]}))
    return all(r["reached"] == r["bit_equal"] == r["tried"] and not r["lost"] and not r["unclear"] and r["tried"]
               for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10, help="checkpoint and data damage trials each")
    parser.add_argument("--kill_trials", type=int, default=10)
    parser.add_argument("--disk_trials", type=int, default=2)
    parser.add_argument("--hang_trials", type=int, default=2, help="each runs the mid-step and the mid-save case")
    parser.add_argument("--spike_trials", type=int, default=2)
    parser.add_argument("--lock_trials", type=int, default=2, help="a second run on a busy workdir")
    parser.add_argument("--interrupt_trials", type=int, default=2, help="Ctrl-C: save and exit 130, and twice: abort")
    parser.add_argument("--save_fail_trials", type=int, default=2, help="a save that fails (file size limit)")
    parser.add_argument("--dir", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke run: one checkpoint, data and kill trial; no test-suite trials")
    parser.add_argument("--crash-points", action="store_true",
                        help="the crash-point sweep (meshtrain.crash_points) instead of the faults above")
    parser.add_argument("--crash-limit", type=int, default=None, help="kill points per process count")
    args = parser.parse_args()
    if args.crash_points:
        limits = {1: 12, 2: 4} if args.quick else {1: args.crash_limit, 2: min(args.crash_limit or 40, 40)}
        root = args.dir or tempfile.mkdtemp(prefix="meshtrain_crash_points_")
        ok = print_crash_table(crash_point_sweep(root, limits))
        if not ok:
            print("FAIL: a crash point's kill did not fire, or its relaunch did not resume bit-equal, lost data or "
                  "ended unclear", file=sys.stderr)
            sys.exit(1)
        return
    if args.quick:
        args.trials, args.kill_trials, args.disk_trials, args.hang_trials, args.spike_trials = 1, 1, 0, 0, 0
        args.lock_trials = args.interrupt_trials = args.save_fail_trials = 0
    root = args.dir or tempfile.mkdtemp(prefix="meshtrain_faults_")
    rng = np.random.default_rng(args.seed)
    rows = []
    if args.trials:
        rows += [checkpoint_trials(args.trials, os.path.join(root, "ckpt"), rng),
                 data_trials(args.trials, os.path.join(root, "data"), rng)]
    if args.kill_trials:
        rows.append(kill_trials(args.kill_trials, os.path.join(root, "kill")))
    for fault, test, trials in (
            ("disk full during a save", "tests/test_checkpoint_crash.py::"
             "test_disk_full_during_a_save_stops_cleanly_and_resumes", args.disk_trials),
            ("hung peer (step; save)", "tests/test_launch.py::"
             "test_a_hung_process_ends_the_job_and_the_relaunch_resumes",
             args.hang_trials),
            ("loss spike (planted rows)", "tests/test_loss_spike.py::"
             "test_a_planted_spike_is_rolled_back_and_its_rows_skipped", args.spike_trials),
            ("busy workdir (2nd run)", "tests/test_reliability.py::"
             "test_a_killed_holder_never_blocks_and_a_live_one_is_named_on_the_command_line", args.lock_trials),
            ("Ctrl-C (once; twice)", "tests/test_reliability.py::"
             "test_ctrl_c_saves_exits_130_and_the_relaunch_resumes_where_a_second_ctrl_c_aborts",
             args.interrupt_trials),
            ("save fails (RLIMIT_FSIZE)", "tests/test_reliability.py::"
             "test_a_failed_save_ends_the_run_in_seconds_with_one_line", args.save_fail_trials)):
        if trials:
            rows.append(test_trials(fault, test, trials, os.path.join(root, fault.split()[0])))
    print(f"{'fault':<27} {'trials':>6} {'caught':>6} {'recovered':>9} {'data lost':>9}")
    for r in rows:
        print(f"{r['fault']:<27} {r['trials']:>6} {r['caught']:>6} {r['recovered']:>9} {r['data_lost']:>9}")
    print(json.dumps({"bench": "faults", "rows": rows}))
    bad = [r["fault"] for r in rows if r["recovered"] < r["trials"] or r["data_lost"] or not r["trials"]]
    if bad:
        print(f"FAIL: not every trial recovered, or data lost: {bad}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
