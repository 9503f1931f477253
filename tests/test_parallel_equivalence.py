"""Sharded training equals the single-device run (playbook: every parallelism is exact).

The tiny model in float32 trains 3 steps on each mesh; losses after each step and the final
parameters must match the 1-device run to rtol 1e-5.
"""

import importlib.metadata

import chex
import jax
import numpy as np
import pytest

from meshtrain import train_step as train_step_lib
from tests import utils
from tests.utils import run_steps, tiny_config

JAXLIB = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])

MESHES = [
    pytest.param({"data": 8}, {}, id="data8"),
    pytest.param({"fsdp": 8}, {"train.zero_stage": 3}, id="fsdp8-zero3"),
    pytest.param({"data": 2, "fsdp": 2, "tensor": 2}, {}, id="data2-fsdp2-tensor2"),
    pytest.param({"fsdp": 4, "tensor": 2}, {"model.sequence_parallel": True}, id="fsdp4-tensor2-sp"),
    pytest.param({"data": 2, "fsdp": 4}, {"train.zero_stage": 0}, id="zero0"),
    pytest.param({"data": 2, "fsdp": 4}, {"train.zero_stage": 1}, id="zero1"),
    pytest.param({"data": 2, "fsdp": 4}, {"train.zero_stage": 2}, id="zero2"),
    pytest.param({"data": 2, "fsdp": 4}, {"train.zero_stage": 3}, id="zero3"),
    pytest.param({"tensor": 4, "data": 2}, {"model.sequence_parallel": True, "train.zero_stage": 0}, id="tensor4-sp"),
    pytest.param({"expert": 2, "fsdp": 2, "data": 2}, {"train.zero_stage": 2, "train.grad_accum_steps": 2},
                 id="expert-as-batch-accum2"),
    # sequence parallelism's gathers and scatters in pieces beside the matmuls (collective_matmul.py)
    pytest.param({"tensor": 4, "data": 2}, {"model.sequence_parallel": True, "model.collective_matmul": True,
                                             "train.zero_stage": 0}, id="tensor4-sp-collective"),
    pytest.param({"fsdp": 2, "tensor": 4}, {"model.sequence_parallel": True, "model.collective_matmul": True,
                                             "train.zero_stage": 3}, id="fsdp2-tensor4-zero3-sp-collective"),
]


@pytest.mark.parametrize("mesh,overrides", MESHES)
def test_sharded_equals_single_device(tiny_reference, mesh, overrides):
    batches, ref_losses, ref_params = tiny_reference
    config = tiny_config(mesh, **overrides)
    losses, params, _ = run_steps(config, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["none", "attention", "full", "offload"])
def test_remat_policies_equal(tiny_reference, policy):
    """Recomputation changes memory, never values (playbook, "Activation recomputation"): every
    step's loss (from the second on, after updates made with the policy's gradients) and the
    parameters after 3 steps equal the default (`selective`) run's."""
    batches, ref_losses, ref_params = tiny_reference
    assert tiny_config().remat.policy == "selective"
    losses, params, _ = run_steps(tiny_config(**{"remat.policy": policy}), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)


def _moe(mesh: dict, **overrides):
    c = utils.load_config_file("tiny_moe")
    c.model.dtype, c.data.source = "float32", "synthetic"
    return utils.apply_overrides(c, {**{f"mesh.{a}": mesh.get(a, 1) for a in utils.AXES}, **overrides})


EIGHT_LAYERS = {"model.n_layers": 8, "train.seq_len": 16}
INIT_CASES = [  # every way a parameter can be split or stored, and the FP8 amax histories
    pytest.param(tiny_config({"fsdp": 8}, **{"train.zero_stage": 3}), id="fsdp8-zero3"),
    pytest.param(tiny_config({"data": 2, "fsdp": 2, "tensor": 2}, **{"train.zero_stage": 3}), id="data-fsdp-tensor"),
    pytest.param(tiny_config({"stage": 2, "data": 4}, **EIGHT_LAYERS, **{"pipeline.schedule": "circular",
                                                                          "pipeline.repeats": 2}), id="circular"),
    pytest.param(tiny_config({"stage": 4, "tensor": 2}, **EIGHT_LAYERS, **{"pipeline.schedule": "1f1b"}), id="stage4"),
    pytest.param(_moe({"expert": 4, "data": 2}), id="moe-expert4"),
    pytest.param(tiny_config({"stage": 2, "fsdp": 2, "tensor": 2}, **{"model.matmul_precision": "fp8",
                                                                      "train.zero_stage": 3}), id="fp8-stage"),
]


@pytest.mark.parametrize("config", INIT_CASES)
def test_every_mesh_initialises_the_same_state(config):
    """One seed is one model whatever the layout: `StateFactory.create` on a mesh gives the
    single-device state bit for bit (parameters, optimizer state, RNG and FP8 histories; layers
    compared in execution order). The partitionable threefry draws every parameter's bits from the
    key alone, never from its sharding. The other equivalence tests rely on it: they start every mesh
    from the single-device state (`utils.initial_state`), not from an initialiser compiled per mesh."""
    factory, _ = train_step_lib.build(utils.resolve(config))
    with jax.set_mesh(factory.mesh):
        state = jax.device_get(factory.to_canonical(factory.create(config.seed)))
    want = jax.device_get(factory.to_canonical(utils.initial_state(factory, config)))
    if JAXLIB < (0, 11):
        utils.assert_bitwise(state, want)
        return
    # jaxlib >= 0.11 on a host with FMA units: XLA:CPU contracts multiply-adds of the initialisers'
    # erf_inv polynomial in the 1F1B layouts' stage-sharded layer stacks but not in the one-device
    # program (with `--xla_cpu_max_isa=SSE4_2`, no FMA instructions, every mesh is bit for bit equal
    # on jaxlib 0.12 too). The random bits are the key's alone; the float values they become may move
    # by the contractions' rounding: at most 2 ulp (measured: 2, on 4-9% of each layer kernel).
    assert jax.tree.structure(state) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype == np.float32:
            np.testing.assert_array_max_ulp(x, y, maxulp=2)
        else:
            np.testing.assert_array_equal(x, y)
