"""The data pipeline: sources, tokenizers, packing, grain loading and global batches.

    it = data.make_iterator(run, split="train", state=None)   # run: a `meshtrain.run.Run` (a `BatchLayout`)
    batch = next(it)   # dict of global [train.batch_size, train.seq_len] jax.Arrays
    it.state()         # {"next_row": ...}: store it with the checkpoint, pass it back to resume

Sources (`config.data.source`): `text_files` (a glob of local files, or the Python standard
library's sources when `config.data.files` is empty), `tfds:<name>` (a TFDS dataset already
prepared in `config.data.data_dir`), `hf:<folder or glob>` (a local Hugging Face dataset read
through `datasets`, `hf_source.py`) and `synthetic` (deterministic, for tests).
"""

from __future__ import annotations

from typing import Protocol

import jax
import ml_collections
import numpy as np

from meshtrain import config as config_lib
from meshtrain.data import packing
from meshtrain.data.loader import DataIterator
from meshtrain.data.synthetic import SyntheticRows

__all__ = ["BatchLayout", "DataIterator", "iterator", "make_iterator", "packing", "read_report"]

SPLITS = ("train", "validation")
_STATE_KEYS = ("source", "seed", "seq_len")


def _rows(config: ml_collections.ConfigDict, split: str):
    source = config.data.source
    if source == "synthetic":
        return SyntheticRows(config.seed, config.train.seq_len, config.model.vocab_size, split)
    from meshtrain.data import sources  # TFDS is imported only for real data

    return sources.open_rows(config, split)


class BatchLayout(Protocol):
    """What the data needs of a run (`meshtrain.run.Run` is one): its config, how a batch is laid out
    over the devices, and in which token order it arrives (`run.layout.permutation`)."""

    config: ml_collections.ConfigDict
    batch_sharding: jax.sharding.NamedSharding
    layout: _TokenOrder


class _TokenOrder(Protocol):
    permutation: np.ndarray | None


def read_report(config: ml_collections.ConfigDict) -> tuple[dict[str, int], list[str]]:
    """(counts, examples) of the files and lines a text source skipped (`sources.read_report`)."""
    if config.data.source != "text_files":
        return {}, []
    from meshtrain.data import sources

    return sources.read_report(config)


def make_iterator(run: BatchLayout, split: str = "train", state: dict | None = None) -> DataIterator:
    """The run's iterator of global batches of `split`: in its batch sharding and token order."""
    return iterator(run.config, run.batch_sharding, split, state, run.layout.permutation)


def iterator(config: ml_collections.ConfigDict, sharding: jax.sharding.NamedSharding, split: str = "train",
             state: dict | None = None, permutation: np.ndarray | None = None) -> DataIterator:
    """The iterator of global batches of `split`, starting at `state["next_row"]` (0 if no state).

    Args:
      config: the validated run config (`data.*`, `train.batch_size`, `train.seq_len`, `seed`).
      sharding: every [B, T] field's sharding (`Run.batch_sharding`).
      split: "train" or "validation".
      state: a dict from `DataIterator.state()` of an earlier run, or None.
      permutation: optional int array [train.seq_len]; every field is permuted along the sequence
        axis on the host (e.g. ring attention's zig-zag layout). Targets are computed before it.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: must be one of {SPLITS}")
    info = {"source": str(config.data.source), "seed": int(config.seed), "seq_len": int(config.train.seq_len)}
    start_row = 0
    if state is not None:
        if "next_row" not in state:
            raise ValueError(f"data state {state!r}: must hold 'next_row' (from DataIterator.state())")
        for key in _STATE_KEYS:
            if key in state and state[key] != info[key]:
                name = {"source": "data.source", "seed": "seed", "seq_len": "train.seq_len"}[key]
                raise ValueError(f"config.{name}={info[key]!r}: the data state to resume was written with "
                                 f"{state[key]!r}; resuming must keep it to see the same rows")
        start_row = int(state["next_row"])
    return DataIterator(
        _rows(config, split), sharding, batch_size=config.train.batch_size, seq_len=config.train.seq_len,
        start_row=start_row, permutation=permutation,
        cross_document_attention=bool(config.data.cross_document_attention),
        prefetch=int(config.data.prefetch), state_info=info)


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """The data rules (gathered by `meshtrain.validate`). Raises ConfigError."""
    del sizes  # the batch divisibility rules live in meshtrain.config
    source = config.data.source
    if not isinstance(source, str) or not (source in ("synthetic", "text_files")
                                           or source.startswith(("tfds:", "hf:"))):
        raise config_lib.ConfigError("data.source", source,
                                     "must be 'text_files', 'synthetic', 'tfds:<name>' or 'hf:<folder or glob>'")
    if not isinstance(config.data.prefetch, int) or config.data.prefetch < 1:
        raise config_lib.ConfigError("data.prefetch", config.data.prefetch, "must be an integer >= 1")
    if source == "synthetic":
        if config.model.vocab_size < 4:
            raise config_lib.ConfigError("model.vocab_size", config.model.vocab_size,
                                         "the synthetic source needs at least 4 ids (PAD, BOS, EOS, one token)")
        return
    from meshtrain.data import sources

    sources.validate_config(config)

