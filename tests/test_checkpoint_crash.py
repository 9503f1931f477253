"""Crash safety and preemption of real training processes.

One workdir goes through 4 SIGKILL trials at random moments (a checkpoint is saved
asynchronously after every step, so most kills land during a save), then a SIGTERM
(preemption), then a final run to the end. After every trial the newest finished checkpoint
must be bitwise the reference state of its step, and the next process must resume from it.
`python bench/faults.py` (and `bench/checkpoint.py --crash_trials N`) run the same trials 10 times
and more.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from meshtrain import checkpoint as checkpoint_lib, data, run_loop, train_step as train_step_lib
from meshtrain.run import Run
from tests.utils import ROOT, cli_args, config_for, load, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache")]

STEPS = 80
KILL_TRIALS = 2  # bench/faults.py runs 10 for the statistics
WAIT_S = 240  # bound on any wait for a training process


def digest(tree) -> list[str]:
    return [hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest() for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def reference_digests():
    """Digest of the full train state after every step of an uninterrupted run (same config)."""
    run = Run.resolve(config_for("/unused", **{"steps": STEPS}))
    factory, step_fn = train_step_lib.build(run)
    state, it, out = factory.create(run.config.seed), data.make_iterator(run), {}
    with jax.set_mesh(run.mesh):
        for step in range(1, STEPS + 1):
            state, _ = step_fn(state, next(it))
            out[step] = digest(state)
    it.close()
    return out, factory.abstract


class Trial:
    """One training process whose output goes to a file."""

    def __init__(self, workdir, log_path, env):
        self.log_path = log_path
        overrides = {"steps": STEPS, "workdir": workdir, "checkpoint.every": 1, "checkpoint.keep": 2}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "meshtrain.train", *cli_args(overrides)],
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def steps(self) -> list[int]:
        return run_loop.logged_steps(self.output())

    def resumed_from(self) -> int | None:
        return run_loop.resumed_step(self.output())

    def wait_for_step_after(self, start: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while not any(s > start for s in self.steps()):
            assert self.proc.poll() is None, f"exited early ({self.proc.returncode}):\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no step after {start} within {WAIT_S}s:\n{self.output()[-3000:]}"
            time.sleep(0.02)

    def finish(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def check_latest(workdir, digests, abstract) -> int:
    """The newest finished checkpoint exists and is bitwise the reference state of its step."""
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(workdir), read_only=True)
    latest = ckpt.latest_step()
    ckpt.close()
    assert latest is not None, "no usable checkpoint left"
    restored = load(workdir, latest, abstract)
    assert digest(restored.state) == digests[latest], f"checkpoint {latest} differs from the reference"
    assert restored.data_state["next_row"] == latest * 8
    return latest


def test_sigkill_trials_then_sigterm_then_finish(reference_digests, tmp_path, compilation_cache):
    digests, abstract = reference_digests
    env, workdir, rng = subprocess_env(compilation_cache), str(tmp_path / "run"), np.random.default_rng(0)
    expected_start = 0
    for trial in range(KILL_TRIALS):
        t = Trial(workdir, tmp_path / f"trial{trial}.log", env)
        # the first run waits for step 3: its save of step 2 waited for the first checkpoint to finish
        t.wait_for_step_after(expected_start + (2 if trial == 0 else 0))
        time.sleep(rng.uniform(0.0, 0.15))
        t.proc.kill()
        t.finish()
        assert (t.resumed_from() or 0) == expected_start, t.output()[-2000:]
        expected_start = check_latest(workdir, digests, abstract)
        assert expected_start < STEPS, "the run finished before all trials were done"

    # Preemption: SIGTERM at a random step -> exit 0 with a checkpoint at the step it was on.
    t = Trial(workdir, tmp_path / "preempted.log", env)
    t.wait_for_step_after(expected_start)
    time.sleep(rng.uniform(0.0, 0.15))
    t.proc.send_signal(signal.SIGTERM)
    assert t.finish() == 0, t.output()[-3000:]
    assert t.resumed_from() == expected_start
    preempted_at = check_latest(workdir, digests, abstract)
    assert preempted_at == t.steps()[-1] and "preempted: checkpoint saved at step" in t.output()

    t = Trial(workdir, tmp_path / "final.log", env)
    assert t.finish() == 0, t.output()[-3000:]
    assert t.resumed_from() == preempted_at and t.steps()[0] == preempted_at + 1
    assert check_latest(workdir, digests, abstract) == STEPS


def test_cli_stops_on_a_real_divergence_with_exit_code_3(tmp_path, compilation_cache):
    """A learning rate of 1e30 makes step 2's gradients non-finite: the process names the step and the
    last good checkpoint, flushes metrics.jsonl, and exits 3 without saving step 2."""
    workdir = tmp_path / "run"
    args = cli_args({"steps": 12, "workdir": workdir, "checkpoint.every": 1, "train.learning_rate": 1e30,
                     "train.warmup_steps": 0})
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", *args], cwd=ROOT, capture_output=True,
                          text=True, env=subprocess_env(compilation_cache), timeout=WAIT_S)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    last_good = os.path.join(checkpoint_lib.checkpoint_root(workdir), "1")
    assert "non-finite values at step 2" in proc.stderr and f"last good checkpoint is {last_good}" in proc.stderr
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(workdir), read_only=True)
    assert ckpt.all_steps() == [1]
    ckpt.close()
    last_record = (workdir / "metrics.jsonl").read_text().splitlines()[-1]
    assert '"step": 2' in last_record and '"nonfinite": 1.0' in last_record


DISK_FULL_SCRIPT = """
set -e
mount -t tmpfs -o size=3m tmpfs "$CKPT"
set +e
"$PYTHON" -m meshtrain.train "$@" > "$WORK/first.log" 2>&1
echo $? > "$WORK/first.rc"
ls -a "$CKPT" > "$WORK/after_failure.ls"
"$PYTHON" -c "
import sys
from meshtrain import checkpoint as c
k = c.Checkpointer(sys.argv[1], read_only=True)
print(' '.join(str(s) for s in k.all_steps()), '|', ' '.join(str(k.verify(s)) for s in k.all_steps()))
k.close()" "$CKPT" > "$WORK/after_failure.steps" 2>/dev/null
mount -o remount,size=64m "$CKPT"
"$PYTHON" -m meshtrain.train "$@" > "$WORK/second.log" 2>&1
echo $? > "$WORK/second.rc"
"""


def test_disk_full_during_a_save_stops_cleanly_and_resumes(tmp_path, compilation_cache):
    """The checkpoint directory is a 3 MiB tmpfs (two tiny checkpoints fit, a third does not), in a
    private mount namespace (`unshare`). The run stops with exit code 4 and one message naming the
    step and the disk error; the finished checkpoints stay intact and verify, no partial step looks
    finished; after the disk grows the relaunched run resumes from the newest one and trains the
    same losses as the first run did for the same steps."""
    work = tmp_path / "run"
    ckpt = work / "checkpoints"
    ckpt.mkdir(parents=True)
    overrides = {"steps": 12, "workdir": work, "checkpoint.every": 2, "checkpoint.keep": 100}
    env = {**subprocess_env(compilation_cache), "WORK": str(tmp_path), "CKPT": str(ckpt), "PYTHON": sys.executable}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", DISK_FULL_SCRIPT, "sh", *cli_args(overrides)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    first = (tmp_path / "first.log").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "4", first[-3000:]
    error = [line for line in first.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "No space left on device" in error[0] and "is intact" in error[0], first[-3000:]
    steps, verified = (tmp_path / "after_failure.steps").read_text().split("|")
    kept = [int(s) for s in steps.split()]
    assert kept and kept == list(range(2, 2 * len(kept) + 1, 2)), kept  # every finished save, in order
    assert verified.split() == ["[]"] * len(kept)  # each one intact against its checksums
    listing = (tmp_path / "after_failure.ls").read_text().split()
    assert not [name for name in listing if name.isdigit() and int(name) not in kept], listing
    second = (tmp_path / "second.log").read_text()
    assert (tmp_path / "second.rc").read_text().strip() == "0", second[-3000:]
    assert run_loop.resumed_step(second) == kept[-1]
    # metrics.jsonl holds each step once; the first run's records past the resumed checkpoint were
    # moved to metrics.rolled_back.jsonl, and the second run trained those steps to the same losses
    trained = {r["step"]: r["loss"] for r in map(json.loads, (work / "metrics.jsonl").read_text().splitlines())}
    assert sorted(trained) == list(range(1, 13))
    rolled_back = {r["step"]: r["loss"] for r in map(json.loads, open(work / "metrics.rolled_back.jsonl"))}
    assert rolled_back and min(rolled_back) == kept[-1] + 1
    assert max(rolled_back) == max(run_loop.logged_steps(first))
    assert all(rolled_back[s] == trained[s] for s in rolled_back)
