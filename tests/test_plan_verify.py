"""`--verify`: the model's per-device state bytes and per-axis bytes moved against the compiled step.

Tiny model, AOT-compiled on fake CPU devices for meshes covering every axis the train step
supports (data, fsdp with ZeRO 0-3 and accumulation, tensor, tensor + sequence parallel, expert on a
dense model, sequence with ring attention, stage with gpipe, 1f1b, interleaved_1f1b and zero_bubble,
and mixtures). State within 5%, bytes per axis within 10%.
"""

from __future__ import annotations

import math

import jax
import pytest

from meshtrain.plan import verify
from tests.utils import tiny_config

MESHES = [
    ({"data": 8}, {}),
    ({"data": 2, "fsdp": 4}, {"train.zero_stage": 0}),
    ({"fsdp": 8}, {"train.zero_stage": 1}),
    ({"fsdp": 8}, {"train.zero_stage": 1, "train.grad_accum_steps": 2}),
    ({"fsdp": 8}, {"train.zero_stage": 2, "train.grad_accum_steps": 2}),
    ({"fsdp": 8}, {"train.zero_stage": 3}),
    ({"tensor": 4}, {"train.zero_stage": 0}),
    ({"tensor": 4}, {"train.zero_stage": 0, "model.sequence_parallel": True}),
    ({"expert": 8}, {"train.zero_stage": 0}),
    ({"data": 2, "fsdp": 2, "tensor": 2}, {"train.zero_stage": 3, "remat.policy": "full"}),
    ({"sequence": 4, "data": 2}, {"attention.impl": "ring", "train.zero_stage": 0}),
    ({"sequence": 2, "tensor": 2, "data": 2}, {"attention.impl": "ulysses", "train.zero_stage": 0}),
    ({"sequence": 4, "fsdp": 2}, {"attention.impl": "ulysses", "attention.ulysses_degree": 2, "train.zero_stage": 1}),
    ({"stage": 2, "data": 4}, {"train.zero_stage": 0, "pipeline.microbatches": 4}),
    ({"stage": 4, "data": 2}, {"train.zero_stage": 0, "pipeline.microbatches": 4}),
    ({"stage": 4, "tensor": 2}, {"train.zero_stage": 0, "pipeline.microbatches": 4, "pipeline.schedule": "1f1b"}),
    ({"stage": 2, "data": 4}, {"train.zero_stage": 0, "pipeline.microbatches": 4, "pipeline.schedule": "1f1b"}),
    ({"stage": 2, "fsdp": 4}, {"train.zero_stage": 3, "pipeline.microbatches": 4, "pipeline.schedule": "1f1b"}),
    ({"stage": 2, "tensor": 4}, {"train.zero_stage": 0, "pipeline.microbatches": 4,
                                 "pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2}),
    ({"stage": 4, "data": 2}, {"train.zero_stage": 0, "pipeline.microbatches": 4, "pipeline.schedule": "zero_bubble"}),
    ({"stage": 2, "sequence": 2, "tensor": 2}, {"train.zero_stage": 0, "pipeline.microbatches": 4,
                                                "pipeline.schedule": "zero_bubble", "attention.impl": "ring"}),
]


@pytest.mark.parametrize("mesh, overrides", MESHES, ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) or "-")
def test_model_agrees_with_compiler(mesh, overrides):
    config = tiny_config(mesh, **overrides)
    n = math.prod(mesh.values())
    result = verify.verify(config, jax.devices()[:n])
    assert result.model["state"] == pytest.approx(result.compiler["state"], rel=0.05)
    axes = {a for a, b in result.compiler_comm.items() if b > 0} | set(result.model_comm)
    assert axes == {a for a, size in mesh.items() if size > 1}
    for axis in axes:
        assert result.model_comm.get(axis, 0.0) == pytest.approx(result.compiler_comm.get(axis, 0.0), rel=0.10), axis


def test_search_top_choice_for_llama3_8b_compiles():
    from meshtrain.plan import estimate, hardware
    from tests.utils import load_config_file

    config = load_config_file("llama3_8b")
    top = estimate.search(config, 8, hardware.get_gpu("h100"))[0]
    assert top.fits
    result = verify.verify(top.config, jax.devices()[:8])
    assert result.compiler["state"] == pytest.approx(result.model["state"], rel=0.05)

