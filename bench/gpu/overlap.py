"""Overlap of communication with compute in the compiled step, on the GPUs of this machine.

`python bench/gpu/overlap.py [--config configs/tiny.py] [--mesh fsdp=8] [--zero 3] [--accum 1]`
compiles the configured step for the local GPUs (ahead of time, nothing runs) with meshtrain's GPU
compiler options (`mesh.compiler_options`: latency-hiding scheduler, collective pipeliner,
double-buffered layer loop; eight collectives in flight with a pipeline) and counts, in the
scheduled module, every asynchronous collective start/done pair and the compute (fusions, GEMMs) the
scheduler placed between them. A pair with no compute between is exposed communication. Prints a
table per collective kind and one JSON line. On CPU it runs too and reports no pairs (XLA:CPU runs
collectives synchronously).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--mesh", default="", help="comma-separated axis=size (default: fsdp = every device)")
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--out", default="", help="also write the JSON line here")
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: configs/tiny.py with 2 layers")
    args = parser.parse_args()
    import jax

    from meshtrain import config as config_lib
    from meshtrain.plan import hlo, verify
    from tests.utils import load_config_file

    config = load_config_file(pathlib.Path(args.config).stem)
    if args.quick:
        config.model.n_layers = 2
    mesh = dict(part.split("=") for part in args.mesh.split(",")) if args.mesh else {"fsdp": len(jax.devices())}
    for axis in config_lib.MESH_AXES:
        config.mesh[axis] = int(mesh.get(axis, 1))
    config.data.source = "synthetic"
    config.train.zero_stage, config.train.grad_accum_steps = args.zero, args.accum
    compiled, run, seconds = verify.compile_step(config)
    pairs = hlo.async_overlap(compiled.as_text())
    by_kind = collections.defaultdict(lambda: [0, 0, 0])
    for p in pairs:
        row = by_kind[p.kind]
        row[0] += 1
        row[1] += p.overlapped
        row[2] += p.compute_between
    print(f"{jax.devices()[0].platform}: {len(jax.devices())} devices, mesh {dict(run.sizes)}, "
          f"ZeRO-{args.zero}, accumulation {args.accum}; compiled in {seconds:.1f} s")
    print(f"{'collective':<20} {'async pairs':>11} {'overlapped':>10} {'compute between':>15}")
    for kind, (n, hidden, between) in sorted(by_kind.items()):
        print(f"{kind:<20} {n:>11} {hidden:>10} {between:>15}")
    line = json.dumps({"bench": "gpu_overlap", "platform": jax.devices()[0].platform, "mesh": dict(run.sizes),
                       "pairs": len(pairs), "overlapped": sum(p.overlapped for p in pairs),
                       "by_kind": {k: {"pairs": v[0], "overlapped": v[1], "compute_between": v[2]}
                                   for k, v in by_kind.items()}})
    print(line)
    if args.out:
        pathlib.Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
