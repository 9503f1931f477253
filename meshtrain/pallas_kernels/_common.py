"""Helpers shared by the Pallas kernels: backend choice and block-size fitting."""

from __future__ import annotations

import jax


def target_platform() -> str:
    """The platform the program being traced is compiled for: the devices of the mesh in context
    (`jax.set_mesh`), which may be another platform than this host's (an H100 program compiled
    ahead of time on a CPU machine), else JAX's default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means interpret mode when compiling for CPU and compiled Triton anywhere else; the
    target is the mesh's devices (`target_platform`), not the host's."""
    if interpret is None:
        return target_platform() == "cpu"
    return bool(interpret)


def dot_precision(a: jax.Array, b: jax.Array) -> jax.lax.Precision | None:
    """A kernel matmul's precision: float32 operands multiply in full float32 (Triton's "ieee"; its
    default for float32 is TF32, 10 mantissa bits), so a float32 kernel matches its reference to 1e-5 on
    a GPU as in interpret mode; bf16 / FP8 operands use the tensor cores' native precision."""
    if a.dtype == b.dtype == jax.numpy.float32:
        return jax.lax.Precision.HIGHEST
    return None


# dot_general dimension numbers of a kernel's 2-D products
NN = (((1,), (0,)), ((), ()))  # a @ b
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    """A kernel's product of two tiles, accumulated in float32 (`dot_precision`)."""
    return jax.lax.dot_general(a, b, dims, precision=dot_precision(a, b), preferred_element_type=jax.numpy.float32)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def fit_block(
    name: str,
    requested: int,
    dim: int,
    dim_name: str,
    *,
    minimum: int,
    user_given: bool,
) -> int:
    """Returns the power-of-two block size for `dim`, clamped to it.

    A block chosen by default is halved until it divides `dim`; a block given by
    the caller is only clamped, and must then divide `dim`.

    Raises:
        ValueError: the block is not a power of two, is below `minimum`, or does
            not divide `dim`.
    """
    if not is_power_of_two(requested) or requested < minimum:
        raise ValueError(
            f"{name}={requested} must be a power of two >= {minimum} "
            "(Triton tiles are powers of two and tl.dot needs 16)"
        )
    block = min(requested, floor_power_of_two(dim))
    if not user_given:
        while block > minimum and dim % block:
            block //= 2
    if block < minimum or dim % block:
        raise ValueError(
            f"{dim_name}={dim} must be a multiple of {name}={block}, a power of "
            f"two >= {minimum}; pad the input or pass other block sizes"
        )
    return block
