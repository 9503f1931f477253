"""ZeRO (playbook, "ZeRO"): per-device state bytes fall as the stage says, read from the compiler."""

import jax
import numpy as np
import pytest

from meshtrain import train_step as train_step_lib
from tests.utils import resolve, tiny_config


def _bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _compiled(config):
    run = resolve(config)
    factory, step_fn = train_step_lib.build(run)
    mesh = run.mesh
    b, t = config.train.batch_size, config.train.seq_len
    batch = {k: jax.ShapeDtypeStruct((b, t), np.float32 if k == "loss_mask" else np.int32)
             for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    with jax.set_mesh(mesh):
        compiled = step_fn.lower(factory.abstract, batch).compile()
    return factory, compiled.memory_analysis(), _bytes(batch) // mesh.size


@pytest.fixture(scope="module")
def unsharded():
    factory, _, _ = _compiled(tiny_config({"data": 8}, **{"train.zero_stage": 0}))
    state = factory.abstract
    return _bytes(state), _bytes(state.params), _bytes(state.opt_state)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_per_device(unsharded, stage):
    total, params, opt = unsharded
    factory, memory, batch_bytes = _compiled(tiny_config({"fsdp": 8}, **{"train.zero_stage": stage}))
    state_bytes = memory.argument_size_in_bytes - batch_bytes
    expected = {0: total, 1: params + opt / 8, 2: params + opt / 8, 3: total / 8}[stage]  # gradients are not state
    assert abs(state_bytes - expected) <= 0.05 * expected, (stage, state_bytes, expected)
    if stage in (1, 2):  # only the optimizer state is sharded between steps
        specs = jax.tree.leaves(factory.specs.params, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
        assert all("fsdp" not in str(s) for s in specs)


def test_zero2_gradient_rests_sharded_in_temp_memory(unsharded):
    """ZeRO-2 (and ZeRO-1, which compiles alike: the gradient is reduce-scattered to the optimizer's
    shards) holds the reduced gradient as a 1/N shard: the compiled step's temp memory is at least
    (N-1)/N of the gradient's bytes below ZeRO-0's on fsdp=8."""
    _, params, _ = unsharded  # float32 gradients: as many bytes as the float32 parameters
    temps = {stage: _compiled(tiny_config({"fsdp": 8}, **{"train.zero_stage": stage}))[1].temp_size_in_bytes
             for stage in (0, 2)}
    assert temps[0] - temps[2] >= (1 - 1 / 8) * params, temps


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_shards_over_sequence_too(unsharded, stage, impl):
    """Context parallelism (playbook, "Context Parallelism"): the `sequence` devices would otherwise hold
    replicas, so ZeRO shards over sequence x fsdp (Megatron's distributed optimizer over the
    data-parallel x context-parallel group): the state on fsdp=2 x sequence=4 rests as on fsdp=8."""
    total, params, opt = unsharded
    mesh = {"fsdp": 2, "sequence": 4}
    factory, memory, batch_bytes = _compiled(tiny_config(mesh, **{"train.zero_stage": stage,
                                                                   "attention.impl": impl}))
    state_bytes = memory.argument_size_in_bytes - batch_bytes
    expected = {1: params + opt / 8, 3: total / 8}[stage]
    assert abs(state_bytes - expected) <= 0.05 * expected, (stage, state_bytes, expected)
    opt_specs = jax.tree.leaves(factory.specs.opt_state, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    assert any(("sequence", "fsdp") in tuple(s) for s in opt_specs)
