"""THE logical-axis -> mesh-axis table, its resolution to PartitionSpecs, and `explain`.

The model names every dimension of every parameter and activation with a logical name
("embed", "heads", "batch", ...). This file alone maps those names to mesh axes; XLA's
partitioner then derives the collectives (playbook: "Tensor Parallelism", "ZeRO",
"Sequence Parallelism"). Two mappings exist, as in the playbook's ZeRO section:

* storage: how state rests between steps. The ZeRO entries (`sequence` and `fsdp` on the
  model dimension: ZeRO shards over both, since the `sequence` devices would otherwise hold
  replicas) apply only to the state that the ZeRO stage shards (optimizer state from stage 1,
  gradients from 2, parameters from 3).
* compute: how activations flow; they never mention `fsdp` on a feature dimension.

Resolution skips a mesh axis an earlier dimension already uses, and refuses a dimension
its axes do not divide: no silent replication.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.config import BATCH_AXES, Axis

D, F, T, S, E, ST = (Axis.DATA.value, Axis.FSDP.value, Axis.TENSOR.value, Axis.SEQUENCE.value,
                     Axis.EXPERT.value, Axis.STAGE.value)
# The axes ZeRO shards parameter-sized state over (playbook, "ZeRO"; Megatron's distributed optimizer
# shards over the data-parallel x context-parallel group): `sequence` first, so that a region manual
# over `sequence` alone (ring or Ulysses attention under ZeRO-3) leaves the state its outer shards;
# `expert`, which splits the batch outside the MoE layers, holds replicas of every other weight as
# `fsdp` does (playbook, "Expert parallelism": EP combined with DP), so ZeRO shards them over it too;
# an expert weight's model dimension skips it (its expert dimension already takes `expert`, and `fsdp` where
# its devices own whole experts: `experts_over_fsdp`).
ZERO_AXES: tuple[str, ...] = (S, F, E)

# The logical name whose split is ZeRO's: `Rules.without_fsdp` leaves it whole (the other names keep
# their axes: an expert weight's `expert` split, the batch's).
ZERO_NAME = "embed"

# logical name -> mesh axes, one entry per name.
RULES: dict[str, tuple[str, ...]] = {
    # activations (compute mapping)
    "batch": BATCH_AXES,           # the data-parallel group (data, fsdp, expert) splits the batch
    "length": (S,),                # context parallelism splits the sequence
    "length_sp": (S, T),           # Megatron sequence parallelism: norm/residual regions split over tensor too
    "act_embed": (),               # the hidden dimension of activations is never split
    "act_heads": (T,),
    "act_kv_heads": (T,),
    "act_mlp": (T,),
    "act_vocab": (T,),
    "act_expert": (E,),
    # parameters (storage mapping; `fsdp` entries only where the ZeRO stage shards the state)
    "embed": ZERO_AXES,            # ZeRO shards the model dimension of every weight
    "heads": (T,),                 # Megatron: attention heads split over tensor
    "kv_heads": (T,),
    "head_dim": (),
    "mlp": (T,),                   # Megatron: column-parallel up/gate, row-parallel down
    "vocab": (T,),                 # output head split over the vocabulary
    "embed_vocab": (),             # input embedding rows: kept whole (a gather on a split vocab rematerialises)
    "layers": (ST,),               # pipeline stages own contiguous layers
    "dense_layers": (),            # the dense first layers before an MoE stack (model.first_dense_layers)
    "expert": (E,),
    "stage": (ST,),
    "repeat": (),
    "norm": (),
}


# The logical names of the expert dimension (weights, activations): over `expert`, and over `fsdp` too where
# the experts rest whole on fsdp's devices (`model.moe_fsdp`, `experts_over_fsdp`).
EXPERT_NAMES = ("expert", "act_expert")


def experts_over_fsdp(model, sizes) -> bool:
    """Whether `model`'s experts split over `fsdp` as well as `expert` on a mesh of `sizes` (`model.moe_fsdp`):
    'experts' where fsdp is split; 'auto' also needs dropless MoE and experts that divide by expert x fsdp
    (playbook, "Expert parallelism": the data-parallel devices double as expert-parallel ones, each owning
    whole experts, so that the routed tokens travel instead of every expert's weights)."""
    if model is None or not model.num_experts or sizes.get(F, 1) == 1 or model.moe_fsdp == "weights":
        return False
    if model.moe_fsdp == "experts":
        return True
    return model.moe_dropless and model.num_experts % (sizes.get(E, 1) * sizes[F]) == 0


class ShardingRuleError(ValueError):
    """A dimension cannot be split the way the rules say."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """The table bound to a mesh shape, with ZeRO's `fsdp` switched on or off, inside the manual
    region of `manual` axes (a `shard_map`: those axes no longer appear in specs).

    Hashable, so it can be a static attribute of a flax module.
    """

    mesh_shape: tuple[tuple[str, int], ...]
    shard_fsdp: bool = True
    manual: frozenset[str] = frozenset()
    experts_over_fsdp: bool = False  # the expert dimension splits over (expert, fsdp) (`experts_over_fsdp`)

    @classmethod
    def for_mesh(cls, mesh: jax.sharding.Mesh, shard_fsdp: bool = True, model=None) -> Rules:
        """The rules on `mesh`; `model` (a `ModelConfig`) decides where its experts rest (`experts_over_fsdp`)."""
        return cls.for_sizes(tuple(mesh.shape.items()), shard_fsdp, model)

    @classmethod
    def for_sizes(cls, shape: tuple[tuple[str, int], ...], shard_fsdp: bool = True, model=None) -> Rules:
        """`for_mesh` from the (axis, size) pairs alone (the planner's)."""
        shape = tuple((a, int(n)) for a, n in shape)
        return cls(shape, shard_fsdp, experts_over_fsdp=experts_over_fsdp(model, dict(shape)))

    def without_fsdp(self) -> Rules:
        return dataclasses.replace(self, shard_fsdp=False)

    def with_manual(self, axes: tuple[str, ...]) -> Rules:
        """The rules inside a `shard_map` manual over `axes` (as well as those already manual)."""
        return dataclasses.replace(self, manual=self.manual | frozenset(axes))

    def size(self, axis: str) -> int:
        return dict(self.mesh_shape).get(axis, 1)

    def split_axes(self, name: str) -> tuple[str, ...]:
        """The mesh axes of size > 1 that the logical `name` maps to, manual or not."""
        return tuple(a for a in self.mesh_axes(name) if self.size(a) > 1)

    def shards(self, name: str) -> int:
        """Into how many blocks the logical `name` is split on the automatic axes (1 if none)."""
        return math.prod(self.size(a) for a in self.split_axes(name) if a not in self.manual)

    def mesh_axes(self, name: str | None) -> tuple[str, ...]:
        if name is None:
            return ()
        if name not in RULES:
            raise ShardingRuleError(f"unknown logical axis name {name!r}; known: {sorted(RULES)}")
        if name == ZERO_NAME and not self.shard_fsdp:
            return ()
        if name in EXPERT_NAMES and self.experts_over_fsdp:
            return (E, F)  # `expert` major: a region already manual over it splits its block over fsdp
        return RULES[name]

    def spec(self, names: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
             what: str = "array") -> P:
        """Logical names -> PartitionSpec. Skips axes used by an earlier dimension, size-1 axes and
        manual axes.

        With `shape`, a dimension its axes do not divide raises ShardingRuleError.
        """
        got = _spec(self, tuple(names), None if shape is None else tuple(shape))
        if isinstance(got, str):
            raise ShardingRuleError(f"{what}: {got}")
        return got


@dataclasses.dataclass(frozen=True)
class Placement:
    """How each part of the train state rests between steps (the storage mapping), by ZeRO stage: the one
    definition the step (`train_step.StateFactory`) and the planner (`plan.memory.Step.placement`) read."""

    params: Rules
    grads: Rules
    opt_state: Rules

    @classmethod
    def for_zero_stage(cls, rules: Rules, zero_stage: int) -> Placement:
        replicated = rules.without_fsdp()
        # ZeRO-1 reduce-scatters the gradient to the optimizer's shards as ZeRO-2 does (playbook, "ZeRO-1"):
        # in one compiled step the whole local gradient exists once either way, so the two compile alike.
        return cls(params=rules if zero_stage >= 3 else replicated,
                   grads=rules if zero_stage >= 1 else replicated,
                   opt_state=rules if zero_stage >= 1 else replicated)


@functools.lru_cache(maxsize=1 << 16)
def _spec(rules: Rules, names: tuple[str | None, ...], shape: tuple[int, ...] | None) -> P | str:
    """`Rules.spec`, or why a dimension is not divisible: memoised (the planner's search asks for the
    same few specs hundreds of thousands of times)."""
    sizes = dict(rules.mesh_shape)
    used: set[str] = set()
    out = []
    for dim, name in enumerate(names):
        axes = tuple(a for a in rules.mesh_axes(name)
                     if a not in used and sizes.get(a, 1) > 1 and a not in rules.manual)
        used.update(axes)
        if shape is not None and axes:
            split = math.prod(sizes[a] for a in axes)
            if shape[dim] % split:
                return (f"dimension {dim} ({name!r}, size {shape[dim]}) is not divisible by mesh axes "
                        f"{axes} of total size {split}; change the mesh or the model shape")
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def constrain(x: jax.Array, names: tuple[str | None, ...], rules: Rules) -> jax.Array:
    """Pins an activation to the compute mapping of its logical names (needs `jax.set_mesh`, unless
    every axis of the rules is 1: nothing to pin then, and the model traces with no mesh at all)."""
    if all(size == 1 or axis in rules.manual for axis, size in rules.mesh_shape):
        return x
    return jax.lax.with_sharding_constraint(x, rules.spec(names, x.shape, what="activation"))


def auto_axes(names: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of `names` of size > 1 that are still automatic in the current (abstract) mesh:
    inside an enclosing `shard_map` (the accumulation loop) its manual axes are gone."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in names if mesh.shape.get(a, 1) > 1 and a not in manual)


def per_shard(fn, in_specs, out_specs, axes: tuple[str, ...]):
    """`fn` run on each device's block over `axes` (a `shard_map`), or `fn` itself when `axes` is empty.

    For Pallas kernels: a pallas_call is a custom call the partitioner cannot split, and it does not
    declare how its outputs vary, hence check_vma=False.
    """
    if not axes:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes), check_vma=False)


def varying(a) -> frozenset[str]:
    """The manual axes `a` varies over (inside a checked `shard_map`; none elsewhere)."""
    return jax.typeof(a).manual_axis_type.varying


def vary(tree, axes: tuple[str, ...]):
    """Every leaf made varying over `axes` (`lax.pcast` over those it does not vary over yet): a
    value each device of a manual region will hold and differentiate on its own."""
    def one(a):
        missing = tuple(x for x in axes if x not in varying(a))
        return jax.lax.pcast(a, missing, to="varying") if missing else a
    return jax.tree.map(one, tree)


def named(mesh: jax.sharding.Mesh, specs):
    """Tree of PartitionSpecs -> tree of NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def explain(boxed_state, specs_tree, mesh: jax.sharding.Mesh) -> str:
    """A table of every array of the state: logical names, PartitionSpec, global and per-device bytes.

    `boxed_state` is the abstract state with flax `LogicallyPartitioned` boxes (names), `specs_tree`
    the matching tree of storage PartitionSpecs.
    """
    def is_box(x):
        return isinstance(x, nn.LogicallyPartitioned)

    sizes = dict(mesh.shape)
    rows = [("array", "shape", "logical", "spec", "global", "per device")]
    total_global = total_device = 0
    leaves = jax.tree_util.tree_flatten_with_path(boxed_state, is_leaf=is_box)[0]
    specs = jax.tree.leaves(specs_tree, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(leaves, specs, strict=True):
        names = tuple(leaf.names) if is_box(leaf) else None
        array = leaf.value if is_box(leaf) else leaf
        nbytes = int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize
        split = math.prod(sizes[axis] for entry in spec if entry
                          for axis in (entry if isinstance(entry, tuple) else (entry,)))
        total_global += nbytes
        total_device += nbytes // split
        rows.append((jax.tree_util.keystr(path).replace(".value", ""), str(tuple(array.shape)),
                     str(names or "-"), str(spec), _human(nbytes), _human(nbytes // split)))
    rows.append(("total", "", "", "", _human(total_global), _human(total_device)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
