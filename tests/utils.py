"""Shared test helpers: the tiny config in float32 and a few-step training run on a chosen mesh."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import numpy as np

from meshtrain import config as config_lib, mesh as mesh_lib, train_step as train_step_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
AXES = config_lib.MESH_AXES


def load_config_file(name: str):
    """`configs/<name>.py`'s get_config()."""
    spec = importlib.util.spec_from_file_location(f"configs_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def tiny_config(mesh: dict | None = None, **overrides):
    """configs/tiny.py in float32 on synthetic data, all mesh axes 1 except `mesh`; overrides are
    dotted keys, e.g. tiny_config({'fsdp': 8}, **{'train.zero_stage': 3})."""
    c = load_config_file("tiny")
    c.model.dtype = "float32"
    c.data.source = "synthetic"
    for axis in AXES:
        c.mesh[axis] = 1
    for axis, size in (mesh or {}).items():
        c.mesh[axis] = size
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def devices_for(config) -> list:
    """The first (product of the mesh axes) devices."""
    n = int(np.prod([max(config.mesh[a], 1) for a in AXES]))
    return jax.devices()[:n]


def synthetic_batches(config, steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Host batches with two documents per row and some padding, deterministic from `seed`."""
    rng = np.random.default_rng(seed)
    b, t, v = config.train.batch_size, config.train.seq_len, config.model.vocab_size
    out = []
    for _ in range(steps):
        tokens = rng.integers(3, v, size=(b, t + 1), dtype=np.int32)
        cut = rng.integers(t // 4, 3 * t // 4, size=b)
        pad = rng.integers(0, t // 8, size=b)
        idx = np.arange(t)[None]
        segment = np.where(idx < cut[:, None], 1, 2).astype(np.int32)
        segment = np.where(idx >= t - pad[:, None], 0, segment)
        positions = np.where(segment == 1, idx, idx - cut[:, None]).astype(np.int32)
        positions = np.where(segment == 0, 0, positions)
        loss_mask = (segment > 0).astype(np.float32)
        loss_mask[np.arange(b), cut - 1] = 0.0  # no target across the document boundary
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment,
                    "positions": positions, "loss_mask": loss_mask})
    return out


def train(config, batches, devices=None):
    """Trains len(batches) steps; returns (metrics per step as floats, final state, factory)."""
    devices = devices or devices_for(config)
    config_lib.validate(config, len(devices))
    mesh = mesh_lib.make_mesh(config, devices)
    factory, step_fn, _ = train_step_lib.build(config, mesh)
    state = factory.create(config.seed)
    records = []
    with jax.set_mesh(mesh):
        for batch in batches:
            state, metrics = step_fn(state, batch)
            records.append(jax.tree.map(float, jax.device_get(metrics)))
    return records, state, factory


def run_steps(config, batches, devices=None):
    """Trains len(batches) steps; returns (losses, final params as numpy, factory)."""
    records, state, factory = train(config, batches, devices)
    return np.array([r["loss"] for r in records]), jax.tree.map(np.asarray, state.params), factory
