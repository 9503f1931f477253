"""Packing: documents laid end to end in fixed-length rows, with document masks.

Playbook, "First Steps: Training on one GPU" (batch size in tokens = rows x seq_len) and
"Context Parallelism" (the sequence axis that these fields are later laid out along, e.g.
in the "Zig-Zag Ring Attention" order). A row of `seq_len` tokens holds several documents
back to back; `segment_ids` tell attention which tokens may see each other (never across a
document unless `data.cross_document_attention`), `positions` restart at 0 for each
document so RoPE sees every document as if it were alone, and `loss_mask` drops the targets
that would cross a document boundary or fall on padding.

A row is built from a window of `seq_len + 1` stream tokens and their document ids: the
extra token is the target of the last input. A document that continues from the previous
row starts a new segment here, with positions from 0 (its earlier part is not visible).
"""

from __future__ import annotations

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
FIELDS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


def row_fields(tokens: np.ndarray, doc_ids: np.ndarray, cross_document_attention: bool = False
               ) -> dict[str, np.ndarray]:
    """The five per-row fields from a window of `seq_len + 1` tokens.

    Args:
      tokens: int [seq_len + 1], the window of the token stream (its last token is only a target).
      doc_ids: int [seq_len + 1], any id that is equal within a document and differs between
        neighbouring documents; 0 marks padding.
      cross_document_attention: one segment per row, positions 0..seq_len-1.

    Returns:
      dict of [seq_len] arrays: inputs, targets (int32), loss_mask (float32), segment_ids
      (1, 2, ... per document in the row; 0 on padding), positions (int32).
    """
    tokens = np.asarray(tokens)
    doc_ids = np.asarray(doc_ids)
    if tokens.shape != doc_ids.shape or tokens.ndim != 1 or tokens.shape[0] < 2:
        raise ValueError(f"tokens {tokens.shape} and doc_ids {doc_ids.shape}: must be equal 1-d shapes of "
                         "length seq_len + 1 >= 2")
    length = tokens.shape[0] - 1
    doc_in, doc_next = doc_ids[:-1], doc_ids[1:]
    real = doc_in != 0
    if cross_document_attention:
        loss_mask = real & (doc_next != 0)
        segment_ids = real.astype(np.int32)
        positions = np.arange(length, dtype=np.int32)
    else:
        loss_mask = real & (doc_in == doc_next)
        starts = np.ones(length, dtype=bool)
        starts[1:] = doc_in[1:] != doc_in[:-1]
        segment_ids = np.where(real, np.cumsum(starts), 0).astype(np.int32)
        index = np.arange(length)
        start_index = np.maximum.accumulate(np.where(starts, index, 0))
        positions = np.where(real, index - start_index, 0).astype(np.int32)
    inputs = np.where(real, tokens[:-1], PAD_ID).astype(np.int32)
    targets = np.where(loss_mask, tokens[1:], PAD_ID).astype(np.int32)
    return {"inputs": inputs, "targets": targets, "loss_mask": loss_mask.astype(np.float32),
            "segment_ids": segment_ids, "positions": positions}
