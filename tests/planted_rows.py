"""Train rows made bad on purpose (tests/test_loss_spike.py, and 2-process runs through
`tests/planted/sitecustomize.py`): rows whose global indices fall in [first, end) are random tokens."""

from __future__ import annotations

import numpy as np


class Poisoned:
    """Train rows whose global indices in [first, end) are uniform random tokens."""

    def __init__(self, rows, vocab_size: int, first: int, end: int):
        self.rows, self.vocab_size, self.first, self.end = rows, vocab_size, first, end

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, row: int):
        tokens, doc_ids = self.rows[row]
        if self.first <= int(row) < self.end:
            rng = np.random.default_rng(int(row))
            return rng.integers(3, self.vocab_size, tokens.shape).astype(tokens.dtype), np.ones_like(doc_ids)
        return tokens, doc_ids


def plant(first: int, end: int) -> None:
    """Every train row source of this process poisons rows [first, end) (`meshtrain.data._rows` wrapped)."""
    from meshtrain import data

    original = data._rows

    def rows(config, split):
        source = original(config, split)
        return Poisoned(source, config.model.vocab_size, first, end) if split == "train" else source

    data._rows = rows
