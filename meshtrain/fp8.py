"""FP8 matmuls with delayed per-tensor scaling (playbook, "Mixed Precision Training": "FP8 pretraining").

Under `model.matmul_precision='fp8'` the attention projections and the MLP matmuls (dense,
expert and shared expert) run on FP8 operands: the forward's input and weight in e4m3 (more
mantissa), the backward's output gradient in e5m2 (more range), each tensor with one float32
scale. The embedding, the output head, the norms, attention's softmax and the loss stay in the
compute dtype, as the playbook recommends: those are the operations that lose the most accuracy
in low precision.

Scaling is delayed (Transformer Engine's recipe, and flax's `fp8_ops`): each quantised matmul
keeps an amax history per operand (`[3, H]`: input, kernel, output gradient; newest first) in the
"fp8" variable collection, and the scale of a step comes from the largest amax of the last H
steps: the power of two at or above `amax / fp8_max`, so the largest value lands in the format's
top binade. Before the
first step the history is empty, so that step scales by its own amax: it runs a program of its own
(`ModelConfig.fp8_first_step`, chosen by `train_step.build`'s step); every later step scales from the
histories alone (an operand whose whole history is 0 scales by 1), so the current amaxes are only
recorded and their reductions over the devices hold nothing up (XLA combines them). The current amaxes leave
the step as the cotangent of the history (flax's "overwrite with gradient" idea): the history
enters the differentiated function as flax's `fm32` dtype, whose cotangents combine by `max`
instead of `+`, so a matmul used by several micro-batches records the largest amax of all of them,
exactly what one pass over the whole batch records. `advance` then shifts the history.

Every recorded amax is global: the partitioner all-reduces `max` over the automatic axes, and a
manual region's devices (the accumulation loop's) each record their own, reduced with one `pmax`
per step after the loop (`train_step.accumulate_gradients`), so no collective waits inside the
layers and a sharded run quantises with the same scales as one device. A pipeline's stage loop
does the same per stage (`parallel/pipeline.py`): each stage holds its own layers' histories, every device
of the batch axes records its own amaxes (only in ticks that run a micro-batch, `recorded_if`),
and they are maximised once after the loop (`per_device` under autodiff; the 1F1B and slot-table
loops carry them beside the gradient sums). Only the first step, whose
history is still empty, scales by the current amax of what each device holds.

Each quantised matmul is a dot of the FP8 values themselves, accumulated in float32, with the
two scales applied to its output: forward e4m3 x e4m3, input gradient e5m2 x e4m3, weight gradient
e4m3 x e5m2 (`QuantisedDot`: einsums and the MoE's grouped matmul). XLA's H100 compiler makes each
of them an FP8 GEMM (a Triton GEMM fusion with f8 operands, or cuBLASLt's FP8 call with Triton GEMMs
off); a dot of values dequantised to bf16 first (`convert(f8) * scale`) stays a bf16 GEMM on the
Triton path, its default. The backward keeps the FP8 operands, not bf16 copies. On a CPU the same
dots compute the same FP8-rounded products exactly (float32 accumulation).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import fp8_ops

COLLECTION = "fp8"
E4M3 = jnp.float8_e4m3fn  # forward operands: 4 exponent bits, 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2  # gradients: 5 exponent bits, 2 mantissa bits, max 57344
ROWS = ("input", "kernel", "grad")  # the history's rows

_MAX_COMBINED = fp8_ops.fm32  # float32 whose autodiff accumulation is max (flax's fp8 meta dtype)


def _f32(a: jax.Array) -> jax.Array:
    return jax.lax.convert_element_type(a, jnp.float32) if a.dtype == _MAX_COMBINED else a


def for_grad(tree):
    """The fp8 state as it enters a differentiated function: cotangents then combine by max."""
    return jax.tree.map(lambda a: jax.lax.convert_element_type(a, _MAX_COMBINED), tree)


def from_grad(tree):
    """Cotangents of `for_grad`'s output back in float32 (the newest amaxes in column 0)."""
    return jax.tree.map(_f32, tree)


def amax(a: jax.Array) -> jax.Array:
    """max |a|, float32: over the whole tensor along automatic axes, over this device's part in a
    manual region (reduced after the loop)."""
    return jnp.max(jnp.abs(a)).astype(jnp.float32)


def _varying(a: jax.Array) -> frozenset[str]:
    return jax.typeof(a).manual_axis_type.varying


def scale_for(history: jax.Array, current: jax.Array | None, dtype) -> jax.Array:
    """The scale of one operand: the power of two at or above its history's largest amax (with
    `current`, the current one while the history is empty: the first step) over the format's largest
    value; 1 when that amax is 0 or not finite.

    A power of two (as MXFP8's and DeepSeek-V3's scales are) makes x / scale exact, so quantising
    only rounds the mantissa, and it makes the scale immune to the last bits of the amax: a sharded
    run, whose sums run in another order, quantises with the very scales of one device.
    """
    amax = jnp.max(history)
    if current is not None:
        amax = jnp.where(amax > 0, amax, current)
    mantissa, exponent = jnp.frexp(amax / jnp.float32(jnp.finfo(dtype).max))  # in [2**(e-1), 2**e)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # a power of two is its own bound
    return jnp.where((amax > 0) & jnp.isfinite(amax), jnp.ldexp(jnp.float32(1), exponent), 1.0)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x / scale rounded to `dtype` (e4m3 / e5m2), clipped to its largest value."""
    fmax = jnp.float32(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def quantize_dequantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x rounded to `dtype` at `scale`, back in x's dtype (the value a quantised operand stands for);
    the product is taken in float32, which holds every scale (float16 does not)."""
    return (quantize(x, scale, dtype).astype(jnp.float32) * scale).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Einsum:
    """`jnp.einsum(eqn, a, b)` (the plain matmul), and its FP8 form with both transposes: each a dot
    of FP8 operands accumulated in float32. Every index of an operand must appear in the other
    operand or the output (a matmul's equation), so the transposes are einsums too."""

    eqn: str

    def __call__(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.einsum(self.eqn, a, b)

    def _terms(self, a_ndim: int, b_ndim: int) -> tuple[str, str, str]:
        """(lhs, rhs, out) with an ellipsis spelled out as letters the equation does not use."""
        lhs, rest = self.eqn.replace(" ", "").split(",")
        rhs, out = rest.split("->")
        free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in self.eqn]
        dots = max(a_ndim - len(lhs.replace("...", "")) if "..." in lhs else 0,
                   b_ndim - len(rhs.replace("...", "")) if "..." in rhs else 0)
        fill = "".join(free[:dots])
        lhs, rhs, out = (t.replace("...", fill) for t in (lhs, rhs, out))
        if any(c not in rhs + out for c in lhs) or any(c not in lhs + out for c in rhs) or len(set(lhs)) < len(lhs):
            raise ValueError(f"{self.eqn!r}: not a matmul (an operand index in neither the other operand nor "
                             "the output, or repeated)")
        return lhs, rhs, out

    def f8(self, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
        lhs, rhs, out = self._terms(a.ndim, b.ndim)
        return jnp.einsum(f"{lhs},{rhs}->{out}", a, b, preferred_element_type=out_dtype)

    def f8_lhs_grad(self, g: jax.Array, b: jax.Array, a_ndim: int, out_dtype) -> jax.Array:
        lhs, rhs, out = self._terms(a_ndim, b.ndim)
        return jnp.einsum(f"{out},{rhs}->{lhs}", g, b, preferred_element_type=out_dtype)

    def f8_rhs_grad(self, a: jax.Array, g: jax.Array, b_ndim: int, out_dtype) -> jax.Array:
        lhs, rhs, out = self._terms(a.ndim, b_ndim)
        return jnp.einsum(f"{lhs},{out}->{rhs}", a, g, preferred_element_type=out_dtype)


@dataclasses.dataclass(frozen=True)
class RaggedDot:
    """`jax.lax.ragged_dot(a [M, K], b [G, K, N], group_sizes [G])` (the MoE's grouped matmul: rows
    of a sorted by group), and its FP8 form with both transposes."""

    def __call__(self, a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(a, b, group_sizes)

    def f8(self, a, b, out_dtype, group_sizes):
        return jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=out_dtype)

    def f8_lhs_grad(self, g, b, a_ndim, out_dtype, group_sizes):  # [M, N] x [G, N, K] -> [M, K]
        del a_ndim
        return jax.lax.ragged_dot(g, jnp.swapaxes(b, 1, 2), group_sizes, preferred_element_type=out_dtype)

    def f8_rhs_grad(self, a, g, b_ndim, out_dtype, group_sizes):  # per group a_g^T g_g: [M,K] x [M,N] -> [G,K,N]
        del b_ndim
        dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                 lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
        return jax.lax.ragged_dot_general(a, g, group_sizes, dims, preferred_element_type=out_dtype)


RAGGED_DOT = RaggedDot()


def _accumulated(dtype):
    """The element type an FP8 dot writes (it accumulates in float32 either way): the compute dtype
    when it has float32's exponent range (bf16, float32), so that what a remat policy saves of the
    dot is no larger than the plain matmul's output; float32 for float16, which the unscaled product
    (up to 448^2 x K) would overflow."""
    return dtype if jnp.finfo(dtype).maxexp >= jnp.finfo(jnp.float32).maxexp else jnp.float32


def _scaled(product: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The dot of FP8 values times the product of their (power-of-two) scales, in `dtype`."""
    return (product.astype(jnp.float32) * scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def scaled_dot(dot: Einsum | RaggedDot, first_step: bool, x: jax.Array, w: jax.Array, history: jax.Array,
               *extra) -> jax.Array:
    """dot(x, w, *extra) on e4m3 operands, in x's dtype; its backward takes the output gradient in e5m2.

    `history` [3, H] (float32, or `fm32` under `for_grad`): the amax history of (x, w, grad).
    Its cotangent carries this step's three amaxes in column 0 (-inf elsewhere).
    `first_step`: the histories are empty and each operand scales by its own current amax. Otherwise
    the scales come from the histories alone: the current amaxes are only recorded, so their
    reductions over the devices wait for nothing and XLA combines them into a few per step.
    """
    return _forward(dot, first_step, x, w, history, *extra)[0]


def _forward(dot, first_step, x, w, history, *extra):
    h = _f32(history)
    amax_x, amax_w = amax(x), amax(w)
    sx = scale_for(h[0], amax_x if first_step else None, E4M3)
    sw = scale_for(h[1], amax_w if first_step else None, E4M3)
    xq, wq = quantize(x, sx, E4M3), quantize(w, sw, E4M3)
    y = _scaled(dot.f8(xq, wq, _accumulated(x.dtype), *extra), sx * sw, x.dtype)
    dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))  # what dx and dw come back in (no bytes)
    return y, (xq, wq, sx, sw, amax_x, amax_w, history, dtypes, extra)


def _backward(dot, first_step, residuals, g):
    xq, wq, sx, sw, amax_x, amax_w, history, (x_like, w_like), extra = residuals
    h = _f32(history)
    amax_g = amax(g)
    sg = scale_for(h[2], amax_g if first_step else None, E5M2)
    gq = quantize(g, sg, E5M2)
    dx = _scaled(dot.f8_lhs_grad(gq, wq, xq.ndim, _accumulated(x_like.dtype), *extra), sg * sw, x_like.dtype)
    dw = _scaled(dot.f8_rhs_grad(xq, gq, wq.ndim, _accumulated(w_like.dtype), *extra), sx * sg, w_like.dtype)
    newest = jnp.stack([amax_x, amax_w, amax_g])
    cot = jnp.full(h.shape, -jnp.inf, jnp.float32).at[:, 0].set(newest)
    # The cotangent varies as the history does: inside the accumulation loop the history is each
    # device's own copy (reduced after the loop); a history shared by a region's devices takes their max.
    shared = tuple(sorted(_varying(cot) - _varying(history)))
    if shared:
        cot = jax.lax.pmax(cot, shared)
    missing = tuple(sorted(_varying(history) - _varying(cot)))
    if missing:
        cot = jax.lax.pcast(cot, missing, to="varying")
    cot = jax.lax.convert_element_type(cot, history.dtype)
    return (dx, dw, cot, *(None for _ in extra))


scaled_dot.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def per_device(history: jax.Array, copies: int) -> jax.Array:
    """history [...] -> [copies, ...]: one copy per device of a manual region's batch axes (the
    pipeline's stage loop splits the leading axis over them), each device recording its own amaxes.
    The copies' cotangents combine by max, once, as they leave the region: a partitioner all-reduce
    outside the loop instead of a collective inside it."""
    return jax.lax.broadcast(history, (copies,))


def _per_device_fwd(history, copies):
    return per_device(history, copies), None


def _per_device_bwd(copies, _, cot):
    del copies
    return (jax.lax.convert_element_type(jnp.max(_f32(cot), axis=0), cot.dtype),)


per_device.defvjp(_per_device_fwd, _per_device_bwd)


@jax.custom_vjp
def recorded_if(history: jax.Array, keep: jax.Array) -> jax.Array:
    """The history, whose cotangent (the amaxes of the matmuls that use it) counts only when `keep`:
    a pipeline tick that runs a stage on no micro-batch (the bubble) records nothing."""
    return history


def _recorded_if_fwd(history, keep):
    return history, keep


def _recorded_if_bwd(keep, cot):
    kept = jnp.where(keep, _f32(cot), -jnp.inf)
    return jax.lax.convert_element_type(kept, cot.dtype), None


recorded_if.defvjp(_recorded_if_fwd, _recorded_if_bwd)


def advance(history: jax.Array, cotangent: jax.Array) -> jax.Array:
    """The history after a step: the step's amaxes (cotangent column 0) in front, the oldest
    dropped. A row with no finite amax (a matmul the step did not differentiate) stays as it was."""
    newest = cotangent[..., :1]
    shifted = jnp.concatenate([newest, history[..., :-1]], axis=-1)
    return jnp.where(jnp.isfinite(newest), shifted, history)


def einsum_dot(eqn: str) -> Einsum:
    """The matmul `eqn` as a `scaled_dot` argument (also callable as the plain einsum)."""
    return Einsum(eqn)


def history(module: nn.Module, name: str, length: int) -> jax.Array:
    """The [3, length] amax history variable `name` of `module` (zeros: no step seen yet)."""
    return module.variable(COLLECTION, name, jnp.zeros, (len(ROWS), length), jnp.float32).value


def einsum(module: nn.Module, name: str, eqn: str, x: jax.Array, w: jax.Array, length: int) -> jax.Array:
    """jnp.einsum(eqn, x, w) through `scaled_dot`, with `module`'s history `name`."""
    return scaled_dot(einsum_dot(eqn), module.cfg.fp8_first_step, x, w, history(module, name, length))


# The split backward of zero bubble (`parallel/pipeline_tables.py`): which collections a matmul reads.
SPLIT_INPUTS = "split_inputs"  # mutable: each matmul records its input (the forward); given: W reads them
SPLIT_PROBES = "split_probes"  # given: B's zeros added to each matmul's output (their cotangents are its dy)
SPLIT_OUTPUTS = "split_outputs"  # mutable: each matmul records its output (W, and the probes' shapes)
# given: zeros of each matmul input's shape, whose cotangent is the input itself (`tap`): B's pullback
# returns the inputs W reads, from the forward it rebuilds under full remat, instead of F keeping them
SPLIT_TAPS = "split_taps"


@jax.custom_vjp
def tap(x: jax.Array, t: jax.Array) -> jax.Array:
    """x, unchanged; the cotangent of `t` (zeros of x's shape) is x: a pullback through it returns the
    value x had in the forward it ran (or rebuilt) as t's gradient."""
    return x


def _tap_fwd(x, t):
    return x, x


def _tap_bwd(x, ct):
    return ct, x


tap.defvjp(_tap_fwd, _tap_bwd)


def matmul(module: nn.Module, name: str, collective: Callable | None = None) -> Callable:
    """The einsum of `module`'s matmul `name`: `einsum` above (its amax history `name`) under
    `model.matmul_precision='fp8'`, else `jnp.einsum` in the compute dtype.

    Under the split backward it also plays its part in B and W (playbook, "Zero Bubble"): with
    `SPLIT_PROBES` given (B's forward) the weight is a constant, so the pullback computes input
    gradients only, and the probe added to the output receives the output gradient dy; with
    `SPLIT_INPUTS` mutable the input is recorded for W (or, `SPLIT_TAPS` given, returned by B's
    pullback as the taps' gradients); with `SPLIT_INPUTS` given (W) the matmul
    runs on the recorded input, so its weight gradient is the one GEMM x^T dy and nothing else of
    the layer is live.

    `collective`: this matmul in pieces beside its collective (`collective_matmul.py`), used under
    `model.collective_matmul` with sequence parallelism."""
    cfg = module.cfg
    base = jnp.einsum if cfg.matmul_precision != "fp8" else functools.partial(einsum, module, name,
                                                                                length=cfg.fp8_history)
    if collective is not None and cfg.collective_matmul and cfg.sequence_parallel:
        base = collective  # `collective_matmul.py` (bf16 only: validated)

    def run(eqn: str, x: jax.Array, w: jax.Array) -> jax.Array:
        if module.is_mutable_collection(SPLIT_INPUTS):
            module.sow(SPLIT_INPUTS, name, x)
        elif module.has_variable(SPLIT_INPUTS, name):  # W
            x = module.get_variable(SPLIT_INPUTS, name)[0]
        elif module.has_variable(SPLIT_TAPS, name):  # B's forward, the inputs from its pullback
            x = tap(x, module.get_variable(SPLIT_TAPS, name)[0])
        if module.has_variable(SPLIT_PROBES, name):  # B's forward
            y = base(eqn, x, jax.lax.stop_gradient(w)) + module.get_variable(SPLIT_PROBES, name)[0]
        else:
            y = base(eqn, x, w)
        if module.is_mutable_collection(SPLIT_OUTPUTS):
            module.sow(SPLIT_OUTPUTS, name, y)
        return y

    return run
