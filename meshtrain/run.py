"""The resolved run: every fact the config and the devices decide, derived once.

    run = Run.resolve(config)            # validates, builds the mesh, chooses the schedule
    factory, step = train_step.build(run)
    it = data.make_iterator(run, "train")

Playbook, "5D parallelism in a nutshell": one mesh of six axes, and from its shape alone which
axes split the batch, which loops are manual over which axes, which pipeline schedule runs and
in which token order the data arrives (ring attention's zig-zag). `train_step.build`, the data
iterator, the checkpoints and `plan --verify` read these facts here instead of re-deriving them.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import attention, hf, mesh as mesh_lib
from meshtrain.config import BATCH_AXES, ModelConfig
from meshtrain.pipeline import Pipeline
from meshtrain.sharding_rules import Rules
from meshtrain.validate import validate


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    """A validated config on a concrete mesh, with everything derived from the pair."""

    config: ml_collections.ConfigDict  # validated; each part reads its own section
    sizes: Mapping[str, int]  # axis -> size, all six
    mesh: jax.sharding.Mesh
    rules: Rules
    model: ModelConfig
    pipeline: Pipeline | None  # None unless mesh.stage > 1
    permutation: np.ndarray | None  # the data's token order along the sequence (ring zig-zag), or None

    @classmethod
    def resolve(cls, config: ml_collections.ConfigDict, devices: list | None = None, *, inputs: bool = True) -> Run:
        """Validates `config` for `devices` (default: all) and builds the mesh. Raises ConfigError.

        `inputs=False` skips the rules that read files (data, checkpoints): a step compiled ahead of
        time reads none."""
        devices = list(jax.devices() if devices is None else devices)
        sizes = types.MappingProxyType(validate(config, len(devices), inputs=inputs))
        mesh = mesh_lib.make_mesh(config, devices)
        kernels = attention.uses_kernels(config, sizes, mesh.devices.flat[0].platform)
        return cls(config=config, sizes=sizes, mesh=mesh, rules=Rules.for_mesh(mesh),
                   model=ModelConfig.from_config(config),
                   pipeline=Pipeline.from_config(config, sizes, kernels=kernels),
                   permutation=attention.data_permutation(config, sizes))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data-parallel axes that are split (size > 1), in mesh order."""
        return tuple(a for a in BATCH_AXES if self.sizes[a] > 1)

    @property
    def data_parallel_size(self) -> int:
        return math.prod(self.sizes[a] for a in BATCH_AXES)

    @property
    def batch_spec(self) -> P:
        """How every [B, T] batch field is laid out: rows over the batch axes, length over `sequence`."""
        return self.rules.spec(("batch", "length"))

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch_spec)

    @property
    def platform(self) -> str:
        """What the step is compiled for: the mesh's devices (a GPU target compiled on a CPU host is 'gpu')."""
        return self.mesh.devices.flat[0].platform

    @property
    def kernels(self) -> bool:
        """Whether the model runs Pallas kernels (their manual regions then go unchecked)."""
        return attention.uses_kernels(self.config, self.sizes, self.platform)

    @property
    def ring_flash(self) -> bool:
        """Whether ring attention runs its blocks in the Pallas flash kernel (on GPU)."""
        return attention.ring_flash(self.config, self.sizes, self.platform)

    @property
    def accumulation_axes(self) -> tuple[str, ...]:
        """The axes the gradient-accumulation loop is manual over (`train_step.accumulate_gradients`).

        The split batch axes over which the parameters are replicated, so each device accumulates
        locally and the data-parallel reduction runs once per step, plus `sequence` under ring
        attention (the ring then runs per device inside). Under ZeRO-3 `fsdp` stays automatic:
        each micro-batch gathers its weights and reduce-scatters its gradient (gradient shards
        accumulate; no full-size buffer). An MoE layer under ZeRO-3 with `fsdp` split would need its
        own shard_map over `fsdp` nested in the loop, which jax 0.10 cannot differentiate: there the
        loop stays automatic and reduces per micro-batch.
        """
        zero3 = self.config.train.zero_stage >= 3
        if zero3 and self.model.num_experts and self.sizes["fsdp"] > 1:
            return ()
        axes = tuple(a for a in self.batch_axes if not (zero3 and a == "fsdp"))
        ring = self.model.attention_impl == "ring" and self.sizes["sequence"] > 1
        return axes + (("sequence",) if ring else ())

    @property
    def compiler_options(self) -> dict[str, str | bool]:
        return mesh_lib.compiler_options(self.mesh)

    def describe(self) -> list[str]:
        """The start-of-run lines: the mesh, and the pipeline schedule when there is one."""
        lines = [mesh_lib.describe(self.mesh)]
        if self.pipeline is not None:
            lines.append(self.pipeline.describe())
        return lines


def setup_runtime(config: ml_collections.ConfigDict) -> None:
    """Before anything else touches JAX: fake CPU devices, the multi-process start, and the model
    shape of a Hugging Face checkpoint the run starts from (`init.from_hf`)."""
    mesh_lib.fake_cpu_devices(config.cpu_devices)
    mesh_lib.maybe_initialize_distributed(config)
    if config.init.from_hf:  # the checkpoint decides the architecture
        hf.apply_model_config(config)
