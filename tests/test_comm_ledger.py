"""Bytes on the wire: the compiled step moves what the playbook's minimum says (plus named choices).

The compiler's bytes per axis (counted from the HLO) against `plan/ledger.py`'s figures, within 5%,
for the meshes the gradient-reduction fixes touched: ZeRO-1 and ZeRO-3 with accumulation (reduced
once per step, hierarchically), TP with fused column-parallel projections, ring attention beside
`data`, gpipe (layer gradients reduced once per step), and ring attention inside 1F1B slots beside
`tensor` (K/V gathered per head shard). `python bench/comm.py` runs the full list.
"""

from __future__ import annotations

import math

import jax
import pytest

from meshtrain.plan import ledger as ledger_lib, verify
from tests.utils import tiny_config

ACC4 = {"train.grad_accum_steps": 4, "train.batch_size": 32}
CASES = [
    ({"fsdp": 4, "data": 2}, {"train.zero_stage": 1, **ACC4}),
    ({"fsdp": 4, "data": 2}, {"train.zero_stage": 3, **ACC4}),
    ({"tensor": 4, "data": 2}, {"train.zero_stage": 0}),
    ({"sequence": 4, "data": 2}, {"train.zero_stage": 0, "attention.impl": "ring"}),
    # Ulysses (four all-to-alls a layer forward, their transposes backward), and a ring across its two groups
    ({"sequence": 4, "data": 2}, {"train.zero_stage": 0, "attention.impl": "ulysses"}),
    ({"sequence": 4, "data": 2}, {"train.zero_stage": 0, "attention.impl": "ulysses", "attention.ulysses_degree": 2}),
    # ZeRO-1 over sequence x fsdp with accumulation: the reduce-scatter and the gather span both axes
    ({"sequence": 4, "fsdp": 2}, {"train.zero_stage": 1, "attention.impl": "ring", **ACC4}),
    ({"stage": 2, "data": 4}, {"train.zero_stage": 0, "pipeline.microbatches": 8, "train.batch_size": 32}),
    # ring inside 1F1B slots (gathered transport) beside tensor: each device gathers its own K/V heads
    ({"stage": 2, "sequence": 2, "tensor": 2}, {"train.zero_stage": 0, "attention.impl": "ring",
                                                "pipeline.schedule": "1f1b"}),
]


@pytest.mark.parametrize("mesh, overrides", CASES, ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()))
def test_compiler_bytes_meet_the_ledger(mesh, overrides):
    config = tiny_config(mesh, **overrides)
    compiled, run, _ = verify.compile_step(config, jax.devices()[:math.prod(mesh.values())])
    got = verify.compiler_bytes(compiled, run)
    ledger = ledger_lib.Ledger.of(config, dict(run.sizes))
    target, minimum = ledger.by_axis(), ledger.by_axis(("minimum",))
    assert set(got) == set(target) == {a for a, n in mesh.items() if n > 1}
    for axis in got:
        assert got[axis] <= 1.05 * target[axis], (axis, got[axis], target[axis])
        assert got[axis] >= 0.9 * target[axis], (axis, got[axis], target[axis])  # the ledger counts what runs
    # the batch axes: exactly the playbook's once-per-step, hierarchical reduction
    for axis in set(got) & {"data"}:
        assert got[axis] == pytest.approx(minimum[axis], rel=1e-3)


def test_zero1_and_zero2_reduce_scatter_then_gather():
    """ZeRO-1/2 on fsdp=8: reduce-scatter + all-gather = 2(N-1)/N Psi, no all-reduce of the whole gradient."""
    config = tiny_config({"fsdp": 8}, **{"train.zero_stage": 1})
    compiled, run, _ = verify.compile_step(config, jax.devices()[:8])
    text = compiled.as_text()
    assert " reduce-scatter(" in text
    ledger = ledger_lib.Ledger.of(config, dict(run.sizes))
    assert verify.compiler_bytes(compiled, run)["fsdp"] == pytest.approx(ledger.by_axis(("minimum",))["fsdp"], rel=1e-3)
