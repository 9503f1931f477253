"""Where a run's wall clock goes: productive steps, and badput (the time that trains nothing).

Each process lifetime of a run (a segment: from the process's start to its end) splits its wall
clock into productive step time and these parts:

    startup     imports, configuration, the mesh, building the state or the data iterator
    compile     tracing, lowering and XLA compiles (or reads from the persistent compile cache),
                wherever they happen: the first step, the first evaluation, the first sample
    restore     reading the checkpoint a run resumes from
    checkpoint  the step loop blocked by saves (the device-to-host copy of an asynchronous save,
                a whole synchronous one, the last save's write at the end)
    data        the step loop waiting for its next batch
    evaluation  evaluation and in-loop sampling
    rollback    steps undone by a loss-spike rollback, and the restore that undid them
    hang        a multi-process run's wait from the last progress to the watchdog's exit
    shutdown    from the loop's end to the interpreter's last exit handler (after JAX's; the
                interpreter's own teardown after it is not seen)

The loop marks each boundary (`Ledger.mark`); the time since the previous mark goes to the part
named, less the compile and data-wait seconds inside it (JAX's compile events, the iterator's input
time). Every metrics.jsonl record carries the segment's totals so far (`fields`: `wall_s`,
`productive_s`, `badput_<part>_s`, `segment_start`, also in TensorBoard) and each segment that ends
appends them to `<workdir>/goodput.jsonl`. `python -m meshtrain.report` sums the segments of a
workdir (`summarize`), adding the steps a restart computed again: a segment's productive time past
its last step still in metrics.jsonl (the next segment resumed from an older checkpoint).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import jax

import meshtrain
from meshtrain import durable

log = logging.getLogger("meshtrain")

PARTS = ("startup", "compile", "restore", "checkpoint", "data", "evaluation", "rollback", "hang", "shutdown")
RECOMPUTED = "recomputed"  # the report's part: steps a restart computed again
SEGMENTS_FILE = "goodput.jsonl"
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_CACHE_HIT, _CACHE_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


class _CompileClock:
    """The seconds JAX spent compiling in this process and its persistent-cache hits and misses (one set
    of `jax.monitoring` listeners per process: JAX cannot remove one)."""

    def __init__(self):
        self.seconds, self.hits, self.misses = 0.0, 0, 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self.seconds += seconds

    def _event(self, event: str, **_) -> None:
        if event in (_CACHE_HIT, _CACHE_MISS):
            with self._lock:
                self.hits += event == _CACHE_HIT
                self.misses += event == _CACHE_MISS


_clock: _CompileClock | None = None


def compile_clock() -> _CompileClock:
    global _clock
    if _clock is None:
        _clock = _CompileClock()
    return _clock


def process_start() -> float:
    """The Unix time this process started, to a clock tick (Linux: its start in /proc against the time
    since boot; elsewhere the time this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return _FIRST_CALL


_FIRST_CALL = time.time()


class Ledger:
    """One segment's wall clock, split as the loop marks it (module docstring).

        ledger = Ledger(workdir, enabled=is_main)
        ledger.mark("startup")              # everything since the process started, less compiles
        ... restore ...; ledger.mark("restore")
        ... a step ...; ledger.mark("productive")
        ledger.close()                      # appends the segment's totals to goodput.jsonl
    """

    def __init__(self, workdir: str, enabled: bool = True, data_seconds: Callable[[], float] | None = None):
        """`data_seconds`: the data iterator's cumulative input wait (it may start again from 0 when the
        loop makes a new iterator)."""
        self.path = os.path.join(workdir, SEGMENTS_FILE)
        self.enabled = enabled
        self.start = process_start()
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.productive = 0.0
        self.data_seconds = data_seconds or (lambda: 0.0)
        self._clock = compile_clock()
        self._last, self._compiled, self._data = self.start, self._clock.seconds, 0.0
        self._at_save: dict[int, float] = {0: 0.0}  # step -> productive seconds when it was saved
        self._closed = False
        if enabled:
            meshtrain.LAST_AT_EXIT["badput"] = self._at_exit  # this process's newest run

    def mark(self, part: str) -> None:
        """The time since the previous mark goes to `part` ("productive" or one of PARTS), less the
        compiles and data waits inside it."""
        now, compiled, data = time.time(), self._clock.seconds, self.data_seconds()
        elapsed = now - self._last
        in_compile = min(max(compiled - self._compiled, 0.0), elapsed)
        in_data = min(max(data - self._data if data >= self._data else data, 0.0), elapsed - in_compile)
        self._last, self._compiled, self._data = now, compiled, data
        self.parts["compile"] += in_compile
        self.parts["data"] += in_data
        rest = elapsed - in_compile - in_data
        if part == "productive":
            self.productive += rest
        else:
            self.parts[part] += rest

    def saved(self, step: int) -> None:
        """A checkpoint of `step`: a rollback to it undoes the productive time after this."""
        self._at_save[step] = self.productive

    def rolled_back(self, step: int) -> None:
        """The loop went back to checkpoint `step` (0: the initial state): the time of the steps after it
        moves from productive to rollback."""
        undone = self.productive - self._at_save.get(step, 0.0)
        self.productive -= undone
        self.parts["rollback"] += undone
        self._at_save = {s: p for s, p in self._at_save.items() if s <= step}

    def fields(self) -> dict:
        """The segment's totals so far, as metrics.jsonl carries them."""
        return {"segment_start": self.start, "wall_s": self._last - self.start, "productive_s": self.productive,
                **{f"badput_{part}_s": seconds for part, seconds in self.parts.items()}}

    def cache_reads(self) -> tuple[int, int]:
        """(hits, misses) of JAX's persistent compile cache in this process so far."""
        return self._clock.hits, self._clock.misses

    def close(self, part: str = "checkpoint") -> None:
        """Marks the time since the last mark as `part` and appends the segment's totals to goodput.jsonl
        (once; process 0 only). A write that fails is logged, not raised: the run's own outcome stands."""
        if self._closed:
            return
        self._closed = True
        self.mark(part)
        self.data_seconds = lambda: self._data  # the iterator is closed: no wait after this
        self._write()

    def _at_exit(self) -> None:
        """At the interpreter's exit after `close`: the time since as shutdown, in one more line (the
        report keeps a segment's latest)."""
        if self._closed:
            self.mark("shutdown")
            self._write()

    def _write(self) -> None:
        if not self.enabled:
            return
        try:  # a torn line a crash left is cut off first
            log_file = durable.JsonlLog(self.path)
            log_file.append({**self.fields(), "end": True})
            log_file.close()
        except OSError as error:  # durable.WriteError included
            log.warning("%s: the segment's goodput not written (%s)", self.path, error.strerror or error)


def segments(workdir: str) -> list[dict]:
    """Each segment of a run with its last known totals, oldest first: its line in goodput.jsonl, else
    (a killed process) its latest record in metrics.jsonl or metrics.rolled_back.jsonl, with
    `surviving_s`: the productive seconds at its last step still in metrics.jsonl (0: none survives;
    the newest segment's all: nothing after it computed them again). Steps after a segment's last
    logged one count as computed again even where a checkpoint kept them: at most `log_every` steps a
    restart."""
    final = _records(os.path.join(workdir, "metrics.jsonl"))
    latest: dict[float, dict] = {}
    for record in [*final, *_records(os.path.join(workdir, "metrics.rolled_back.jsonl")),
                   *_records(os.path.join(workdir, SEGMENTS_FILE))]:
        if "segment_start" not in record:
            continue
        key = float(record["segment_start"])
        if key not in latest or record["wall_s"] >= latest[key]["wall_s"]:
            latest[key] = record
    surviving: dict[float, tuple[int, float]] = {}
    for record in final:
        if "segment_start" in record and "step" in record:
            key = float(record["segment_start"])
            if key not in surviving or record["step"] > surviving[key][0]:
                surviving[key] = (int(record["step"]), float(record["productive_s"]))
    ordered = sorted(latest)
    return [{**latest[key], "surviving_s": latest[key]["productive_s"] if key == ordered[-1]
             else surviving.get(key, (0, 0.0))[1]} for key in ordered]


def _records(path: str) -> list[dict]:
    return durable.read_jsonl(path) if os.path.exists(path) else []


def summarize(workdir: str) -> dict | None:
    """{"wall_s", "productive_s", "goodput", "segments", "badput_s": {part: seconds}} over every segment of
    the run in `workdir`; None before any record carried the figures."""
    found = segments(workdir)
    if not found:
        return None
    wall = sum(s["wall_s"] for s in found)
    productive = sum(min(s["surviving_s"], s["productive_s"]) for s in found)
    badput = {part: sum(s.get(f"badput_{part}_s", 0.0) for s in found) for part in PARTS}
    badput[RECOMPUTED] = sum(max(s["productive_s"] - s["surviving_s"], 0.0) for s in found)
    return {"wall_s": wall, "productive_s": productive, "goodput": productive / wall if wall > 0 else None,
            "segments": len(found), "killed": sum(not s.get("end") for s in found), "badput_s": badput}


def format_summary(summary: dict) -> str:
    """The report's goodput lines: the wall clock, goodput, each badput part in seconds and share."""
    wall = summary["wall_s"]
    lines = [f"goodput {summary['goodput']:.1%}: {summary['productive_s']:,.1f} s of steps kept in "
             f"{wall:,.1f} s of wall clock over {summary['segments']} process lifetime(s) "
             f"({summary['killed']} ended without finishing)"]
    for part, seconds in summary["badput_s"].items():
        lines.append(f"  badput {part:<11} {seconds:>10,.1f} s  {seconds / wall:6.1%}" if wall else part)
    accounted = summary["productive_s"] + sum(summary["badput_s"].values())
    lines.append(f"  accounted {accounted:,.1f} s of {wall:,.1f} s")
    return "\n".join(lines)
