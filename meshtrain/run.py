"""The resolved run: a validated config on a concrete mesh, and the parallel plan of the pair.

    sizes = validate(config, len(devices))   # meshtrain.validate: every rule, before anything compiles
    run = Run.resolve(config, devices)       # the mesh, the sharding rules, the layout
    factory, step = train_step.build(run)
    it = data.make_iterator(run, "train")

Playbook, "5D parallelism in a nutshell": one mesh of six axes, and from its shape alone which
axes split the batch, which regions are manual over which axes, which pipeline schedule runs and
in which token order the data arrives (`parallel.layout.Layout`). A frozen value: building it
starts nothing (distributed start, logging and fake devices are `cli.setup_runtime`'s).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

import jax
import ml_collections
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import attention, config as config_lib, mesh as mesh_lib
from meshtrain.config import BATCH_AXES, ModelConfig
from meshtrain.parallel.layout import Layout
from meshtrain.sharding_rules import Rules


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    """A validated config on a concrete mesh, with everything derived from the pair."""

    config: ml_collections.ConfigDict  # validated; each part reads its own section
    sizes: Mapping[str, int]  # axis -> size, all six
    mesh: jax.sharding.Mesh
    rules: Rules
    model: ModelConfig
    layout: Layout  # the parallel plan: pipeline, manual regions, kernels, attention, token order

    @classmethod
    def resolve(cls, config: ml_collections.ConfigDict, devices: list | None = None) -> Run:
        """`config`, validated by the caller (`meshtrain.validate.validate`), on `devices` (default: all)."""
        devices = list(jax.devices() if devices is None else devices)
        sizes = types.MappingProxyType(config_lib.mesh_shape(config, len(devices)))
        mesh = mesh_lib.make_mesh(config, devices)
        platform = mesh.devices.flat[0].platform
        model = ModelConfig.from_config(config, platform)
        return cls(config=config, sizes=sizes, mesh=mesh, rules=Rules.for_mesh(mesh, model=model),
                   model=model, layout=Layout.plan(config, sizes, platform))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data-parallel axes that are split (size > 1), in mesh order."""
        return tuple(a for a in BATCH_AXES if self.sizes[a] > 1)

    @property
    def data_parallel_size(self) -> int:
        return config_lib.data_parallel_size(self.sizes)

    @property
    def batch_spec(self) -> P:
        """How every [B, T] batch field is laid out: rows over the batch axes, length over `sequence`."""
        return self.rules.spec(("batch", "length"))

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch_spec)

    def describe(self) -> list[str]:
        """The start-of-run lines: the mesh, and the pipeline schedule when there is one."""
        lines = [mesh_lib.describe(self.mesh)]
        impl = self.config.attention.impl
        lines.append(f"attention: {self.layout.attention_impl}"
                     + (f" (attention.impl='auto' on {self.layout.platform})" if impl == "auto" else "")
                     + (f"; {self._document_paths()}" if self.layout.attention_impl == "cudnn" else ""))
        if self.layout.pipeline is not None:
            lines.append(self.layout.pipeline.describe())
        return lines

    def _document_paths(self) -> str:
        c = self.config
        return attention.document_paths(c.model.head_dim, c.train.seq_len, c.attention.max_documents)

