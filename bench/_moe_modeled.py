"""`python bench/moe.py --modeled [--quick] [--target h100]`: fine-grained MoE steps compiled for H100s.

Playbook, "Expert parallelism". Each row compiles the train step for 8 (or 64) H100s without a GPU
(`meshtrain.aot`: XLA's GPU compiler, the `gpu` extra) at today's MoE shapes, 4 layers (the last two rows:
the whole 48-layer Qwen3-30B-A3B), sequences of
4,096, one sequence a device, full remat, every other key as `configs/mixtral_8x7b.py` sets it
(dropless, ZeRO-3), and prints:

- the kernel model's step and modeled MFU (packed documents / one document a row), the compiler's peak
  per device beside the planner's, the planner's step over the kernel model's;
- the expert exchange read from the compiled step: the most bytes one all-to-all (ragged or not) over
  `expert` can move, over the routed rows it carries (`routed rows x d_model x 2 bytes` a chunk; a
  ragged one moves at most the smaller of its operand and its output), and how many of its start /
  done pairs have compute scheduled between them.

Targets (a row that misses one is marked, and the run exits 1, but for the misses `OPEN` names with their
figures, printed as open): Qwen3-30B-A3B shapes at least 35%
modeled MFU and at most 30 GiB a device under `mesh.expert=8` and `mesh.fsdp=8`; Mixtral 8x7B shapes at
least 45% under `mesh.expert=8`; the whole Qwen3-30B-A3B (`configs/qwen3_30b_a3b.py`, 48 layers) at least
35% within 78 GiB on 8 and 64 H100s; the exchange at most 1.15x the routed rows at expert 8 and 64; the
planner's memory within 10% of the compiler's and its step within 15% of the kernel model's on every
MoE row. `--quick` (CI) compiles the two Qwen3 rows at 8 devices, read back from the compile cache when
unchanged. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3 = {"model.d_model": 2048, "model.n_heads": 32, "model.n_kv_heads": 4, "model.head_dim": 128,
         "model.qk_norm": True, "model.num_experts": 128, "model.moe_mlp_dim": 768, "model.experts_per_token": 8,
         "model.vocab_size": 151936}
STEP = {"model.n_layers": 4, "train.seq_len": 4096, "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
        "mesh.expert": 1}
# name -> (config file, devices, overrides); batch: one sequence of 4,096 tokens a device
ROWS: dict[str, tuple[str, int, dict]] = {
    "qwen3-30b-a3b expert 8": ("mixtral_8x7b", 8, {**QWEN3, **STEP, "mesh.expert": 8, "train.batch_size": 8}),
    "qwen3-30b-a3b fsdp 8": ("mixtral_8x7b", 8, {**QWEN3, **STEP, "mesh.fsdp": 8, "train.batch_size": 8}),
    "mixtral-8x7b expert 8": ("mixtral_8x7b", 8, {**STEP, "mesh.expert": 8, "train.batch_size": 8}),
    "llama3-8b fsdp 8 (dense)": ("llama3_8b", 8, {**STEP, "model.n_layers": 8, "mesh.fsdp": 8,
                                                  "train.batch_size": 8}),
    "qwen3-30b-a3b expert 8 capacity": ("mixtral_8x7b", 8, {**QWEN3, **STEP, "mesh.expert": 8, "train.batch_size": 8,
                                                            "model.moe_dropless": False,
                                                            "model.capacity_factor": 1.25}),
    "qwen3-30b-a3b expert 64": ("mixtral_8x7b", 64, {**QWEN3, **STEP, "mesh.expert": 64, "train.batch_size": 64}),
    # the whole model, as configs/qwen3_30b_a3b.py sets it (48 layers; the fsdp devices own whole experts)
    "qwen3-30b-a3b 48 layers fsdp 8": ("qwen3_30b_a3b", 8, {"mesh.fsdp": 8, "train.batch_size": 8}),
    "qwen3-30b-a3b 48 layers fsdp 64": ("qwen3_30b_a3b", 64, {"mesh.fsdp": 64, "train.batch_size": 64}),
}
QUICK = ("qwen3-30b-a3b expert 8", "qwen3-30b-a3b fsdp 8")
MFU_TARGETS = {"qwen3-30b-a3b expert 8": 0.35, "qwen3-30b-a3b fsdp 8": 0.35, "mixtral-8x7b expert 8": 0.45,
               "qwen3-30b-a3b 48 layers fsdp 8": 0.35, "qwen3-30b-a3b 48 layers fsdp 64": 0.35}
PEAK_TARGETS = {"qwen3-30b-a3b expert 8": 30 * 2**30, "qwen3-30b-a3b fsdp 8": 30 * 2**30,
                "qwen3-30b-a3b 48 layers fsdp 8": 78 * 2**30, "qwen3-30b-a3b 48 layers fsdp 64": 78 * 2**30}
EXCHANGE_TARGET = 1.15  # bytes one exchange can move, over the routed rows it carries
PLANNER_MEMORY, PLANNER_STEP = 0.10, 0.15  # the planner's largest errors on an MoE row
# Targets not met yet, with the figures measured (kernel model, H100, jax 0.10.2 / 0.12.0.1): reported as open
# (`tests/test_moe_gpu.py` holds them as strict expected failures), not counted in the exit status.
OPEN: dict[str, str] = {
    "mixtral-8x7b expert 8": "modeled MFU 39.6% (jax 0.10.2), target 45%: a 115.6 ms step; of the 117.3 ms before "
                             "cuDNN's packed call for rows of documents the grouped kernels took 76.0 (priced at 0.65 "
                             "/ 0.56 of the peak, a Pallas-Triton grouped matmul's public figure at this very shape), "
                             "the optimizer 8.4, the rest of the MoE layers 8.3, attention 7.0, the other GEMMs 6.9",
    "qwen3-30b-a3b 48 layers fsdp 8": "modeled MFU 25.9% (jax 0.10.2), target 35%: a 445.8 ms step (460.8 before "
                                      "cuDNN's packed call); of the 466.6 ms before the dispatch's gradient stopped "
                                      "copying a zero buffer a layer, the grouped kernels took 110.4, the MoE layers' "
                                      "other work 122.9 (the float32 expert weights converted a layer and pass 29, the "
                                      "exchange's zero-filled receive buffers 12, the gathers into and out of the "
                                      "layout and the combine's), attention 83.8, the other GEMMs 49.0, the optimizer "
                                      "41.8",
}


def exchange(compiled, run) -> dict:
    """The expert exchange in the compiled step: its all-to-alls (ragged or not) over the experts' axes
    (`expert`, and `fsdp` where its devices own whole experts), the most bytes one can move over the routed
    rows a chunk carries, and how many have compute beside them."""
    from meshtrain import moe_dropless
    from meshtrain.plan import hlo

    text = compiled.as_text()
    sizes = dict(run.sizes)
    axes = run.rules.split_axes("expert")
    m, expert = run.model, math.prod(sizes[a] for a in axes)
    found = [c for c in hlo.collectives(text, run.mesh.devices.size)
             if c.kind in ("all-to-all", "ragged-all-to-all") and c.groups and len(c.groups[0]) > 1
             and set(axes) & set(hlo.group_axes(c.groups[0], sizes))]
    pairs = [p for p in hlo.async_overlap(text) if p.kind in ("all-to-all", "ragged-all-to-all")]
    tokens = run.config.train.batch_size * run.config.train.seq_len // run.mesh.devices.size
    chunks = moe_dropless.chunks_for(tokens, m.moe_chunks, expert) if m.moe_dropless else 1
    routed = tokens * m.experts_per_token // chunks
    carried = routed * m.d_model * 2  # bf16 rows a chunk routes
    big = [c.result_bytes for c in found if c.result_bytes >= carried // 64]  # not the counts' small ones
    return {"exchanges": len(big), "bytes_over_routed": round(max(big) / carried, 4) if big and expert > 1 else None,
            "pairs": len(pairs), "overlapped": sum(p.overlapped for p in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--target", default="h100")
    args = parser.parse_args()
    from meshtrain import aot, cli, compile_cache

    aot.keep_jax_on_cpu()
    compile_cache.use_records(compile_cache.records_default())
    names = QUICK if args.quick else tuple(ROWS)
    print(f"{'row':<34}{'devices':>8}{'step s':>9}{'MFU packed/one doc':>20}{'peak GiB (planner)':>20}"
          f"{'planner step':>13}{'exchange':>10}{'beside':>8}  missed")
    rows, start = [], time.perf_counter()
    for name in names:
        config_name, devices, overrides = ROWS[name]
        config = cli.apply_overrides(cli.load_config_file(str(ROOT / "configs" / f"{config_name}.py")), overrides)
        seen: dict = {}
        report = aot.compile_report(config, args.target, devices, sample=None,
                                    inspect=lambda compiled, run, seen=seen: seen.update(exchange(compiled, run)))
        peak, planned = report.step.memory["peak"], report.planner["peak"]
        moe = bool(config.model.num_experts)
        row = {"row": name, "devices": devices, "sizes": report.sizes,
               "modeled_step_s": round(report.step.modeled_seconds, 5),
               "modeled_mfu": round(report.modeled_mfu, 4), "modeled_mfu_one_document":
               round(report.modeled_mfu_one_document, 4), "peak_bytes": peak, "planner_peak_bytes": planned,
               "planner_over_compiler": round(planned / peak, 4),
               "planner_step_over_kernel_model": round(report.planner_seconds / report.step.modeled_seconds, 4),
               "compile_s": round(report.step.compile_seconds, 1), **{f"exchange_{k}": v for k, v in seen.items()}}
        missed, known = [], []
        if name in MFU_TARGETS and row["modeled_mfu"] < MFU_TARGETS[name]:
            (known if name in OPEN else missed).append(f"MFU<{MFU_TARGETS[name]:.0%}")
        if name in PEAK_TARGETS and peak > PEAK_TARGETS[name]:
            (known if name in OPEN else missed).append(f"peak>{PEAK_TARGETS[name] / 2**30:.0f}GiB")
        ratio = seen.get("bytes_over_routed")
        if moe and config.model.moe_dropless and ratio is not None and ratio > EXCHANGE_TARGET:
            missed.append(f"exchange>{EXCHANGE_TARGET}x")
        if moe and abs(row["planner_over_compiler"] - 1) > PLANNER_MEMORY:
            missed.append(f"planner memory off>{PLANNER_MEMORY:.0%}")
        if moe and abs(row["planner_step_over_kernel_model"] - 1) > PLANNER_STEP:
            missed.append(f"planner step off>{PLANNER_STEP:.0%}")
        row["missed"], row["open"] = missed, known
        rows.append(row)
        mfu = f"{row['modeled_mfu']:.1%} / {row['modeled_mfu_one_document']:.1%}"
        mem = f"{peak / 2**30:.2f} ({planned / 2**30:.2f})"
        beside = f"{seen.get('overlapped', 0)}/{seen.get('pairs', 0)}"
        print(f"{name:<34}{devices:>8}{row['modeled_step_s']:>9.4f}{mfu:>20}{mem:>20}"
              f"{row['planner_step_over_kernel_model']:>13.3f}{'-' if ratio is None else f'{ratio:.3f}x':>10}"
              f"{beside:>8}  {', '.join(missed + [f'{k} (open)' for k in known]) or '-'}", flush=True)
    failed = [r["row"] for r in rows if r["missed"]]
    for r in rows:
        if r["open"]:
            print(f"open: {r['row']}: {OPEN[r['row']]}")
    print(f"{time.perf_counter() - start:.0f} s; rows missing a target: {', '.join(failed) or 'none'}")
    print(json.dumps({"bench": "moe_modeled", "target": args.target, "quick": args.quick, "rows": rows,
                      "missed": failed, "open": [r["row"] for r in rows if r["open"]]}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
