"""Crash points: every file operation of a run recorded, and a kill right before any one of them.

A training process reads three variables at its start (`install`, called by `python -m meshtrain.train`):

    MESHTRAIN_CRASH_ROOTS={"W": workdir, "D": data dir, "L": local tier}   the folders whose operations count
    MESHTRAIN_CRASH_TRACE=<file>   appends one JSON line per operation (`Point`) to <file>.<process>
    MESHTRAIN_CRASH_AT=<Point as JSON>   SIGKILLs the process right before that operation
    MESHTRAIN_CRASH_REACHED=<file>   created right before that kill (the exit code of a several-process
                                     job is whichever process the launcher saw end first)

The operations: a file opened for writing (`open`), each `write` and `flush` of a file opened that
way (a kill at a `write` first writes half of its bytes: a torn write), `rename` (and `replace`),
`delete`, `mkdir`, `rmdir`, `rmtree`, `truncate`, `copy`, seen through Python's audit hooks and its
`open`. An operation is named by its process, kind, path (relative to its root, with process ids,
timestamps and random temporary names made stable) and occurrence (the n-th of that kind on that
path in that process), so a point names the same operation in every run of the same command
whatever threads interleave. Writes done in C++ (tensorstore's array chunks, array_record's shards)
are not seen; the Python operations around them (orbax's and TFDS's renames and metadata) are.

`sweep` runs a short job once while recording, then for each chosen point kills a fresh run right
before it, relaunches the same command and checks: the relaunch trains (or ends with one line that
starts with "error:"), its metrics.jsonl equals the uninterrupted run's bit for bit on every logged
step (loss, gradient norm, learning rate: each step once, none lost) and its newest checkpoints are
the same steps. SQLite's crash tests and FoundationDB's simulation test storage the same way.
`tests/test_crash_points.py` runs a sample; `python bench/faults.py --crash-points [--quick]` the sweep.
Unset (the default), nothing is recorded or killed.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

ENV_ROOTS = "MESHTRAIN_CRASH_ROOTS"
ENV_TRACE = "MESHTRAIN_CRASH_TRACE"
ENV_AT = "MESHTRAIN_CRASH_AT"
ENV_REACHED = "MESHTRAIN_CRASH_REACHED"
KINDS = ("open", "write", "flush", "rename", "delete", "mkdir", "rmdir", "rmtree", "truncate", "copy")


@dataclasses.dataclass(frozen=True)
class Point:
    """One file operation of a run: the `occurrence`-th `kind` on `path` in `process`."""

    process: int
    kind: str
    path: str
    occurrence: int

    def spec(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def parse(cls, spec: str) -> Point:
        try:
            return cls(**json.loads(spec))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{ENV_AT}={spec!r}: must be a JSON object with process, kind, path, occurrence") from e

    @property
    def file_kind(self) -> str:
        """What the file is, for sampling and the table: its path with step numbers and names folded."""
        return file_kind(self.path)


def file_kind(path: str) -> str:
    root, _, rest = path.partition("/")
    if root == "W":
        if rest.startswith("checkpoints"):
            return "checkpoint"
        if rest.startswith("metrics"):
            return "metrics"
        if rest.startswith(".meshtrain.lock"):
            return "lock"
        if rest.startswith("tb") or "tfevents" in rest:
            return "tensorboard"
        return "workdir other"
    if root == "L":
        return "local tier"
    if "token_cache" in rest or ".tokens." in rest or ".starts." in rest:
        return "token cache"
    return "dataset"


_PATTERNS = [
    (re.compile(r"[0-9a-f]{32}"), "#"),  # uuid hex
    (re.compile(r"(?<![0-9A-Za-z])\d{6,}(?![0-9A-Za-z])"), "#"),  # timestamps
    (re.compile(re.escape(socket.gethostname())), "<host>"),
    (re.compile(r"(incomplete\.|tmp|partial-|old-)[A-Za-z0-9_]{6,}"), r"\1#"),  # tempfile / TFDS random names
]


def normalize(path: str, roots: dict[str, str], pid: int) -> str | None:
    """`path` relative to the root that holds it ("W/metrics.jsonl"), made the same in every run; None
    when no root holds it."""
    full = os.path.realpath(os.path.abspath(path))
    for label, root in roots.items():
        if full == root or full.startswith(root + os.sep):
            rel = label + full[len(root):]
            break
    else:
        return None
    if pid >= 1000:  # a small pid could be a step number too
        rel = re.sub(rf"(?<!\d){pid}(?!\d)", "<pid>", rel)
    for pattern, replacement in _PATTERNS:
        rel = pattern.sub(replacement, rel)
    return rel


class _Recorder:
    def __init__(self, process: int, roots: dict[str, str], trace: str | None, target: Point | None):
        self.process, self.target = process, target
        self.roots = {label: os.path.realpath(path) for label, path in roots.items()}
        self.pid = os.getpid()
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.trace_fd = os.open(f"{trace}.{process}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if trace else None

    def path_of(self, path) -> str | None:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str | os.PathLike):
            return None
        return normalize(os.fspath(path), self.roots, self.pid)

    def op(self, kind: str, rel: str | None, kill: bool = True) -> bool:
        """Counts one operation; True (or the kill itself, when `kill`) when it is the target."""
        if rel is None:
            return False
        with self.lock:
            self.counts[(kind, rel)] += 1
            point = Point(self.process, kind, rel, self.counts[(kind, rel)])
            if self.trace_fd is not None:
                os.write(self.trace_fd, (point.spec() + "\n").encode())
        if point != self.target:
            return False
        if kill:
            _kill()
        return True


def _kill() -> None:
    if marker := os.environ.get(ENV_REACHED):
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o644))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _Tracked:
    """A file opened for writing under a root: each write and flush is an operation."""

    def __init__(self, file, rel: str, recorder: _Recorder):
        self._file, self._rel, self._recorder = file, rel, recorder

    def write(self, data):
        if self._recorder.op("write", self._rel, kill=False):
            if len(data) > 1:  # a torn write: half of it reaches the file, then the process dies
                self._file.write(data[:len(data) // 2])
                self._file.flush()
            _kill()
        return self._file.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        self._recorder.op("flush", self._rel)
        return self._file.flush()

    def __enter__(self):
        self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def __iter__(self):
        return iter(self._file)

    def __next__(self):
        return next(self._file)

    def __getattr__(self, name):
        return getattr(self._file, name)


_AUDITED = {"os.rename": ("rename", 1), "os.remove": ("delete", 0), "os.mkdir": ("mkdir", 0),
            "os.rmdir": ("rmdir", 0), "shutil.rmtree": ("rmtree", 0), "os.truncate": ("truncate", 0),
            "shutil.copyfile": ("copy", 1)}
_installed: _Recorder | None = None


def install(process: int = 0) -> bool:
    """Starts recording and the kill the environment asks for (nothing when `ENV_ROOTS` is unset);
    True when installed. Python's audit hooks stay for the life of the process."""
    global _installed
    if _installed is not None or not os.environ.get(ENV_ROOTS):
        return _installed is not None
    roots = json.loads(os.environ[ENV_ROOTS])
    target = Point.parse(os.environ[ENV_AT]) if os.environ.get(ENV_AT) else None
    recorder = _installed = _Recorder(int(process), roots, os.environ.get(ENV_TRACE), target)
    original_open = builtins.open

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
                (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
            if writing:
                recorder.op("open", recorder.path_of(path))
        elif event in _AUDITED:
            kind, index = _AUDITED[event]
            recorder.op(kind, recorder.path_of(args[index]))

    def tracked_open(file, mode="r", *args, **kwargs):
        handle = original_open(file, mode, *args, **kwargs)
        if isinstance(mode, str) and any(c in mode for c in "wax+") and (rel := recorder.path_of(file)):
            return _Tracked(handle, rel, recorder)
        return handle

    sys.addaudithook(hook)
    builtins.open = io.open = tracked_open
    return True


def read_trace(path: str) -> list[Point]:
    """The points of a recorded run (every `<path>.<process>` file), each process's in order."""
    folder, stem = os.path.split(path)
    points = []
    for name in sorted(os.listdir(folder or ".")):
        if name.startswith(os.path.basename(stem) + ".") and name.rsplit(".", 1)[-1].isdigit():
            with open(os.path.join(folder, name)) as fh:
                points += [Point(**json.loads(line)) for line in fh if line.strip()]
    return points


def distinct(points: list[Point]) -> list[Point]:
    """`points` less the writes inside a run of writes to one file (a kill between two chunks of one
    `json.dump` is a kill before its last): the first and the last of each run stay."""
    kept = []
    for i, point in enumerate(points):
        if point.kind == "write" and 0 < i < len(points) - 1:
            before, after = points[i - 1], points[i + 1]
            if all(p.kind == "write" and (p.process, p.path) == (point.process, point.path) for p in (before, after)):
                continue
        kept.append(point)
    return kept


def choose(points: list[Point], limit: int | None) -> list[Point]:
    """`limit` points spread over every file kind and kind of operation: the first point of each (file
    kind, kind) pair, the file kinds in turn, then the last of each pair, then evenly between; all of
    them when `limit` is None."""
    if limit is None or limit >= len(points):
        return list(points)
    groups: dict[tuple, list[Point]] = collections.defaultdict(list)
    for point in points:
        groups[(point.process, point.kind, point.file_kind)].append(point)
    buckets = collections.defaultdict(list)  # each (process, file kind)'s groups in turn: every file first
    for key, group in groups.items():
        buckets[(key[0], key[2])].append(group)
    by_process = collections.defaultdict(list)  # and the processes in turn
    for key in buckets:
        by_process[key[0]].append(buckets[key])
    ordered = [bs[i] for i in range(max(map(len, by_process.values()))) for bs in by_process.values() if i < len(bs)]
    turns = [gs[i] for i in range(max(map(len, ordered))) for gs in ordered if i < len(gs)]
    orders = [[group[i] for i in _spread(len(group))] for group in turns]
    order = [o[rank] for rank in range(max(map(len, orders))) for o in orders if rank < len(o)]
    return order[:limit]


def _spread(n: int) -> list[int]:
    """0..n-1 in an order that covers the range evenly early: first, last, middle, quarters, ..."""
    order, seen, intervals = [], set(), collections.deque([(0, n - 1)])
    for i in (0, n - 1):
        if 0 <= i and i not in seen:
            seen.add(i)
            order.append(i)
    while intervals:
        lo, hi = intervals.popleft()
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        seen.add(mid)
        order.append(mid)
        intervals += [(lo, mid), (mid, hi)]
    return order


# The sweep ------------------------------------------------------------------------------------------------

DETERMINISTIC = ("step", "loss", "grad_norm", "learning_rate", "tokens", "loss_scale")


def _corpus(path: str, documents: int = 400) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i in range(documents):
            f.write(json.dumps({"text": f"document {i}: " + "the quick brown fox jumps " * (i % 13 + 1)}) + "\n")


def command(trial: str, corpus: str, steps: int, processes: int, config: str) -> list[str]:
    flags = {"mesh.data": 1, "mesh.fsdp": -1, "model.dtype": "float32", "model.n_layers": 2, "train.seq_len": 32,
             "train.batch_size": 8, "train.warmup_steps": 1, "log_every": 1, "steps": steps,
             "checkpoint.every": 1, "checkpoint.keep": 2, "checkpoint.local_every": 1,
             "checkpoint.local_dir": os.path.join(trial, "local"), "data.source": "text_files", "data.files": corpus,
             "data.data_dir": os.path.join(trial, "data"), "workdir": os.path.join(trial, "work"),
             "cpu_devices": 8 // processes}
    args = ["--config", config] + [f"--config.{k}={v}" for k, v in flags.items()]
    if processes == 1:
        return [sys.executable, "-m", "meshtrain.train", *args]
    return [sys.executable, "-m", "meshtrain.launch", "--processes", str(processes), "--", *args]


def _run(cmd: list[str], env: dict, log: str, timeout: float) -> tuple[int, str]:
    with open(log, "w") as out:
        try:
            code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    with open(log) as fh:
        return code, fh.read()


def _metrics(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    from meshtrain import durable

    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in durable.read_jsonl(path)]


def _checkpoints(workdir: str) -> list[int]:
    root = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []


def clear_ending(output: str) -> bool:
    """A failed command ended with one clear line: its last line says "error: ..." and no traceback."""
    lines = [line for line in output.splitlines() if line.strip()]
    return bool(lines) and lines[-1].startswith(("error:", "launch:")) and "Traceback" not in output


def sweep(root: str, *, limit: int | None, processes: int = 1, steps: int = 4, env: dict | None = None,
          config: str | None = None, timeout: float = 300.0, pick=None, progress=print) -> dict:
    """Records a run of `steps` steps, then kills and relaunches it at `limit` points (`choose`; all when
    None; `pick`, a function of the recorded points, chooses instead). Returns the table's figures and
    one row per trial."""
    config = config or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                    "tiny.py")
    env = dict(env if env is not None else os.environ)
    corpus = os.path.join(root, "corpus", "docs.jsonl")
    _corpus(corpus)
    reference = os.path.join(root, "reference")
    trace = os.path.join(root, "trace", "ops")
    os.makedirs(os.path.dirname(trace), exist_ok=True)
    roots = lambda trial: json.dumps({"W": os.path.join(trial, "work"), "D": os.path.join(trial, "data"),  # noqa: E731
                                      "L": os.path.join(trial, "local")})
    start = time.monotonic()
    code, output = _run(command(reference, corpus, steps, processes, config),
                        {**env, ENV_ROOTS: roots(reference), ENV_TRACE: trace}, os.path.join(root, "reference.log"),
                        timeout)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run failed (exit {code}):\n{output[-3000:]}")
    expected, expected_ckpts = _metrics(os.path.join(reference, "work")), _checkpoints(os.path.join(reference, "work"))
    points = read_trace(trace)
    chosen = pick(points) if pick else choose(distinct(points), limit)
    progress(f"crash points: {len(points)} operations recorded in {time.monotonic() - start:.1f} s; "
             f"trying {len(chosen)}")
    rows = []
    for index, point in enumerate(chosen):
        trial = os.path.join(root, f"trial_{index}")
        cmd = command(trial, corpus, steps, processes, config)
        marker = trial + ".reached"
        killed_code, killed_out = _run(cmd, {**env, ENV_ROOTS: roots(trial), ENV_AT: point.spec(), ENV_REACHED: marker},
                                       os.path.join(trial + ".killed.log"), timeout)
        # the killed process left the marker; with several processes the job's exit code may be a peer's
        # (one that saw the kill as a failed collective first)
        reached = os.path.exists(marker)
        code, output = _run(cmd, {**env, ENV_ROOTS: roots(trial)}, os.path.join(trial + ".relaunch.log"), timeout)
        got, ckpts = _metrics(os.path.join(trial, "work")), _checkpoints(os.path.join(trial, "work"))
        row = {"point": dataclasses.asdict(point), "file_kind": point.file_kind, "reached": reached,
               "relaunch_exit": code, "trained": code == 0, "clear": code == 0 or clear_ending(output),
               "bit_equal": code == 0 and got == expected,
               # a logged step or a kept checkpoint of the uninterrupted run missing or different
               "lost": len([r for r in expected if r not in got]) + len(set(expected_ckpts) - set(ckpts)),
               # an old checkpoint whose deletion the kill interrupted: the next save deletes it
               "left_over": sorted(set(ckpts) - set(expected_ckpts))}
        rows.append(row)
        left = f", checkpoints {row['left_over']} left over" if row["left_over"] else ""
        progress(f"  {index + 1}/{len(chosen)} {point.kind:<8} {point.path} #{point.occurrence} (process "
                 f"{point.process}): {'killed' if reached else f'not reached (exit {killed_code})'}, relaunch "
                 f"exit {code}{', bit-equal' if row['bit_equal'] else ', DIFFERS'}"
                 f"{left}"
                 f"{'' if row['clear'] else ', UNCLEAR ending'}")
        if row["bit_equal"] and row["clear"]:
            shutil.rmtree(trial, ignore_errors=True)
        else:
            progress(output[-2000:])
    per_kind = collections.Counter(p.kind for p in points)
    tried = collections.Counter(r["file_kind"] for r in rows)
    return {"processes": processes, "operations": len(points), "operations_by_kind": dict(per_kind),
            "file_kinds": dict(collections.Counter(p.file_kind for p in points)), "tried": len(rows),
            "tried_by_file_kind": dict(tried), "reached": sum(r["reached"] for r in rows),
            "bit_equal": sum(r["bit_equal"] for r in rows), "lost": sum(r["lost"] for r in rows),
            "left_over": sum(bool(r["left_over"]) for r in rows),
            "unclear": sum(not r["clear"] for r in rows), "seconds": round(time.monotonic() - start, 1), "rows": rows}
