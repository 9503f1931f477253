"""The loss-spike guard (`train.spike_*`): planted rows of random tokens spike the loss; the run
rolls back to the newest checkpoint before the spike, skips exactly those rows, and trains on to
the losses of a run that never saw them."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from meshtrain import data, run_guards, train
from tests import planted_rows
from tests.utils import config_for, losses_of

pytestmark = pytest.mark.usefixtures("compilation_cache")

STEPS, BATCH, EVERY = 30, 8, 5
POISONED_STEPS = (20, 21)  # step 20 is also a checkpoint step: no checkpoint may be written while spiking
FIRST_ROW = (POISONED_STEPS[0] - 1) * BATCH
END_ROW = POISONED_STEPS[-1] * BATCH  # rows [FIRST_ROW, END_ROW) are random tokens


def _Poisoned(rows, vocab_size: int, first: int = FIRST_ROW, end: int = END_ROW):
    return planted_rows.Poisoned(rows, vocab_size, first, end)


class _Without:
    """Train rows with [FIRST_ROW, END_ROW) removed: what the recovered run should have trained on."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, row: int):
        row = int(row)
        return self.rows[row + (END_ROW - FIRST_ROW) if row >= FIRST_ROW else row]


def _with_rows(monkeypatch, wrap):
    original = data._rows

    def rows(config, split):
        return wrap(original(config, split), config) if split == "train" else original(config, split)
    monkeypatch.setattr(data, "_rows", rows)


def _config(workdir, **overrides):
    return config_for(workdir, **{"steps": STEPS, "data.source": "synthetic", "checkpoint.every": EVERY,
                                  "train.batch_size": BATCH, "train.learning_rate": 1e-2, "train.warmup_steps": 2,
                                  **overrides})  # a loss well below log(vocab) by step 20


def test_a_planted_spike_is_rolled_back_and_its_rows_skipped(tmp_path, monkeypatch, caplog):
    guarded = tmp_path / "guarded"
    _with_rows(monkeypatch, lambda rows, config: _Poisoned(rows, config.model.vocab_size))
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        last = train.run(_config(guarded, **{"train.spike_factor": 1.5, "train.spike_steps": 2,
                                             "train.spike_window": 8}))
    assert last["spike_rollbacks"] == 1
    # the planted rows spiked the loss: those steps' records were moved out of metrics.jsonl
    rolled_back = {r["step"]: r["loss"] for r in map(json.loads, open(guarded / "metrics.rolled_back.jsonl"))}
    assert sorted(rolled_back) == list(range(EVERY * 3 + 1, POISONED_STEPS[-1] + 1))  # 16..21
    losses = losses_of(guarded)
    median = float(np.median([losses[s] for s in range(POISONED_STEPS[0] - 8, POISONED_STEPS[0])]))
    assert all(rolled_back[s] > 1.5 * median for s in POISONED_STEPS), (rolled_back, median)
    # rolled back to checkpoint 15: the one at step 20 was never written (the loss was spiking)
    warnings = [r.getMessage() for r in caplog.records if r.name == "meshtrain"]
    assert f"step {POISONED_STEPS[0]}: no checkpoint while the loss spikes (since step {POISONED_STEPS[0]})" in warnings
    message = [m for m in warnings if m.startswith("loss spike at")]
    assert len(message) == 1 and f"steps {POISONED_STEPS[0]}..{POISONED_STEPS[-1]}" in message[0], message
    assert f"rolled back to step {EVERY * 3}, skipping data rows {FIRST_ROW}..{END_ROW - 1}" in message[0], message
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < min(rolled_back[s] for s in POISONED_STEPS) and losses[STEPS] < losses[EVERY * 3]

    # the recovered run equals a run that never saw the planted rows
    monkeypatch.undo()
    clean = tmp_path / "clean"
    _with_rows(monkeypatch, lambda rows, config: _Without(rows))
    train.run(_config(clean))
    reference = losses_of(clean)
    np.testing.assert_allclose([losses[s] for s in range(1, STEPS + 1)],
                               [reference[s] for s in range(1, STEPS + 1)], rtol=1e-5, atol=0)


def test_a_spike_that_persists_stops_the_run(tmp_path, monkeypatch):
    """Every row from step 20 on is random: each rollback meets another spike; after
    train.spike_max_rollbacks the run stops with one error naming the steps and the limit."""
    _with_rows(monkeypatch, lambda rows, config: _Poisoned(rows, config.model.vocab_size, FIRST_ROW, 2**62))
    with pytest.raises(run_guards.SpikeError, match=r"after 1 rollbacks \(train.spike_max_rollbacks\)"):
        train.run(_config(tmp_path, **{"train.spike_factor": 1.5, "train.spike_steps": 2, "train.spike_window": 8,
                                       "train.spike_max_rollbacks": 1}))
