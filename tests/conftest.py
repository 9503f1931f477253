"""Test session setup: 8 fake CPU devices, float32 matmuls, before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compare sharded and unsharded runs at 1e-5: matmuls must be full float32.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "float32")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
