"""Bytes on the wire: the compiler's bytes per mesh axis against the playbook's minimum.

`python bench/comm.py [--only NAME,...] [--json PATH]` compiles the tiny model's step (float32, 8
fake CPU devices, AOT: nothing runs) for a fixed list of meshes: each axis alone, ZeRO 0-3 with
and without gradient accumulation, TP with and without SP, ring attention, each pipeline
schedule, EP, and mixed meshes. Per mesh and axis it prints the bytes one device sends per step
as counted from the compiled HLO (`plan/hlo.py`), the playbook's minimum, the figures of named
choices and of XLA:CPU's lowering (`plan/ledger.py`), and the ratios, then one JSON line.

`ratio` is compiler / (minimum + choices + cpu figures): the bench fails when a row passes 1.05,
except in the cases listed in OPEN (a known excess, reported with its cause). `vs min` is
compiler / minimum alone. Terms are listed under the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LIMIT = 1.05
ACC4 = {"train.grad_accum_steps": 4, "train.batch_size": 32}
# Cases whose excess is known and not yet removed: reported, not failed.
OPEN: dict[str, str] = {
    "ring zero3 f2": "ZeRO-3 over sequence x fsdp: XLA:CPU reduces the gradient of a (sequence, fsdp)-sharded weight "
                     "by a reduce-scatter over sequence and, inside the layer loop, an all-reduce over fsdp (2x the "
                     "hierarchical reduce-scatter's fsdp bytes); sequence moves 0.78x the ledger's, the total 0.88x",
}

# name, mesh, overrides (dotted keys; "moe": the tiny MoE config)
CASES = [
    ("dp", {"data": 8}, {"train.zero_stage": 0}),
    ("zero0 fsdp", {"fsdp": 8}, {"train.zero_stage": 0}),
    ("zero1", {"fsdp": 8}, {"train.zero_stage": 1}),
    ("zero2", {"fsdp": 8}, {"train.zero_stage": 2}),
    ("zero3", {"fsdp": 8}, {"train.zero_stage": 3}),
    ("zero1 d2", {"fsdp": 4, "data": 2}, {"train.zero_stage": 1}),
    ("zero1 d2 acc4", {"fsdp": 4, "data": 2}, {"train.zero_stage": 1, **ACC4}),
    ("zero2 d2 acc4", {"fsdp": 4, "data": 2}, {"train.zero_stage": 2, **ACC4}),
    ("zero3 d2", {"fsdp": 4, "data": 2}, {"train.zero_stage": 3}),
    ("zero3 d2 acc4", {"fsdp": 4, "data": 2}, {"train.zero_stage": 3, **ACC4}),
    ("tp d2", {"tensor": 4, "data": 2}, {"train.zero_stage": 0}),
    ("tp+sp d2", {"tensor": 4, "data": 2}, {"train.zero_stage": 0, "model.sequence_parallel": True}),
    ("ring d2", {"sequence": 4, "data": 2}, {"train.zero_stage": 0, "attention.impl": "ring"}),
    ("ulysses d2", {"sequence": 4, "data": 2}, {"train.zero_stage": 0, "attention.impl": "ulysses"}),
    ("ulysses tp d2", {"sequence": 2, "tensor": 2, "data": 2}, {"train.zero_stage": 0, "attention.impl": "ulysses"}),
    ("ulysses noremat", {"sequence": 4, "data": 2}, {"train.zero_stage": 0, "attention.impl": "ulysses",
                                                     "remat.policy": "none"}),
    ("ulys2xring d2", {"sequence": 4, "data": 2}, {"train.zero_stage": 0, "attention.impl": "ulysses",
                                                  "attention.ulysses_degree": 2}),
    ("ulys2xring 1f1b", {"stage": 2, "sequence": 4}, {"train.zero_stage": 0, "attention.impl": "ulysses",
                                                     "attention.ulysses_degree": 2, "pipeline.schedule": "1f1b"}),
    ("ring zero1 f2", {"sequence": 4, "fsdp": 2}, {"train.zero_stage": 1, "attention.impl": "ring"}),
    ("ring zero3 f2", {"sequence": 4, "fsdp": 2}, {"train.zero_stage": 3, "attention.impl": "ring"}),
    ("ring zero1 acc4", {"sequence": 4, "fsdp": 2}, {"train.zero_stage": 1, "attention.impl": "ring", **ACC4}),
    ("gpipe d4", {"stage": 2, "data": 4}, {"train.zero_stage": 0, "train.batch_size": 32, "pipeline.microbatches": 8}),
    ("circular d4", {"stage": 2, "data": 4}, {"train.zero_stage": 0, "train.batch_size": 32, "pipeline.microbatches": 8,
                                              "pipeline.schedule": "circular", "pipeline.repeats": 2}),
    ("1f1b d4", {"stage": 2, "data": 4}, {"train.zero_stage": 0, "train.batch_size": 32, "pipeline.microbatches": 8,
                                          "pipeline.schedule": "1f1b"}),
    ("ep", {"expert": 8}, {"moe": True, "train.zero_stage": 0}),
    ("ep d2", {"expert": 4, "data": 2}, {"moe": True, "train.zero_stage": 0}),
    ("3d zero3", {"data": 2, "fsdp": 2, "tensor": 2}, {"train.zero_stage": 3}),
    ("tp ring 1f1b", {"stage": 2, "sequence": 2, "tensor": 2}, {"train.zero_stage": 0, "attention.impl": "ring",
                                                               "pipeline.schedule": "1f1b"}),
    ("ep ring d2", {"expert": 2, "sequence": 2, "data": 2}, {"moe": True, "train.zero_stage": 1,
                                                          "attention.impl": "ring", "model.moe_dropless": True}),
]


def case_config(mesh: dict, overrides: dict):
    from tests.utils import apply_overrides, load_config_file, tiny_config

    overrides = dict(overrides)
    if overrides.pop("moe", False):
        config = load_config_file("tiny_moe")
        config.model.dtype, config.data.source = "float32", "synthetic"
        for axis in config.mesh:
            config.mesh[axis] = mesh.get(axis, 1)
    else:
        config = tiny_config(mesh)
    return apply_overrides(config, overrides)


def measure(name: str, mesh: dict, overrides: dict) -> dict:
    import jax

    from meshtrain.plan import ledger as ledger_lib, verify

    config = case_config(mesh, overrides)
    start = time.perf_counter()
    compiled, run, _ = verify.compile_step(config, jax.devices()[:math.prod(mesh.values())])
    compiler = verify.compiler_bytes(compiled, run)
    ledger = ledger_lib.Ledger.of(config, dict(run.sizes))
    minimum, target = ledger.by_axis(("minimum",)), ledger.by_axis()
    rows = []
    for axis in sorted(set(compiler) | set(target), key=list(run.sizes).index):
        got, least, want = compiler.get(axis, 0.0), minimum.get(axis, 0.0), target.get(axis, 0.0)
        rows.append({"axis": axis, "compiler": got, "minimum": least, "target": want,
                     "ratio": got / want if want else math.inf if got else 1.0,
                     "vs_min": got / least if least else math.inf if got else 1.0})
    terms = [dict(axis=t.axis, kind=t.kind, what=t.what, formula=t.formula, bytes=t.bytes) for t in ledger.terms]
    return {"name": name, "mesh": mesh, "overrides": overrides, "rows": rows, "terms": terms,
            "seconds": time.perf_counter() - start}


def _mib(b: float) -> str:
    return f"{b / 2**20:.3f}"


def table(results: list[dict]) -> str:
    lines = [f"{'mesh':<15} {'axis':<9} {'compiler MiB':>12} {'minimum MiB':>12} {'target MiB':>11} "
             f"{'ratio':>6} {'vs min':>7}"]
    for r in results:
        for row in r["rows"]:
            lines.append(f"{r['name']:<15} {row['axis']:<9} {_mib(row['compiler']):>12} {_mib(row['minimum']):>12} "
                         f"{_mib(row['target']):>11} {row['ratio']:>6.3f} {row['vs_min']:>7.3f}")
    lines.append("")
    lines.append("terms beyond the minimum (choice: a named design choice; cpu: XLA:CPU's lowering):")
    for r in results:
        for t in r["terms"]:
            if t["kind"] != "minimum":
                lines.append(f"  {r['name']:<15} {t['axis']:<9} {t['kind']:<6} {_mib(t['bytes']):>8} MiB  "
                             f"{t['what']}: {t['formula']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--json", default="", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: the dp and zero3 cases")
    args = parser.parse_args()
    if args.quick:
        args.only = args.only or "dp,zero3"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = wanted - {name for name, _, _ in CASES}
    if unknown:
        parser.error(f"--only: unknown case(s) {sorted(unknown)}; known: {[name for name, _, _ in CASES]}")
    results = []
    for name, mesh, overrides in CASES:
        if wanted and name not in wanted:
            continue
        print(f"compiling {name} ...", file=sys.stderr, flush=True)
        results.append(measure(name, mesh, overrides))
    print(table(results))
    for r in results:
        if r["name"] in OPEN:
            print(f"open: {r['name']}: {OPEN[r['name']]}")
    worst = max((row["ratio"] for r in results if r["name"] not in OPEN for row in r["rows"]), default=1.0)
    open_cases = sorted(set(OPEN) & {r["name"] for r in results})
    summary = {"bench": "comm", "limit": LIMIT, "worst_ratio": worst, "open": open_cases,
               "cases": [{"name": r["name"], "mesh": r["mesh"],
                          "axes": {row["axis"]: {k: row[k] for k in ("compiler", "minimum", "target", "ratio")}
                                   for row in r["rows"]}} for r in results]}
    print(json.dumps(summary))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    if worst > LIMIT:
        print(f"FAIL: a row moves {worst:.3f}x its target (limit {LIMIT})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
