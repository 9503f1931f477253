"""Fused RMSNorm in Pallas (Triton on GPU, interpret mode on CPU).

Playbook, "Fused Kernels": the norm is a chain of point-wise operations on each
token, so one kernel reads a row once, computes its mean square, scales it and
writes it back, instead of one trip to global memory per operation. The
statistics are computed in fp32 whatever the input dtype ("Mixed Precision
Training"). The backward kernel recomputes the row statistic (nothing but x and
the weight is saved), writes dx in the same pass and accumulates the weight
gradient over the rows each program owns; the per-program partial sums are added
at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from meshtrain.pallas_kernels._common import (
    fit_block,
    floor_power_of_two,
    is_power_of_two,
    resolve_interpret,
)


@dataclasses.dataclass(frozen=True)
class RMSNormBlockSizes:
    """Tile sizes of the RMSNorm kernels.

    Attributes:
        block_rows: rows per tile (a power of two dividing the row count).
        max_programs: at most this many backward programs, each owning an equal
            share of the rows and one partial weight gradient.
    """

    block_rows: int = 64
    max_programs: int = 256

    @staticmethod
    def for_shape(rows: int, dim: int) -> RMSNormBlockSizes:
        """Keeps a tile around 16k elements: one row per program for wide models."""
        per_tile = max(1, 16384 // max(dim, 1))
        return RMSNormBlockSizes(block_rows=min(64, floor_power_of_two(per_tile)))

    def fit(self, rows: int, *, user_given: bool) -> RMSNormBlockSizes:
        block = fit_block(
            "block_rows",
            self.block_rows,
            rows,
            "rows",
            minimum=1,
            user_given=user_given,
        )
        if self.max_programs < 1:
            raise ValueError(f"max_programs={self.max_programs} must be >= 1")
        return RMSNormBlockSizes(block_rows=block, max_programs=self.max_programs)


@dataclasses.dataclass(frozen=True)
class _Config:
    eps: float
    dim: int  # true feature size; the tile may be zero-padded to a power of two
    blocks: RMSNormBlockSizes
    interpret: bool


def _normalize(x, dim: int, eps: float):
    """x [rows, D] fp32 -> (x * rsqrt(mean(x^2) + eps), the rsqrt) over the true D."""
    r = lax.rsqrt(jnp.sum(x * x, axis=1) / dim + eps)
    return x * r[:, None], r


def _forward_kernel(x_ref, w_ref, y_ref, *, cfg: _Config):
    x = x_ref[...].astype(jnp.float32)
    x_hat, _ = _normalize(x, cfg.dim, cfg.eps)
    y_ref[...] = (x_hat * w_ref[...].astype(jnp.float32)[None, :]).astype(y_ref.dtype)


def _backward_kernel(x_ref, w_ref, dy_ref, dx_ref, dw_ref, *, cfg: _Config, tiles: int):
    br = cfg.blocks.block_rows
    w = w_ref[...].astype(jnp.float32)

    def body(t, dw):
        rows = pl.ds(t * br, br)
        x_hat, r = _normalize(x_ref[rows, :].astype(jnp.float32), cfg.dim, cfg.eps)
        dy = dy_ref[rows, :].astype(jnp.float32)
        g = dy * w[None, :]
        # d/dx of x * r(x): r * (g - x_hat * mean(g * x_hat)).
        proj = jnp.sum(g * x_hat, axis=1) / cfg.dim
        dx_ref[rows, :] = (r[:, None] * (g - x_hat * proj[:, None])).astype(dx_ref.dtype)
        return dw + jnp.sum(dy * x_hat, axis=0)

    dw_ref[...] = lax.fori_loop(0, tiles, body, jnp.zeros(w.shape, jnp.float32))


def _params(dim: int):
    return plgpu.CompilerParams(num_warps=4 if dim <= 1024 else 8, num_stages=1)


def _forward(cfg: _Config, x, w):
    rows, dim = x.shape
    br = cfg.blocks.block_rows
    return pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        grid=(rows // br,),
        in_specs=[
            pl.BlockSpec((br, dim), lambda i: (i, 0)),
            pl.BlockSpec((dim,), lambda i: (0,)),
        ],
        out_specs=pl.BlockSpec((br, dim), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=_params(dim),
        interpret=cfg.interpret,
        name="rms_norm_forward",
    )(x, w)


def _backward(cfg: _Config, x, w, dy):
    rows, dim = x.shape
    br = cfg.blocks.block_rows
    # A power of two dividing the tile count, so every program owns equal rows.
    programs = math.gcd(rows // br, floor_power_of_two(cfg.blocks.max_programs))
    share = rows // programs
    row_spec = pl.BlockSpec((share, dim), lambda p: (p, 0))
    dx, dw_parts = pl.pallas_call(
        functools.partial(_backward_kernel, cfg=cfg, tiles=share // br),
        grid=(programs,),
        in_specs=[row_spec, pl.BlockSpec((dim,), lambda p: (0,)), row_spec],
        out_specs=[row_spec, pl.BlockSpec((None, dim), lambda p: (p, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((programs, dim), jnp.float32),
        ],
        compiler_params=_params(dim),
        interpret=cfg.interpret,
        name="rms_norm_backward",
    )(x, w, dy.astype(x.dtype))
    return dx, jnp.sum(dw_parts, axis=0).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rms_norm(cfg, x, w):
    return _forward(cfg, x, w)


def _rms_norm_fwd(cfg, x, w):
    return _forward(cfg, x, w), (x, w)


def _rms_norm_bwd(cfg, residuals, dy):
    return _backward(cfg, *residuals, dy)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    block_sizes: RMSNormBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * weight.

    Args:
        x: [..., D] activations, any float dtype.
        weight: [D] scale.
        eps: added to the mean square.
        block_sizes: rows per tile; default chosen from the shape.
        interpret: Pallas interpret mode; None = on CPU only.

    Returns:
        [..., D] in x.dtype, computed in float32. A D that is not a power of two
        is zero-padded to one for the kernel (a copy; powers of two avoid it).

    Raises:
        ValueError: weight is not [D], eps is not positive, or bad block sizes.
    """
    if x.ndim < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"weight shape {list(weight.shape)} must be [{x.shape[-1:]}] (x's last dim)")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    rows = x2.shape[0]
    user_given = block_sizes is not None
    blocks = (block_sizes or RMSNormBlockSizes.for_shape(rows, dim)).fit(rows, user_given=user_given)
    cfg = _Config(eps=float(eps), dim=dim, blocks=blocks, interpret=resolve_interpret(interpret))
    padded = dim if is_power_of_two(dim) else 2 * floor_power_of_two(dim)
    w = weight
    if padded != dim:
        x2 = jnp.pad(x2, ((0, 0), (0, padded - dim)))
        w = jnp.pad(weight, (0, padded - dim))
    y = _rms_norm(cfg, x2, w)
    return y[:, :dim].reshape(x.shape)


def rms_norm_reference(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    """Pure-jnp RMSNorm in float32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)
