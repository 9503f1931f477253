"""One pipeline stage's branches timed on this machine's GPU, beside the roofline the cost model prices,
and every schedule's modeled step from the measured times.

`python bench/gpu/pipeline_branches.py [--quick] [--stages 4,2] [--shapes NAMES] [--out FILE]`

Playbook, "Pipeline Parallelism". A pipeline of p stages needs p GPUs; on one, what can be measured is
what each stage runs per tick: the branches of `parallel/cost.py` (`stage_branches`: forward, fused
backward, the split's forward, input-gradient and weight-gradient GEMMs), each run on the GPU inside a
device loop as the tick loop runs it (`cost.timed`). The lock-step model (`cost.step_time`: a tick
lasts its slowest stage's branch, plus the transfer unless overlapped) then gives each schedule's step
from those times; the transfer is the link's bandwidth, which one GPU cannot measure. Beside it, the
roofline prices (`BranchCosts.from_compiler`: XLA's FLOPs at the bf16 peak or the branch's bytes at
HBM bandwidth) that `bench/pipeline.py --modeled` and the planner use, and the kernel-by-kernel prices
of the branches' GPU compile (`BranchCosts.from_gpu_compile`, `kernel_model.KernelTimes`, fitted to this
bench's first H200 run): on a GPU with `--kernel_model`, without one where the `gpu` extra is
installed (for the H100). The measured times of a later run check the fit against the same model run
deviceless for that GPU (`bench/pipeline.py --modeled --compiled --gpu h200`).

Shapes: docs/pipeline.md's modeled table (d_model 512, 8 layers, one row of 128 tokens a micro-batch), the
same at 2,048 tokens, and llama3_8b's layer (8 layers, one row of 4,096 tokens); each at p in
`--stages` (p stages of n_layers / p layers); then llama3_8b at p=4 with the Pallas flash attention
kernel (the roofline column prices the einsum attention throughout). On a CPU (or with `--quick`) one
small shape runs, with each attention (the kernel interpreted), to prove the bench works: its times
are the CPU's. Prints a table per shape and one JSON line (`--out`
rewritten after every shape, so a run stopped at a time limit keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshtrain.parallel import schedules  # noqa: E402  (no JAX: the registry is plain Python)

# 1F1B, the baseline, first, then every other registered schedule (circular too: the registry's, not
# `schedules.SCHEDULES`, which holds those with stage orders)
SCHEDULES = (schedules.BASELINE, *(name for name in schedules.REGISTRY if name != schedules.BASELINE))

# (name, model overrides or a configs/ name, tokens a micro-batch, timed loop iterations, attention.impl, stages
# (None: --stages))
SHAPES = (("d512 x 128", {"d_model": 512, "n_layers": 8}, 128, 50, "xla", None),
          ("d512 x 2048", {"d_model": 512, "n_layers": 8}, 2048, 20, "xla", None),
          ("llama3_8b x 4096", "llama3_8b", 4096, 4, "xla", None),
          ("llama3_8b x 4096 flash", "llama3_8b", 4096, 4, "pallas", (4,)))
QUICK = (("d128 x 64 (quick)", {"d_model": 128, "n_layers": 4}, 64, 2, "xla", None),
         ("d128 x 64 flash (quick)", {"d_model": 128, "n_layers": 4}, 64, 1, "pallas", None))


def shape_config(model, tokens: int, p: int, m: int, impl: str = "xla"):
    """A bf16 config of `model` (overrides of the small Llama, or a configs/ name) at p stages, one row
    of `tokens` tokens a micro-batch, attention `impl`."""
    from meshtrain import cli, config as config_lib

    if isinstance(model, str):
        c = cli.load_config_file(str(ROOT / "configs" / f"{model}.py"))
        c.model.n_layers = 8
    else:
        c = config_lib.default_config()
        d = model["d_model"]
        c.model.update(vocab_size=264, n_heads=8, n_kv_heads=4, head_dim=d // 8, mlp_dim=3 * d, **model)
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = 1
    c.mesh.stage = p
    c.model.dtype = "bfloat16"
    c.attention.impl = impl
    c.train.update(batch_size=m, seq_len=tokens)
    # weight_span 2: the W over two micro-batches' records priced too (`modeled_rows` weighs it)
    c.pipeline.update(schedule=schedules.BASELINE, microbatches=m, weight_span=2)
    return c


def gpu_entry(device):
    """The hardware table's GPU for this device (H100 for anything it does not know, a CPU included)."""
    from meshtrain.plan import hardware

    kind = device.device_kind.lower()
    return hardware.get_gpu(next((name for name in hardware.GPUS if name in kind), "h100"))


def modeled_rows(costs, p: int, m: int, layers: int, config) -> dict[str, float]:
    """{schedule (+overlap): modeled step / 1f1b's} for `costs` (interleaved v=2, W in balanced parts), each
    table as the trainer runs it under `config`'s remat and split (W deferred or not; overlapped zero bubble
    over one or two micro-batches, whichever is faster where `costs` prices both: `cost.fastest_split`)."""
    from meshtrain.parallel import cost, pipeline

    base = cost.step_time(schedules.BASELINE, p, m, 1, costs).seconds
    out = {}
    for name in SCHEDULES:
        for overlap in (False, True) if name in pipeline.OVERLAPPING else (False,):
            v = 2 if name in pipeline.CHUNKED_SCHEDULES else 1
            deferred = pipeline.defers_w(config.pipeline.split_backward, config.remat.policy, overlap)
            spans = (1,) if costs.weight_grad_span is None else tuple(sorted({1, pipeline.w_span(
                name, config.pipeline.split_backward, config.remat.policy, overlap, costs.weight_grad_span[0])}))
            *_, executed = cost.fastest_split(name, p, m, 2, costs, layers // (p * v), overlap, deferred, spans)
            out[name + ("+overlap" if overlap else "")] = executed.seconds / base
    return out


def kernel_model(config, sizes, gpu, device, on_gpu: bool = False):
    """The branches priced kernel by kernel from their GPU compile (`cost.BranchCosts.from_gpu_compile`):
    on a GPU only with `on_gpu` (`--kernel_model`: five more compiles a shape, device time the same
    model spends nothing of when run deviceless for that GPU), for the H100 without one where the `gpu`
    extra is installed, else None."""
    from meshtrain import aot
    from meshtrain.parallel import cost
    from meshtrain.plan import kernel_model as kernels

    if device.platform == "gpu":
        if not on_gpu:
            return None
        return cost.BranchCosts.from_gpu_compile(config, sizes, gpu, device,
                                                 module_seconds=kernels.module_seconds(gpu))
    if aot.gpu_compiler_installed():
        return cost.BranchCosts.from_gpu_compile(config, sizes, gpu, aot.target_devices("h100", 1)[0],
                                                 module_seconds=kernels.module_seconds(gpu))
    return None


def write(out: str, device, gpu, quick: bool, results: list) -> str:
    """The JSON line of the results so far, also written to `out` when given."""
    line = json.dumps({"bench": "gpu_pipeline_branches", "device": device.device_kind, "platform": device.platform,
                       "roofline_gpu": gpu.name, "quick": quick, "results": results})
    if out:
        pathlib.Path(out).write_text(line + "\n")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape at p=2 (the CI run; forced on CPU)")
    parser.add_argument("--stages", default="4,2")
    parser.add_argument("--shapes", default="", help="comma-separated subset of: " + ", ".join(s[0] for s in SHAPES))
    parser.add_argument("--out", default="", help="also write the JSON line here")
    parser.add_argument("--kernel_model", action="store_true",
                        help="on a GPU, also price each branch kernel by kernel from its compile for it")
    args = parser.parse_args()
    import jax

    from meshtrain import config as config_lib
    from meshtrain.parallel import cost

    device = jax.devices()[0]
    quick = args.quick or device.platform == "cpu"
    gpu = gpu_entry(device)
    shapes = QUICK if quick else [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    stages = [2] if quick else [int(p) for p in args.stages.split(",")]
    print(f"{device.device_kind} ({device.platform}); roofline of {gpu.name}")
    results = []
    for name, model, tokens, iterations, impl, only in shapes:
        for p in only or stages:
            config = shape_config(model, tokens, p, 16, impl)
            sizes = {**{a: 1 for a in config_lib.MESH_AXES}, "stage": p}
            try:
                roof = cost.BranchCosts.from_compiler(config, sizes, gpu)
                kern = kernel_model(config, sizes, gpu, device, args.kernel_model)
                real = cost.BranchCosts.measured(config, sizes, gpu, device, iterations=iterations)
            except Exception as error:  # noqa: BLE001 - one shape's failure is a result, the others still run
                results.append({"shape": name, "stages": p, "error": f"{type(error).__name__}: {str(error)[:300]}"})
                print(f"{name}, p={p}: {results[-1]['error']}")
                write(args.out, device, gpu, quick, results)
                continue
            layers = config.model.n_layers
            print(f"\n{name} tokens, {layers // p} layers a stage (p={p}): branch seconds of one micro-batch")
            print(f"{'branch':14} {'roofline us':>12} {'kernels us':>11} {'measured us':>12} {'meas/kernels':>12} "
                  f"{'units roof':>10} {'units kern':>10} {'units meas':>10}")
            branches = {}
            for branch in ("forward", "backward", "split_forward", "input_grad", "weight_grad"):
                field = branch if branch != "split_forward" else "forward_split"
                r, t = getattr(roof, field), getattr(real, field)
                k = getattr(kern, field) if kern else float("nan")
                branches[branch] = {"roofline_s": r, "kernels_s": k if kern else None, "measured_s": t}
                print(f"{branch:14} {r * 1e6:12.1f} {k * 1e6:11.1f} {t * 1e6:12.1f} {t / k:12.2f} "
                      f"{r / roof.forward:10.2f} {k / (kern.forward if kern else 1):10.2f} {t / real.forward:10.2f}")
            rows = {}
            models = {"roofline": roof, "kernels": kern, "measured": real}
            for m in (8, 16):
                rows[m] = {name: modeled_rows(c, p, m, layers, config) for name, c in models.items() if c}
            print(f"{'schedule':24} " + " ".join(f"{f'm={m} {name[:4]}':>10}" for m in rows for name in rows[m]))
            for schedule in rows[8]["roofline"]:
                print(f"{schedule:24} " + " ".join(f"{rows[m][name][schedule]:10.3f}"
                                                   for m in rows for name in rows[m]))
            results.append({"shape": name, "attention": impl, "stages": p, "layers_per_stage": layers // p,
                            "branches": branches,
                            "transfer_s": real.transfer, "vs_1f1b": rows})
            write(args.out, device, gpu, quick, results)
    print(write(args.out, device, gpu, quick, results))
    sys.exit(1 if any("error" in r for r in results) else 0)


if __name__ == "__main__":
    main()
