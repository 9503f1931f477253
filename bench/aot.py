"""Llama 3 8B / 70B and Mixtral 8x7B meshes compiled for H100 without a GPU: memory per device, fits or not.

`python bench/aot.py [--quick] [--target h100]` (needs the `gpu` extra: XLA's GPU compiler)

Each mesh of `meshtrain.aot.REFERENCE_MESHES` (the real model shapes, bf16, full remat, ZeRO-3)
goes through `meshtrain.aot`: the compiler's per-device total (arguments + temporaries + outputs not
aliased) beside the planner's, whether it fits the target's usable HBM, the Pallas kernels that are
Triton calls, the asynchronous collectives with compute scheduled beside them, and the compile time.
`--quick` compiles the two smallest (llama3_8b on fsdp=8, with and without the kernels), read back
from the per-user compile cache when the same programs were compiled before (`meshtrain.compile_cache`;
the compile time shown is then the first compile's).

Each row also gives the attention the step runs (`attention.impl=auto` on a GPU: cuDNN's fused
attention) and the step's modeled MFU (`meshtrain.aot`: model FLOPs over the kernel model's step at
the target's peak, communication not included); where cuDNN's attention chooses between its causal
and its packed call (rows of documents), both where they differ: "packed documents / one document a
row". Targets, on packed documents (what pretraining's data path gives): the GPU runbook's 1.5B step on
one H200 (`bench/gpu/mfu.py`'s model, compiled first in every mode) at least 50%, llama3_8b on fsdp=8 at
least 57%; llama3_8b on fsdp=8 in FP8 (`model.matmul_precision=fp8`) a modeled step at most 0.72x the
bf16 row's (`FP8_STEP_TARGET`: about 744 TFLOP/s a GPU). A row that misses its target is marked, the JSON
line says which, and the run exits 1, but for the misses `OPEN` names with their figures (printed as
open). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUICK = ("8b-fsdp8", "8b-fsdp8-kernels")
RUNBOOK = "runbook-1.5b-h200"  # bench/gpu/mfu.py's model and step, one H200
MFU_TARGETS = {RUNBOOK: 0.50, "8b-fsdp8": 0.57}  # checked on packed documents (`modeled_mfu`)
FP8_STEP_TARGET = ("8b-fsdp8-fp8", "8b-fsdp8", 0.72)  # (row, its bf16 row, the most its step may be of that one's)
# targets not met yet, with the figures measured (kernel model, jax 0.10.2); a miss listed here is printed as open
OPEN: dict[str, str] = {
    "8b-fsdp8-fp8": "modeled step 0.6170 s, 0.751x the bf16 row's 0.8220 s, target 0.72x (770 model TFLOP/s a GPU, "
                    "above the 744 the target names, whose bf16 step was 0.8851 s before cuDNN's packed call): "
                    "the FP8 GEMMs take "
                    "266.8 ms (bf16: 508.1), the bf16 head 30.7, attention 165.4 (both as in bf16), the other "
                    "kernels 154 ms against bf16's 118 (quantising each GEMM operand, the amaxes; the output "
                    "gradient of the MLP's gate and up written in bf16, then read back to quantise: 9.7 ms)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--target", default="h100")
    args = parser.parse_args()
    from meshtrain import aot, cli, compile_cache, config as config_lib

    aot.keep_jax_on_cpu()
    if args.quick:  # a smoke run: an earlier compile of the same program is read back
        compile_cache.use_records(compile_cache.records_default())
    names = QUICK if args.quick else tuple(aot.REFERENCE_MESHES)
    rows, start = [], time.perf_counter()
    header = (f"{'mesh':<32} {'devices':>7} {'compiler GiB':>12} {'planner GiB':>11} {'planner/compiler':>16} "
              f"{'fits':>4} {'overlapped':>10} {'kernels':>7} {'attention':>9} {'modeled MFU':>20} {'compile s':>9}")
    print(header, flush=True)
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import mfu

    for name in (RUNBOOK, *names):
        if name == RUNBOOK:
            config_name, devices, target = "bench/gpu/mfu.py", 1, "h200"
            config = mfu.bench_config(False, "bf16", False, "auto")
        else:
            config_name, devices, overrides = aot.REFERENCE_MESHES[name]
            config = cli.apply_overrides(cli.load_config_file(str(ROOT / "configs" / f"{config_name}.py")), overrides)
            target = args.target
        report = aot.compile_report(config, target, devices, sample=None)
        mem, plan = report.step.memory["peak"], report.planner["peak"]
        pairs = sum(c["pairs"] for c in report.step.collectives.values())
        hidden = sum(c["overlapped"] for c in report.step.collectives.values())
        row = {"mesh": name, "config": config_name, "devices": devices, "sizes": report.sizes,
               "compiler_bytes": mem, "planner_bytes": plan, "planner_over_compiler": round(plan / mem, 4),
               "fits": report.fits, "async_pairs": pairs, "overlapped": hidden,
               "triton_kernels": sum(report.step.kernels.values()), "compile_s": round(report.step.compile_seconds, 1),
               "target": target, "attention": config_lib.attention_impl(config, "gpu"),
               "cudnn_calls": sum(report.step.cudnn_attention.values()),
               "modeled_step_s": round(report.step.modeled_seconds, 4),
               "modeled_mfu": round(report.modeled_mfu, 4) if report.modeled_mfu is not None else None,
               "modeled_mfu_one_document": round(report.modeled_mfu_one_document, 4)
               if report.modeled_mfu_one_document is not None else None,
               "mfu_target": MFU_TARGETS.get(name)}
        checked = row["modeled_mfu"]
        row["mfu_target_met"] = None if row["mfu_target"] is None or checked is None else checked >= row["mfu_target"]
        rows.append(row)
        mfu_cell = "-" if row["modeled_mfu"] is None else f"{row['modeled_mfu']:.1%}"
        if row["modeled_mfu_one_document"] and abs(row["modeled_mfu_one_document"] - row["modeled_mfu"]) > 5e-4:
            mfu_cell += f"/{row['modeled_mfu_one_document']:.1%}"
        if row["mfu_target_met"] is not None:
            mfu_cell += f" {'>=' if row['mfu_target_met'] else '<'}{row['mfu_target']:.0%}"
        print(f"{name:<32} {devices:>7} {mem / 2**30:>12.2f} {plan / 2**30:>11.2f} {plan / mem:>16.3f} "
              f"{'yes' if report.fits else 'no':>4} {f'{hidden}/{pairs}':>10} {row['triton_kernels']:>7} "
              f"{row['attention']:>9} {mfu_cell:>20} {row['compile_s']:>9.1f}", flush=True)
    worst = max(abs(r["planner_over_compiler"] - 1) for r in rows)
    print(f"largest planner error {worst:.1%}; {time.perf_counter() - start:.0f} s in all")
    missed = [r["mesh"] for r in rows if r["mfu_target_met"] is False]
    by_name = {r["mesh"]: r for r in rows}
    fp8, bf16, most = FP8_STEP_TARGET
    fp8_ratio = None
    if fp8 in by_name and bf16 in by_name:
        fp8_ratio = round(by_name[fp8]["modeled_step_s"] / by_name[bf16]["modeled_step_s"], 4)
        print(f"FP8 step: {fp8_ratio:.3f}x the bf16 step (target at most {most}x)")
        if fp8_ratio > most:
            missed.append(fp8)
    known = [name for name in missed if name in OPEN]
    for name in known:
        print(f"open: {name}: {OPEN[name]}")
    missed = [name for name in missed if name not in OPEN]
    print(f"modeled targets missed: {', '.join(missed) or 'none'}")
    print(json.dumps({"bench": "aot", "target": args.target, "quick": args.quick, "rows": rows,
                      "largest_planner_error": round(worst, 4), "fp8_over_bf16": fp8_ratio,
                      "targets_open": known, "mfu_targets_missed": missed}))
    if missed:
        sys.exit(1)


if __name__ == "__main__":
    main()
