"""Multi-process runs: 2 processes x 4 CPU devices joined by jax.distributed train like 1 x 8,
write metrics and checkpoints once, and a dead or hung process makes its peer fail instead of hang."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from meshtrain import badput, checkpoint as checkpoint_lib, data, faults, launch, local_tier, run_guards, train
from tests.utils import ROOT, abstract_state, cli_args, config_for, load, losses_of, subprocess_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("compilation_cache")]

STEPS = 12  # the same program as tests/test_checkpoint.py's runs: the 1 x 8 run loads it from the cache
WAIT_S = 300


@pytest.fixture(scope="module")
def one_of_eight(tmp_path_factory, compilation_cache):
    """The uninterrupted 1 x 8 run every 2-process run is compared with: its workdir."""
    workdir = tmp_path_factory.mktemp("one")
    train.run(config_for(workdir, **{"steps": STEPS}))
    return workdir


def test_two_processes_of_four_devices_match_one_of_eight(tmp_path, compilation_cache, one_of_eight):
    """The job is preempted (SIGTERM to the launcher, forwarded to both processes) after step 3 or later,
    relaunched, and finishes: its losses equal a 1 x 8 run's. In the relaunch process 1 is a slow host
    (it waits `faults.SLOW_S` before each batch): the straggler check every 2 steps names it."""
    workdir = tmp_path / "two"
    cmd = [sys.executable, "-m", "meshtrain.launch", "--processes", "2", "--",
           *cli_args({"steps": STEPS, "workdir": workdir, "cpu_devices": 4})]
    env = subprocess_env(compilation_cache)
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_logged_steps(first, workdir, tmp_path / "first.log")
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    preempted_at = max(losses_of(workdir))
    assert 3 <= preempted_at < STEPS
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(workdir), read_only=True)
    assert ckpt.all_steps() == [preempted_at]  # both processes agreed on the step, saved it, exited 0
    ckpt.close()
    second = subprocess.run([*cmd, "--config.train.straggler_every=2"], cwd=ROOT, text=True, timeout=WAIT_S,
                            env={**env, faults.ENV: "slow:batch:1:1"}, capture_output=True)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-3000:]
    named = re.findall(r"straggler: process (\d+) \(host (\S+)\) took ([\d.]+) ms a step to get its batch",
                       output)
    assert named and {(p, h) for p, h, _ in named} == {("1", socket.gethostname())}, output[-3000:]
    assert all(float(ms) >= faults.SLOW_S * 1e3 for _, _, ms in named)
    assert "(8 devices, 2 process(es))" in output and f"(step {preempted_at})" in output
    # process 0 prints the run's lines, process 1 none of them (its own warnings and errors only)
    assert output.count(f"step {STEPS} |") == 1 and output.count("(8 devices, 2 process(es))") == 1, output[-3000:]
    # each process checksummed its own shards; the checkpoint verifies whole
    final = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(workdir), read_only=True)
    assert final.verify(STEPS) == []
    assert sorted(os.listdir(os.path.join(final.step_path(STEPS), checkpoint_lib.CHECKSUMS_SUBDIR))) == [
        "process_0.json", "process_1.json"]
    final.close()

    config = config_for(one_of_eight, **{"steps": STEPS})
    two, one = losses_of(workdir), losses_of(one_of_eight)  # losses_of refuses a step written twice
    assert sorted(two) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5, atol=0)
    # the 2-process checkpoint (each process wrote its shards) restores in one process
    abstract = abstract_state(config)
    restored_two, restored_one = load(workdir, STEPS, abstract), load(one_of_eight, STEPS, abstract)
    for a, b in zip(jax.tree.leaves(restored_two.state.params), jax.tree.leaves(restored_one.state.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert restored_two.data_state == restored_one.data_state


def test_a_job_resumes_on_fewer_processes_and_again_on_more(tmp_path, compilation_cache, one_of_eight):
    """2 processes x 4 devices, preempted; resumed as 1 process of 4 devices (the global batch kept:
    gradient accumulation 1 -> 2), preempted; resumed as 2 x 4 again (2 -> 1), to the end: one line
    each time says what changed, and the losses are the uninterrupted 1 x 8 run's."""
    workdir = tmp_path / "run"
    flags = cli_args({"steps": STEPS, "workdir": workdir, "cpu_devices": 4, "mesh.fsdp": -1})
    two = [sys.executable, "-m", "meshtrain.launch", "--processes", "2", "--", *flags]
    one = [sys.executable, "-m", "meshtrain.train", *flags]
    env = subprocess_env(compilation_cache)
    outputs, stops = [], []
    for i, (cmd, preempt) in enumerate(((two, True), (one, True), (two, False))):
        log_path = tmp_path / f"segment_{i}.log"
        slowed = {**env, faults.ENV: "slow:batch:1"} if preempt else env  # a step the SIGTERM lands inside
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=slowed, stdout=log, stderr=subprocess.STDOUT)
        try:
            if preempt:
                wait_for_logged_steps(proc, workdir, log_path, steps=(stops[-1] if stops else 0) + 3)
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=WAIT_S) == 0, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        outputs.append(log_path.read_text())
        stops.append(max(losses_of(workdir)))
    assert stops[0] < stops[1] < STEPS == stops[2]
    assert (f"resuming step {stops[0]} on 4 devices in 1 process(es), the checkpoint's on 8 in 2: global batch 8 "
            "kept, 1 sequence(s) a data-parallel rank at once (1 before); train.grad_accum_steps 1 -> 2") in outputs[1]
    assert (f"resuming step {stops[1]} on 8 devices in 2 process(es), the checkpoint's on 4 in 1: global batch 8 "
            "kept, 1 sequence(s) a data-parallel rank at once (1 before); train.grad_accum_steps 2 -> 1") in outputs[2]
    resumed, uninterrupted = losses_of(workdir), losses_of(one_of_eight)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([resumed[s] for s in sorted(resumed)], [uninterrupted[s] for s in sorted(resumed)],
                               rtol=1e-5, atol=0)


def _run_until_stopped(cmd, env, log_path, stopping: int) -> str:
    """Launches `cmd` (the launcher); once `stopping` of its processes have stopped themselves (an
    injected `stop`), kills the launcher and every process. Returns the output."""
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + WAIT_S
    try:
        while True:
            assert launcher.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no process stopped itself"
            procs = children(launcher.pid)
            if procs and sum(faults.stopped(p) for p in procs) >= stopping:
                break
            time.sleep(0.05)
        for pid in procs:
            os.kill(pid, signal.SIGKILL)
    finally:
        launcher.kill()
        launcher.wait()
    return log_path.read_text()


def test_the_local_tier_restores_from_a_peer_then_the_previous_step_then_the_persistent_tier(tmp_path,
                                                                                            compilation_cache):
    """2 processes x 4 devices, 16 steps, a local-tier save every 2 steps and a persistent one every 6,
    against an uninterrupted run of the same job, bit for bit. Stopped after step 11 (the local save of
    step 8 or 10 complete) and process 1's local folder deleted (a replaced host): the relaunch takes
    its shards from process 0's copy of them. Stopped in the middle of the local save of step 14 (both
    processes): the next relaunch takes step 12, the previous complete one. Stopped after step 15 with
    every local copy damaged: the persistent tier's newest. Every step's loss is the uninterrupted run's."""
    steps = 16

    def command(name):
        return [sys.executable, "-m", "meshtrain.launch", "--processes", "2", "--",
                *cli_args({"steps": steps, "workdir": tmp_path / name, "cpu_devices": 4, "checkpoint.every": 6,
                           "checkpoint.local_every": 2, "checkpoint.local_dir": tmp_path / f"{name}_local"})]

    env = subprocess_env(compilation_cache)
    reference = subprocess.run(command("reference"), cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=WAIT_S)
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-3000:]
    local, cmd = tmp_path / "run_local", command("run")
    _run_until_stopped(cmd, {**env, faults.ENV: "stop:step:11"}, tmp_path / "first.log", stopping=2)
    shutil.rmtree(local / "process_1")  # its own copies and the copy it kept of process 0's
    second = _run_until_stopped(cmd, {**env, faults.ENV: "stop:local:14"}, tmp_path / "second.log", stopping=2)
    found = re.search(r"resumed from the local tier \(step (8|10)\)", second)
    assert found, second[-3000:]
    assert (f"process 1: its local copy of step {found.group(1)} is gone; restored from its peer's copy"
            in second), second[-3000:]
    third = _run_until_stopped(cmd, {**env, faults.ENV: "stop:step:15"}, tmp_path / "third.log", stopping=2)
    assert "resumed from the local tier (step 12)" in third, third[-3000:]  # step 14 was never complete
    for path in local.rglob(local_tier.DATA):  # every local copy damaged: one byte flipped
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    last = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    output = last.stdout + last.stderr
    assert last.returncode == 0, output[-3000:]
    assert "is damaged (its checksum does not match); not used" in output, output[-3000:]
    assert re.search(r"resumed from \S+/checkpoints/(6|12) \(step (6|12)\)", output), output[-3000:]
    resumed, uninterrupted = losses_of(tmp_path / "run"), losses_of(tmp_path / "reference")
    assert sorted(resumed) == list(range(1, steps + 1))
    assert [resumed[s] for s in sorted(resumed)] == [uninterrupted[s] for s in sorted(uninterrupted)]


def wait_for_logged_steps(proc: subprocess.Popen, workdir, log, steps: int = 3) -> None:
    """Until `workdir/metrics.jsonl` holds `steps` lines; fails if `proc` exits first or WAIT_S passes."""
    deadline = time.monotonic() + WAIT_S
    metrics = workdir / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the 2-process run did not reach step {steps}"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_killing_one_process_fails_the_job_promptly(tmp_path, compilation_cache):
    """SIGKILL of process 1 of a launched job: the launcher stops process 0 and exits non-zero within
    seconds (on its own, process 0 would fail after jax.distributed's heartbeat timeout, 100 s)."""
    workdir = tmp_path / "run"
    args = cli_args({"steps": 100000, "workdir": workdir, "cpu_devices": 4, "checkpoint.every": 5})
    with open(tmp_path / "launch.log", "w") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "meshtrain.launch", "--processes", "2", "--grace_s", "5",
                                     "--", *args], cwd=ROOT, env=subprocess_env(compilation_cache), stdout=log,
                                    stderr=subprocess.STDOUT)
    try:
        wait_for_logged_steps(launcher, workdir, tmp_path / "launch.log")
        procs = children(launcher.pid)
        assert len(procs) == 2
        victim = next(p for p in procs if b"--process_id=1" in open(f"/proc/{p}/cmdline", "rb").read())
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        code = launcher.wait(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    output = (tmp_path / "launch.log").read_text()
    # The launcher names the first process it sees fail: the killed one (-9), or its peer when the
    # peer's collective notices the lost connection first (a race on a loaded machine).
    assert code != 0 and re.search(r"process (1 exited with -9|0 exited with 5)", output), output[-3000:]
    assert elapsed < 30, f"the job took {elapsed:.0f}s to fail"
    assert not any(os.path.exists(f"/proc/{p}") for p in procs)  # no process left behind
    # whatever was saved before is still a finished, restorable checkpoint
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(workdir), read_only=True)
    steps = ckpt.all_steps()
    ckpt.close()
    assert all(s % 5 == 0 for s in steps)
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # written by process 0 only


def test_a_hung_process_ends_the_job_and_the_relaunch_resumes(tmp_path, compilation_cache, one_of_eight):
    """Process 1 stops itself (SIGSTOP) once its part of checkpoint 8 is written, before the commit;
    relaunched, it stops again right after dispatching step 10. Each time process 0 ends within
    train.hang_timeout_s with one line naming the hang and the newest intact checkpoint, exit code 5,
    and the launcher kills the stopped process; each relaunch resumes from the checkpoint the line
    named, and the third trains to the 1 x 8 losses. (Whether checkpoint 8 of the first launch is
    committed is the barrier's race with the dying peer: its files are all written; the test holds
    the run to whichever the line names.)"""
    timeout_s = 10
    workdir = tmp_path / "run"
    root = checkpoint_lib.checkpoint_root(workdir)
    cmd = [sys.executable, "-m", "meshtrain.launch", "--processes", "2", "--grace_s", "2", "--",
           *cli_args({"steps": STEPS, "workdir": workdir, "cpu_devices": 4, "checkpoint.every": 4,
                      "train.hang_timeout_s": timeout_s})]
    env = subprocess_env(compilation_cache)
    named = None
    for point, step in [("save", 8), ("step", 10)]:
        hung = subprocess.run(cmd, cwd=ROOT, env={**env, faults.ENV: f"stop:{point}:{step}:1"}, capture_output=True,
                              text=True, timeout=WAIT_S)
        output = hung.stdout + hung.stderr
        # on failure: the lines that say why (an abort's C++ message comes before its long stack dump)
        why = "\n".join(line for line in output.splitlines()
                        if re.search(r"error|launch:|Fatal|Check fail|rendezvous|timeout|step \d+ \|", line))
        assert hung.returncode == run_guards.HANG_EXIT_CODE, why[-6000:] + "\n...\n" + output[-2000:]
        assert named is None or f"(step {named})" in output, output[-3000:]  # the relaunch resumed there
        error = [line for line in output.splitlines() if line.startswith("error: ")]
        assert len(error) == 1, output[-3000:]
        # the watchdog (the step after the hang, no progress for timeout_s; or, when process 0 is
        # still in the save's commit barrier the stopped peer never reaches, that save) or gloo's own
        # 30-s read timeout (the collective the hung peer never joined), whichever ends first
        hung_step = step + 1 if point == "save" else step
        in_save = f"|no progress for {timeout_s} s in the checkpoint save at step {step}" if point == "save" else ""
        assert re.match(rf"error: process 0: (no progress for {timeout_s} s in step {hung_step}"
                        rf"|step \d+ failed in a collective{in_save})", error[0]), error[0]
        found = re.search(rf"newest intact checkpoint \({re.escape(root)}/(\d+)\)$", error[0])
        assert found, error[0]
        named = int(found.group(1))
        ckpt = checkpoint_lib.Checkpointer(root, read_only=True)
        assert ckpt.all_steps()[-1] == named and ckpt.verify(named) == [] and named in (4, 8)
        ckpt.close()

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    output = again.stdout + again.stderr
    assert again.returncode == 0 and f"(step {named})" in output, output[-3000:]
    two, one = losses_of(workdir), losses_of(one_of_eight)  # each step once: the hung runs' later records moved
    assert sorted(two) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5, atol=0)
    rolled_back = [json.loads(line)["step"] for line in open(workdir / "metrics.rolled_back.jsonl")]
    assert rolled_back and min(rolled_back) in (5, 9)
    # the goodput of the job: three lifetimes of process 0, the watchdog's wait in the hung ones as hang
    goodput = badput.summarize(str(workdir))
    assert goodput["segments"] == 3 and goodput["badput_s"]["hang"] >= timeout_s, goodput


def test_a_spike_in_a_two_process_run_is_rolled_back_like_in_one(tmp_path, compilation_cache):
    """The planted rows of tests/test_loss_spike.py in a 2 x 4 run (each process poisons the rows it
    reads, through tests/planted/sitecustomize.py): both processes see the spike at the same steps,
    roll back to the same checkpoint, skip the same rows, and train on to the losses of a 1 x 8 run
    that never saw them."""
    from tests import test_loss_spike as spike

    workdir = tmp_path / "two"
    overrides = {"steps": spike.STEPS, "data.source": "synthetic", "checkpoint.every": spike.EVERY,
                 "train.batch_size": spike.BATCH, "train.learning_rate": 1e-2, "train.warmup_steps": 2,
                 "train.spike_factor": 1.5, "train.spike_steps": 2, "train.spike_window": 8}
    cmd = [sys.executable, "-m", "meshtrain.launch", "--processes", "2", "--",
           *cli_args({**overrides, "workdir": workdir, "cpu_devices": 4})]
    env = {**subprocess_env(compilation_cache), "MESHTRAIN_TEST_POISON": f"{spike.FIRST_ROW}:{spike.END_ROW}",
           "PYTHONPATH": f"{ROOT / 'tests' / 'planted'}:{ROOT}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count("loss spike at steps") == 1, output[-3000:]  # logged once, by process 0
    rolled_back = sorted(json.loads(line)["step"] for line in open(workdir / "metrics.rolled_back.jsonl"))
    assert rolled_back == list(range(spike.EVERY * 3 + 1, spike.POISONED_STEPS[-1] + 1))

    clean = tmp_path / "clean"
    original = data._rows
    try:
        data._rows = lambda config, split: (spike._Without(original(config, split)) if split == "train"
                                            else original(config, split))
        train.run(config_for(clean, **overrides))
    finally:
        data._rows = original
    two, one = losses_of(workdir), losses_of(clean)
    assert sorted(two) == list(range(1, spike.STEPS + 1))
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5, atol=0)


def test_launcher_reports_a_failed_process():
    assert launch.commands(2, 1234, ["--config", "c.py"])[1][-3:] == [
        "--coordinator_address=127.0.0.1:1234", "--num_processes=2", "--process_id=1"]
    with pytest.raises(ValueError, match="processes=0"):
        launch.commands(0, 1234, [])
    # an unknown config key: both processes exit non-zero at flag parsing; so does the launcher
    code = launch.launch(2, ["--config", str(ROOT / "configs" / "tiny.py"), "--config.no_such_key=1"],
                         grace_s=5)
    assert code != 0


def test_fault_injection_spec_is_checked():
    assert faults.parse("") is None
    assert faults.parse("stop:save:8:1") == faults.Injection("stop", "save", 8, 1)
    assert faults.parse("stop:step:3") == faults.Injection("stop", "step", 3, None)
    for bad in ("stop", "kill:step:3", "stop:eval:3", "stop:step:x", "stop:step:1:2:3"):
        with pytest.raises(ValueError, match=f"{faults.ENV}="):
            faults.parse(bad)
