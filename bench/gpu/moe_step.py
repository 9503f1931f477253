"""The MoE's grouped matmul kernels and an MoE train step timed on this machine's GPU, beside the kernel
model's price of the same compiled programs.

`python bench/gpu/moe_step.py [--quick] [--out FILE] [--iters N]`

Playbook, "Expert parallelism". Three measurements, each against what `meshtrain.aot`'s kernel model
(`plan.kernel_model`) makes of the compiled program, so that a GPU run replaces the efficiencies the model
assumes for the grouped kernels (`plan.kernel_model.GROUPED_EFFICIENCY`, from public measurements of a similar
kernel, not of these) with measured ones:

1. the grouped matmul kernels (`pallas_kernels.grouped_matmul`: forward, input gradient, weight
   gradient) at Qwen3-30B-A3B's expert shapes (32,768 routed rows a device, 128 experts of
   2,048 x 768) and at Mixtral's (8,192 rows, 8 experts of 4,096 x 14,336), bf16, the rows spread
   evenly: seconds a call, TFLOP/s, share of the bf16 peak; beside them `jax.lax.ragged_dot`'s forward;
2. the kernels' values against `grouped_matmul_reference` (within bf16's rounding);
3. one train step of the Qwen3-30B-A3B shapes on this GPU (2 layers, one sequence of 4,096 tokens,
   dropless, the grouped kernels), measured and modeled.

On a machine without a GPU (or with `--quick`) the same runs at small shapes with the kernels
interpreted, to prove the bench works: its times are the CPU's. Prints a table and one JSON line
(`--out` too).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (name, routed rows, experts, d_model, width)
SHAPES = (("qwen3-30b-a3b", 32768, 128, 2048, 768), ("mixtral-8x7b", 8192, 8, 4096, 14336))
QUICK_SHAPES = (("tiny", 512, 8, 64, 128),)


def _timed(fn, *args, iters: int) -> float:
    """Seconds a call of the jitted `fn`, after one warm-up call (compile), calls queued back to back."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def kernel_rows(name, routed, experts, d, f, iters, on_gpu, peak):
    """The three kernels' and ragged_dot's times at one shape, and the kernels' error against the reference."""
    import jax
    import jax.numpy as jnp

    from meshtrain import moe_dropless
    from meshtrain.pallas_kernels import grouped_matmul as gm

    tile = moe_dropless.kernel_tile(routed, experts)
    sizes = jnp.full((experts,), routed // experts, jnp.int32)
    layout = gm.GroupLayout.pack(sizes, tile, gm.GroupLayout.capacity(routed, experts, tile))
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(kx, (layout.rows, d), jnp.float32)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (experts, d, f), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(kg, (layout.rows, f), jnp.float32).astype(jnp.bfloat16)
    interpret = not on_gpu
    forward = jax.jit(lambda x, w: gm.grouped_matmul(x, w, layout, interpret=interpret))
    _, pullback = jax.vjp(lambda x, w: gm.grouped_matmul(x, w, layout, interpret=interpret), x, w)
    backward = jax.jit(lambda dy: pullback(dy))
    ragged = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, sizes))
    flops = 2.0 * routed * d * f
    rows = []
    for kernel, fn, args, work in (("grouped_matmul", forward, (x, w), flops),
                                   ("grouped_matmul_dx + _dw", backward, (dy,), 2 * flops),
                                   ("ragged_dot (XLA)", ragged, (x[:routed], w), flops)):
        seconds = _timed(fn, *args, iters=iters)
        rows.append({"shape": name, "kernel": kernel, "seconds": seconds, "tflops": work / seconds / 1e12,
                     "share_of_peak": work / seconds / peak if on_gpu else None})
    want = gm.grouped_matmul_reference(x.astype(jnp.float32), w.astype(jnp.float32), layout)
    got = forward(x, w).astype(jnp.float32)
    error = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    return rows, error


def step_row(quick: bool, on_gpu: bool, iters: int):
    """One train step of the Qwen3-30B-A3B shapes on one device (2 layers; --quick: tiny), measured, and the
    kernel model's price of the same compiled step (on a GPU)."""
    import jax

    from meshtrain import cli, config as config_lib, train_step
    from meshtrain.plan import hardware, kernel_model
    from meshtrain.run import Run
    from tests import utils

    c = cli.load_config_file(str(ROOT / "configs" / "mixtral_8x7b.py"))
    shapes = dict(d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128, qk_norm=True, num_experts=128,
                  moe_mlp_dim=768, experts_per_token=8, vocab_size=151936, n_layers=2)
    if quick:
        shapes.update(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, num_experts=8, moe_mlp_dim=32,
                      experts_per_token=2, vocab_size=256)
    c.model.update(shapes)
    c.model.moe_matmul = "pallas"
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = 1
    c.cpu_devices = 0
    c.data.source = "synthetic"
    c.train.update(seq_len=128 if quick else 4096, batch_size=1)
    run = Run.resolve(c, jax.devices()[:1])
    factory, step_fn = train_step.build(run)
    batch = utils.synthetic_batches(c, 1)[0]
    with jax.set_mesh(run.mesh):
        compiled = step_fn.lower(factory.abstract, batch).compile()
        state = factory.create(0)
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(iters):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        seconds = (time.perf_counter() - start) / iters
    modeled = None
    if on_gpu:
        gpu = hardware.get_gpu(_gpu_name(jax.devices()[0]))
        modeled = kernel_model.module_seconds(gpu)(compiled.as_text())
    return {"step": "qwen3-30b-a3b shapes, 2 layers" if not quick else "tiny", "seconds": seconds,
            "modeled_seconds": modeled, "loss": float(metrics["loss"])}


def _gpu_name(device) -> str:
    kind = device.device_kind.lower()
    return "h200" if "h200" in kind else "b200" if "b200" in kind else "a100" if "a100" in kind else "h100"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, kernels interpreted on a CPU")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import jax

    from meshtrain.plan import hardware

    on_gpu = any(d.platform == "gpu" for d in jax.devices()) and not args.quick
    shapes = SHAPES if on_gpu else QUICK_SHAPES
    iters = args.iters if on_gpu else 1
    peak = hardware.get_gpu(_gpu_name(jax.devices()[0])).peak_flops if on_gpu else float("nan")
    rows, errors = [], {}
    print(f"{'shape':<16}{'kernel':<26}{'ms a call':>10}{'TFLOP/s':>9}{'of peak':>9}")
    for shape in shapes:
        found, errors[shape[0]] = kernel_rows(*shape, iters, on_gpu, peak)
        for r in found:
            share = "-" if r["share_of_peak"] is None else f"{r['share_of_peak']:.1%}"
            print(f"{r['shape']:<16}{r['kernel']:<26}{r['seconds'] * 1e3:>10.3f}{r['tflops']:>9.1f}{share:>9}")
        rows += found
    step = step_row(not on_gpu, on_gpu, iters)
    modeled = "-" if step["modeled_seconds"] is None else f"{step['modeled_seconds'] * 1e3:.1f} ms modeled"
    print(f"train step ({step['step']}): {step['seconds'] * 1e3:.1f} ms measured, {modeled}; "
          f"kernel errors vs reference {errors}")
    bad = [name for name, e in errors.items() if not e < 2 ** -6]
    result = {"bench": "moe_step", "gpu": on_gpu, "device": jax.devices()[0].device_kind, "kernels": rows,
              "relative_errors": errors, "step": step, "errors_over_bf16_rounding": bad}
    print(json.dumps(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
