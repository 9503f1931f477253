"""Single-device MFU of a ~1B Llama: each attention implementation, bf16 and FP8 matmuls, the Pallas kernels.

`python bench/gpu/mfu.py [--quick] [--steps 10] [--out FILE] [--profile DIR]`

Each variant builds meshtrain's own step (`train_step.build` on a one-device mesh: no parallelism,
so the figure is the kernels and XLA's code, not communication), creates the state, and times
`--steps` steps after two warm-up steps on a fixed synthetic batch (one document a row, so the
`cudnn` variants run cuDNN's causal mask; `cudnn+docs` gives every row 4 documents, cuDNN's masked
call). The variants, in the order they run (a run stopped at its time limit keeps the first):
`auto` (the default config: `attention.impl=auto`), `cudnn`, `cudnn+docs`, `bf16` (einsum attention),
`bf16+kernels` (the Pallas flash attention, fused norm and fused head + loss), `fp8`, `fp8+kernels`
(einsum attention; with the kernels, Pallas). MFU follows the playbook
("Benchmarking thousands of configurations"): model FLOPs per token (`metrics.flops_per_token`)
x tokens/s / the device's peak (`metrics.device_peak_flops`; under FP8 the quantised matmuls'
share counts at the FP8 peak). The model is Llama 3.2 1B's shape (16 layers, d_model 2048, 32 heads,
8 K/V heads of 64, MLP 8192, vocabulary 128256; 1.24B parameters), batch 4 x 4096, remat `full`.

With `--profile DIR` two more steps of each variant are traced (`jax.profiler`, Perfetto and TensorBoard
files under DIR/<variant>) and the JSON gains each device's top operations by summed duration
(`tensorboard.trace_op_times`): where the step's time goes, GEMMs against attention against the rest.

On a CPU (or with `--quick`) the model shrinks to a few layers of width 256 and the kernels run in
interpret mode: the numbers are not MFU, the run proves the bench works. Prints a table and one
JSON line (also written to `--out`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> (matmuls, attention.impl, the fused norm and loss kernels, documents a row)
VARIANTS = {
    "auto": ("bf16", "auto", False, 1),
    "cudnn": ("bf16", "cudnn", False, 1),
    "cudnn+docs": ("bf16", "cudnn", False, 4),
    "bf16": ("bf16", "xla", False, 1),
    "bf16+kernels": ("bf16", "pallas", True, 1),
    "fp8": ("fp8", "xla", False, 1),
    "fp8+kernels": ("fp8", "pallas", True, 1),
}


def bench_config(quick: bool, matmuls: str, kernels: bool, attention: str = ""):
    from meshtrain import config as config_lib

    c = config_lib.default_config()
    c.cpu_devices = 0
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = 1
    c.data.source = "synthetic"
    c.train.zero_stage = 0
    c.remat.policy = "full"
    if quick:
        c.model.update(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=512)
        c.train.update(batch_size=2, seq_len=128)
    else:
        c.model.update(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                       mlp_dim=8192, rope_theta=500000.0)
        c.train.update(batch_size=4, seq_len=4096)
    c.model.matmul_precision = matmuls
    c.attention.impl = attention or ("pallas" if kernels else "xla")
    c.model.fused_norm = c.model.fused_loss = kernels
    return c


def measure(config, steps: int, profile: str = "", documents: int = 1) -> dict:
    import jax
    import numpy as np

    from meshtrain import metrics, train_step
    from meshtrain.run import Run

    run = Run.resolve(config, jax.devices()[:1])
    factory, step = train_step.build(run)
    b, t, v = config.train.batch_size, config.train.seq_len, config.model.vocab_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, v, size=(b, t + 1), dtype=np.int32)
    host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
            "segment_ids": np.repeat(np.arange(1, documents + 1, dtype=np.int32), -(-t // documents))[None, :t]
                           .repeat(b, axis=0),
            "loss_mask": np.ones((b, t), np.float32)}
    batch = {k: jax.device_put(x, run.batch_sharding) for k, x in host.items()}
    start = time.perf_counter()
    with jax.set_mesh(run.mesh):
        state = factory.create(0)
        state, out = step(state, batch)  # compiles
        jax.block_until_ready(out)
        compile_s = time.perf_counter() - start
        state, out = step(state, batch)
        jax.block_until_ready(out)
        start = time.perf_counter()
        for _ in range(steps):
            state, out = step(state, batch)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - start) / steps
        top_ops = None
        if profile:  # two more steps traced, and where their time went
            from meshtrain import tensorboard

            try:  # a failed profile (no CUPTI, say) is reported beside the timing it must not lose
                with jax.profiler.trace(profile, create_perfetto_trace=True):
                    for _ in range(2):
                        state, out = step(state, batch)
                    jax.block_until_ready(out)
                found = tensorboard.trace_op_times(profile, top=15)
                top_ops = {k: v for k, v in found.items() if k.startswith("/device:")} or found
            except Exception as error:  # noqa: BLE001
                top_ops = {"error": [{"name": f"{type(error).__name__}: {str(error)[:200]}", "ms": 0.0, "calls": 0,
                                      "share": 0.0}]}
    tokens_per_s = b * t / seconds
    cfg = run.model
    per_token = metrics.flops_per_token(cfg, t)
    peak = metrics.device_peak_flops(jax.devices()[0], metrics.fp8_flops_per_token(cfg) / per_token)
    return {"attention": run.layout.attention_impl, "step_s": seconds, "tokens_per_s": tokens_per_s,
            "compile_s": compile_s,
            "tflops_per_s": per_token * tokens_per_s / 1e12, "mfu": per_token * tokens_per_s / peak if peak else None,
            "loss": float(out["loss"]), "params": int(sum(x.size for x in jax.tree.leaves(state.params))),
            **({"top_ops": top_ops} if top_ops is not None else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model (the CI run; forced on CPU)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="", help="also write the JSON line here")
    parser.add_argument("--profile", default="", help="trace two more steps of each variant into DIR/<variant> "
                        "(Perfetto and TensorBoard) and add its top operations per device to the JSON")
    parser.add_argument("--variants", default="", help="comma-separated subset of " + ", ".join(VARIANTS))
    args = parser.parse_args()
    import jax

    quick = args.quick or jax.default_backend() == "cpu"
    device = jax.devices()[0]
    rows = {}
    chosen = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    for name in chosen:
        matmuls, attention, kernels, documents = VARIANTS[name]
        if attention == "cudnn" and device.platform != "gpu":
            rows[name] = {"skipped": "cuDNN's attention runs on an NVIDIA GPU"}
            continue
        try:
            profile = str(pathlib.Path(args.profile) / name.replace("+", "_")) if args.profile else ""
            rows[name] = measure(bench_config(quick, matmuls, kernels, attention), 2 if quick else args.steps,
                                 profile, documents)
        except Exception as error:  # noqa: BLE001 - one variant's failure is a result, the others still run
            rows[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        if args.out:  # after every variant, so that a run stopped at its time limit keeps what it measured
            pathlib.Path(args.out).write_text(json.dumps({"bench": "gpu_mfu", "device": device.device_kind,
                                                          "platform": device.platform, "quick": quick,
                                                          "variants": rows}) + "\n")
    print(f"{device.device_kind} ({device.platform}), {'quick model' if quick else 'Llama 3.2 1B shape'}")
    print(f"{'variant':<14} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'compile s':>9}")
    for name, r in rows.items():
        if "error" in r or "skipped" in r:
            print(f"{name:<14} {r.get('error') or 'skipped: ' + r['skipped']}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{name:<14} {r['step_s']:>8.4f} {r['tokens_per_s']:>10,.0f} {r['tflops_per_s']:>8.1f} {mfu:>6} "
              f"{r['compile_s']:>9.1f}")
    for name, r in rows.items():
        for where, ops in r.get("top_ops", {}).items():
            print(f"{name}, {where}: " + "; ".join(f"{o['name'][:60]} {o['share']:.1%}" for o in ops[:8]))
    line = json.dumps({"bench": "gpu_mfu", "device": device.device_kind, "platform": device.platform,
                       "quick": quick, "variants": rows})
    print(line)
    if args.out:
        pathlib.Path(args.out).write_text(line + "\n")
    sys.exit(1 if any("error" in r for r in rows.values()) else 0)


if __name__ == "__main__":
    main()
