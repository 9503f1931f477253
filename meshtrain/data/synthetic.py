"""A synthetic token source for tests and smoke runs: learnable, deterministic, instant.

Every row is a function of (seed, split, global row index) only, so any process can make
any row and a resumed or re-sharded run sees the same rows. The structure to learn: a
fixed table of random n-grams (drawn from the seed); documents are BOS, a random sequence
of those n-grams, EOS. Once the first token of an n-gram is seen the rest is predictable,
so the loss falls well below log(vocab). Rows end with padding when the space left is too
short for another document, which exercises the loss mask.
"""

from __future__ import annotations

import numpy as np

from meshtrain.data import packing

NUM_NGRAMS = 64
NGRAM_LEN = 6
MIN_DOC_TOKENS = 8
_SPLIT_IDS = {"train": 0, "validation": 1}


class SyntheticRows:
    """Random-access rows: `rows[i]` is the window (tokens, doc_ids) of global row i."""

    def __init__(self, seed: int, seq_len: int, vocab_size: int, split: str = "train"):
        if split not in _SPLIT_IDS:
            raise ValueError(f"split={split!r}: must be one of {tuple(_SPLIT_IDS)}")
        if vocab_size < 4:
            raise ValueError(f"vocab_size={vocab_size}: the synthetic source needs at least 4 ids "
                             "(PAD, BOS, EOS and one token)")
        self.seed, self.seq_len, self.vocab_size = int(seed), int(seq_len), int(vocab_size)
        self.split = _SPLIT_IDS[split]
        table_rng = np.random.default_rng([self.seed, 7919])
        first_token = packing.EOS_ID + 1
        self.ngrams = table_rng.integers(first_token, vocab_size, size=(NUM_NGRAMS, NGRAM_LEN), dtype=np.int32)

    def __len__(self) -> int:
        return 2**62  # unbounded: every index is a row

    def __getitem__(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        width = self.seq_len + 1
        rng = np.random.default_rng([self.seed, self.split, int(row)])
        tokens = np.full(width, packing.PAD_ID, dtype=np.int32)
        doc_ids = np.zeros(width, dtype=np.int32)
        pos, doc = 0, 1
        while width - pos >= MIN_DOC_TOKENS:
            n = int(rng.integers(1, max(2, width // NGRAM_LEN)))
            body = self.ngrams[rng.integers(0, NUM_NGRAMS, size=n)].reshape(-1)
            text = np.concatenate([[packing.BOS_ID], body, [packing.EOS_ID]])[: width - pos]
            tokens[pos:pos + len(text)] = text
            doc_ids[pos:pos + len(text)] = doc
            pos, doc = pos + len(text), doc + 1
        return tokens, doc_ids
