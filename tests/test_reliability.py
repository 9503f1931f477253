"""A run in a hostile world: one run per workdir, Ctrl-C that saves, a failed save that ends the run
in seconds with one line, data that is checked as it is read, unchecked optimizer values refused.

The command-line cases run `python -m meshtrain.train` in child processes (marked slow), as a user
would; exit codes: 2 a bad config, input or busy workdir, 4 a failed save, 130 Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

from meshtrain import config as config_lib, run_guards, train, workdir_lock
from tests import utils

SHORT = {"steps": 3, "log_every": 1, "train.warmup_steps": 1, "data.source": "synthetic"}


def _train_args(workdir, *extra) -> list[str]:
    return [sys.executable, "-m", "meshtrain.train", "--config", str(utils.ROOT / "configs" / "tiny.py"),
            f"--config.workdir={workdir}", "--config.data.source=synthetic", "--config.train.warmup_steps=1",
            "--config.log_every=1", *extra]


def _env() -> dict:
    return {**utils.subprocess_env(utils.jax_cache_dir()), "XLA_FLAGS": "--xla_backend_optimization_level=0"}


# ---- one run per workdir ------------------------------------------------------------------------


def test_a_busy_workdir_stops_a_second_run_naming_the_holder(tmp_path):
    config = utils.config_for(tmp_path, {"data": 8}, **SHORT)
    with workdir_lock.WorkdirLock(str(tmp_path)):  # another run holds it (its own open file: the lock conflicts)
        with pytest.raises(config_lib.ConfigError, match=rf"config\.workdir='{tmp_path}': is in use by another run "
                                                         rf"\(pid {os.getpid()} on .*, started .*;"):
            train.run(config)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert train.run(config)["step"] == 3  # released: the workdir trains


@pytest.mark.slow
def test_a_killed_holder_never_blocks_and_a_live_one_is_named_on_the_command_line(tmp_path):
    """The lock dies with its process (SIGKILL included); while it lives, the second command is one
    line and exit 2, before anything compiles."""
    hold = (f"import time; from meshtrain.workdir_lock import WorkdirLock; lock = WorkdirLock({str(tmp_path)!r})"
            ".acquire(); print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold], env=_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    start = time.monotonic()
    busy = subprocess.run(_train_args(tmp_path, "--config.steps=2"), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert busy.returncode == 2 and time.monotonic() - start < 60
    assert busy.stderr.strip().count("\n") == 0 and f"pid {holder.pid}" in busy.stderr, busy.stderr
    holder.kill()
    holder.wait()
    done = subprocess.run(_train_args(tmp_path, "--config.steps=2"), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# ---- Ctrl-C --------------------------------------------------------------------------------------


def _run_until_a_step(tmp_path, resumed_from: int | None = None) -> subprocess.Popen:
    """A long run, once it has logged a step (the second, or the one after `resumed_from`, which its
    start must name)."""
    proc = subprocess.Popen(_train_args(tmp_path, "--config.steps=100000", "--config.checkpoint.every=1000"),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first, resumed = 2 if resumed_from is None else resumed_from + 1, resumed_from is None
    for line in proc.stdout:
        resumed = resumed or f"(step {resumed_from})" in line
        if f" step {first} " in line:
            assert resumed, f"the run did not say it resumed from step {resumed_from}"
            return proc
    raise AssertionError(f"the run ended before step {first}: {proc.wait()} {proc.stderr.read()[-2000:]}")


@pytest.mark.slow
def test_ctrl_c_saves_exits_130_and_the_relaunch_resumes_where_a_second_ctrl_c_aborts(tmp_path):
    """One Ctrl-C: the step finishes, is saved, one line, exit 130. The relaunch resumes at the next
    step; Ctrl-C twice there (the second while the first is being handled) aborts at once, no save."""
    proc = _run_until_a_step(tmp_path)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == run_guards.INTERRUPT_EXIT_CODE, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (Ctrl-C) at step "), err
    step = int(lines[0].split("at step ")[1].split(";")[0])
    assert utils.all_steps(tmp_path) == [step] and "Ctrl-C: saving at the end of this step" in out

    resumed = _run_until_a_step(tmp_path, resumed_from=step)
    resumed.send_signal(signal.SIGINT)
    for line in resumed.stdout:  # the first one is handled (two at once would arrive as one)
        if "Ctrl-C: saving" in line:
            break
    resumed.send_signal(signal.SIGINT)
    start = time.monotonic()
    resumed.communicate(timeout=120)
    assert resumed.returncode == -signal.SIGINT and time.monotonic() - start < 30


# ---- a save that fails ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_failed_save_ends_the_run_in_seconds_with_one_line(tmp_path):
    """A process whose files may not exceed 256 KiB (RLIMIT_FSIZE: the writes fail as on a full disk,
    root or not) cannot write checkpoint 4: the run stops before its next save (step 8), exit 4, one
    line naming the save, the reason and that no checkpoint was finished, no traceback."""
    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    start = time.monotonic()
    env = {k: v for k, v in _env().items() if not k.startswith("JAX_COMPILATION_CACHE")}  # big files
    result = subprocess.run(_train_args(tmp_path, "--config.steps=1000", "--config.checkpoint.every=4"), env=env,
                            preexec_fn=small_files, capture_output=True, text=True, timeout=300)
    assert result.returncode == 4 and time.monotonic() - start < 120, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: checkpoint save of step 4") and "File too large" in lines[0]
    assert "no checkpoint was finished before it" in lines[0]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) <= 8  # nothing trained past the next save (the step after the failure is known: below)
    assert utils.all_steps(tmp_path) == []


def test_the_loop_stops_at_the_step_after_a_save_fails(tmp_path, monkeypatch):
    """`Checkpointer.check` after every step: a background save that failed ends the run at the next
    step, not at the next save."""
    from meshtrain import checkpoint

    def check(self):
        if self._saving == 2:
            raise self._failed(2, OSError(28, "No space left on device"))
    monkeypatch.setattr(checkpoint.Checkpointer, "check", check)
    config = utils.config_for(tmp_path, {"data": 8}, **{**SHORT, "steps": 12, "checkpoint.every": 2})
    with pytest.raises(checkpoint.CheckpointSaveError, match="save of step 2 .*No space left on device"):
        train.run(config)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 3


# ---- data checked as it is read ------------------------------------------------------------------


def _corpus(folder) -> None:
    folder.mkdir()
    (folder / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    (folder / "b.txt").write_text("plain text document " * 30)
    (folder / "tool.bin").write_bytes(bytes(range(256)) * 8)  # binary: a NUL byte
    (folder / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 40)  # not UTF-8
    lines = [{"text": "a good line " * 20}, {"text": None}, {"text": 12345}, {"text": {"nested": "x"}},
             {"other": "no text key"}, {"text": "another good line " * 20}]
    (folder / "d.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")


def test_bad_files_and_lines_are_skipped_by_name_counted_and_kept_in_the_first_record(tmp_path):
    _corpus(tmp_path / "corpus")
    config = utils.config_for(tmp_path / "run", {"data": 8}, **{
        **SHORT, "data.source": "text_files", "data.files": str(tmp_path / "corpus"),  # a folder
        "data.data_dir": str(tmp_path / "prepared"), "train.seq_len": 32})
    train.run(config)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["data_files"], first["data_documents"]) == (3, 4)  # a.py, b.txt, d.jsonl; two good lines
    assert first["data_skipped_files"] == 2 and first["data_skipped_lines"] == 5


@pytest.mark.parametrize("change, key, match", [
    ({"data.on_bad_data": "error"}, "data.on_bad_data", "d.jsonl:2: 'text' holds NoneType, not text"),
    ({"data.text_field": "body"}, "data.text_field", "no line of .*d.jsonl has this key .*other, text"),
])
def test_data_refusals_name_the_key(tmp_path, change, key, match):
    _corpus(tmp_path / "corpus")
    config = utils.config_for(tmp_path / "run", {"data": 8}, **{
        **SHORT, "data.source": "text_files", "data.files": str(tmp_path / "corpus"),
        "data.data_dir": str(tmp_path / "prepared"), **change})
    with pytest.raises(config_lib.ConfigError, match=rf"config\.{key}=.*{match}"):
        train.run(config)


def test_files_that_hold_no_text_are_one_config_error(tmp_path):
    """Files of supported formats with no document in them (an empty .txt, a .jsonl of empty lines): one error
    naming data.files, before the run writes a checkpoint or a metrics line."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("")
    (tmp_path / "corpus" / "b.jsonl").write_text("\n\n")
    config = utils.config_for(tmp_path / "run", {"data": 8}, **{
        **SHORT, "data.source": "text_files", "data.files": str(tmp_path / "corpus"),
        "data.data_dir": str(tmp_path / "prepared")})
    with pytest.raises(config_lib.ConfigError, match=r"config\.data\.files=.*the files hold no document"):
        train.run(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not [p for p in (tmp_path / "run" / "checkpoints").rglob("*") if p.is_file()]


@pytest.mark.parametrize("entry, folder", [("metrics.jsonl", True), ("checkpoints", False), ("tb", False)])
def test_a_workdir_entry_of_the_wrong_kind_is_one_config_error(tmp_path, entry, folder):
    """A folder where the run keeps a file, or a file where it keeps a folder: one error naming it, before
    anything is read or written, and the entry left as it was."""
    run = tmp_path / "run"
    run.mkdir()
    if folder:
        (run / entry).mkdir()
        (run / entry / "kept").write_text("user data")
    else:
        (run / entry).write_text("user data")
    config = utils.config_for(run, {"data": 8}, **SHORT)
    kind = "folder where the run keeps a file" if folder else "file where the run keeps a folder"
    with pytest.raises(config_lib.ConfigError, match=rf"config\.workdir=.*{entry} is a {kind}"):
        train.run(config)
    assert (run / entry / "kept" if folder else run / entry).read_text() == "user data"
    assert sorted(p.name for p in run.iterdir()) == [entry]


def test_a_model_whose_state_cannot_fit_the_host_is_refused_before_allocating(tmp_path):
    """On CPU devices (the host's memory): an 11B-parameter model replicated over 8 devices needs about 1.3 TiB
    for its parameters, gradients and Adam moments alone; one line naming the model, the need and what is
    available, before anything is allocated, compiled or written."""
    from meshtrain import train as train_module

    config = utils.config_for(tmp_path / "run", {"data": 8}, **{
        **SHORT, "model.d_model": 4096, "model.n_layers": 64, "model.mlp_dim": 14336, "model.n_heads": 32,
        "model.n_kv_heads": 8})
    with pytest.raises(config_lib.ConfigError, match=r"config\.model='11\.\d+B parameters': its training state "
                                                     r"alone needs 1[0-9]{3}\.\d GiB of host memory") as error:
        train.run(config)
    said = float(re.search(r"([\d.]+) GiB are available", str(error.value)).group(1))
    assert said == pytest.approx(train_module.host_available_bytes() / 2**30, rel=0.2)  # what the host has free
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- values a run cannot use -------------------------------------------------------------------


@pytest.mark.parametrize("overrides, key", [
    ({"train.grad_clip": -1.0}, "train.grad_clip"),
    ({"train.b1": 1.5}, "train.b1"),
    ({"train.b2": -0.1}, "train.b2"),
    ({"train.weight_decay": -5.0}, "train.weight_decay"),
    ({"train.eps": 0.0}, "train.eps"),
    ({"train.warmup_steps": 1000, "steps": 30}, "train.warmup_steps"),
    ({"data.on_bad_data": "ignore"}, "data.on_bad_data"),
])
def test_optimizer_values_are_checked(overrides, key):
    from meshtrain.validate import validate

    with pytest.raises(config_lib.ConfigError, match=rf"config\.{key}="):
        validate(utils.tiny_config({"data": 8}, **overrides), 8)
