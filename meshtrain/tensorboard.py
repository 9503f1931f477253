"""TensorBoard scalars and `jax.profiler` traces of a run, without TensorFlow.

Every number written to `metrics.jsonl` also goes to TensorBoard event files in
`<workdir>/tb` (through `tensorboardX`), every text (the in-loop sample) as a text summary,
and `config.profile.steps = (first, last)` traces those steps into `<workdir>/profile`,
readable by TensorBoard's profile plugin and by Perfetto (`*.trace.json.gz`). The playbook's
"Profiling GPU compute and communication" and appendix "A1: Distributed Training Profiling"
read such traces to check that communication overlaps computation.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
from collections.abc import Iterator

import jax

from meshtrain import durable

log = logging.getLogger(__name__)


class TensorBoardWriter:
    """Writes each record's numeric values as scalars, and its texts as text, at its `step`
    (process 0 only).

    When `tensorboardX` is not installed it says so once and writes nothing.
    """

    def __init__(self, workdir: str, enabled: bool = True):
        self.logdir = os.path.join(workdir, "tb")
        self._writer = None
        if not enabled:
            return
        self._writer = summary_writer_class()(self.logdir, flush_secs=30)

    def write(self, record: dict) -> None:
        if self._writer is None:
            return
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(key, float(value), step)
            elif isinstance(value, str):  # the in-loop sample (`sample_every`)
                self._writer.add_text(key, value, step)
        with durable.writing(self.logdir):  # a full disk: one line (`durable.WriteError`), as for metrics
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except OSError as error:  # the run is ending; what failed to reach the disk is lost from TB only
                log.warning("TensorBoard events in %s not all written: %s", self.logdir, error)


_IMPORT_LOCK = threading.Lock()


def summary_writer_class():
    """tensorboardX's `SummaryWriter`, imported without torch.

    tensorboardX imports torch whenever torch is installed, only to accept torch tensors (which
    meshtrain never passes): a noticeable part of every run's start where torch is installed (the test
    extra installs it; docs/benchmarks.md). While tensorboardX is imported, `import torch` fails (a `None` entry in
    `sys.modules`), and tensorboardX falls back to numpy; torch imported later imports normally.
    """
    with _IMPORT_LOCK:
        if "tensorboardX" in sys.modules or "torch" in sys.modules:
            from tensorboardX import SummaryWriter

            return SummaryWriter
        sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
        return SummaryWriter


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the scalars in every event file under `logdir`."""
    out: dict[str, list[tuple[int, float]]] = {}
    for step, value in _values(logdir):
        if value.WhichOneof("value") == "simple_value":
            out.setdefault(value.tag, []).append((step, value.simple_value))
    return out


def read_texts(logdir: str) -> dict[str, list[tuple[int, str]]]:
    """tag -> [(step, text)] of the text summaries (`add_text`) under `logdir`."""
    out: dict[str, list[tuple[int, str]]] = {}
    for step, value in _values(logdir):
        if value.metadata.plugin_data.plugin_name == "text":
            out.setdefault(value.tag, []).append((step, value.tensor.string_val[0].decode()))
    return out


def _values(logdir: str) -> Iterator[tuple[int, object]]:
    """(step, Summary.Value) of every event file under `logdir` (TFRecord framing, protobuf Events)."""
    from tensorboardX.proto import event_pb2

    for root, _, files in os.walk(logdir):
        for name in sorted(files):
            if "tfevents" not in name:
                continue
            for payload in _records(os.path.join(root, name)):
                event = event_pb2.Event.FromString(payload)
                for value in event.summary.value:
                    yield event.step, value


def _records(path: str) -> Iterator[bytes]:
    """The payloads of a TFRecord file; a torn last record (a crash during its write) ends the file, as
    TensorBoard reads it."""
    with open(path, "rb") as fh:
        while len(header := fh.read(12)) == 12:  # uint64 length, uint32 masked crc of the length
            (length,) = struct.unpack("<Q", header[:8])
            payload = fh.read(length)
            if len(payload) < length or len(fh.read(4)) < 4:  # masked crc of the payload
                return  # a torn last record (a crash during its write), as TensorBoard reads it: skipped
            yield payload


class StepProfiler:
    """Starts a `jax.profiler` trace before step `first` and stops it after step `last` has run.

    `steps=(0, 0)` turns it off. Call `before(step)` before dispatching a step and
    `after(step, outputs)` after; `after` waits for the outputs so the trace holds the whole step.
    """

    def __init__(self, workdir: str, steps: tuple[int, int], enabled: bool = True):
        self.first, self.last = (int(s) for s in steps)
        self.logdir = os.path.join(workdir, "profile")
        self.enabled = enabled and self.first > 0
        self.active = False

    def before(self, step: int) -> None:
        if self.enabled and step == self.first:
            os.makedirs(self.logdir, exist_ok=True)
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
            self.active = True
            log.info("profiling steps %d-%d into %s", self.first, self.last, self.logdir)

    def after(self, step: int, outputs) -> None:
        if self.active and step == self.last:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False



def trace_op_times(logdir: str, top: int = 20) -> dict[str, list[dict]]:
    """Where a profiled stretch spent its time: for each process of the newest `*.trace.json.gz` under
    `logdir` (`StepProfiler`, or `jax.profiler.trace(..., create_perfetto_trace=True)`), each line of a
    device process apart ("/device:GPU:0 / Stream #13", "... / XLA Ops"), the `top` operations by total
    duration summed over their calls, as {"name", "ms", "calls", "share"} (share of that row's summed
    durations). A GPU stream's rows are its kernels (GEMMs, Triton kernels, XLA's fusions, NCCL
    collectives); nested host events count once per level."""
    import collections
    import glob
    import gzip
    import json

    traces = sorted(glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not traces:
        raise FileNotFoundError(f"no *.trace.json.gz under {logdir}")
    with gzip.open(traces[-1], "rt") as fh:
        events = json.load(fh)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    processes = {e["pid"]: e.get("args", {}).get("name", str(e["pid"])) for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", str(e.get("tid"))) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    totals: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            pid, tid = e.get("pid"), e.get("tid")
            where = processes.get(pid, str(pid))
            if where.startswith("/device:"):  # a GPU's lines (its streams, "XLA Ops", "XLA Modules") apart
                where += f" / {threads.get((pid, tid), tid)}"
            row = totals[where][e.get("name", "?")]
            row[0] += float(e["dur"])
            row[1] += 1
    out = {}
    for where, ops in totals.items():
        whole = sum(t for t, _ in ops.values()) or 1.0
        ranked = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
        out[where] = [{"name": name[:160], "ms": round(t / 1e3, 3), "calls": n, "share": round(t / whole, 4)}
                      for name, (t, n) in ranked]
    return out
