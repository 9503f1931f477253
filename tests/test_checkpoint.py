"""Checkpoints in one process: exact resume, resharding restore, non-finite steps, restore safety.

Every run uses the real data pipeline (the text_files source) and `meshtrain.train.run`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import (
    checkpoint as checkpoint_lib,
    config as config_lib,
    data,
    run_guards,
    train,
    train_step as train_step_lib,
)
from meshtrain.run import Run
from meshtrain.validate import validate
from tests.utils import STEPS, abstract_state, all_steps, assert_bitwise, config_for, latest_step, load, losses_of

pytestmark = pytest.mark.usefixtures("compilation_cache")

STOPS = (1, 5, 11)  # the chained run stops (SIGTERM) after each and resumes


class HookedIterator:
    """Wraps the run's data iterator: `hook(global_step, batch) -> batch` before each step."""

    def __init__(self, it, batch_size, hook):
        self.it, self.batch_size, self.hook = it, batch_size, hook

    def __next__(self):
        step = self.it.state()["next_row"] // self.batch_size + 1
        return self.hook(step, next(self.it))

    def __getattr__(self, name):
        return getattr(self.it, name)


def hook_data(monkeypatch, hook):
    real = data.make_iterator

    def make_iterator(run, split="train", **kwargs):
        it = real(run, split, **kwargs)
        return HookedIterator(it, run.config.train.batch_size, hook) if split == "train" else it
    monkeypatch.setattr(data, "make_iterator", make_iterator)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """12 uninterrupted steps on fsdp=8, a checkpoint after every step (all kept)."""
    workdir = tmp_path_factory.mktemp("reference")
    train.run(config_for(workdir, **{"checkpoint.every": 1}))
    return workdir


def test_exact_resume_after_stops_at_1_5_11(reference, tmp_path, monkeypatch):
    hook_data(monkeypatch, lambda step, batch: (os.kill(os.getpid(), signal.SIGTERM) if step in STOPS else None)
              or batch)
    config = config_for(tmp_path, **{"checkpoint.every": 4})
    for k in (*STOPS, STEPS):
        result = train.run(config)
        assert result["step"] == k  # stopped right after the preempted step (or finished)
        assert latest_step(tmp_path) == k
    want, got = losses_of(reference), losses_of(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == want  # bitwise: JSON keeps every float32 loss exactly
    abstract = abstract_state(config)
    for k in (*STOPS, STEPS):
        restored, expected = load(tmp_path, k, abstract), load(reference, k, abstract)
        assert_bitwise(restored.state, expected.state)
        assert restored.data_state == expected.data_state
        assert restored.data_state["next_row"] == k * 8


@pytest.mark.parametrize("mesh,devices", [({"data": 2, "fsdp": 2, "tensor": 2}, 8), ({"data": 2, "fsdp": 2}, 4)])
def test_restore_onto_another_mesh(reference, mesh, devices):
    """Saved on fsdp=8, restored onto the new mesh: bitwise params; the losses of the continued run
    equal those of an uninterrupted run on the new mesh."""
    config = config_for("/unused", mesh)
    device_list = jax.devices()[:devices]
    run = Run.resolve(config, device_list)
    factory, step_fn = train_step_lib.build(run)
    restored = load(reference, 5, factory.abstract)
    saved = load(reference, 5, abstract_state(config_for("/unused")))
    assert_bitwise(restored.state, saved.state)
    for leaf, target in zip(jax.tree.leaves(restored.state), jax.tree.leaves(factory.abstract), strict=True):
        assert leaf.sharding == target.sharding  # in the new run's layout

    def train_steps(state, data_state, count):
        it, losses = data.make_iterator(run, state=data_state), []
        with jax.set_mesh(run.mesh):
            for _ in range(count):
                state, metrics = step_fn(state, next(it))
                losses.append(float(metrics["loss"]))
        it.close()
        return losses

    uninterrupted = train_steps(factory.create(config.seed), None, STEPS)
    continued = train_steps(restored.state, restored.data_state, STEPS - 5)
    np.testing.assert_allclose(continued, uninterrupted[5:], rtol=1e-5, atol=0)


def nan_at(step_with_nan):
    def hook(step, batch):
        if step == step_with_nan:
            batch = {**batch, "loss_mask": batch["loss_mask"] * jnp.float32(jnp.nan)}
        return batch
    return hook


def test_nonfinite_step_stops_the_run_before_the_update(tmp_path, monkeypatch):
    hook_data(monkeypatch, nan_at(4))
    config = config_for(tmp_path, **{"checkpoint.every": 2})
    with pytest.raises(run_guards.NonFiniteError, match="at step 4") as error:
        train.run(config)
    assert error.value.step == 4 and np.isnan(error.value.loss)
    assert error.value.last_good == os.path.join(checkpoint_lib.checkpoint_root(tmp_path), "2")
    assert "checkpoints/2" in str(error.value)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert records[-1]["step"] == 4 and records[-1]["nonfinite"] == 1.0  # flushed before stopping
    assert all_steps(tmp_path) == [2]


def test_nonfinite_step_is_skipped_with_state_unchanged(reference, tmp_path, monkeypatch):
    hook_data(monkeypatch, nan_at(3))
    config = config_for(tmp_path, **{"checkpoint.every": 1, "train.skip_nonfinite": True})
    result = train.run(config)
    assert result["step"] == STEPS and result["skipped_steps"] == 1
    abstract = abstract_state(config)
    before, after = load(tmp_path, 2, abstract), load(tmp_path, 3, abstract)
    assert_bitwise((before.state.params, before.state.opt_state), (after.state.params, after.state.opt_state))
    assert int(after.state.step) == 2  # optimizer steps actually taken
    assert after.meta["skipped_steps"] == 1 and after.data_state["next_row"] == 3 * 8  # the batch is consumed
    assert_bitwise(before.state, load(reference, 2, abstract).state)
    losses = losses_of(tmp_path)
    assert np.isnan(losses[3]) and all(np.isfinite(v) for s, v in losses.items() if s != 3)


def test_restore_from_another_run_and_safety(reference, tmp_path, monkeypatch):
    abstract = abstract_state(config_for(tmp_path))
    # another run's workdir, its checkpoints/ root, or one step directory; no pickle is read
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load during restore"))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads during restore"))
    for source, step in ((reference, STEPS), (reference / "checkpoints", STEPS),
                         (reference / "checkpoints" / "7", 7)):
        config = config_for(tmp_path / f"new{step}", **{"checkpoint.restore_from": str(source)})
        ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(config.workdir))
        restored = checkpoint_lib.resume(config, ckpt, abstract)
        ckpt.close()
        assert restored.step == step
        assert_bitwise(restored.state, load(reference, step, abstract).state)
        assert restored.meta["config"]["model"]["d_model"] == 64  # the resolved config, as JSON

    with pytest.raises(ValueError, match="restore_from.*no such directory"):
        checkpoint_lib.resolve_restore_from(str(tmp_path / "missing"))
    # a step directory that is a symlink to somewhere else is refused
    root = tmp_path / "planted" / "checkpoints"
    root.mkdir(parents=True)
    os.symlink(reference / "checkpoints" / "3", root / "3")
    with pytest.raises(ValueError, match="outside the checkpoint root"):
        checkpoint_lib.Checkpointer(str(root), read_only=True).step_path(3)
    with pytest.raises(ValueError, match="keep=0"):
        checkpoint_lib.Checkpointer(str(tmp_path / "k"), keep=0)
    with pytest.raises(ValueError, match="shape"):  # a checkpoint of another model
        load(reference, 5, abstract_state(config_for(tmp_path, **{"model.d_model": 32})))
    # through the run: one ConfigError naming the key, before anything is compiled
    other_model = config_for(tmp_path / "other", **{"model.d_model": 32, "checkpoint.restore_from": str(reference)})
    with pytest.raises(config_lib.ConfigError, match=r"config.checkpoint.restore_from=.*has shape"):
        train.run(other_model)
    missing = config_for(tmp_path / "m", **{"checkpoint.restore_from": str(tmp_path / "missing")})
    with pytest.raises(config_lib.ConfigError, match=r"config.checkpoint.restore_from=.*is not a directory"):
        checkpoint_lib.validate_config(missing, validate(config_for(tmp_path), 8))


# ---- damaged checkpoints: checksums, fallback, nothing deleted --------------------------------


def test_checkpoint_without_fp8_state_resumes_exactly(reference, tmp_path):
    """A checkpoint whose state has no `fp8` node (written before the FP8 histories were part of the
    train state) resumes as one that has it: the continued run's losses equal the uninterrupted run's
    bitwise, and nothing is set aside as damaged."""
    config = config_for(tmp_path)
    restored = load(reference, 5, abstract_state(config))
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(tmp_path), async_save=False)
    older = {f.name: getattr(restored.state, f.name) for f in dataclasses.fields(restored.state) if f.name != "fp8"}
    ckpt.save(5, older, restored.data_state, restored.meta)
    ckpt.close()
    train.run(config)
    want, got = losses_of(reference), losses_of(tmp_path)
    assert sorted(got) == list(range(6, STEPS + 1))
    assert got == {k: want[k] for k in got}
    assert not os.path.exists(checkpoint_lib.checkpoint_root(tmp_path) + ".damaged")


def test_matmul_precision_switches_across_a_checkpoint(reference, tmp_path):
    """bf16 -> fp8: the parameters and optimizer state come back bitwise and the FP8 histories start
    empty (zeros, in the run's sharding); fp8 -> bf16: the histories are left unread."""
    bf16 = abstract_state(config_for("/unused"))
    fp8 = abstract_state(config_for("/unused", **{"model.matmul_precision": "fp8"}))
    assert jax.tree.leaves(fp8.fp8) and not jax.tree.leaves(bf16.fp8)
    as_bf16 = load(reference, 5, bf16).state
    as_fp8 = load(reference, 5, fp8)
    assert_bitwise(as_fp8.state.replace(fp8={}), as_bf16)
    for leaf, target in zip(jax.tree.leaves(as_fp8.state.fp8), jax.tree.leaves(fp8.fp8), strict=True):
        assert leaf.sharding == target.sharding and not np.asarray(leaf).any()
    histories = jax.tree.map(lambda a: a + 1.5, as_fp8.state.fp8)
    ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_root(tmp_path), async_save=False)
    ckpt.save(5, as_fp8.state.replace(fp8=histories), as_fp8.data_state, as_fp8.meta)
    ckpt.close()
    assert_bitwise(load(tmp_path, 5, fp8).state.fp8, histories)  # same precision: read exactly
    assert_bitwise(load(tmp_path, 5, bf16).state, as_bf16)


def _biggest_array_file(step_dir) -> str:
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
             if os.sep + "d" + os.sep in os.path.join(d, f)]
    return max(files, key=os.path.getsize)


def _truncate(step_dir) -> str:
    path = _biggest_array_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return path


def _flip_byte(step_dir) -> str:
    path = _biggest_array_file(step_dir)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    return path


def _remove_metadata(step_dir) -> str:
    path = os.path.join(step_dir, "state", "_METADATA")
    os.remove(path)
    return path


def _garble_json(step_dir) -> str:
    path = os.path.join(step_dir, "data", "metadata")
    with open(path, "w") as f:
        f.write('{"next_row": 8, "garbled')
    return path


def _garble_meta(step_dir) -> str:
    path = os.path.join(step_dir, "meta", "metadata")
    with open(path, "r+b") as f:
        f.seek(2)
        f.write(b"\x00garbled")
    return path


def _unchecksummed_process(step_dir) -> str:
    """Shards of a second process whose checksum file never came (a process that wrote but did not
    checksum): the missing file is what the error names."""
    shards = os.path.join(step_dir, "state", "ocdbt.process_1")
    os.makedirs(shards)
    with open(os.path.join(shards, "manifest.ocdbt"), "wb") as f:
        f.write(b"\0" * 16)
    return os.path.join(step_dir, checkpoint_lib.CHECKSUMS_SUBDIR, "process_1.json")


DAMAGES = {"truncated-array": _truncate, "flipped-byte": _flip_byte, "missing-metadata": _remove_metadata,
           "garbled-json": _garble_json, "unchecksummed-process": _unchecksummed_process}


def _copy_checkpoints(reference, workdir, steps) -> str:
    import shutil

    root = checkpoint_lib.checkpoint_root(workdir)
    for step in steps:
        source = os.path.join(checkpoint_lib.checkpoint_root(reference), str(step))
        shutil.copytree(source, os.path.join(root, str(step)))
    return root


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_checkpoint_is_named_and_refused(reference, tmp_path, damage):
    """Each damage is caught by the checksums before any array is read, and names the step and the file."""
    root = _copy_checkpoints(reference, tmp_path, (11, 12))
    damaged = DAMAGES[damage](os.path.join(root, "12"))
    abstract = abstract_state(config_for(tmp_path))
    ckpt = checkpoint_lib.Checkpointer(root, read_only=True)
    try:
        assert ckpt.verify(11) == []
        with pytest.raises(checkpoint_lib.CheckpointDamaged, match="step 12") as error:
            ckpt.restore(abstract, 12)
        assert os.path.relpath(damaged, os.path.join(root, "12")) in str(error.value)
        assert_bitwise(ckpt.restore(abstract, 11).state, load(reference, 11, abstract).state)
    finally:
        ckpt.close()


def test_resume_falls_back_to_the_newest_intact_checkpoint(reference, tmp_path):
    """Steps 12 and 11 damaged (a flipped array byte; a garbled run record): the run names both, moves
    them to checkpoints.damaged/ unchanged,
    resumes from 10 and trains steps 11 and 12 to the uninterrupted run's losses and state, bitwise.
    `restore_from` naming a damaged step stops with one error naming the key."""
    import filecmp

    root = _copy_checkpoints(reference, tmp_path / "run", (9, 10, 11, 12))
    _flip_byte(os.path.join(root, "12"))
    _garble_meta(os.path.join(root, "11"))
    kept = tmp_path / "kept"
    _copy_checkpoints(tmp_path / "run", kept, (11, 12))  # the damaged bytes, for comparison
    result = train.run(config_for(tmp_path / "run", **{"checkpoint.every": 1}))
    assert result["step"] == STEPS
    got, want = losses_of(tmp_path / "run"), losses_of(reference)
    assert got == {11: want[11], 12: want[12]}
    abstract = abstract_state(config_for(tmp_path))
    assert_bitwise(load(tmp_path / "run", 12, abstract).state, load(reference, 12, abstract).state)
    for step in (11, 12):  # moved aside, byte for byte
        moved = os.path.join(root + ".damaged", str(step))
        comparison = filecmp.dircmp(moved, os.path.join(checkpoint_lib.checkpoint_root(kept), str(step)))
        assert not comparison.diff_files and not comparison.left_only and not comparison.right_only
    assert all_steps(tmp_path / "run") == [9, 10, 11, 12]

    source = tmp_path / "source"
    _copy_checkpoints(reference, source, (12,))
    _flip_byte(os.path.join(checkpoint_lib.checkpoint_root(source), "12"))
    named = config_for(tmp_path / "new", **{"checkpoint.restore_from": os.path.join(
        checkpoint_lib.checkpoint_root(source), "12")})
    with pytest.raises(config_lib.ConfigError, match=r"config.checkpoint.restore_from=.*step 12.*is damaged"):
        train.run(named)


def test_synchronous_saves_are_checksummed_too(tmp_path):
    ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "c"), async_save=False)
    ckpt.save(1, {"w": jnp.arange(64.0)}, {"next_row": 0}, {"seed": 0})
    assert ckpt.verify(1) == []
    assert os.listdir(os.path.join(ckpt.step_path(1), checkpoint_lib.CHECKSUMS_SUBDIR)) == ["process_0.json"]
    ckpt.close()


def test_every_checkpoint_damaged_refuses_a_silent_fresh_start(reference, tmp_path):
    """All checkpoints damaged: the launch that finds them stops (they are moved aside); the relaunch,
    which sees no checkpoint at all, refuses too instead of training from step 0, until told to with
    `checkpoint.restart_from_scratch` (then it trains the reference run's losses from the start)."""
    root = _copy_checkpoints(reference, tmp_path / "run", (11, 12))
    _flip_byte(os.path.join(root, "12"))
    _truncate(os.path.join(root, "11"))
    with pytest.raises(config_lib.ConfigError, match=r"every checkpoint is damaged.*restart_from_scratch"):
        train.run(config_for(tmp_path / "run"))
    with pytest.raises(config_lib.ConfigError, match=r"config\.workdir=.*holds no intact checkpoint.*steps \[11, 12\]"
                                                     r".*restart_from_scratch=True"):
        train.run(config_for(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # refused before anything was written
    result = train.run(config_for(tmp_path / "run", **{"checkpoint.restart_from_scratch": True}))
    assert result["step"] == STEPS and losses_of(tmp_path / "run") == losses_of(reference)


def test_a_checkpoint_without_checksums_needs_trust_and_a_nan_after_it_names_it(reference, tmp_path, monkeypatch):
    """No checksums (a save stopped before writing them): refused, naming `checkpoint.trust_unverified`;
    trusted, it restores, and a non-finite step right after names it as suspect, not as good."""
    import shutil

    root = _copy_checkpoints(reference, tmp_path / "run", (10,))
    shutil.rmtree(os.path.join(root, "10", checkpoint_lib.CHECKSUMS_SUBDIR))
    with pytest.raises(config_lib.ConfigError, match=r"config\.checkpoint\.trust_unverified=False: checkpoint step 10"):
        train.run(config_for(tmp_path / "run"))
    hook_data(monkeypatch, nan_at(11))
    with pytest.raises(run_guards.NonFiniteError, match=r"checkpoints/10, is suspect") as error:
        train.run(config_for(tmp_path / "run", **{"checkpoint.trust_unverified": True}))
    assert error.value.step == 11 and "last good" not in str(error.value)
