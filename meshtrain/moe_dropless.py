"""Dropless MoE dispatch: the routed rows grouped by expert, exchanged over `expert` as they are.

Playbook, "Expert parallelism" (and MegaBlocks' dropless MoE): each token's k assignments are sorted
by expert and every expert multiplies only its own rows (a grouped matmul). Per device, for each of
`moe_chunks` slices of its tokens:

1. Sort. The n*k assignments by expert (`argsort`), counts per expert.
2. Place. Without expert parallelism the rows go straight into the grouped layout (`GroupLayout`:
   expert e's rows from `starts[e]`, each expert rounded up to the grouped matmul's row tile).
   Under `expert` (ep devices, E_l = E / ep experts each) they travel: the per-expert counts are
   all-gathered, from which every device computes the same exchange table (`ExchangePlan`): where
   each source's rows for each expert land in the receiver's grouped layout, and how many a receiver
   accepts. A receiver holds at most R rows, R = `moe_exchange_factor` x the balanced load (n*k),
   or the worst case ep * n * min(k, E_l) when the factor is 0; rows past R are dropped and counted
   (`moe_dropped_fraction`). The exchange moves each accepted row once:
   * `ragged`: `jax.lax.ragged_all_to_all`, one slice per (destination, expert), written straight
     into the receiver's grouped layout (XLA:GPU; XLA:CPU has none);
   * `all_to_all`: one buffer per destination sized for the most rows a device can send one
     (n * min(k, E_l)), placed by the same table (any platform).
3. The experts: SwiGLU through three grouped matmuls (`grouped_matmul`, or `jax.lax.ragged_dot`).
4. Back the same way (the table read the other way round), then each token sums its k rows times
   the router weights.

The row moves are gathers both ways (`_gather_tokens`, `_combine`: their gradients are gathers too,
no scatter-add). Splitting a device's tokens into chunks gives the scheduler independent exchanges to
run beside the previous chunk's matmuls (item 3 of the playbook's "overlap" advice); the results do
not depend on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from meshtrain import fp8 as fp8_lib
from meshtrain.pallas_kernels.grouped_matmul import GroupLayout, grouped_matmul, grouped_swiglu

MATMULS = ("ragged_dot", "pallas")
EXCHANGES = ("all_to_all", "ragged")


# ---------------------------------------------------------------------------------------------
# Row moves whose gradients are gathers.
# ---------------------------------------------------------------------------------------------


@jax.custom_vjp
def _gather_tokens(x: jax.Array, token: jax.Array, row: jax.Array) -> jax.Array:
    """out[p] = x[token[p]] (0 where token[p] < 0): tokens x [n, D] -> rows [M, D]. `row` [n, k] is the
    inverse (the row of each token's j-th copy, -1 for none), which the gradient gathers by."""
    return _take(x, token)


def _gather_tokens_fwd(x, token, row):
    return _take(x, token), (token, row)


def _gather_tokens_bwd(residuals, g):
    token, row = residuals
    dx = jnp.sum(_take(g, row.reshape(-1)).reshape(*row.shape, g.shape[-1]), axis=1, dtype=jnp.float32)
    return dx.astype(g.dtype), None, None


_gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


@jax.custom_vjp
def _combine(out: jax.Array, row: jax.Array, weights: jax.Array, assignment: jax.Array) -> jax.Array:
    """y[t] = sum_j weights[t, j] * out[row[t, j]]: rows [M, D] -> tokens [n, D] (row -1: nothing).
    `assignment` [M] is the inverse (t * k + j of each row, -1 for none), which d_out gathers by."""
    return _combine_fwd(out, row, weights, assignment)[0]


def _combine_fwd(out, row, weights, assignment):
    picked = _take(out, row.reshape(-1)).reshape(*row.shape, out.shape[-1])  # [n, k, D]
    y = jnp.einsum("tkd,tk->td", picked, weights.astype(out.dtype))
    return y, (out, row, weights, assignment)


def _combine_bwd(residuals, g):
    out, row, weights, assignment = residuals
    k = row.shape[1]
    w = jnp.where(assignment >= 0, weights.reshape(-1)[jnp.maximum(assignment, 0)], 0).astype(g.dtype)
    d_out = _take(g, jnp.where(assignment >= 0, assignment // k, -1)) * w[:, None]
    picked = _take(out, row.reshape(-1)).reshape(*row.shape, out.shape[-1])
    d_weights = jnp.einsum("tkd,td->tk", picked, g, preferred_element_type=jnp.float32).astype(weights.dtype)
    return d_out, None, d_weights, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[index] along the first axis, 0 where index < 0 (or past the end)."""
    valid = (index >= 0) & (index < x.shape[0])
    rows = x[jnp.clip(index, 0, x.shape[0] - 1)]
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), rows, 0).astype(x.dtype)


def _inverse(perm: jax.Array) -> jax.Array:
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def _exclusive_cumsum(a: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


# ---------------------------------------------------------------------------------------------
# The exchange table.
# ---------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """Where every device's rows for every expert go, the same on every device (from the all-gathered
    counts). Axes: s, j source and destination device (ep), e global expert (E = ep * E_l), l local
    expert of a device.

    Attributes:
        counts: [s, e] rows source s routes to expert e.
        accepted: [s, e] of them the expert's device takes (its R rows fill expert by expert, source by source).
        before: [s, e] accepted rows of expert e from sources before s (their place in e's group).
        sent_from: [s, e] row of source s's sorted buffer where its rows for e begin.
        starts: [j, l] first row of each device's expert l in its grouped layout.
        me: this device's index on the axis.
    """

    counts: jax.Array
    accepted: jax.Array
    before: jax.Array
    sent_from: jax.Array
    starts: jax.Array
    me: jax.Array
    tile: int = dataclasses.field(metadata=dict(static=True))
    rows: int = dataclasses.field(metadata=dict(static=True))  # M: the grouped layout's rows

    @classmethod
    def of(cls, counts: jax.Array, me: jax.Array, capacity: int, tile: int) -> ExchangePlan:
        """counts [ep, E] (every device's per-expert counts), `capacity` rows a device accepts."""
        ep, e = counts.shape
        e_l = e // ep
        counts = counts.astype(jnp.int32)
        total = jnp.sum(counts, axis=0).reshape(ep, e_l)
        took = jnp.clip(capacity - _exclusive_cumsum(total, 1), 0, total).reshape(e)  # [e]: each expert's rows kept
        accepted = jnp.clip(took[None, :] - _exclusive_cumsum(counts, 0), 0, counts)
        before = _exclusive_cumsum(accepted, 0)
        padded = (took.reshape(ep, e_l) + tile - 1) // tile * tile
        return cls(counts, accepted, before, _exclusive_cumsum(counts, 1), _exclusive_cumsum(padded, 1), me,
                   tile, GroupLayout.capacity(capacity, e_l, tile))

    @property
    def local(self) -> int:
        return self.starts.shape[1]

    def layout(self) -> GroupLayout:
        """This device's grouped layout: its experts' accepted rows."""
        mine = self._mine(self.accepted)  # [s, l]
        return GroupLayout(jnp.sum(mine, axis=0), self.starts[self.me], self.tile, self.rows)

    def _mine(self, a: jax.Array) -> jax.Array:
        """a [s, e] -> [s, l]: the columns of this device's experts."""
        return jax.lax.dynamic_slice_in_dim(a, self.me * self.local, self.local, axis=1)

    def dropped(self) -> jax.Array:
        """Rows this device routed that no expert's device accepted."""
        return jnp.sum(self.counts[self.me] - self.accepted[self.me]).astype(jnp.float32)

    def dispatch(self) -> tuple[jax.Array, ...]:
        """`ragged_all_to_all`'s (input_offsets, send_sizes, output_offsets, recv_sizes) there: slice
        e = j * E_l + l carries this device's rows for expert e to device j's grouped layout."""
        me = self.me
        return (self.sent_from[me], self.accepted[me], self.starts.reshape(-1) + self.before[me],
                self._mine(self.accepted).reshape(-1))

    def back(self) -> tuple[jax.Array, ...]:
        """The same, back: slice s * E_l + l carries source s's rows of local expert l home."""
        offsets = self.starts[self.me][None, :] + self._mine(self.before)  # [s, l]
        return (offsets.reshape(-1), self._mine(self.accepted).reshape(-1), self._mine(self.sent_from).reshape(-1),
                self.accepted[self.me])

    def placement(self, chunk: int) -> jax.Array:
        """[s, chunk] rows of the grouped layout for row r of the block source s sends this device by
        `all_to_all` (its sorted rows from its first row for this device's experts), rows + 1 for a
        row not accepted (another device's expert, past the capacity, past the routed rows)."""
        sent = self._mine(self.sent_from)  # [s, l]
        r = jnp.arange(chunk, dtype=jnp.int32)[None, :, None]
        into = r - (sent - sent[:, :1])[:, None, :]  # [s, r, l]: rank of row r in expert l's rows
        inside = (into >= 0) & (into < self._mine(self.accepted)[:, None, :])
        target = self.starts[self.me][None, None, :] + self._mine(self.before)[:, None, :] + into
        return jnp.max(jnp.where(inside, target, -1), axis=-1).clip(-1).astype(jnp.int32)


def _gather_counts(counts: jax.Array, ep: int, axis: tuple[str, ...]) -> jax.Array:
    """[ep, E]: every device's routed counts, by an `all_to_all` of this device's row to each: not an
    all-gather, which XLA:GPU's collective pipeliner (on for the ZeRO gathers, `mesh.GPU_COMPILER_OPTIONS`)
    joins to the next layer's weight gathers and moves into the layer loop's previous iteration with all it
    depends on: under remat the next layer's attention, computed twice (docs/moe.md)."""
    return jax.lax.all_to_all(jnp.broadcast_to(counts[None], (ep, *counts.shape)), axis, 0, 0, tiled=True)


def _ragged(x: jax.Array, rows: int, tables: tuple[jax.Array, ...], axis: tuple[str, ...],
            into: jax.Array | None = None) -> jax.Array:
    """`jax.lax.ragged_all_to_all` of x's slices into `rows` rows. The rows no slice writes keep what the
    buffer held, which nothing reads (the grouped matmuls mask the rows no expert owns, the combine the
    rows of dropped choices), so the buffer is `into` where the caller has one of that shape it no
    longer needs (the combine writes into the dispatch's send buffer: no fill a layer), else made from
    x's own first row: a constant one XLA would hoist out of the layer loop and keep, one a layer, for
    the whole step."""
    if into is not None:
        blank = jax.lax.stop_gradient(into)
    else:
        blank = jnp.broadcast_to(jax.lax.stop_gradient(x[:1]) * 0, (rows, x.shape[1]))
    return jax.lax.ragged_all_to_all(x, blank, *tables, axis_name=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 4))
def _ragged_dispatch(sent: jax.Array, rows: int, tables: tuple[jax.Array, ...], back: tuple[jax.Array, ...],
                     axis: tuple[str, ...]) -> jax.Array:
    """The dispatch's exchange (`_ragged` of the sorted rows into the `rows`-row layout by `tables`), whose
    gradient is the exchange home (`back`: the reverse tables) into a buffer made from the cotangent's own
    first row: JAX's own transpose fills a constant zero buffer of the sorted rows, which XLA hoists out of
    the layer loop and then copies into every layer's exchange (a read and a write of the rows where a fill
    is a write). The sorted rows no slice writes (choices past the receiver's capacity) get zeros."""
    return _ragged(sent, rows, tables, axis)


def _ragged_dispatch_fwd(sent, rows, tables, back, axis):
    return _ragged_dispatch(sent, rows, tables, back, axis), (sent.shape[0], back)


def _ragged_dispatch_bwd(rows, axis, residuals, ct):
    routed, back = residuals
    return _ragged(ct, routed, back, axis), None, None


_ragged_dispatch.defvjp(_ragged_dispatch_fwd, _ragged_dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged_home(out: jax.Array, into: jax.Array, tables: tuple[jax.Array, ...], back: tuple[jax.Array, ...],
                 axis: tuple[str, ...]) -> jax.Array:
    """The combine's exchange (`_ragged` of the grouped layout's rows home, by `tables`, into `into`),
    whose gradient is the dispatch's exchange (`back`: the reverse tables) written into the layout
    buffer `out` itself, which nothing reads after the combine: JAX's own transpose would fill a zero
    buffer of the layout's rows for it (and XLA copy that), a layer and a chunk. The layout's rows no
    slice writes keep what `out` held there: the rows no expert owns, which the grouped kernels mask."""
    return _ragged(out, into.shape[0], tables, axis, into=into)


def _ragged_home_fwd(out, into, tables, back, axis):
    return _ragged_home(out, into, tables, back, axis), (out, back)


def _ragged_home_bwd(axis, residuals, ct):
    out, back = residuals
    d_out = _ragged(ct.astype(out.dtype), out.shape[0], back, axis, into=out)
    return d_out, None, None, None


_ragged_home.defvjp(_ragged_home_fwd, _ragged_home_bwd)


def _send_dense(sent: jax.Array, plan: ExchangePlan, chunk: int, axis: tuple[str, ...]) -> jax.Array:
    """`all_to_all` dispatch: to each device the `chunk` sorted rows from its experts' first, placed."""
    first = plan.sent_from[plan.me].reshape(-1, plan.local)[:, 0]  # [j]
    blocks = _take(sent, (first[:, None] + jnp.arange(chunk)[None, :]).clip(max=sent.shape[0]))
    received = jax.lax.all_to_all(blocks, axis, 0, 0, tiled=True)  # [s, chunk, D]
    target = plan.placement(chunk).reshape(-1)
    return _take(received.reshape(-1, sent.shape[1]), _inverse_map(target, plan.rows))


def _return_dense(out: jax.Array, plan: ExchangePlan, chunk: int, routed: int, expert_of: jax.Array,
                  axis: tuple[str, ...]) -> jax.Array:
    """`all_to_all` return: each source's block of rows gathered from the grouped layout, sent home
    and read back in the source's sorted order (`expert_of` [routed]: each sorted row's expert)."""
    blocks = _take(out, plan.placement(chunk).reshape(-1)).reshape(-1, chunk, out.shape[1])
    home = jax.lax.all_to_all(blocks, axis, 0, 0, tiled=True)  # [j, chunk, D]
    first = plan.sent_from[plan.me].reshape(-1, plan.local)[:, 0]
    dest = expert_of // plan.local
    r = jnp.arange(routed, dtype=jnp.int32) - first[dest]
    return _take(home.reshape(-1, out.shape[1]), dest * chunk + r)


def _inverse_map(target: jax.Array, size: int) -> jax.Array:
    """[size]: the index i with target[i] == p for each p (-1 where none); targets < 0 are skipped."""
    ids = jnp.arange(target.shape[0], dtype=jnp.int32)
    return jnp.full((size,), -1, jnp.int32).at[jnp.where(target >= 0, target, size)].set(ids, mode="drop")


# ---------------------------------------------------------------------------------------------
# The experts on the grouped layout.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedDot:
    """How the grouped matmuls run: `jax.lax.ragged_dot` (groups back to back: tile 1; FP8 through
    `fp8.scaled_dot` with `histories`) or the Pallas kernel (tile `kernel_tile`), priced by the kernel
    model at `expected` rows."""

    impl: str
    expected: int = 0
    histories: tuple[jax.Array, ...] = ()
    first_step: bool = False
    model_major: bool = False  # the kernel's weights come [D, E, F] (`moe.gathers_model_dim`)

    def tile(self, routed: int, groups: int) -> int:
        """The grouped layout's row tile: the kernel's (`kernel_tile`), or 1 (groups back to back)."""
        return kernel_tile(routed, groups) if self.impl == "pallas" else 1

    def __call__(self, x: jax.Array, w: jax.Array, layout: GroupLayout, i: int) -> jax.Array:
        if self.impl == "pallas":
            order = ("ngk" if i == 2 else "kgn") if self.model_major else "gkn"
            return grouped_matmul(x, w, layout, order=order, expected_rows=self.expected)
        if self.histories:
            return fp8_lib.scaled_dot(fp8_lib.RAGGED_DOT, self.first_step, x, w, self.histories[i], layout.sizes)
        return jax.lax.ragged_dot(x, w, layout.sizes)

    def swiglu(self, x: jax.Array, layout: GroupLayout, w_gate, w_up, w_down) -> jax.Array:
        if self.impl == "pallas":  # the fused kernels (`grouped_swiglu`)
            orders = ("kgn", "kgn", "ngk") if self.model_major else ("gkn",) * 3
            return grouped_swiglu(x, w_gate, w_up, w_down, layout, orders=orders, expected_rows=self.expected)
        hidden = nn.silu(self(x, w_gate, layout, 0)) * self(x, w_up, layout, 1)
        return self(hidden, w_down, layout, 2)


def kernel_tile(routed: int, groups: int) -> int:
    """The grouped matmul kernel's row tile (its block_m) for `routed` rows over `groups` experts: each
    expert's rows start at a multiple of it, so it pads on average half a tile an expert. 128 rows (128 x
    256 tiles, 8 warps: two Hopper warpgroups) unless that padding passes a quarter of the rows (128
    experts of 32,768 routed rows, Qwen3-30B-A3B's shapes on one device, pad exactly a quarter), then 64
    (64 x 128 tiles, 4 warps)."""
    return 128 if groups * 64 <= routed // 4 else 64


def expected_rows(routed: int, groups: int, tile: int, rows: int) -> int:
    """Rows a grouped matmul computes for `routed` rows spread evenly over `groups` experts: each
    expert's rows rounded up to whole tiles, on average half a tile more (at most `rows`)."""
    return min(rows, routed + groups * (tile - 1) // 2)


# ---------------------------------------------------------------------------------------------
# The dispatch.
# ---------------------------------------------------------------------------------------------


def receive_capacity(routed: int, ep: int, worst: int, factor: float) -> int:
    """R: rows a device accepts from the exchange: `factor` x its balanced share `routed`, at most the
    worst case (every device sends it all it can); the worst case when `factor` is 0."""
    return worst if factor <= 0 else min(worst, math.ceil(factor * routed))


def dropless_ffn(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate, w_up, w_down, *, num_experts: int,
                 axis: tuple[str, ...] | None, ep: int, dot: GroupedDot, exchange: str, factor: float,
                 chunks: int) -> tuple[jax.Array, jax.Array]:
    """x [b, T, D], router weights / experts [b, T, k] -> (y [b, T, D], rows dropped at the exchange)."""
    b, t, d = x.shape
    k = experts.shape[-1]
    n = b * t
    size = n // chunks
    ys, dropped = [], jnp.zeros((), jnp.float32)
    for c in range(chunks):
        part = slice(c * size, (c + 1) * size)
        y, lost = _chunk(x.reshape(n, d)[part], weights.reshape(n, k)[part], experts.reshape(n, k)[part],
                         w_gate, w_up, w_down, num_experts=num_experts, axis=axis, ep=ep, dot=dot,
                         exchange=exchange, factor=factor)
        ys.append(y)
        dropped = dropped + lost
    return jnp.concatenate(ys, axis=0).reshape(b, t, d), dropped


def _chunk(x, weights, experts, w_gate, w_up, w_down, *, num_experts, axis, ep, dot, exchange, factor):
    """One chunk of a device's tokens: x [n, D], weights / experts [n, k] -> (y [n, D], dropped)."""
    n, k = experts.shape
    routed = n * k
    flat = experts.reshape(routed)  # assignment i: token i // k, choice i % k
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted row -> assignment
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    if ep == 1:
        tile = dot.tile(routed, num_experts)
        layout = GroupLayout.pack(counts, tile, GroupLayout.capacity(routed, num_experts, tile))
        expert_of = flat[order]
        rank = jnp.arange(routed, dtype=jnp.int32) - _exclusive_cumsum(counts)[expert_of]
        row_sorted = layout.starts[expert_of] + rank  # the grouped row of each sorted assignment
        row = jnp.zeros((routed,), jnp.int32).at[order].set(row_sorted).reshape(n, k)
        assignment = jnp.full((layout.rows,), -1, jnp.int32).at[row_sorted].set(order)
        rows = _gather_tokens(x, jnp.where(assignment >= 0, assignment // k, -1), row)
        dot = dataclasses.replace(dot, expected=expected_rows(routed, num_experts, tile, layout.rows))
        out = dot.swiglu(rows, layout, w_gate, w_up, w_down)
        return _combine(out, row, weights, assignment), jnp.zeros((), jnp.float32)

    e_l = num_experts // ep
    row = _inverse(order).reshape(n, k)  # the sorted row of each assignment
    sent = _gather_tokens(x, order // k, row)  # [routed, D] sorted by expert
    worst = ep * n * min(k, e_l)
    plan = ExchangePlan.of(_gather_counts(counts, ep, axis), jax.lax.axis_index(axis),
                           receive_capacity(routed, ep, worst, factor), dot.tile(routed, e_l))
    layout = plan.layout()
    chunk = n * min(k, e_l)  # the most rows one device sends another
    if exchange == "ragged":
        grouped = _ragged_dispatch(sent, plan.rows, plan.dispatch(), plan.back(), axis)
    else:
        grouped = _send_dense(sent, plan, chunk, axis)
    dot = dataclasses.replace(dot, expected=expected_rows(routed, e_l, plan.tile, plan.rows))
    out = dot.swiglu(grouped, layout, w_gate, w_up, w_down)
    if exchange == "ragged":
        home = _ragged_home(out, sent, plan.back(), plan.dispatch(), axis)
        # rows of dropped choices stay as the buffer held them: the combine leaves them out
        expert_of = flat[order]
        rank = jnp.arange(routed, dtype=jnp.int32) - plan.sent_from[plan.me][expert_of]
        delivered = rank < plan.accepted[plan.me][expert_of]  # [routed], sorted order
        row = jnp.where(delivered[row], row, -1)
        order = jnp.where(delivered, order, -1)
    else:
        home = _return_dense(out, plan, chunk, routed, flat[order], axis)
    return _combine(home, row, weights, order), plan.dropped()


def chunks_for(n_tokens: int, requested: int, ep: int) -> int:
    """The chunks a device's `n_tokens` split into: `requested` (0: 2 when the rows travel over ep > 1
    devices, else 1), or fewer until they divide evenly."""
    c = max(1, min(requested or (2 if ep > 1 else 1), n_tokens))
    while n_tokens % c:
        c -= 1
    return c

