"""Train state creation (already sharded), ZeRO placement, and the jitted train step.

Playbook sections implemented here:

* "Gradient accumulation": micro-batches run in a `lax.scan`, gradients accumulate in
  float32, and the loss is normalised once by the number of valid tokens in the whole
  global batch (all micro-batches, all data-parallel ranks), so 4 micro-batches of b
  rows give the same update as 1 of 4b even with unequal padding.
* "Data Parallelism" / "ZeRO": `train.zero_stage` chooses the storage sharding over
  `fsdp`: 0 replicates everything, 1 shards the optimizer state, 2 also the gradients,
  3 also the parameters. The partitioner derives the all-reduce / reduce-scatter /
  all-gather pattern from those shardings.
* "Mixed Precision Training": float32 master weights and optimizer state, compute in
  `model.dtype` (bf16 by default); under `model.matmul_precision='fp8'` the state also holds
  the FP8 amax histories (`fp8.py`), advanced by each applied step.

Shapes before bytes: `jax.eval_shape` gives the abstract state, the rules give its
shardings, and `jax.jit(init, out_shardings=...)` creates it already sharded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import fp8 as fp8_lib, mesh as mesh_lib, model as model_lib, moe as moe_lib, optimizer as optimizer_lib
from meshtrain.sharding_rules import ZERO_AXES, Placement, Rules, named, vary

if TYPE_CHECKING:
    from meshtrain.run import Run


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict
    opt_state: optax.OptState
    rng: jax.Array  # uint32 key data: the run's random stream, advanced once per applied step
    fp8: dict  # FP8 amax histories [.., 3, H] per quantised matmul (`fp8.py`); empty unless matmul_precision='fp8'


def initial_rng(seed_key: jax.Array) -> jax.Array:
    """The training stream's key data, derived from (and distinct from) the initialisation key."""
    return jax.random.key_data(jax.random.fold_in(seed_key, 1))


def _is_box(x) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def _boxed_specs(tree, rules: Rules):
    """PartitionSpecs for a tree of (possibly) boxed arrays; unboxed leaves are replicated."""
    def spec(x):
        if _is_box(x):
            return rules.spec(tuple(x.names), tuple(x.value.shape), what="/".join(map(str, x.names)))
        return P()
    return jax.tree.map(spec, tree, is_leaf=_is_box)


class StateFactory:
    """Abstract state, its shardings, and the sharded initialiser for one model + optimizer + mesh."""

    def __init__(self, model: model_lib.Transformer, tx: optax.GradientTransformation,
                 mesh: jax.sharding.Mesh, placement: Placement, batch_shape: tuple[int, int]):
        self.model, self.tx, self.mesh, self.placement = model, tx, mesh, placement
        self._batch_shape = batch_shape
        with jax.set_mesh(mesh):  # nothing runs eagerly: the mesh may be a compile-only target's devices
            canonical = jax.eval_shape(lambda: self._init_boxed(jax.random.key(0)))
        self._stacked = self._stacked_leaves(canonical)
        self.boxed = self._with_rows(canonical)  # the schedule's storage: uneven stages add empty rows
        self.specs = self._specs(self.boxed)
        self.shardings = named(mesh, self.specs)
        self.grad_specs = _boxed_specs(self.boxed.params, placement.grads)
        self.zero_shards = jax.tree.map(ZeroShard.of, self.grad_specs,
                                        _boxed_specs(self.boxed.params, placement.grads.without_fsdp()),
                                        is_leaf=lambda x: isinstance(x, P))
        self.abstract = _placed(nn.unbox(self.boxed), self.shardings)
        # Checkpoints and exports hold the layers in execution order, `canonical`: the same shapes, except
        # that uneven stages' empty rows are gone; a layer dimension `stage` no longer divides moves the
        # stage split to another dimension of the leaf (`_canonical_spec`), so no device holds more.
        self.canonical_specs = jax.tree.map(
            lambda spec, a, stacked: _canonical_spec(spec, a.shape, dict(mesh.shape)) if stacked else spec,
            self.specs, nn.unbox(canonical), self._stacked, is_leaf=lambda x: isinstance(x, P))
        self.canonical_shardings = named(mesh, self.canonical_specs)
        self.canonical = _placed(nn.unbox(canonical), self.canonical_shardings)

    def _specs(self, boxed: TrainState) -> TrainState:
        return TrainState(
            step=P(),
            params=_boxed_specs(boxed.params, self.placement.params),
            opt_state=_boxed_specs(boxed.opt_state, self.placement.opt_state),
            rng=P(),
            fp8=jax.tree.map(lambda _: P(), boxed.fp8))  # small: replicated

    @staticmethod
    def _stacked_leaves(boxed: TrainState) -> TrainState:
        """True at every layer-stacked leaf (first logical name "layers": parameters and their optimizer
        moments; the FP8 amax histories of the layers), False elsewhere; the unboxed state's structure."""
        stacked = jax.tree.map(lambda x: _is_box(x) and bool(x.names) and x.names[0] == "layers", boxed,
                               is_leaf=_is_box)
        layered = {name: jax.tree.map(lambda _, n=name: n == "layers", tree) for name, tree in boxed.fp8.items()}
        return stacked.replace(fp8=layered)

    def _with_rows(self, boxed: TrainState) -> TrainState:
        """The abstract state with `Pipeline.rows` layer rows (more than the model's units when uneven)."""
        pipe = self.model.pipeline
        units = model_lib.scan_unit(self.model.cfg)[1]
        rows = units if pipe is None else pipe.rows(units)
        if rows == units:
            return boxed

        def grow(x, stacked):
            if not stacked:
                return x
            value = x.value if _is_box(x) else x
            grown = jax.ShapeDtypeStruct((rows, *value.shape[1:]), value.dtype)
            return x.replace_boxed(grown) if _is_box(x) else grown
        flat, treedef = jax.tree.flatten(boxed, is_leaf=_is_box)
        return jax.tree.unflatten(treedef, [grow(x, s) for x, s in zip(flat, jax.tree.leaves(self._stacked),
                                                                        strict=True)])

    def _init_boxed(self, rng: jax.Array) -> TrainState:
        batch = model_lib.dummy_batch(*self._batch_shape)
        variables = self.model.init(rng, batch["inputs"], batch["positions"], batch["segment_ids"])
        params = variables["params"]
        # optax maps over the boxes, so the optimizer state keeps the parameters' logical names.
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                          rng=initial_rng(rng), fp8=dict(variables.get(fp8_lib.COLLECTION, {})))

    def create(self, seed: int) -> TrainState:
        """The initial state, created directly in its shardings (nothing materialised whole).

        The layers are initialised in execution order, then laid out in the schedule's storage order:
        one seed is one model whatever the mesh and schedule.
        """
        init = jax.jit(lambda rng: self._reorder(nn.unbox(self._init_boxed(rng)), self._stored),
                       out_shardings=self.shardings)
        with jax.set_mesh(self.mesh):
            return init(jax.random.key(seed))

    @functools.cached_property
    def _order(self) -> np.ndarray | None:
        """order[q] = stored row of the q-th scanned unit to run; None when they are the same."""
        pipe = self.model.pipeline
        if pipe is None:
            return None
        units = model_lib.scan_unit(self.model.cfg)[1]
        order = pipe.execution_order(units)
        return None if order.size == pipe.rows(units) and np.array_equal(order, np.arange(order.size)) else order

    @property
    def _stored(self) -> np.ndarray | None:
        """stored[r] = the unit held by row r in execution order, -1 for an empty row (uneven stages)."""
        if self._order is None:
            return None
        pipe = self.model.pipeline
        stored = np.full(pipe.rows(self._order.size), -1)
        stored[self._order] = np.arange(self._order.size)
        return stored

    def _reorder(self, state: TrainState, index: np.ndarray | None) -> TrainState:
        """Every layer-stacked leaf taken along its first dimension at `index` (-1: a row of zeros)."""
        if index is None:
            return state

        def take(a):
            if (index >= 0).all():
                return a[index]
            real = (index >= 0).reshape(-1, *([1] * (a.ndim - 1)))
            return jnp.where(real, a[np.maximum(index, 0)], jnp.zeros((), a.dtype))
        return jax.tree.map(lambda a, s: take(a) if s else a, state, self._stacked)

    def to_canonical(self, state: TrainState) -> TrainState:
        """The state with its layers in execution order: how checkpoints and exports hold them, so
        their meaning never depends on the schedule that wrote them (identity unless circular or
        uneven); shaped and sharded as `canonical`."""
        return self._convert(state, self._order, self.canonical_shardings)

    def from_canonical(self, state: TrainState) -> TrainState:
        """The inverse of `to_canonical`: execution order -> this schedule's storage order."""
        return self._convert(state, self._stored, self.shardings)

    def _convert(self, state: TrainState, index: np.ndarray | None, shardings) -> TrainState:
        if index is None:
            return state
        with jax.set_mesh(self.mesh):
            return jax.jit(lambda s: self._reorder(s, index), out_shardings=shardings)(state)

    def from_params(self, params: dict, seed: int) -> TrainState:
        """The state at step 0 around given parameters in execution order (e.g. imported weights,
        already in `canonical_shardings.params`): the optimizer state is initialised from them inside one jit
        whose outputs are the factory's shardings, and the run's RNG derives from `seed`."""
        def init(params):  # params in execution order (as imported) -> the schedule's storage order
            state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                               rng=initial_rng(jax.random.key(seed)),
                               fp8=jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.boxed.fp8))
            return self._reorder(state, self._stored)
        with jax.set_mesh(self.mesh):
            return jax.jit(init, out_shardings=self.shardings, donate_argnums=0)(params)


def _placed(shapes, shardings):
    """ShapeDtypeStructs of `shapes` carrying `shardings`."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def _canonical_spec(spec: P, shape: tuple[int, ...], sizes: dict[str, int]) -> P:
    """A stored layer-stacked leaf's spec for its canonical shape: the same when the axes of the layer
    dimension divide it; else those axes move to the first other dimension they divide with the axes
    already there (replicated over them when none does: small leaves such as norm scales)."""
    entries = [tuple(e) if isinstance(e, tuple) else ((e,) if e else ()) for e in spec]
    entries += [()] * (len(shape) - len(entries))
    moving = entries[0]
    if not moving or shape[0] % math.prod(sizes[a] for a in moving) == 0:
        return spec
    entries[0] = ()
    for dim in range(1, len(shape)):
        if shape[dim] % math.prod(sizes[a] for a in entries[dim] + moving) == 0:
            entries[dim] = entries[dim] + moving
            break
    out = [e[0] if len(e) == 1 else (e or None) for e in entries]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _split_micro(x: jax.Array, accum: int) -> jax.Array:
    """[B, ...] -> [accum, B/accum, ...] with micro-batch a = rows {j*accum + a}.

    Each device keeps its own rows (the batch dimension stays sharded): no data moves.
    """
    b = x.shape[0]
    return jnp.swapaxes(x.reshape(b // accum, accum, *x.shape[1:]), 0, 1)


def grads_one_pass(params, histories, batch, model, total_tokens, accum_steps, copies: int = 1):
    """(loss_sum, aux, grads, amaxes) of one (micro-)batch by autodiff; the loss is pre-divided by
    the global token count. With FP8 amax `histories`, `amaxes` are their cotangents: this pass's
    amaxes (`fp8.py`; max-combined over every use of a matmul); {} without.

    `copies`: on how many devices of an enclosing manual region each device's `aux` (MoE losses of
    statistics summed over the region) is the same value. Each device adds it to its own loss, and
    the backward of that implicit broadcast sums the copies' cotangents, so each adds 1/copies.
    """
    def loss_fn(params, histories, micro):
        # `aux` holds auxiliary losses (added); the model sows logged-only scalars into "metrics".
        variables = {"params": params}
        if histories:
            variables[fp8_lib.COLLECTION] = fp8_lib.for_grad(histories)
        (loss_sum, aux), sown = model.apply(variables, micro, method=model_lib.Transformer.loss, mutable=["metrics"])
        mtp_sum = aux.pop(model_lib.MTP_SUM, 0.0)  # a sum, divided by the batch's tokens as the main loss is
        added = sum(aux.values()) / (accum_steps * copies)
        return (loss_sum + mtp_sum) / total_tokens + added, (loss_sum, {**aux, **sown.get("metrics", {})})
    (_, (loss_sum, aux)), (grads, amaxes) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, histories, batch)
    return loss_sum, aux, grads, amaxes


def _accumulate_local(params, histories, micro_batches, model, total_tokens, accum_steps, varying_axes=()):
    """Scan over micro-batches summing float32 gradients (and taking the largest FP8 amaxes); no
    collective over the batch axes inside."""
    copies = math.prod(model.rules.size(a) for a in varying_axes)

    def accumulate(carry, micro):
        grads_acc, amax_acc, loss_acc = carry
        loss_sum, aux, grads, amaxes = grads_one_pass(params, histories, micro, model, total_tokens,
                                                      accum_steps, copies)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        amax_acc = jax.tree.map(jnp.maximum, amax_acc, amaxes)
        return (grads_acc, amax_acc, loss_acc + loss_sum), aux

    carry = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
             jax.tree.map(lambda h: jnp.full(h.shape, -jnp.inf, jnp.float32), histories), jnp.zeros((), jnp.float32))
    if varying_axes:  # inside shard_map the accumulators differ per device
        carry = jax.lax.pcast(carry, varying_axes, to="varying")
    (grads, amaxes, loss_sum), aux = jax.lax.scan(accumulate, carry, micro_batches)
    return loss_sum, jax.tree.map(jnp.mean, aux), grads, amaxes


def _axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]):
    """The PartitionSpec entry of `axes`: None, one name, or the tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class ZeroShard:
    """Where a gradient rests split by ZeRO (`sharding_rules.ZERO_AXES`): the dimension and the axes its
    storage spec (`Placement.grads`) splits it on beyond its compute spec (ZeRO off). An expert weight's
    `expert` split is its compute sharding, not ZeRO's, though `expert` is one of ZeRO's axes. A pytree
    leaf (no children)."""

    dim: int | None
    axes: tuple[str, ...] = ()

    @classmethod
    def of(cls, storage: P, compute: P) -> ZeroShard:
        for dim, entry in enumerate(storage):
            computed = set(_axes_of(compute[dim])) if dim < len(compute) else set()
            found = tuple(a for a in _axes_of(entry) if a in ZERO_AXES and a not in computed)
            if found:
                return cls(dim, found)
        return cls(None)

    def within(self, axes: tuple[str, ...]) -> tuple[int | None, tuple[str, ...]]:
        """(dimension, the shard's axes among `axes`), or (None, ()) when none of them splits it."""
        found = tuple(a for a in self.axes if a in axes)
        return (self.dim, found) if found else (None, ())


def accumulate_gradients(params, batch, *, model, total_tokens, accum_steps, manual_axes, grad_specs, zero_shards,
                         checked: bool = True, histories=None):
    """Gradient accumulation (playbook "Gradient accumulation" + "Interplay with gradient accumulation").

    The micro-batch loop runs inside a `jax.shard_map` that is manual over `manual_axes`
    (`Layout.accumulation_axes`: the split batch axes over which the parameters are replicated, and
    `sequence` under ring attention), so every device accumulates its own local gradient and the
    data-parallel reduction happens once, after the loop, hierarchically: a reduce-scatter over
    `fsdp` first where the gradient rests sharded (ZeRO-2), then the all-reduce of the shard over
    the other axes, so `data` moves 1/fsdp of the gradient. The other axes (tensor, ZeRO-3's fsdp)
    stay automatic: under ZeRO-3 each micro-batch gathers the weights and reduce-scatters its
    gradient over `fsdp`, and the loop accumulates the shards. MoE layers, ring attention and the
    Pallas kernels run inside (regions compose by axis); `checked` is False around Pallas kernels.

    Returns (loss_sum, aux, grads, amaxes): `amaxes` the cotangents of the FP8 amax `histories`
    (every device's largest; empty without FP8).
    """
    histories = histories or {}
    micro_batches = jax.tree.map(functools.partial(_split_micro, accum=accum_steps), batch)
    if not manual_axes:
        return _accumulate_local(params, histories, micro_batches, model, total_tokens, accum_steps)
    inner = model.clone(rules=model.rules.with_manual(manual_axes))
    # expert weights enter split over the manual ones of their axes (expert, and fsdp where the experts rest
    # whole on its devices): the exchange runs inside
    split = tuple(a for a in model.rules.split_axes("expert") if a in manual_axes)
    is_spec = functools.partial(jax.tree.map, is_leaf=lambda x: isinstance(x, P))

    def entering(spec: P, shard: ZeroShard) -> P:
        return P(*[_entry(tuple(a for a in _axes_of(e) if a in split and not (d == shard.dim and a in shard.axes)))
                   for d, e in enumerate(spec)])

    def local(params, histories, micro_batches, total_tokens):
        params, histories = vary((params, histories), manual_axes)  # each device differentiates its own copy
        loss_sum, aux, grads, amaxes = _accumulate_local(params, histories, micro_batches, inner, total_tokens,
                                                         accum_steps, manual_axes)

        def reduce(g, spec, shard):
            dim, zero = shard.within(manual_axes)
            split_on = {a for entry in spec for a in _axes_of(entry)} - set(zero)
            over = tuple(a for a in manual_axes if a not in split_on and a not in zero)  # not the weight's split
            if dim is not None:  # the shard first: the other axes then move 1/(its ZeRO axes) of it
                g = jax.lax.psum_scatter(g, zero, scatter_dimension=dim, tiled=True)
            return jax.lax.psum(g, over) if over else g
        grads = is_spec(reduce, grads, grad_specs, zero_shards)
        amaxes = jax.tree.map(lambda a: jax.lax.pmax(a, manual_axes), amaxes)  # each device saw its part: global
        return (jax.lax.psum(loss_sum, manual_axes), jax.tree.map(lambda a: jax.lax.pmean(a, manual_axes), aux),
                grads, amaxes)

    def leaving(spec: P, shard: ZeroShard) -> P:
        dim, zero = shard.within(manual_axes)
        return P(*[(zero if d == dim else _entry(tuple(a for a in _axes_of(e) if a in split)))
                   for d, e in enumerate(spec)])

    grad_out_specs = is_spec(leaving, grad_specs, zero_shards)
    param_in_specs = is_spec(entering, grad_specs, zero_shards)
    rows = tuple(a for a in manual_axes if a != "sequence")
    length = ("sequence",) if "sequence" in manual_axes else ()
    batch_in = jax.tree.map(lambda _: P(None, rows or None, length or None), micro_batches)
    return jax.shard_map(
        local, in_specs=(param_in_specs, P(), batch_in, P()), out_specs=(P(), P(), grad_out_specs, P()),
        axis_names=set(manual_axes), check_vma=checked,
    )(params, histories, micro_batches, total_tokens)


def step_gradients(state: TrainState, batch: dict[str, jax.Array], total_tokens: jax.Array, *,
                   model: model_lib.Transformer, grad_specs, zero_shards, accum_steps: int,
                   manual_axes: tuple[str, ...], grads_fn: Callable = grads_one_pass, checked: bool = True):
    """(loss_sum, aux, grads, amaxes) of one optimizer step's batch, the gradients in their step
    sharding (`grad_specs`). One micro-batch still goes through the manual loop (its hand-written,
    once-per-step reduction) unless a pipeline's stage loop, itself manual over the batch axes,
    reduces the gradients."""
    if accum_steps == 1 and (model.pipeline is not None or not manual_axes):
        loss_sum, aux, grads, amaxes = grads_fn(state.params, state.fp8, batch, model, total_tokens, 1)
    else:
        loss_sum, aux, grads, amaxes = accumulate_gradients(
            state.params, batch, model=model, total_tokens=total_tokens, accum_steps=accum_steps,
            manual_axes=manual_axes, grad_specs=grad_specs, zero_shards=zero_shards, checked=checked,
            histories=state.fp8)
    return loss_sum, aux, jax.tree.map(jax.lax.with_sharding_constraint, grads, grad_specs), amaxes


def train_step(state: TrainState, batch: dict[str, jax.Array], *, model: model_lib.Transformer,
               tx: optax.GradientTransformation, schedule: optax.Schedule, grad_specs, zero_shards,
               accum_steps: int, manual_axes: tuple[str, ...], grad_clip: float = 0.0,
               grads_fn: Callable = grads_one_pass, checked: bool = True) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over the global batch [B, T]; returns the new state and scalar metrics.

    `grads_fn` -> (loss_sum, aux, grads, amaxes): autodiff of the loss (`grads_one_pass`), or a
    pipeline schedule's own loop.
    `grad_clip` > 0 scales the gradients to at most that global norm before `tx`.
    """
    total_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    loss_sum, aux, grads, amaxes = step_gradients(state, batch, total_tokens, model=model, grad_specs=grad_specs,
                                                  zero_shards=zero_shards,
                                                  accum_steps=accum_steps, manual_axes=manual_axes,
                                                  grads_fn=grads_fn, checked=checked)
    grads, loads = moe_lib.split_router_loads(grads)  # the router biases' "gradients" are expert loads
    # Computed once (logged, checked, and the clipping's norm), in float32 whatever the parameters'
    # dtype: bf16 gradients (`model.param_dtype=bfloat16`) squared and summed in bf16 round the norm
    # to 8 bits on one device but not on a sharded mesh, whose partial sums XLA adds in float32.
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
    loss = loss_sum / total_tokens
    # A non-finite loss or gradient norm withholds the update (params, optimizer state and step
    # stay as they were); the loop stops on it, or skips it under `train.skip_nonfinite`.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    for a in jax.tree.leaves(fp8_lib.from_grad(amaxes)):  # FP8 clips an overflow the loss would show: +inf, nan
        finite &= ~jnp.any(jnp.isnan(a) | (a == jnp.inf))
    scale = optimizer_lib.clip_scale(grad_norm, grad_clip)
    grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = jax.tree.map(lambda p, u: (p + jnp.where(finite, u, 0)).astype(p.dtype), state.params, updates)
    params = moe_lib.balance_router_bias(params, loads, model.cfg.moe_bias_rate, finite)
    opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), opt_state, state.opt_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state.step),
               "tokens": total_tokens, "nonfinite": 1.0 - finite.astype(jnp.float32), **aux,
               **moe_lib.load_metrics(loads)}
    next_rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    rng = jnp.where(finite, next_rng, state.rng)
    histories = jax.tree.map(lambda h, a: jnp.where(finite, fp8_lib.advance(h, fp8_lib.from_grad(a)), h),
                             state.fp8, amaxes)
    return TrainState(step=state.step + finite.astype(jnp.int32), params=params, opt_state=opt_state,
                      rng=rng, fp8=histories), metrics


def jit_train_step(factory: StateFactory, schedule: optax.Schedule, batch_sharding: NamedSharding, *,
                   accum_steps: int = 1, manual_axes: tuple[str, ...] = (), grads_fn: Callable = grads_one_pass,
                   grad_clip: float = 0.0, compiler_options: dict[str, str | bool] | None = None,
                   checked: bool = True, model: model_lib.Transformer | None = None) -> Callable:
    """The step jitted once: explicit in/out shardings, the state donated. `model`: the factory's by default."""
    step = functools.partial(train_step, model=model or factory.model, tx=factory.tx, schedule=schedule,
                             grad_specs=factory.grad_specs, zero_shards=factory.zero_shards, accum_steps=accum_steps,
                             manual_axes=manual_axes,
                             grad_clip=grad_clip, grads_fn=grads_fn, checked=checked)
    replicated = NamedSharding(factory.mesh, P())
    return jax.jit(step, in_shardings=(factory.shardings, batch_sharding),
                   out_shardings=(factory.shardings, replicated), donate_argnums=0,
                   compiler_options=compiler_options)


def build(run: Run) -> tuple[StateFactory, Callable]:
    """The state factory and the jitted step of a resolved run; every choice is made here, once."""
    config = run.config
    layout = run.layout
    model = model_lib.Transformer(run.model, run.rules, layout.attention, pipeline=layout.pipeline)
    tx = optimizer_lib.make_optimizer(config)
    micro = config.train.batch_size // config.train.grad_accum_steps
    factory = StateFactory(model, tx, run.mesh, Placement.for_zero_stage(run.rules, config.train.zero_stage),
                           (micro, config.train.seq_len))
    grads_fn = layout.grads_function(grads_one_pass)
    jitted = functools.partial(jit_train_step, factory, optimizer_lib.learning_rate_schedule(config),
                               run.batch_sharding, accum_steps=config.train.grad_accum_steps,
                               manual_axes=layout.accumulation_axes, grads_fn=grads_fn,
                               grad_clip=config.train.grad_clip, compiler_options=mesh_lib.compiler_options(
                                   run.mesh, config.train.xla_gpu_memory_limit_slop_factor),
                               checked=not layout.kernels)
    if not run.model.fp8:
        return factory, jitted()
    first = model.clone(cfg=dataclasses.replace(model.cfg, fp8_first_step=True))
    return factory, Fp8Step(jitted(), functools.partial(jitted, model=first))


class Fp8Step:
    """The FP8 train step: the usual program, scaling every quantised operand by its amax history,
    and the first step's own program (`ModelConfig.fp8_first_step`: the histories are still empty,
    so each operand scales by its current amax), run while the state's histories are empty (a fresh
    state, or one switched from bf16; a withheld first step leaves them empty). Its other attributes
    (`lower`, `trace`, ...) are the usual program's: what runs from the second step on."""

    def __init__(self, steady: Callable, make_first: Callable[[], Callable]):
        self._steady, self._make_first, self._first, self._histories_seen = steady, make_first, None, False

    def __call__(self, state: TrainState, batch):
        if not self._histories_seen:
            if not _histories_recorded(state.fp8):
                self._first = self._first or self._make_first()
                return self._first(state, batch)
            self._histories_seen = True  # histories never empty again: one check per step object
        return self._steady(state, batch)

    def __getattr__(self, name: str):
        return getattr(self._steady, name)


@jax.jit
def _any_recorded(histories) -> jax.Array:
    return functools.reduce(jnp.logical_or, [jnp.any(h != 0) for h in jax.tree.leaves(histories)], False)


def _histories_recorded(histories) -> bool:
    """Whether any amax history holds a step: one replicated scalar, read from this process's own copy
    (every process of a multi-process run reads the same value and picks the same program)."""
    return bool(np.asarray(_any_recorded(histories).addressable_data(0)))
