"""Grouped matmul in Pallas (Triton on GPU, interpret mode on CPU): the experts of an MoE layer as GEMMs.

Playbook, "Expert parallelism": after routing, the rows sent to each expert are sorted by expert and
every expert multiplies only its own rows by its own weights (MegaBlocks' grouped GEMM). The rows lie
in a buffer of M rows in which group g (an expert) owns the rows `starts[g] .. starts[g] + sizes[g]`,
every group starting at a multiple of the tile height `block_m` (`GroupLayout`: the dispatch writes
the rows there directly), so each row tile belongs to one group and the kernels never mask a tile in
two. The tiles past the last group's are inactive: they compute nothing and write zeros.

Three kernels, each a grid of output tiles:
- `grouped_matmul`: out[r] = x[r] @ w[g(r)], [M, K] x [G, K, N] -> [M, N]; with `transpose_rhs`,
  x[r] @ w[g(r)].T, [M, N] x [G, K, N] -> [M, K] (the input gradient);
- `grouped_weight_grad`: dw[g] = x[rows of g].T @ dy[rows of g], [M, K] x [M, N] -> [G, K, N] (the
  weight gradient; a program per (group, K tile, N tile) walks its group's row tiles).
A row outside every group gives zero output and takes no part in a weight gradient. All
accumulation is float32 ("Mixed Precision Training"); float32 operands multiply in full precision.

The public `grouped_matmul` differentiates through the other two (`jax.custom_vjp`);
`grouped_matmul_reference` is the same product with `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from meshtrain.pallas_kernels._common import NN, NT, TN, dot, is_power_of_two, resolve_interpret

MIN_BLOCK = 16  # tl.dot's smallest tile
# shared memory for a kernel's pipelined loads: an H100's 227 KiB a block less room for the epilogue
SHARED_MEMORY = 192 * 1024


@dataclasses.dataclass(frozen=True)
class GroupedBlockSizes:
    """Tile sizes (powers of two >= 16) and Triton launch parameters.

    Attributes:
        block_m: rows per tile; every group starts at a multiple of it (`GroupLayout.tile`).
        block_n: output columns per program.
        block_k: contracted columns per step of a program's loop.
        num_warps, num_stages: warps per program and software-pipelining depth of the loops.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def default(cls, block_m: int) -> GroupedBlockSizes:
        """The tiles for a layout of `block_m`-row tiles: 64 x 128 tiles with 4 warps (one Hopper
        warpgroup) for fine-grained experts, 128 x 256 with 8 warps where the layout's tiles are 128
        rows (`moe_dropless.kernel_tile`: wide experts with many rows each)."""
        if block_m >= 128:
            return cls(block_m=block_m, block_n=256, block_k=64, num_warps=8, num_stages=3)
        return cls(block_m=block_m)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not is_power_of_two(value) or value < MIN_BLOCK:
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_BLOCK} "
                                 "(Triton tiles are powers of two and tl.dot needs 16)")

    def params(self, tile_bytes: int) -> plgpu.CompilerParams:
        """Triton's launch parameters for a kernel whose loop loads `tile_bytes` a step: `num_stages`
        steps in flight, fewer where they would pass the shared memory a Hopper SM gives a block
        (`SHARED_MEMORY`)."""
        stages = max(1, min(self.num_stages, SHARED_MEMORY // max(tile_bytes, 1)))
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=stages)

    def fit(self, dim: int, name: str) -> int:
        """The block of dimension `dim` (`block_n` or `block_k`), halved until it divides `dim`."""
        block = getattr(self, name)
        while block > MIN_BLOCK and dim % block:
            block //= 2
        if dim % block:
            raise ValueError(f"a grouped matmul dimension of {dim} must be a multiple of {MIN_BLOCK} "
                             f"({name} tiles are powers of two >= {MIN_BLOCK})")
        return block


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Where G groups' rows lie in a buffer of `rows` rows: group g at `starts[g] .. starts[g] + sizes[g]`,
    each start a multiple of `tile`, in group order, the groups' tiles disjoint.

    Attributes:
        sizes: [G] int32, each group's rows.
        starts: [G] int32, each group's first row.
        tile: the row tile (1: groups packed back to back, as `jax.lax.ragged_dot` takes them).
        rows: M, the buffer's rows (a multiple of `tile`).
    """

    sizes: jax.Array
    starts: jax.Array
    tile: int = dataclasses.field(metadata=dict(static=True))
    rows: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def pack(cls, sizes: jax.Array, tile: int, rows: int) -> GroupLayout:
        """Groups one after another, each rounded up to whole tiles. `rows` must hold them all: at least
        sum(sizes) + G * (tile - 1), rounded up to a multiple of `tile` (`capacity`)."""
        if rows % tile:
            raise ValueError(f"rows={rows} must be a multiple of tile={tile}")
        sizes = sizes.astype(jnp.int32)
        padded = (sizes + tile - 1) // tile * tile
        return cls(sizes, jnp.cumsum(padded) - padded, tile, rows)

    @staticmethod
    def capacity(total: int, groups: int, tile: int) -> int:
        """Rows a buffer needs for `groups` groups of `total` rows in all, each padded to whole tiles."""
        return -(-(total + groups * (tile - 1)) // tile) * tile

    @property
    def num_groups(self) -> int:
        return self.sizes.shape[0]

    def valid_rows(self) -> jax.Array:
        """[rows] bool: the rows some group owns."""
        r = jnp.arange(self.rows, dtype=jnp.int32)[:, None]
        return jnp.any((r >= self.starts) & (r < self.starts + self.sizes), axis=1)

    def tile_groups(self) -> tuple[jax.Array, jax.Array]:
        """(group [T], rows [T]): the group each of the T = rows / tile row tiles belongs to (G: none)
        and how many of its rows that group owns (0 for an inactive tile)."""
        first = jnp.arange(self.rows // self.tile, dtype=jnp.int32) * self.tile
        group = jnp.sum(first[:, None] >= self.starts[None, :], axis=1, dtype=jnp.int32) - 1
        g = jnp.clip(group, 0, self.num_groups - 1)
        owned = jnp.clip(self.starts[g] + self.sizes[g] - first, 0, self.tile)
        owned = jnp.where(group >= 0, owned, 0)
        return jnp.where(owned > 0, g, self.num_groups), owned


# ---------------------------------------------------------------------------------------------
# Kernels.
# ---------------------------------------------------------------------------------------------


def _weight_index(order: str, g, k, n) -> tuple:
    """The index of w (axes in `order`, a permutation of "gkn") taking group g, rows k, columns n."""
    return tuple({"g": g, "k": k, "n": n}[axis] for axis in order)


def _tile_kernel(group_ref, owned_ref, *refs, mode: str, contracted: int, block_c: int, num_groups: int,
                 transpose_rhs: bool, orders: tuple[str, ...]):
    """One [block_m, block_o] output tile of its rows' group, over the contracted dimension. `mode`:

    - "one": out = x @ w (refs x, w, out);
    - "gate_up": gate = x @ w_gate, up = x @ w_up, out h = silu(gate) * up (refs x, w_gate, w_up, h, gate,
      up): x read once for both, two accumulators;
    - "dual": out = a @ w_a + b @ w_b (refs a, w_a, b, w_b, out): the SwiGLU input's gradient, one pass;
    - "swiglu_grad": dh = dy @ w, then d gate = dh * up * silu'(gate), d up = dh * silu(gate) (refs dy, w,
      gate, up, d_gate, d_up): the down projection's input gradient through the SwiGLU, dh never written.
    """
    g, owned = group_ref[...], owned_ref[...]
    block_m, block_o = refs[-1].shape
    outs = pl.ds(pl.program_id(1) * block_o, block_o)
    c_axis, o_axis = ("n", "k") if transpose_rhs else ("k", "n")
    group = jnp.minimum(g, num_groups - 1)

    def product(x, w_ref, order, cs):
        index = {c_axis: cs, o_axis: outs}
        # the loaded [bc, bo] block, or [bo, bc] where the weights hold the output axis first
        dims = NN if order.replace("g", "").index(c_axis) == 0 else NT
        return dot(x, w_ref[_weight_index(order, group, index["k"], index["n"])], dims)

    if mode == "gate_up":
        x_ref, wg_ref, wu_ref = refs[:3]
        lhs = [(x_ref, wg_ref, orders[0]), (x_ref, wu_ref, orders[1])]
    elif mode == "dual":
        a_ref, wa_ref, b_ref, wb_ref = refs[:4]
        lhs = [(a_ref, wa_ref, orders[0]), (b_ref, wb_ref, orders[1])]
    else:
        lhs = [(refs[0], refs[1], orders[0])]
    separate = mode == "gate_up"

    def step(i, accs):
        cs = pl.ds(i * block_c, block_c)
        loaded = {}
        terms = []
        for x_ref, w_ref, order in lhs:
            if id(x_ref) not in loaded:
                loaded[id(x_ref)] = x_ref[:, cs]  # [bm, bc]
            terms.append(product(loaded[id(x_ref)], w_ref, order, cs))
        if separate:
            return tuple(acc + t for acc, t in zip(accs, terms, strict=True))
        return (accs[0] + sum(terms[1:], terms[0]),)

    zeros = jnp.zeros((block_m, block_o), jnp.float32)
    steps = (g < num_groups).astype(jnp.int32) * (contracted // block_c)  # inactive tile: no step
    accs = lax.fori_loop(jnp.int32(0), steps, step, (zeros,) * (2 if separate else 1))
    keep = lax.broadcasted_iota(jnp.int32, (block_m, block_o), 0) < owned

    def store(ref, value):
        ref[...] = jnp.where(keep, value, 0.0).astype(ref.dtype)

    if mode == "gate_up":
        h_ref, gate_ref, up_ref = refs[3:]
        gate, up = accs
        store(gate_ref, gate)
        store(up_ref, up)
        store(h_ref, jax.nn.silu(gate.astype(gate_ref.dtype).astype(jnp.float32))
              * up.astype(up_ref.dtype).astype(jnp.float32))
    elif mode == "swiglu_grad":
        gate_ref, up_ref, dgate_ref, dup_ref = refs[2:]
        gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
        dh = accs[0].astype(dgate_ref.dtype).astype(jnp.float32)
        sig = jax.nn.sigmoid(gate)
        store(dgate_ref, dh * up * sig * (1 + gate * (1 - sig)))
        store(dup_ref, dh * gate * sig)
    else:
        store(refs[-1], accs[0])


def _weight_grad_kernel(first_ref, count_ref, size_ref, x_ref, dy_ref, o_ref, *, block_m: int, block_k: int,
                        block_n: int, transposed: bool):
    """One [block_k, block_n] tile of dw[g]: x.T @ dy over the row tiles of group g (written as its
    transpose where the weights hold n before k)."""
    first, count, size = first_ref[...], count_ref[...], size_ref[...]
    k0, n0 = pl.program_id(1) * block_k, pl.program_id(2) * block_n

    def step(i, acc):
        rows = pl.ds((first + i) * block_m, block_m)
        keep = lax.broadcasted_iota(jnp.int32, (block_m, 1), 0) < size - i * block_m
        x = jnp.where(keep, x_ref[rows, pl.ds(k0, block_k)], 0)
        dy = jnp.where(keep, dy_ref[rows, pl.ds(n0, block_n)], 0)
        if transposed:
            return acc + dot(dy, x, TN)
        return acc + dot(x, dy, TN)

    shape = (block_n, block_k) if transposed else (block_k, block_n)
    acc = lax.fori_loop(jnp.int32(0), count.astype(jnp.int32), step, jnp.zeros(shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _sizes(w: jax.Array, order: str) -> dict[str, int]:
    return dict(zip(order, w.shape, strict=True))


def _tiles(mode: str, lhs: tuple[jax.Array, ...], weights: tuple[jax.Array, ...], layout: GroupLayout,
           blocks: GroupedBlockSizes, interpret: bool, transpose_rhs: bool, orders: tuple[str, ...], name: str,
           extra: tuple[jax.Array, ...] = (), outputs: int = 1) -> jax.Array | list[jax.Array]:
    """`_tile_kernel` over every row tile and output column block: lhs [M, C] each, weights one [G, K, N]
    a product (axes in `orders`), `extra` [M, O] inputs read by the tile (swiglu_grad's gate and up)."""
    m, c = lhs[0].shape
    size = _sizes(weights[0], orders[0])
    out_dim = size["k"] if transpose_rhs else size["n"]
    for x, w, order in zip(lhs, weights, orders, strict=True):
        got = _sizes(w, order)
        if x.shape != (m, c) or c != (got["n"] if transpose_rhs else got["k"]):
            raise ValueError(f"grouped_matmul: x {x.shape} does not contract with w {w.shape} (axes {order!r})"
                             f"{' transposed' if transpose_rhs else ''}")
    accumulators = 2 if mode == "gate_up" else 1  # two accumulators: half the columns a tile (registers)
    bm, bc = layout.tile, blocks.fit(c, "block_k")
    bn = blocks.fit(out_dim, "block_n")
    bn = max(MIN_BLOCK, bn // accumulators) if out_dim % max(MIN_BLOCK, bn // accumulators) == 0 else bn
    group, owned = layout.tile_groups()
    scalar = pl.BlockSpec((None,), lambda t, j: (t,))
    rows = pl.BlockSpec((bm, c), lambda t, j: (t, 0))
    tile = pl.BlockSpec((bm, bn), lambda t, j: (t, j))
    in_specs = [scalar, scalar]
    args = [group, owned]
    for x, w in zip(lhs, weights, strict=True):
        if mode == "gate_up" and len(args) > 2:  # x once, then its second weights
            in_specs.append(pl.no_block_spec)
            args.append(w)
            continue
        in_specs += [rows, pl.no_block_spec]
        args += [x, w]
    in_specs += [tile] * len(extra)
    args += list(extra)
    per_step = (bm + bn * len(weights)) * bc * lhs[0].dtype.itemsize * (1 if mode == "gate_up" else len(lhs))
    out = pl.pallas_call(
        functools.partial(_tile_kernel, mode=mode, contracted=c, block_c=bc, num_groups=size["g"],
                          transpose_rhs=transpose_rhs, orders=orders),
        grid=(m // bm, out_dim // bn),
        in_specs=in_specs,
        out_specs=[tile] * outputs,
        out_shape=[jax.ShapeDtypeStruct((m, out_dim), lhs[0].dtype)] * outputs,
        compiler_params=blocks.params(per_step),
        interpret=interpret,
        name=name,
    )(*args)
    return out if outputs > 1 else out[0]


def _matmul(x: jax.Array, w: jax.Array, layout: GroupLayout, blocks: GroupedBlockSizes, interpret: bool,
            transpose_rhs: bool, order: str, name: str) -> jax.Array:
    return _tiles("one", (x,), (w,), layout, blocks, interpret, transpose_rhs, (order,), name)


def _weight_grad(x: jax.Array, dy: jax.Array, w_shape: tuple[int, ...], layout: GroupLayout,
                 blocks: GroupedBlockSizes, interpret: bool, order: str, name: str) -> jax.Array:
    k, n = x.shape[1], dy.shape[1]
    g, bm = layout.num_groups, layout.tile
    bk, bn = blocks.fit(k, "block_k"), blocks.fit(n, "block_n")
    block = {"g": None, "k": bk, "n": bn}
    scalar = pl.BlockSpec((None,), lambda e, i, j: (e,))
    transposed = order.replace("g", "") == "nk"
    return pl.pallas_call(
        functools.partial(_weight_grad_kernel, block_m=bm, block_k=bk, block_n=bn, transposed=transposed),
        grid=(g, k // bk, n // bn),
        in_specs=[scalar, scalar, scalar, pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.BlockSpec(tuple(block[a] for a in order), lambda e, i, j: _weight_index(order, e, i, j)),
        out_shape=jax.ShapeDtypeStruct(w_shape, x.dtype),
        compiler_params=blocks.params(bm * (bk + bn) * x.dtype.itemsize),
        interpret=interpret,
        name=name,
    )(layout.starts // bm, (layout.sizes + bm - 1) // bm, layout.sizes, x, dy)


# ---------------------------------------------------------------------------------------------
# The public function.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    blocks: GroupedBlockSizes
    interpret: bool
    expected_rows: int  # rows the caller expects the groups to hold (the kernel model's price)
    order: str  # the weights' axes, a permutation of "gkn"

    def name(self, kernel: str) -> str:
        """`kernel` with its tiles and the rows it is expected to compute (`plan.kernel_model.grouped_matmul_price`)."""
        return f"{kernel}_m{self.blocks.block_m}w{self.blocks.num_warps}_rows{self.expected_rows}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped(cfg: _Config, x, w, layout):
    return _matmul(x, w, layout, cfg.blocks, cfg.interpret, False, cfg.order, cfg.name("grouped_matmul"))


def _grouped_fwd(cfg, x, w, layout):
    return _grouped(cfg, x, w, layout), (x, w, layout)


def _grouped_bwd(cfg, residuals, dy):
    x, w, layout = residuals
    dy = dy.astype(x.dtype)
    dx = _matmul(dy, w, layout, cfg.blocks, cfg.interpret, True, cfg.order, cfg.name("grouped_matmul_dx"))
    dw = _weight_grad(x, dy, w.shape, layout, cfg.blocks, cfg.interpret, cfg.order, cfg.name("grouped_matmul_dw"))
    zeros = jax.tree.map(lambda a: None, layout)
    return dx, dw.astype(w.dtype), zeros


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, layout: GroupLayout, *, order: str = "gkn",
                   blocks: GroupedBlockSizes | None = None, interpret: bool | None = None,
                   expected_rows: int | None = None) -> jax.Array:
    """out[r] = x[r] @ w[g] for the rows r of each group g of `layout`; 0 for the rows of none.

    Args:
        x: [M, K] rows, laid out as `layout` says (M = layout.rows); bf16, fp16 or float32.
        w: one [K, N] weight matrix a group, G of them, with its axes in `order` (the same dtype as x).
        layout: the groups' rows; its tile is the kernels' block_m.
        order: w's axes, a permutation of "gkn": "gkn" is [G, K, N]; "kgn" ([K, G, N]) and "ngk" take
            the weights as ZeRO-3 gathers them along their model dimension (that dimension first), which
            the kernels then read without a transposed copy.
        blocks: tiles and launch parameters (default: `GroupedBlockSizes.default(layout.tile)`).
        interpret: None: interpret mode when compiling for CPU (`resolve_interpret`).
        expected_rows: the rows the caller expects the groups to hold in all (default M), named in
            the kernels so the kernel model prices them by the work they do (`plan.kernel_model`).

    Returns:
        [M, N] in x's dtype; differentiable in x and w.
    """
    if sorted(order) != ["g", "k", "n"]:
        raise ValueError(f"grouped_matmul: order={order!r} must be a permutation of 'gkn'")
    groups = dict(zip(order, w.shape, strict=False)).get("g")
    if x.ndim != 2 or w.ndim != 3 or x.shape[0] != layout.rows or groups != layout.num_groups:
        raise ValueError(f"grouped_matmul: x [M={layout.rows}, K] and w of axes {order!r} with "
                         f"G={layout.num_groups} expected, got x {x.shape} and w {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_matmul: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    blocks = blocks or GroupedBlockSizes.default(layout.tile)
    if blocks.block_m != layout.tile:
        raise ValueError(f"block_m={blocks.block_m} must be the layout's tile ({layout.tile})")
    cfg = _Config(blocks, resolve_interpret(interpret), expected_rows or layout.rows, order)
    return _grouped(cfg, x, w, layout)


@dataclasses.dataclass(frozen=True)
class _SwigluConfig:
    base: _Config
    orders: tuple[str, str, str]  # the gate's, the up's and the down projection's weight axes


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _swiglu(cfg: _SwigluConfig, x, w_gate, w_up, w_down, layout):
    return _swiglu_fwd(cfg, x, w_gate, w_up, w_down, layout)[0]


def _swiglu_fwd(cfg, x, w_gate, w_up, w_down, layout):
    c = cfg.base
    h, gate, up = _tiles("gate_up", (x, x), (w_gate, w_up), layout, c.blocks, c.interpret, False, cfg.orders[:2],
                         c.name("grouped_swiglu"), outputs=3)
    y = _matmul(h, w_down, layout, c.blocks, c.interpret, False, cfg.orders[2], c.name("grouped_matmul"))
    return y, (x, w_gate, w_up, w_down, h, gate, up, layout)


def _swiglu_bwd(cfg, residuals, dy):
    x, w_gate, w_up, w_down, h, gate, up, layout = residuals
    c = cfg.base
    dy = dy.astype(x.dtype)
    d_gate, d_up = _tiles("swiglu_grad", (dy,), (w_down,), layout, c.blocks, c.interpret, True, cfg.orders[2:],
                          c.name("grouped_swiglu_dx"), extra=(gate, up), outputs=2)
    dx = _tiles("dual", (d_gate, d_up), (w_gate, w_up), layout, c.blocks, c.interpret, True, cfg.orders[:2],
                c.name("grouped_dual_dx"))
    dw = functools.partial(_weight_grad, layout=layout, blocks=c.blocks, interpret=c.interpret,
                           name=c.name("grouped_matmul_dw"))
    pairs = ((x, d_gate, w_gate), (x, d_up, w_up), (h, dy, w_down))
    grads = [dw(a, b, w.shape, order=order).astype(w.dtype) for (a, b, w), order in zip(pairs, cfg.orders, strict=True)]
    return (dx, *grads, jax.tree.map(lambda a: None, layout))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def grouped_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, layout: GroupLayout, *,
                   orders: tuple[str, str, str] = ("gkn", "gkn", "gkn"), blocks: GroupedBlockSizes | None = None,
                   interpret: bool | None = None, expected_rows: int | None = None) -> jax.Array:
    """Each group's SwiGLU on its rows: (silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g], 0 for the rows
    of no group, as five kernels: gate and up in one pass over x (their product written, gate and up kept
    for the backward), the down projection; backward, the down projection's input gradient through the
    SwiGLU in one pass (d gate and d up, its own gradient never written), x's gradient from both in one
    more, and the three weight gradients (`grouped_matmul_dw`). Playbook, "Fused Kernels".

    Args:
        x: [M, D] rows, laid out as `layout` says.
        w_gate, w_up: [G, D, F] (axes in `orders[0]`, `orders[1]`: "gkn", or "kgn" gathered D first).
        w_down: [G, F, D] (axes in `orders[2]`: "gkn", or "ngk").
        layout, blocks, interpret, expected_rows: as `grouped_matmul`'s.

    Returns:
        [M, D] in x's dtype; differentiable in x and the three weights.
    """
    for order in orders:
        if sorted(order) != ["g", "k", "n"]:
            raise ValueError(f"grouped_swiglu: orders={orders!r}: each must be a permutation of 'gkn'")
    if x.ndim != 2 or x.shape[0] != layout.rows:
        raise ValueError(f"grouped_swiglu: x [M={layout.rows}, D] expected, got {x.shape}")
    if not x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype:
        raise ValueError("grouped_swiglu: x and the weights must share a dtype")
    blocks = blocks or GroupedBlockSizes.default(layout.tile)
    if blocks.block_m != layout.tile:
        raise ValueError(f"block_m={blocks.block_m} must be the layout's tile ({layout.tile})")
    cfg = _SwigluConfig(_Config(blocks, resolve_interpret(interpret), expected_rows or layout.rows, orders[0]),
                        tuple(orders))
    return _swiglu(cfg, x, w_gate, w_up, w_down, layout)


def grouped_swiglu_reference(x, w_gate, w_up, w_down, layout: GroupLayout) -> jax.Array:
    """`grouped_swiglu` with `grouped_matmul_reference` ([G, K, N] weights)."""
    hidden = jax.nn.silu(grouped_matmul_reference(x, w_gate, layout)) * grouped_matmul_reference(x, w_up, layout)
    return grouped_matmul_reference(hidden, w_down, layout)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, layout: GroupLayout) -> jax.Array:
    """`grouped_matmul` with `jax.lax.ragged_dot`: each group's tiles as one ragged group (their padding
    rows zeroed), the rows of no group zeroed."""
    valid = layout.valid_rows()[:, None]
    padded = jnp.diff(jnp.append(layout.starts, layout.rows))
    out = lax.ragged_dot(jnp.where(valid, x, 0), w, padded.astype(jnp.int32),
                         preferred_element_type=jnp.float32)
    return jnp.where(valid, out, 0).astype(x.dtype)
