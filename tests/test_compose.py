"""Every axis composes with every other (playbook, "5D parallelism in a nutshell").

Each of the 20 meshes that put three of the six axes at 2 on 8 devices trains 3 float32 steps of
the tiny model to the losses and parameters of the same config on `data=8`. Each axis brings its
feature along: `expert` the tiny MoE, `sequence` ring attention, `stage` the 1F1B schedule,
`fsdp` ZeRO-3. MoE runs take the sequence-wise balance loss (additive over rows, so exact under
1F1B's micro-batches) and, with `sequence`, dropless dispatch: capacity dispatch ranks a row's
tokens by position, and ring attention's zig-zag order permutes them. Losses agree within 1e-5 when
`data` is among the three (two axes shard the model), 1e-4 where three model-sharding axes meet;
parameters within 1e-4 (atol 1e-5) everywhere: each mesh sums float32 gradients in its own order,
and Adam's normalised update turns that rounding in near-zero gradient entries into parameter
differences far above the gradients' own relative error.

Also: a checkpoint written under the circular schedule continues on `stage=1`, 1F1B and circular
to the same losses, and exports the same Hugging Face weights as a `stage=1` run.
"""

from __future__ import annotations

import functools
import itertools

import chex
import jax
import numpy as np
import pytest

from meshtrain import config as config_lib, hf, train, train_step as train_step_lib
from meshtrain.run import Run
from tests import utils
from tests.utils import composed_config

AXES = config_lib.MESH_AXES
TRIPLES = list(itertools.combinations(AXES, 3))
STEPS = 3


def _train(config):
    """(losses, final params as numpy) of STEPS steps on the config's mesh, batches in its token order."""
    run = utils.resolve(config)
    batches = utils.synthetic_batches(config, STEPS)
    if run.layout.permutation is not None:
        batches = [{k: v[:, run.layout.permutation] for k, v in b.items()} for b in batches]
    records, state, _ = utils.train(config, batches)
    return np.array([r["loss"] for r in records]), jax.tree.map(np.asarray, state.params)


@functools.cache
def _reference(moe: bool, ring: bool):
    """The same model, features and data on `data=8`."""
    config = composed_config({"expert": 2 if moe else 1, "sequence": 2 if ring else 1})
    for axis in AXES:
        config.mesh[axis] = 8 if axis == "data" else 1
    return _train(config)


@pytest.mark.parametrize("axes", TRIPLES, ids=["-".join(t) for t in TRIPLES])
def test_three_axes_train_like_data8(axes):
    mesh = {a: 2 for a in axes}
    losses, params = _train(composed_config(mesh))
    ref_losses, ref_params = _reference("expert" in axes, "sequence" in axes)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5 if "data" in axes else 1e-4)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)


KERNELS = {"attention.impl": "pallas", "model.fused_norm": True, "model.fused_loss": True}


@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "data": 2, "tensor": 2}, {"pipeline.schedule": "1f1b"}),
    ({"stage": 2, "data": 2, "tensor": 2}, {"pipeline.schedule": "gpipe"}),
    ({"expert": 2, "data": 2}, {}),
], ids=["stage-data-tensor-1f1b", "stage-data-tensor-gpipe", "expert-data-moe"])
def test_pallas_kernels_compose(mesh, overrides):
    """The three Pallas kernels (interpret mode) inside pipeline stages next to tensor parallelism, and
    beside the MoE exchange: the losses and parameters of the same model without kernels on data=8."""
    config = composed_config(mesh)
    for key, value in {**KERNELS, **overrides}.items():
        section, leaf = key.split(".")
        config[section][leaf] = value
    losses, params = _train(config)
    ref_losses, ref_params = _reference("expert" in mesh, False)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)


ULYSSES = [({"sequence": 2, "expert": 2, "data": 2}, 0), ({"sequence": 2, "stage": 2, "data": 2}, 0),
           ({"sequence": 4, "stage": 2}, 2)]


@pytest.mark.parametrize("mesh, degree", ULYSSES, ids=["sequence-expert-data", "sequence-stage-data-1f1b",
                                                       "sequence4-stage-1f1b-hybrid2"])
def test_ulysses_composes(mesh, degree):
    """Ulysses in place of the ring beside the MoE exchange over `expert` and inside 1F1B's slots (its
    all-to-alls per group of `sequence` devices, which take the same branch), and ring x Ulysses in
    1F1B's slots (the ring across the two groups by all-gather / reduce-scatter): the data=8 run's
    losses and parameters."""
    config = composed_config(mesh)
    config.attention.impl, config.attention.ulysses_degree = "ulysses", degree
    losses, params = _train(config)
    ref_losses, ref_params = _reference("expert" in mesh, True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5 if "data" in mesh else 1e-4)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)


def _portable_config(workdir, mesh: dict, steps: int, **overrides):
    return utils.tiny_config(mesh, **{"model.n_layers": 8, "train.seq_len": 32, "pipeline.microbatches": 4,
                                      "steps": steps, "train.warmup_steps": 1, "log_every": 1, "workdir": str(workdir),
                                      **overrides})


CIRCULAR = ({"stage": 2, "data": 4}, {"pipeline.schedule": "circular", "pipeline.repeats": 2})


def test_checkpoint_moves_between_schedules(tmp_path):
    """Saved under circular (stage 2, repeats 2: layers stored out of order), resumed under stage=1,
    1f1b and circular: the continued losses agree; the HF export of the circular state equals the
    export of the same checkpoint restored on one stage, bitwise."""
    source = tmp_path / "circular"
    train.run(_portable_config(source, CIRCULAR[0], 2, **CIRCULAR[1]))
    continued = {}
    for name, (mesh, overrides) in {"stage1": ({"data": 8}, {}), "1f1b": ({"stage": 2, "data": 4},
                                    {"pipeline.schedule": "1f1b"}), "circular": CIRCULAR}.items():
        workdir = tmp_path / name
        train.run(_portable_config(workdir, mesh, 4, **overrides, **{"checkpoint.restore_from": str(source)}))
        continued[name] = [v for k, v in sorted(utils.losses_of(workdir).items()) if k > 2]
    assert len(continued["stage1"]) == 2
    np.testing.assert_allclose(continued["1f1b"], continued["stage1"], rtol=1e-5)
    np.testing.assert_allclose(continued["circular"], continued["stage1"], rtol=1e-5)

    exports = {}
    for name, (mesh, overrides) in {"stage1": ({"data": 8}, {}), "circular": CIRCULAR}.items():
        run = Run.resolve(_portable_config(tmp_path / "x", mesh, 2, **overrides), jax.devices()[:8])
        factory, _ = train_step_lib.build(run)
        state = factory.from_canonical(utils.load(source, 2, factory.canonical).state)  # as the run holds it
        exports[name] = tmp_path / f"hf_{name}"
        hf.save(run.model, factory.to_canonical(state).params, str(exports[name]))
    for path in sorted(exports["stage1"].iterdir()):
        assert path.read_bytes() == (exports["circular"] / path.name).read_bytes(), path.name
