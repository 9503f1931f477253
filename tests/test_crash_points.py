"""Crash consistency at every write: append-only logs with a torn tail, a kill right before chosen file
operations of a real run (`meshtrain.crash_points`), and hostile paths, each one line.

`python bench/faults.py --crash-points` kills a run before every operation it records; this file runs
a sample (one and two processes) chosen to cover each way a file is written: a torn append to
metrics.jsonl, a torn TensorBoard record, orbax's commit rename, a checksum file's rename (process 1
of two), the dataset's and its checksums' renames.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshtrain import crash_points, durable, metrics
from tests.utils import ROOT, cli_args, subprocess_env

pytestmark = pytest.mark.usefixtures("compilation_cache")
WAIT_S = 300


# Append-only logs ----------------------------------------------------------------------------------------

def _write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def test_a_torn_last_line_is_dropped_with_one_warning(tmp_path, caplog):
    whole = b'{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n'
    for torn in (b'{"step": 3, "lo', b'{"step": 3, "lo\n', b"\x00\x00\x00"):
        path = _write(tmp_path / "m.jsonl", whole + torn)
        caplog.clear()
        assert durable.read_jsonl(path) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
        assert [r.levelname for r in caplog.records] == ["WARNING"] and ":3: a torn last line" in caplog.text
    # a whole record that lost only its newline is kept, blank lines skipped
    path = _write(tmp_path / "m.jsonl", whole + b"\n" + b'{"step": 3}')
    assert [r["step"] for r in durable.read_jsonl(path)] == [1, 2, 3]


def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path):
    path = _write(tmp_path / "m.jsonl", b'{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(durable.CorruptFileError, match=r"m\.jsonl:2: not a JSON object"):
        durable.read_jsonl(path)


def test_the_first_append_cuts_a_torn_tail_and_keeps_a_whole_one(tmp_path):
    log = durable.JsonlLog(_write(tmp_path / "m.jsonl", b'{"step": 1}\n{"step": 2, "lo'))
    log.append({"step": 2})
    log.append({"step": 3})
    log.close()
    assert (tmp_path / "m.jsonl").read_bytes() == b'{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    log = durable.JsonlLog(_write(tmp_path / "b.jsonl", b'{"step": 1}\n{"step": 2, "lo\n'))  # bad, newline-ended
    log.append({"step": 2})
    log.close()
    assert (tmp_path / "b.jsonl").read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    log = durable.JsonlLog(_write(tmp_path / "n.jsonl", b'{"step": 1}'))  # whole, without its newline
    log.append({"step": 2})
    log.close()
    assert (tmp_path / "n.jsonl").read_bytes() == b'{"step": 1}\n{"step": 2}\n'


def test_rolling_back_a_torn_log_moves_whole_records_and_loses_none(tmp_path):
    _write(tmp_path / "metrics.jsonl", b'{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    writer = metrics.MetricsWriter(str(tmp_path))
    writer.truncate_after(2)
    writer.write({"step": 3, "loss": 1.0})
    writer.close()
    assert durable.read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 1}, {"step": 2}, {"step": 3, "loss": 1.0}]
    assert durable.read_jsonl(str(tmp_path / "metrics.rolled_back.jsonl")) == [{"step": 3}]


def test_a_whole_file_write_leaves_the_old_or_the_new_file(tmp_path):
    path = str(tmp_path / "f.json")
    durable.write_json(path, {"a": 1})
    with pytest.raises(RuntimeError), durable.atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            fh.write('{"a": 2')
        raise RuntimeError("killed mid-write")
    assert json.loads(open(path).read()) == {"a": 1} and os.listdir(tmp_path) == ["f.json"]


def test_a_folder_this_user_cannot_write_is_named(tmp_path):
    """Permissions as a non-root user: a child process drops to uid 65534 when the suite runs as root."""
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    (tmp_path / "afile").write_text("x")
    assert durable.unwritable(str(tmp_path / "afile")) == "is a file, not a folder"
    assert "afile is a file" in durable.unwritable(str(tmp_path / "afile" / "run"))
    assert durable.unwritable(str(tmp_path / "new" / "run")) is None
    # a child process asks as another user: it imports meshtrain.durable first (as root, the interpreter
    # under /root is unreadable to uid 65534), then gives up root; as a non-root user the folder is made
    # read-only for it instead
    script = ("import json, os, sys; sys.path.insert(0, sys.argv[1]); from meshtrain import durable\n"
              "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
              "print(json.dumps([durable.unwritable(sys.argv[2]), durable.unwritable(sys.argv[2] + '/run')]))")
    if os.geteuid() != 0:
        folder.chmod(0o555)
    child = subprocess.run([sys.executable, "-c", script, str(ROOT), str(folder)], capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0, child.stderr
    answer = json.loads(child.stdout)
    assert answer[0].startswith("cannot be written by this user (uid ")
    assert answer[1].startswith("cannot be written by this user") and "its parent" in answer[1]


def test_a_dead_preparations_leftovers_are_removed_and_a_live_ones_kept(tmp_path):
    """TFDS prepares into `incomplete.*` and renames; a kill leaves that folder. The next preparation
    removes it once nothing in it changed for `_STALE_S`; one still being written stays."""
    from meshtrain.data import sources

    dead, live = tmp_path / "incomplete.ABC123_1.1.0", tmp_path / "incomplete.XYZ789_1.1.0"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "shard").write_bytes(b"x")
    old = os.path.getmtime(dead) - sources._STALE_S - 1
    for path in (dead / "shard", dead):
        os.utime(path, (old, old))
    sources.remove_stale_incomplete(str(tmp_path))
    assert not dead.exists() and (live / "shard").exists()


# The command line: torn logs and hostile paths -------------------------------------------------------------

def _train(overrides: dict, compilation_cache, *, wrap: list[str] | None = None, env: dict | None = None):
    cmd = [sys.executable, "-m", "meshtrain.train", *cli_args({"train.warmup_steps": 1, **overrides})]
    return subprocess.run((wrap or []) + cmd, cwd=ROOT, env={**subprocess_env(compilation_cache), **(env or {})},
                          capture_output=True, text=True, timeout=WAIT_S)


def _one_error_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_a_torn_metrics_line_resumes_and_a_damaged_one_is_one_line(tmp_path, compilation_cache):
    """The issue's row: the last line of metrics.jsonl torn (a kill or a full disk during its write),
    then the command again: the run resumes, drops the torn line with one warning, and `report` reads
    the file. A line damaged before the last is not a crash's: one line naming the file and the line,
    exit 2, the file left as it was."""
    work = tmp_path / "run"
    overrides = {"steps": 4, "workdir": work, "checkpoint.every": 2}
    assert _train(overrides, compilation_cache).returncode == 0
    path = work / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:len(lines[-1]) // 2])  # step 4's record, torn
    resumed = _train({**overrides, "steps": 6}, compilation_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("a torn last line") + resumed.stderr.count("a torn last line") == 1
    assert [r["step"] for r in durable.read_jsonl(str(path))] == [1, 2, 3, 5, 6]
    report = subprocess.run([sys.executable, "-m", "meshtrain.report", str(work)], cwd=ROOT, capture_output=True,
                            text=True, env=subprocess_env(compilation_cache), timeout=WAIT_S)
    assert report.returncode == 0 and "step" in report.stdout, report.stderr
    lines = path.read_bytes().splitlines(keepends=True)
    damaged = b"".join(lines[:2]) + b'{"step": 3, "lo\n' + b"".join(lines[3:])
    path.write_bytes(damaged)
    refused = _train({**overrides, "steps": 8}, compilation_cache)
    assert refused.returncode == 2
    assert f"{path}:3: not a JSON object" in _one_error_line(refused)
    assert path.read_bytes() == damaged


@pytest.mark.slow
def test_hostile_paths_are_one_line_before_anything_compiles(tmp_path, compilation_cache):
    """A missing --config file and a workdir that is a file: exit 2, one line naming the path."""
    missing = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", "configs/nope.py"], cwd=ROOT,
                             capture_output=True, text=True, env=subprocess_env(compilation_cache), timeout=WAIT_S)
    assert missing.returncode == 2
    assert "--config configs/nope.py: no such config file" in _one_error_line(missing) and "tiny.py" in missing.stderr
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    proc = _train({"steps": 4, "workdir": afile}, compilation_cache)
    assert proc.returncode == 2 and f"config.workdir='{afile}': is a file, not a folder" in _one_error_line(proc)
    assert afile.read_text() == "keep me"


READ_ONLY_SCRIPT = """
set -e
mount --bind "$TARGET" "$TARGET"
mount -o remount,bind,ro "$TARGET"
exec "$@"
"""

FULL_DISK_SCRIPT = """
set -e
mount -t tmpfs -o size="$SIZE" tmpfs "$TARGET"
if [ -n "$FILL_TO" ]; then
    mkdir -p "$TARGET/checkpoints" && mount -t tmpfs -o size=64m tmpfs "$TARGET/checkpoints"
    head -c "$FILL_TO" /dev/zero > "$TARGET/filler"
fi
set +e
"$@"
echo $? > "$OUT/rc"
cp "$TARGET/metrics.jsonl" "$OUT/first.metrics.jsonl" 2>/dev/null
rm -f "$TARGET/filler"
mount -o remount,size=64m "$TARGET"
"$@" > "$OUT/second.log" 2>&1
echo $? > "$OUT/second.rc"
cp "$TARGET"/metrics*.jsonl "$OUT/" 2>/dev/null
true
"""


@pytest.mark.slow
def test_read_only_workdir_and_data_dir_are_one_line_and_lose_nothing(tmp_path, compilation_cache):
    """A workdir on a read-only mount (a bind mount in a private mount namespace: even root cannot
    write it) and a data folder on one, before its dataset is prepared: exit 2, one line each."""
    work, data_dir = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    data_dir.mkdir()
    (work / "notes.txt").write_text("mine")
    wrap = ["unshare", "-rm", "sh", "-c", READ_ONLY_SCRIPT, "sh"]
    proc = _train({"steps": 4, "workdir": work}, compilation_cache, wrap=wrap, env={"TARGET": str(work)})
    assert proc.returncode == 2 and "is on a read-only file system" in _one_error_line(proc)
    assert sorted(os.listdir(work)) == ["notes.txt"]
    proc = _train({"steps": 4, "workdir": tmp_path / "run", "data.data_dir": data_dir}, compilation_cache, wrap=wrap,
                  env={"TARGET": str(data_dir)})
    line = _one_error_line(proc)
    assert proc.returncode == 2 and f"the data folder {data_dir} is on a read-only file system" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("where", ["data preparation", "metrics write"])
def test_a_full_disk_is_one_line_then_the_same_command_resumes(where, tmp_path, compilation_cache):
    """The data folder (first preparation) or the workdir (its metrics.jsonl; checkpoints on a disk of
    their own) on a small tmpfs: exit 4, one line naming the path; once space is freed the same
    command trains to the end, metrics.jsonl holding every step once."""
    work, data_dir = tmp_path / "work", tmp_path / "data"
    corpus = tmp_path / "corpus.jsonl"
    crash_points._corpus(str(corpus), documents=4000 if where == "data preparation" else 400)
    work.mkdir()
    data_dir.mkdir()
    target = data_dir if where == "data preparation" else work
    env = {"TARGET": str(target), "OUT": str(tmp_path), "SIZE": "256k" if where == "data preparation" else "1m",
           "FILL_TO": "" if where == "data preparation" else str(1024 * 1024 - 24 * 1024)}
    overrides = {"steps": 40, "workdir": work, "data.files": corpus, "data.data_dir": data_dir, "checkpoint.every": 20}
    first = _train(overrides, compilation_cache, wrap=["unshare", "-rm", "sh", "-c", FULL_DISK_SCRIPT, "sh"], env=env)
    assert (tmp_path / "rc").read_text().strip() == "4", first.stderr[-3000:]
    line = _one_error_line(first)
    assert f"cannot write {target}" in line and "the disk is full" in line, line
    second = (tmp_path / "second.log").read_text()
    assert (tmp_path / "second.rc").read_text().strip() == "0", second[-3000:]
    if where == "metrics write":  # the workdir's tmpfs lived in the namespace: its logs were copied out
        logged = durable.read_jsonl(str(tmp_path / "first.metrics.jsonl"))
        final = durable.read_jsonl(str(tmp_path / "metrics.jsonl"))
        assert 0 < len(logged) < 40 and [r["step"] for r in final] == list(range(1, 41))
        moved = tmp_path / "metrics.rolled_back.jsonl"
        kept = final + (durable.read_jsonl(str(moved)) if moved.exists() else [])
        assert {(r["step"], r["loss"]) for r in logged} <= {(r["step"], r["loss"]) for r in kept}  # none lost


# Crash points --------------------------------------------------------------------------------------------

def _pick(wanted):
    """The points of a recorded run that match `wanted`: (process, kind, path suffix or part, occurrence)."""
    def pick(points):
        chosen = []
        for process, kind, part, occurrence in wanted:
            match = [p for p in points if (p.process, p.kind, p.occurrence) == (process, kind, occurrence)
                     and part in p.path]
            assert match, (process, kind, part, occurrence, sorted({(p.kind, p.path) for p in points}))
            chosen.append(match[0])
        return chosen
    return pick


SAMPLE = [(0, "write", "W/metrics.jsonl", 2), (0, "rename", "W/checkpoints/2", 1), (0, "rename", "D/text_files/", 1),
          (0, "rename", "meshtrain_shards.json", 1), (0, "write", "tfevents", 40),
          (0, "write", "L/process_0/own/.1.tmp-<pid>/data.bin", 1)]
SAMPLE_TWO_PROCESSES = [(1, "rename", "2.orbax-checkpoint-tmp/checksums/process_1.json", 1),
                        (0, "write", "W/metrics.jsonl", 3), (1, "rename", "L/process_1/peer/1", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_a_run_killed_before_a_file_operation_resumes_to_the_same_bits(processes, tmp_path, compilation_cache):
    """The run is recorded once; for each chosen operation a fresh run is SIGKILLed right before it (a
    write: after half of its bytes), then the same command is run again: it must train to the end, its
    metrics.jsonl equal to the uninterrupted run's on every step (float32, bit for bit), its newest
    checkpoints the same steps, and nothing a finished step wrote lost."""
    result = crash_points.sweep(str(tmp_path), limit=None, processes=processes, steps=3,
                                pick=_pick(SAMPLE if processes == 1 else SAMPLE_TWO_PROCESSES),
                                env=subprocess_env(compilation_cache))
    rows = result["rows"]
    assert result["operations"] > 50 and len(rows) == len(SAMPLE if processes == 1 else SAMPLE_TWO_PROCESSES)
    assert all(r["reached"] for r in rows), rows
    assert [r for r in rows if not (r["trained"] and r["bit_equal"] and r["clear"])] == []
    assert result["lost"] == 0 and result["unclear"] == 0
