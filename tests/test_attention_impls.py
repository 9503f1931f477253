"""The tiny model trains to the same losses with ring attention and with the Pallas kernels.

Ring attention (playbook, "Context Parallelism") on sequence-split meshes, its zig-zag token
order applied once to the batch, against the single-device einsum run; the three Pallas kernels
(interpret mode on CPU) against the same run.
"""

import chex
import numpy as np
import pytest

from meshtrain.parallel import layout
from meshtrain.validate import validate
from tests.utils import run_steps, tiny_config


def _permuted(batches, perm):
    if perm is None:
        return batches
    return [{k: v[:, perm] for k, v in b.items()} for b in batches]


RING_3D = {"data": 2, "sequence": 2, "tensor": 2}


@pytest.mark.parametrize("mesh,accum,sp", [({"sequence": 4}, 1, False), (RING_3D, 2, False), (RING_3D, 1, True),
                                           ({"data": 8}, 1, False), (RING_3D, 1, "collective")],
                         ids=["sequence4", "data2-sequence2-tensor2-accum2", "data2-sequence2-tensor2-sp",
                              "data8-ring-degenerate", "data2-sequence2-tensor2-sp-collective-matmul"])
def test_ring_attention_trains_like_single_device(tiny_reference, mesh, accum, sp):
    """Ring attention alone, with TP and accumulation, and with sequence parallelism over `tensor`
    (the norm regions split over `tensor` on top of the ring's `sequence` split), its gathers and
    scatters also as collective matmuls (pieces over `tensor` within each `sequence` block)."""
    batches, ref_losses, ref_params = tiny_reference
    config = tiny_config(mesh, **{"attention.impl": "ring", "train.grad_accum_steps": accum,
                                  "model.sequence_parallel": bool(sp), "model.collective_matmul": sp == "collective"})
    sizes = validate(config, int(np.prod(list(mesh.values()))))
    losses, params, _ = run_steps(config, _permuted(batches, layout.data_permutation(config, sizes)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh,degree,zigzag", [({"sequence": 4, "data": 2}, 0, True), (RING_3D, 0, True),
                                                 ({"sequence": 4, "data": 2}, 2, True),
                                                 ({"sequence": 4, "data": 2}, 2, False)],
                         ids=["sequence4-data2", "data2-sequence2-tensor2", "sequence4-data2-hybrid2-zigzag",
                              "sequence4-data2-hybrid2-contiguous"])
def test_ulysses_trains_like_single_device(tiny_reference, mesh, degree, zigzag):
    """Ulysses (all-to-all over `sequence`, heads split over `tensor` too) and ring x Ulysses (groups of
    2, a ring across the 2 groups, zig-zag or contiguous) on batches of two documents a row."""
    batches, ref_losses, ref_params = tiny_reference
    config = tiny_config(mesh, **{"attention.impl": "ulysses", "attention.ulysses_degree": degree,
                                  "attention.zigzag": zigzag})
    sizes = validate(config, int(np.prod(list(mesh.values()))))
    losses, params, _ = run_steps(config, _permuted(batches, layout.data_permutation(config, sizes)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh, overrides, key", [
    ({"sequence": 4}, {"attention.ulysses_degree": 3}, "attention.ulysses_degree"),
    ({"sequence": 8}, {}, "model.n_kv_heads"),  # 4 key/value heads over 8 devices
    ({"sequence": 2, "tensor": 2}, {"model.n_heads": 12, "model.n_kv_heads": 6}, "model.n_kv_heads"),
    ({"sequence": 4}, {"attention.ulysses_degree": 2, "train.seq_len": 36}, "train.seq_len"),
    ({"sequence": 2}, {"attention.impl": "ring", "attention.ulysses_degree": 2}, "attention.ulysses_degree"),
])
def test_ulysses_validation_names_the_key(mesh, overrides, key):
    config = tiny_config(mesh, **{"attention.impl": "ulysses", **overrides})
    with pytest.raises(ValueError, match=f"config.{key}="):
        validate(config, int(np.prod(list(mesh.values()))))


@pytest.mark.parametrize("remat", ["selective", "attention"])
def test_pallas_kernels_train_like_xla(tiny_reference, remat):
    """attention.impl=pallas + fused RMSNorm + fused loss (interpret mode) == everything off; under
    remat.policy=attention the flash kernel's output and log-sum-exp are the saved residuals."""
    batches, ref_losses, _ = tiny_reference
    config = tiny_config({"data": 2}, **{"attention.impl": "pallas", "model.fused_norm": True,
                                         "model.fused_loss": True, "train.grad_accum_steps": 2,
                                         "remat.policy": remat})
    losses, _, _ = run_steps(config, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_scores_in_the_compute_dtype_train_like_float32_scores(tiny_reference):
    """attention.scores_dtype=compute in a float32 run: the same scores (the scale moved onto q)."""
    batches, ref_losses, _ = tiny_reference
    config = tiny_config({"data": 2, "tensor": 2}, **{"attention.impl": "xla", "attention.scores_dtype": "compute"})
    losses, _, _ = run_steps(config, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_sequence_axis_needs_ring():
    with pytest.raises(ValueError, match="config.attention.impl"):
        validate(tiny_config({"sequence": 2}), 2)
    with pytest.raises(ValueError, match="config.train.seq_len"):
        validate(tiny_config({"sequence": 8}, **{"attention.impl": "ring", "train.seq_len": 120}), 8)
