"""Gradient accumulation (playbook, "Gradient accumulation"): the same update as one big batch."""

import math

import chex
import jax
import numpy as np
import pytest

from meshtrain.parallel import layout
from meshtrain.validate import validate
from tests.hlo_utils import collectives_by_computation
from tests.utils import AXES, load_config_file, resolve, run_steps, synthetic_batches, tiny_config


@pytest.mark.parametrize("mesh", [{}, {"data": 2, "fsdp": 2}], ids=["1dev", "data2-fsdp2"])
def test_four_micro_batches_equal_one_batch(mesh):
    """4 micro-batches of b rows with unequal padding == 1 micro-batch of 4b (normalised by all tokens)."""
    config = tiny_config(mesh, **{"train.batch_size": 16})
    batches = synthetic_batches(config, 1, seed=3)
    counts = batches[0]["loss_mask"].reshape(4, 4, -1).sum(axis=(0, 2))
    assert len(set(counts.tolist())) > 1  # padding differs between micro-batches
    one_losses, one_params, _ = run_steps(config, batches)
    accum = tiny_config(mesh, **{"train.batch_size": 16, "train.grad_accum_steps": 4})
    acc_losses, acc_params, _ = run_steps(accum, batches)
    np.testing.assert_allclose(acc_losses, one_losses, rtol=1e-6)
    chex.assert_trees_all_close(acc_params, one_params, rtol=1e-5, atol=1e-6)


def test_no_gradient_collective_inside_micro_batch_loop():
    """With data=8 the gradient all-reduce happens once, after the micro-batch loop."""
    from meshtrain import train_step as train_step_lib

    run = resolve(tiny_config({"data": 8}, **{"train.batch_size": 32, "train.grad_accum_steps": 2}))
    factory, step_fn = train_step_lib.build(run)
    mesh = run.mesh
    batch = {k: jax.ShapeDtypeStruct((32, 128), np.float32 if k == "loss_mask" else np.int32)
             for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    with jax.set_mesh(mesh):
        hlo = step_fn.lower(factory.abstract, batch).compile().as_text()
    by_comp = collectives_by_computation(hlo)
    in_loops = {name: ops for name, ops in by_comp.items() if name != "ENTRY" and ops}
    assert not in_loops, in_loops
    n_params = sum(x.size for x in jax.tree.leaves(factory.abstract.params))
    reduced = sum(elems for kind, elems in by_comp["ENTRY"] if kind == "all-reduce")
    assert n_params <= reduced <= n_params + 8  # every gradient once, plus scalars


def _moe_config(mesh: dict, **overrides):
    c = load_config_file("tiny_moe")
    c.model.dtype, c.data.source = "float32", "synthetic"
    c.train.seq_len, c.train.warmup_steps = 32, 1
    for axis in AXES:
        c.mesh[axis] = mesh.get(axis, 1)
    for key, value in overrides.items():
        section, leaf = key.split(".")
        c[section][leaf] = value
    return c


# The MoE balance loss per sequence (additive over rows) decomposes exactly over micro-batches; the
# batch-wide Switch loss of a micro-batch is by definition not the batch's.
SEQUENCE_BALANCE = {"model.moe_balance_scope": "sequence"}
FEATURES = [
    ("moe", {"data": 2, "expert": 2}, SEQUENCE_BALANCE),
    ("moe-zero3", {"fsdp": 2, "expert": 2}, {"train.zero_stage": 3, **SEQUENCE_BALANCE}),
    ("ring", {"sequence": 2, "data": 2}, {"attention.impl": "ring"}),
    ("zero3", {"fsdp": 2, "data": 2}, {"train.zero_stage": 3}),
]


@pytest.mark.parametrize("name, mesh, overrides", FEATURES, ids=[f[0] for f in FEATURES])
def test_accumulation_with_each_feature_equals_one_device_one_batch(name, mesh, overrides):
    """The manual accumulation loop (MoE exchange and router losses, ring attention, ZeRO-3 shards
    inside) on a mesh == one device, one batch: 2 steps, float32 (composite: 1e-4)."""
    make = _moe_config if name.startswith("moe") else (lambda m, **o: tiny_config(m, **{"train.seq_len": 32, **o}))
    single = make({}, **{"train.batch_size": 16, **overrides})
    batches = synthetic_batches(single, 2, seed=5)
    ref_losses, ref_params, _ = run_steps(single, batches)
    accum = make(mesh, **{"train.batch_size": 16, "train.grad_accum_steps": 2, **overrides})
    perm = layout.data_permutation(accum, validate(accum, math.prod(mesh.values())))  # ring's zig-zag order
    if perm is not None:
        batches = [{k: v[:, perm] for k, v in b.items()} for b in batches]
    losses, params, _ = run_steps(accum, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)
