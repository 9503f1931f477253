"""The data iterator: packing fields, determinism, exact resume across topologies, permutation."""

import json

import jax
import numpy as np
import pytest

from meshtrain import config as config_lib, data
from meshtrain.data import packing
from meshtrain.data.sources import PackedRows
from tests.utils import batch_sharding, mesh_of as make_mesh


def small_config(seed=0, batch_size=8, seq_len=32):
    c = config_lib.default_config()
    c.seed, c.train.batch_size, c.train.seq_len = seed, batch_size, seq_len
    c.data.source = "synthetic"
    return c


def take(config, mesh, steps, state=None, split="train", permutation=None):
    it = data.iterator(config, batch_sharding(mesh), split=split, state=state, permutation=permutation)
    try:
        batches = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(steps)]
        return batches, it.state(), it
    finally:
        it.close()


def row_fields_reference(tokens, doc_ids):
    """Loop-by-loop definition of the packed fields (natural order, no cross-document attention)."""
    length = len(tokens) - 1
    out = {k: np.zeros(length, np.float32 if k == "loss_mask" else np.int32) for k in packing.FIELDS}
    segment, position = 0, 0
    for t in range(length):
        if doc_ids[t] == 0:
            continue
        if t == 0 or doc_ids[t] != doc_ids[t - 1]:
            segment, position = segment + 1, 0
        out["inputs"][t], out["segment_ids"][t], out["positions"][t] = tokens[t], segment, position
        position += 1
        if doc_ids[t + 1] == doc_ids[t]:
            out["targets"][t], out["loss_mask"][t] = tokens[t + 1], 1.0
    return out


def test_row_fields_match_reference():
    rng = np.random.default_rng(0)
    doc_ids = np.repeat([7, 3, 3, 9, 4, 0], [5, 1, 0, 12, 9, 6])[:33]
    doc_ids = np.concatenate([doc_ids, np.zeros(33 - len(doc_ids), int)])
    tokens = np.where(doc_ids > 0, rng.integers(3, 259, 33), 0)
    got = packing.row_fields(tokens, doc_ids)
    want = row_fields_reference(tokens, doc_ids)
    for name in packing.FIELDS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert got[name].dtype == want[name].dtype
    assert got["segment_ids"].max() == 4 and got["positions"][6:18].tolist() == list(range(12))


def test_cross_document_attention_is_one_segment():
    c = small_config()
    c.data.cross_document_attention = True
    (batch,), _, _ = take(c, make_mesh(data=8), 1)
    real = batch["inputs"] != packing.PAD_ID
    np.testing.assert_array_equal(batch["segment_ids"], real.astype(np.int32))
    np.testing.assert_array_equal(batch["positions"], np.broadcast_to(np.arange(32), (8, 32)))


def test_batch_fields_shapes_dtypes_sharding():
    mesh = make_mesh(data=2, fsdp=2, sequence=2)
    (batch,), state, _ = take(small_config(), mesh, 1)
    it = data.iterator(small_config(), batch_sharding(mesh))
    live = next(it)
    it.close()
    want = {"inputs": np.int32, "targets": np.int32, "loss_mask": np.float32, "segment_ids": np.int32,
            "positions": np.int32}
    for name, dtype in want.items():
        assert live[name].shape == (8, 32) and live[name].dtype == dtype
        assert live[name].sharding == batch_sharding(mesh)
    assert batch_sharding(mesh).spec == jax.sharding.PartitionSpec(("data", "fsdp"), "sequence")
    assert state["next_row"] == 8 and batch["loss_mask"].sum() > 0 and (batch["loss_mask"] == 0).any()


def test_same_seed_same_batches_different_seed_differs():
    mesh = make_mesh(data=8)
    first, _, _ = take(small_config(seed=3), mesh, 3)
    again, _, _ = take(small_config(seed=3), mesh, 3)
    other, _, _ = take(small_config(seed=4), mesh, 3)
    for a, b in zip(first, again, strict=True):
        for name in packing.FIELDS:
            np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(first[0]["inputs"], other[0]["inputs"])
    validation, _, _ = take(small_config(seed=3), mesh, 1, split="validation")
    assert not np.array_equal(first[0]["inputs"], validation[0]["inputs"])


@pytest.mark.parametrize("resume_mesh", [{"data": 8}, {"data": 2, "tensor": 4},
                                         {"fsdp": 2, "sequence": 2, "tensor": 2}])
def test_resume_on_any_data_parallel_size_gives_uninterrupted_rows(resume_mesh):
    config = small_config(seed=1)
    full, _, _ = take(config, make_mesh(data=4, fsdp=2), 5)
    _, state, _ = take(config, make_mesh(data=4, fsdp=2), 2)
    assert state["next_row"] == 2 * 8
    state = json.loads(json.dumps(state))  # as stored with a checkpoint
    rest, _, _ = take(config, make_mesh(**resume_mesh), 3, state=state)
    for a, b in zip(full[2:], rest, strict=True):
        for name in packing.FIELDS:
            np.testing.assert_array_equal(a[name], b[name])


def test_resume_rejects_a_different_seed():
    _, state, _ = take(small_config(seed=1), make_mesh(data=8), 1)
    with pytest.raises(ValueError, match="config.seed=2"):
        data.iterator(small_config(seed=2), batch_sharding(make_mesh(data=8)), state=state)


def test_permutation_applies_after_targets():
    perm = np.random.default_rng(0).permutation(32)
    mesh = make_mesh(data=4, sequence=2)
    (plain,), _, _ = take(small_config(), mesh, 1)
    (permuted,), _, _ = take(small_config(), mesh, 1, permutation=perm)
    for name in packing.FIELDS:
        np.testing.assert_array_equal(permuted[name], plain[name][:, perm])
    with pytest.raises(ValueError, match="permutation"):
        data.iterator(small_config(), batch_sharding(mesh), permutation=np.zeros(32, int))


def test_input_wait_is_measured():
    it = data.iterator(small_config(), batch_sharding(make_mesh(data=8)))
    for _ in range(3):
        next(it)
    assert it.input_seconds() == it.wait_seconds >= 0.0
    it.close()


def test_synthetic_is_learnable_structure():
    """Every synthetic token after the first of an n-gram is determined by its predecessor's n-gram."""
    (batch,), _, _ = take(small_config(batch_size=8, seq_len=128), make_mesh(data=8), 1)
    inputs, mask = batch["inputs"], batch["loss_mask"]
    pairs = {}
    for a, b in zip(inputs[mask > 0], batch["targets"][mask > 0], strict=True):
        pairs.setdefault(int(a), set()).add(int(b))
    mean_successors = np.mean([len(v) for v in pairs.values()])
    assert mean_successors < 8  # vs up to 512 for uniform noise


def test_packed_rows_split_long_documents_and_drop_nothing():
    # 3 documents: one of 300 tokens (longer than seq_len) and two short ones; total - 1 = 6 * 64.
    lengths = [300, 40, 45]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.arange(starts[-1], dtype=np.uint16) % 250 + 3
    rows = PackedRows(tokens, starts, seq_len=64, seed=5, split="train")
    assert rows.num_windows == 6
    windows = sorted((int(rows._windows[i]), rows[i]) for i in range(rows.num_windows))  # one epoch
    stream = np.concatenate([w[0][:-1] for _, w in windows] + [windows[-1][1][0][-1:]])
    order_tokens = np.concatenate([tokens[starts[d]:starts[d + 1]] for d in rows.order])
    np.testing.assert_array_equal(stream, order_tokens)  # every token of every document, in stream order
    long_rows = [w for _, w in windows if (w[1] == 1 + int(np.flatnonzero(rows.order == 0)[0])).any()]
    assert len(long_rows) >= 5  # the 300-token document spans several rows
    epoch2 = [int(rows._windows[i]) for i in range(6, 12)]
    assert sorted(epoch2) == list(range(6))
