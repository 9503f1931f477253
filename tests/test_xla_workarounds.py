"""The smallest programs that abort XLA:CPU in bfloat16, and the workaround that compiles them.

Each program is a bfloat16 all-reduce inside a `jax.shard_map` that is manual over only some of
the mesh's axes (here `data` of a data x expert mesh), reached the three ways meshtrain reaches
it (see `mesh.compiler_options`):

* `psum`: an explicit psum (the MoE router statistics, the pipeline's summed outputs);
* `vma_grad`: autodiff of a check_vma=True shard_map where a replicated weight meets per-device
  rows: the transpose psums the weight's cotangent (MoE expert weights, pipeline inputs);
* `unchecked_grad`: autodiff of a check_vma=False shard_map with a replicated input: its
  cotangent is psummed at the boundary (the Pallas kernel wrappers, e.g. the fused loss's head).

With `mesh.compiler_options` each compiles and equals its float32 twin exactly (small integers
are exact in bf16); without it each still aborts the process (run in a child process), so the
workaround is known to be needed for as long as this test passes.

Run one program alone: `python tests/test_xla_workarounds.py PROGRAM [--no-workaround]`.
"""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

PROGRAMS = ("psum", "vma_grad", "unchecked_grad")


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def program(name: str, mesh: jax.sharding.Mesh):
    """(function, arguments as float32) of the named program; the function runs on `mesh`."""
    x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) % 7  # rows split over `data`
    w = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4) % 5  # replicated
    if name == "psum":
        fn = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P(),
                           axis_names={"data"}, check_vma=True)
        return fn, (x,)

    def loss(x, w):
        return jnp.sum(jnp.einsum("bd,df->bf", x, w).astype(jnp.float32))

    if name == "vma_grad":
        return jax.shard_map(jax.grad(loss, argnums=1), mesh=mesh, in_specs=(P("data"), P()), out_specs=P(),
                             axis_names={"data"}, check_vma=True), (x, w)
    # check_vma=False: differentiating from outside psums the replicated w's cotangent at the boundary.
    rows = jax.shard_map(lambda x, w: jnp.einsum("bd,df->bf", x, w), mesh=mesh, in_specs=(P("data"), P()),
                         out_specs=P("data"), axis_names={"data"}, check_vma=False)
    return jax.grad(lambda x, w: jnp.sum(rows(x, w).astype(jnp.float32)), argnums=1), (x, w)


def run(name: str, dtype, options: dict[str, str]) -> np.ndarray:
    mesh = _mesh()
    fn, args = program(name, mesh)
    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(fn, compiler_options=options)(*(a.astype(dtype) for a in args)), np.float32)


def test_workaround_is_in_the_cpu_compiler_options():
    from meshtrain import mesh as mesh_lib

    assert mesh_lib.compiler_options(_mesh()) == mesh_lib.CPU_COMPILER_OPTIONS


@pytest.mark.parametrize("name", PROGRAMS)
def test_bf16_program_compiles_with_the_workaround_and_equals_float32(name):
    from meshtrain import mesh as mesh_lib

    options = mesh_lib.compiler_options(_mesh())
    np.testing.assert_array_equal(run(name, jnp.bfloat16, options), run(name, jnp.float32, {}))


@pytest.mark.slow
@pytest.mark.parametrize("name", PROGRAMS)
def test_bf16_program_still_aborts_without_the_workaround(name):
    """If this fails, XLA no longer needs the workaround: drop `mesh.CPU_COMPILER_OPTIONS`."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, __file__, name, "--no-workaround"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == -6, (result.returncode, result.stderr[-2000:])  # SIGABRT
    assert "Invalid binary instruction opcode copy" in result.stderr


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    from meshtrain import mesh as mesh_lib

    print(run(sys.argv[1], jnp.bfloat16, {} if "--no-workaround" in sys.argv else mesh_lib.compiler_options(_mesh())))
