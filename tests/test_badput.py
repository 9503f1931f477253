"""The wall clock of a run split into productive steps and badput (`meshtrain/badput.py`): the ledger's
marks, and the report's sum over the process lifetimes of a workdir (killed ones, rollbacks, steps a
restart computed again). A run killed twice for real: `bench/restart.py` (CI runs it)."""

from __future__ import annotations

import json

import pytest

from meshtrain import badput


class _Clock:
    """Stands in for the process's compile clock: seconds the test says JAX compiled."""

    def __init__(self):
        self.seconds, self.hits, self.misses = 0.0, 0, 0


@pytest.fixture
def ledger(monkeypatch, tmp_path):
    now = [1000.0]
    monkeypatch.setattr(badput.time, "time", lambda: now[0])
    monkeypatch.setattr(badput, "process_start", lambda: 990.0)
    clock = _Clock()
    monkeypatch.setattr(badput, "compile_clock", lambda: clock)
    data = [0.0]
    book = badput.Ledger(str(tmp_path), enabled=True, data_seconds=lambda: data[0])

    def advance(seconds, compiled=0.0, waited=0.0):
        now[0] += seconds
        clock.seconds += compiled
        data[0] += waited

    return book, advance, data


def test_marks_split_the_time_less_compiles_and_data_waits(ledger):
    book, advance, data = ledger
    book.mark("startup")  # 10 s since the process started
    advance(5.0, compiled=4.0)  # the first step: 4 s of it compiling
    book.mark("productive")
    advance(2.0, waited=0.5)
    book.mark("productive")
    book.saved(2)
    advance(0.25)
    book.mark("checkpoint")
    advance(3.0)
    book.mark("productive")
    book.rolled_back(2)  # the 3 s after step 2's save were undone
    advance(1.0)
    data[0] = 0.25  # a fresh iterator counts from 0 again
    book.mark("rollback")
    fields = book.fields()
    assert fields["wall_s"] == 21.25 and fields["segment_start"] == 990.0
    assert fields["productive_s"] == 1.0 + 1.5
    assert {p: fields[f"badput_{p}_s"] for p in ("startup", "compile", "data", "checkpoint", "rollback")} == {
        "startup": 10.0, "compile": 4.0, "data": 0.75, "checkpoint": 0.25, "rollback": 3.0 + 0.75}
    assert fields["productive_s"] + sum(fields[f"badput_{p}_s"] for p in badput.PARTS) == fields["wall_s"]


def test_close_writes_the_segment_once_and_exit_adds_the_shutdown(ledger, tmp_path):
    book, advance, _ = ledger
    advance(2.0)
    book.close("checkpoint")
    book.close("checkpoint")
    advance(0.5)
    book._at_exit()
    lines = [json.loads(line) for line in (tmp_path / badput.SEGMENTS_FILE).read_text().splitlines()]
    assert [(line["wall_s"], line["badput_checkpoint_s"], line["badput_shutdown_s"]) for line in lines] == [
        (12.0, 12.0, 0.0), (12.5, 12.0, 0.5)]


def _record(segment, step, wall, productive, **parts):
    return {"step": step, "loss": 1.0, "segment_start": segment, "wall_s": wall, "productive_s": productive,
            **{f"badput_{p}_s": parts.get(p, 0.0) for p in badput.PARTS}}


def test_the_report_sums_the_lifetimes_of_a_run_killed_twice(tmp_path):
    """Segment 1 logs steps 1-6 and is killed (resumed from 4); segment 2 logs 5-9, is killed and its
    newest logged steps were never saved (resumed from 8); segment 3 logs 9-12 and ends."""
    final = [_record(1.0, s, 10.0 + s, 1.0 * s, startup=5.0, compile=5.0) for s in (1, 2, 3, 4)]
    final += [_record(100.0, s, 5.0 + s, 2.0 * (s - 4), startup=3.0, restore=0.5) for s in (5, 6, 7, 8)]
    final += [_record(200.0, s, 4.0 + s, 1.5 * (s - 8), startup=2.5) for s in (9, 10, 11, 12)]
    rolled = [_record(1.0, s, 10.0 + s, 1.0 * s, startup=5.0, compile=5.0) for s in (5, 6)]
    rolled += [_record(100.0, 9, 14.0, 10.0, startup=3.0, restore=0.5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in final))
    (tmp_path / "metrics.rolled_back.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rolled))
    end = {**_record(200.0, 12, 16.5, 6.0, startup=2.5, checkpoint=0.5), "end": True}
    del end["step"], end["loss"]
    (tmp_path / badput.SEGMENTS_FILE).write_text(json.dumps(end) + "\n")
    summary = badput.summarize(str(tmp_path))
    assert summary["segments"] == 3 and summary["killed"] == 2
    assert summary["wall_s"] == 16.0 + 14.0 + 16.5
    assert summary["productive_s"] == 4.0 + 8.0 + 6.0  # what survives: steps 1-4, 5-8, 9-12
    assert summary["badput_s"]["recomputed"] == (6.0 - 4.0) + (10.0 - 8.0)
    assert summary["badput_s"]["startup"] == 10.5 and summary["badput_s"]["restore"] == 0.5
    text = badput.format_summary(summary)
    assert text.startswith(f"goodput {18.0 / 46.5:.1%}") and "(2 ended without finishing)" in text


def test_a_run_without_the_figures_has_no_goodput(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert badput.summarize(str(tmp_path)) is None
