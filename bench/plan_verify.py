"""The planner against the compiler for llama3_8b on 8 fake CPU devices (AOT only, nothing allocated).

`python bench/plan_verify.py [--mesh fsdp=8] [--zero 3] [--remat full]`: prints the model-vs-compiler
table (per-device state / temp / peak bytes, bytes sent per mesh axis per step) and the AOT compile time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mesh", default="fsdp=8", help="comma-separated axis=size, the rest 1")
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: 2 layers")
    args = parser.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from meshtrain import config as config_lib
    from meshtrain.plan import verify
    from tests.utils import load_config_file

    config = load_config_file("llama3_8b")
    mesh = {k: int(v) for k, v in (part.split("=") for part in args.mesh.split(","))}
    for axis in config_lib.MESH_AXES:
        config.mesh[axis] = mesh.get(axis, 1)
    config.train.zero_stage, config.remat.policy, config.train.grad_accum_steps = args.zero, args.remat, args.accum
    if args.quick:
        config.model.n_layers = 2
    start = time.perf_counter()
    result = verify.verify(config, jax.devices()[:8])
    print(f"llama3_8b, mesh {args.mesh}, ZeRO-{args.zero}, remat={args.remat}, accumulation {args.accum}, "
          f"batch {config.train.batch_size} x {config.train.seq_len}")
    print(result.table())
    seconds, rss = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"total (build + lower + compile): {seconds:.1f} s; host peak RSS {rss:.2f} GiB")
    print(json.dumps({"bench": "plan_verify", "layers": config.model.n_layers, **result.as_json(),
                      "seconds": round(seconds, 1), "host_rss_gib": round(rss, 2)}))


if __name__ == "__main__":
    main()
