"""Pipeline parallelism over the `stage` mesh axis: one SPMD scan over clock ticks.

Playbook, "Pipeline Parallelism": the layer stack is cut into p stages along depth, the
batch into m micro-batches, and every device of the `stage` axis runs its own stage on a
different micro-batch at each clock tick. Activations move to the next stage with one
`lax.ppermute` over `stage` per tick (inside `jax.shard_map`, manual over `stage` only:
`data`, `fsdp`, `tensor` stay with the partitioner). The embedding and the output head
stay outside the pipelined stack.

Layout. The scanned layer parameters [L, ...] are sharded over `stage` on their first
dimension (rule 'layers' -> stage), so stage s stores the contiguous block
[s*v*k, (s+1)*v*k) of v*k layers, seen as [v repeats, k layers]. Stage s runs its chunk r
as layers (r*p + s)*k ... : for gpipe and 1f1b (v = 1) this is the stored order; for the
circular schedule the stored order is a fixed permutation of the execution order
(`execution_order`), the price of keeping each stage's weights local.

Schedules (`config.pipeline.schedule`):

* gpipe ("all-forward-all-backward"): micro-batch i runs stage s at tick i + s; the
  backward is the autodiff transpose of the tick scan. Ticks m + p - 1, bubble
  (p-1)/(m+p-1); every stage keeps the inputs of all m micro-batches for the backward.
* circular ("Interleaving stages"): each device holds v = `pipeline.repeats` chunks;
  micro-batches go round the ring v times (stage p-1 feeds stage 0, which parks them
  until their next lap). Ticks v*m + p - 1, bubble (p-1)/(v*m+p-1), v times the transfers.
* 1f1b ("One-forward-one-backward"): a hand-written tick loop in which each stage does
  one forward and one backward (`jax.vjp` of its stage, recomputed from the stashed
  stage input) per tick; the last stage takes the loss of a micro-batch in the tick it
  finishes it and sends the gradient back at once. A stage keeps 2(p-s)-1 micro-batch
  inputs in flight (the ring is one tick per hop each way), independent of m. Ticks
  m + 2(p-1). It is a loss-and-gradient function, `loss_and_grads`, used by the train
  step instead of autodiff; its forward-only pass (evaluation) is the gpipe loop.

Remat per stage per micro-batch: the backward recomputes a stage from its input.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain import config as config_lib
from meshtrain.mesh import Axis

STAGE = Axis.STAGE.value


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline schedule: p stages, m micro-batches, v repeats (chunks per stage)."""

    schedule: str
    stages: int
    microbatches: int
    repeats: int = 1

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, stages: int) -> Pipeline | None:
        """The configured schedule, or None when the mesh has a single stage."""
        if stages <= 1:
            return None
        pipe = config.pipeline
        return cls(pipe.schedule, stages, pipe.microbatches, pipe.repeats if pipe.schedule == "circular" else 1)

    @property
    def ticks(self) -> int:
        """Trip count of the tick loop."""
        p, m, v = self.stages, self.microbatches, self.repeats
        return m + 2 * (p - 1) if self.schedule == "1f1b" else v * m + p - 1

    @property
    def bubble(self) -> float:
        """Idle fraction of the ticks, 1 - v*m/ticks: gpipe (p-1)/(m+p-1), circular (p-1)/(v*m+p-1)
        (the playbook's (p-1)/(v*m) is relative to the ideal time), 1f1b 2(p-1)/(m+2(p-1)): an
        SPMD tick costs the same on every stage whether its slot holds work or not, and 1F1B's ring
        takes one tick per hop in each direction.
        """
        return 1 - self.repeats * self.microbatches / self.ticks

    def in_flight(self) -> tuple[int, ...]:
        """Per stage: micro-batch activations held for the backward at the peak."""
        p, m, v = self.stages, self.microbatches, self.repeats
        if self.schedule == "1f1b":
            return tuple(min(m, 2 * (p - s) - 1) for s in range(p))
        return (v * m,) * p

    def execution_order(self, n_layers: int) -> np.ndarray:
        """order[q] = stored index of the layer that runs q-th (identity unless circular)."""
        p, v = self.stages, self.repeats
        k = n_layers // (p * v)
        stored = np.arange(n_layers).reshape(p, v, k)  # [stage, repeat, layer]
        return stored.transpose(1, 0, 2).reshape(-1)

    def forward(self, model, x, positions, segment_ids):
        """The layer stack of a bound `Transformer` on x [B,T,D] -> [B,T,D], pipelined over `stage`.

        Differentiable (gpipe, circular); 1f1b uses this loop for its forward-only pass.
        """
        stack = _chunk_function(stage_function(model))
        if model.cfg.remat_policy != "none":  # remat per stage per micro-batch: keep only its input
            stack = jax.checkpoint(stack, prevent_cse=False)
        layers = model.layers.variables["params"]
        m = self.microbatches
        split = functools.partial(_split, m=m)
        body = functools.partial(_ring_loop, stack, p=self.stages, m=m, v=self.repeats)
        out = jax.shard_map(
            body, in_specs=(P(STAGE), P(), P(), P()), out_specs=P(), axis_names={STAGE}, check_vma=True,
        )(layers, split(x), split(positions), split(segment_ids))
        return out.reshape(x.shape)


def _split(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [B/m, m, ...]: micro-batch i is rows {j*m + i}; a free reshape, each device keeps its rows."""
    return a.reshape(a.shape[0] // m, m, *a.shape[1:])


def stage_function(model):
    """(chunk params [k, ...], x [b,T,D], positions, segment_ids) -> x: k layers of the model's block.

    The block is the model's own (with its remat policy), its rules manual over `stage`.
    """
    from meshtrain import model as model_lib

    rules = model.rules.with_manual((STAGE,))
    block = model_lib.remat_block(model.cfg)(model.cfg, rules, model.attention_fn, parent=None)

    def stack(chunk, x, positions, segment_ids):
        def layer(x, params):
            return block.apply({"params": params}, x, positions, segment_ids)[0], None
        return lax.scan(layer, x, chunk)[0]
    return stack


def _chunk_function(stack):
    """stack on chunk r and micro-batch i, both picked inside: a remat keeps (r, i, x), not weights."""
    def run(chunks, r, i, x, positions, segment_ids):
        chunk = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, r, 0, keepdims=False), chunks)
        return stack(chunk, x, lax.dynamic_index_in_dim(positions, i, 1, keepdims=False),
                     lax.dynamic_index_in_dim(segment_ids, i, 1, keepdims=False))
    return run


def _ring_loop(stack, layers, xs, positions, segment_ids, *, p, m, v):
    """gpipe / circular tick loop on one stage. xs [b, m, T, D]; layers [v*k, ...] local.

    Stage 0 reads lap 0 from `buffer` (the embedded micro-batches) and later laps from the
    same buffer, where the activations arriving from stage p-1 are parked; after the last
    tick the buffer of stage 0 holds the stack's output.
    """
    s = lax.axis_index(STAGE)
    chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers)
    ring = [(j, (j + 1) % p) for j in range(p)]
    buffer = lax.pcast(xs, (STAGE,), to="varying")  # [b, m, T, D]
    incoming = jnp.zeros_like(buffer[:, 0])  # [b, T, D] from the previous stage

    def park(buffer, incoming, t):  # stage p-1 finished micro-batch t - p on the previous tick
        slot = (t - p) % m
        kept = jnp.where(t >= p, incoming, lax.dynamic_index_in_dim(buffer, slot, 1, keepdims=False))
        return lax.dynamic_update_index_in_dim(buffer, kept, slot, 1)

    def tick(carry, t):
        buffer, incoming = carry
        buffer = park(buffer, incoming, t)
        i, r = (t - s) % m, jnp.clip((t - s) // m, 0, v - 1)  # micro-batch and lap of this stage
        x = jnp.where(s == 0, lax.dynamic_index_in_dim(buffer, t % m, 1, keepdims=False), incoming)
        y = stack(chunks, r, i, x, positions, segment_ids)
        return (buffer, lax.ppermute(y, STAGE, ring)), None

    ticks = v * m + p - 1
    (buffer, incoming), _ = lax.scan(tick, (buffer, incoming), jnp.arange(ticks))
    buffer = park(buffer, incoming, ticks)
    return lax.psum(jnp.where(s == 0, buffer, jnp.zeros_like(buffer)), STAGE)


# ---------------------------------------------------------------------------------------------
# 1F1B: loss and gradients in one hand-written tick loop.
# ---------------------------------------------------------------------------------------------


def loss_and_grads(params, batch, model, total_tokens, accum_steps):
    """((loss_sum, aux), grads) of the 1F1B schedule; the train step's drop-in for autodiff.

    Same contract as the train step's one-pass gradient: the differentiated loss is
    loss_sum / total_tokens (no auxiliary losses: the MoE validator rejects MoE with mesh.stage > 1).
    """
    del accum_steps  # the validator requires train.grad_accum_steps == 1 with a pipeline
    pipe = model.pipeline
    inner = model.clone(rules=model.rules.with_manual((STAGE,)), pipeline=None)
    stack = stage_function(inner)
    outer = {k: v for k, v in params.items() if k != "layers"}
    micro = jax.tree.map(functools.partial(_split, m=pipe.microbatches), batch)
    body = functools.partial(_one_f_one_b_loop, stack, inner, p=pipe.stages, m=pipe.microbatches)
    loss_sum, outer_grads, layer_grads = jax.shard_map(
        body, in_specs=(P(STAGE), P(), P(), P()), out_specs=(P(), P(), P(STAGE)),
        axis_names={STAGE}, check_vma=True,
    )(params["layers"], outer, micro, total_tokens)
    grads = {**outer_grads, "layers": layer_grads}
    return loss_sum, {}, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def _one_f_one_b_loop(stack, model, layers, outer, micro, total_tokens, *, p, m):
    """One stage's 1F1B ticks. Tick t: forward of micro-batch t - s, backward of t - 2(p-1) + s.

    The inputs of forwards whose backward is pending wait in a stash of 2p - 1 slots.
    """
    s = lax.axis_index(STAGE)
    outer = lax.pcast(outer, (STAGE,), to="varying")  # differentiate per stage; reduce once at the end
    slots = 2 * p - 1

    def embed(o, tokens):
        return model.apply({"params": o}, tokens, method="embed")

    def head_loss(o, y, mb):
        return model.apply({"params": o}, y, mb, method="head_loss")

    def pick(i):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 1, keepdims=False), micro)

    example = jax.eval_shape(embed, outer, pick(0)["inputs"])
    act = jnp.zeros(example.shape, example.dtype)  # [b, T, D]
    carry = dict(fwd=act, bwd=act, stash=jnp.zeros((slots, *act.shape), act.dtype),
                 g_layers=jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), layers),
                 g_outer=jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), outer),
                 loss=jnp.zeros((), jnp.float32))
    carry = lax.pcast(carry, (STAGE,), to="varying")  # every stage holds its own

    def tick(c, t):
        # forward of micro-batch i_f (stage 0 embeds it, others take it from the previous stage)
        i_f = t - s
        f_on = (i_f >= 0) & (i_f < m)
        fi = jnp.clip(i_f, 0, m - 1)
        mf = pick(fi)
        x = jnp.where(s == 0, embed(outer, mf["inputs"]), c["fwd"])
        y = stack(layers, x, mf["positions"], mf["segment_ids"])
        slot = fi % slots
        stash = lax.dynamic_update_index_in_dim(
            c["stash"], jnp.where(f_on, x, c["stash"][slot]), slot, 0)
        # the last stage takes the loss of the micro-batch it just finished
        take = (s == p - 1) & f_on
        loss, head_vjp = jax.vjp(lambda o, y: head_loss(o, y, mf), outer, y)
        g_head, dy = head_vjp(jnp.where(take, 1.0 / total_tokens, 0.0).astype(loss.dtype))
        # Barriers give the tick's collectives one order on every device (forward, loss, send,
        # backward, send): the CPU runtime may otherwise start independent ones in different orders.
        y, dy = lax.optimization_barrier((y, dy))
        fwd = lax.ppermute(y, STAGE, [(j, j + 1) for j in range(p - 1)])
        # backward of micro-batch i_b, recomputed from its stashed input
        i_b = t - 2 * (p - 1) + s
        b_on = (i_b >= 0) & (i_b < m)
        bi = jnp.clip(i_b, 0, m - 1)
        mb = pick(bi)
        g = jnp.where(b_on, jnp.where(s == p - 1, dy, c["bwd"]), jnp.zeros_like(dy))
        fwd, g, x_saved = lax.optimization_barrier((fwd, g, stash[bi % slots]))
        _, stack_vjp = jax.vjp(lambda w, x: stack(w, x, mb["positions"], mb["segment_ids"]), layers, x_saved)
        g_layers, dx = stack_vjp(g)
        _, embed_vjp = jax.vjp(lambda o: embed(o, mb["inputs"]), outer)
        (g_embed,) = embed_vjp(jnp.where((s == 0) & b_on, dx, jnp.zeros_like(dx)))
        dx, g_layers, g_embed = lax.optimization_barrier((dx, g_layers, g_embed))
        acc = functools.partial(jax.tree.map, lambda a, *gs: a + sum(x.astype(jnp.float32) for x in gs))
        return dict(
            fwd=fwd, bwd=lax.ppermute(dx, STAGE, [(j + 1, j) for j in range(p - 1)]),
            stash=stash, g_layers=acc(c["g_layers"], g_layers), g_outer=acc(c["g_outer"], g_head, g_embed),
            loss=c["loss"] + jnp.where(take, loss, 0.0)), None

    c, _ = lax.scan(tick, carry, jnp.arange(m + 2 * (p - 1)))
    return lax.psum(c["loss"], STAGE), lax.psum(c["g_outer"], STAGE), c["g_layers"]


def grads_function(pipe: Pipeline | None, default):
    """The train step's (loss_sum, aux, grads) function: 1F1B's own loop, else `default` (autodiff)."""
    return loss_and_grads if pipe is not None and pipe.schedule == "1f1b" else default


# ---------------------------------------------------------------------------------------------
# Validation and the start-of-run description.
# ---------------------------------------------------------------------------------------------


def validate(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """Pipeline rules (run by `config.validate`); raises ConfigError."""
    p = sizes[STAGE]
    pipe, req = config.pipeline, config_lib._require
    if p == 1:
        return
    v = pipe.repeats
    req(pipe.schedule == "circular" or v == 1, "pipeline.repeats", v,
        f"repeats > 1 needs pipeline.schedule='circular' (got {pipe.schedule!r})")
    req(config.model.n_layers % (p * v) == 0, "model.n_layers", config.model.n_layers,
        f"layers must be divisible by mesh.stage*pipeline.repeats={p}*{v}")
    req(pipe.microbatches >= p, "pipeline.microbatches", pipe.microbatches,
        f"must be >= mesh.stage={p} (every stage needs a micro-batch to work on)")
    dp = config_lib.data_parallel_size(sizes)
    req(config.train.batch_size % (pipe.microbatches * dp) == 0, "train.batch_size", config.train.batch_size,
        f"must be divisible by pipeline.microbatches*mesh.(data*fsdp*expert)={pipe.microbatches}*{dp}")
    req(config.train.grad_accum_steps == 1, "train.grad_accum_steps", config.train.grad_accum_steps,
        "must be 1 with mesh.stage > 1: pipeline.microbatches splits the batch instead")
    req(config.attention.impl == "xla", "attention.impl", config.attention.impl,
        "must be 'xla' with mesh.stage > 1 (ring/pallas attention are not supported inside the pipeline yet)")
    for key in ("fused_norm", "fused_loss"):
        req(not config.model[key], f"model.{key}", config.model[key],
            "Pallas kernels are not supported with mesh.stage > 1 yet")



def describe(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> str | None:
    """One line for the start-of-run log: schedule, ticks, bubble, in-flight micro-batches per stage."""
    pipe = Pipeline.from_config(config, sizes[STAGE])
    if pipe is None:
        return None
    return (f"pipeline {pipe.schedule}: {pipe.stages} stages x {pipe.repeats} repeats, {pipe.microbatches} "
            f"micro-batches, {pipe.ticks} ticks, bubble {pipe.bubble:.1%}, "
            f"in flight per stage {list(pipe.in_flight())}")
