"""`python -m meshtrain.plan --config configs/llama3_8b.py --devices 64 --gpu h100 [--verify [--target h100]] [--json]`.

With a mesh on the command line (`--config.mesh.fsdp=64`) or `--devices` omitted, it models the
configured run; with `--devices N` and no mesh override it searches meshes x ZeRO stage x remat x
gradient accumulation (playbook, "Finding the Best Training Configuration").

`--verify` compiles the chosen step ahead of time and sets the compiler's per-device memory and
per-axis bytes beside the model's: on fake CPU devices by default, or with `--target h100` (any
`meshtrain.aot` target; needs the `gpu` extra) through XLA's GPU compiler for that GPU, the
compiler the memory model is calibrated on.
"""

from __future__ import annotations

import json
import math
import os
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from meshtrain import aot, cli, compile_cache, config as config_lib, durable
from meshtrain.plan import comm, estimate as estimate_lib, goodput as goodput_lib, hardware, memory, verify
from meshtrain.validate import validate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
flags.DEFINE_integer("devices", 0, "Number of accelerators (0: the product of the configured mesh).")
flags.DEFINE_string("gpu", "h100", f"Accelerator: one of {sorted(hardware.GPUS)}.")
flags.DEFINE_integer("devices-per-node", 8, "Accelerators per node (in-node links vs network).")
flags.DEFINE_bool("json", False, "Print one JSON object instead of tables.")
flags.DEFINE_bool("verify", False, "AOT-compile the (chosen) step on fake CPU devices and compare.")
flags.DEFINE_string("target", "", "With --verify: compile for this GPU (meshtrain.aot targets) instead of CPU devices.")
flags.DEFINE_bool("compile_cache", True, "With --target: read back an earlier compile of the same program from the "
                  "per-user compile cache (meshtrain.compile_cache) and keep new ones there.")
flags.DEFINE_string("plot", "", "Write a PNG of the memory breakdown and the ranked candidates.")
flags.DEFINE_integer("top", 10, "Candidates to print when searching.")
flags.DEFINE_bool("goodput", False, "Model the run's goodput at its size (the configured layout, -1 filled from "
                  "--devices): checkpoint intervals that maximise it with two tiers and with the persistent one.")
flags.DEFINE_float("restart_seconds", goodput_lib.RESTART_SECONDS, "With --goodput: seconds a restart takes "
                   "(detection, rescheduling, start-up, compile or cache read).")
flags.DEFINE_float("failures_per_gpu_hour", goodput_lib.LLAMA3_FAILURE_RATE, "With --goodput: unplanned "
                   "interruptions per GPU-hour (default: Llama 3's 405B run).")
flags.DEFINE_float("persistent_bandwidth", goodput_lib.TECTONIC_BANDWIDTH, "With --goodput: bytes/s the job "
                   "writes and reads its persistent checkpoints at (default: Llama 3's file system).")
FLAGS = flags.FLAGS


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def report(est: estimate_lib.Estimate) -> str:
    m = est.memory
    mesh = ", ".join(f"{a}={n}" for a, n in est.run.sizes.items() if n > 1) or "single device"
    lines = [f"mesh {mesh}; ZeRO-{est.run.zero_stage}; remat={est.remat}; grad accumulation {est.run.grad_accum}"
             + (f"; pipeline {est.pipeline}" if est.pipeline else ""),
             f"parameters {memory.num_params(est.run.model):,}",
             "memory per device (GiB): " + ", ".join(f"{k} {_gib(v)}" for k, v in m.items())
             + f"  [usable {_gib(est.usable_bytes)}: {'fits' if est.fits else 'DOES NOT FIT'}]",
             "bytes sent per device per step: " + (", ".join(f"{a} {_gib(b)} GiB" for a, b in est.comm_bytes.items())
                                                   or "none"),
             "exposed communication (s): " + (", ".join(f"{a} {s:.3f}" for a, s in est.comm_seconds.items())
                                              or "none"),
             f"compute {est.compute_seconds:.3f} s, bubble {est.bubble_seconds:.3f} s -> step "
             f"{est.step_seconds:.3f} s, {est.tokens_per_second:,.0f} tokens/s, MFU {est.mfu:.1%}",
             f"limit: {est.limit}"]
    return "\n".join(lines)


def candidates_table(ests: list[estimate_lib.Estimate]) -> str:
    rows = [("#", "mesh", "ZeRO", "remat", "accum", "pipeline", "GiB/dev", "step s", "MFU", "fits", "limit")]
    for i, e in enumerate(ests, 1):
        mesh = ",".join(f"{a[:3]}{n}" for a, n in e.run.sizes.items() if n > 1) or "1"
        schedule = "-"
        if e.pipeline:
            schedule = e.run.pipeline_schedule.removesuffix("_1f1b") \
                + ("+overlap" if e.run.overlap_transfers else "")
        rows.append((str(i), mesh, str(e.run.zero_stage), e.remat, str(e.run.grad_accum), schedule,
                     _gib(e.memory["total"]), f"{e.step_seconds:.3f}", f"{e.mfu:.1%}", "yes" if e.fits else "no",
                     e.limit))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def plot(path: str, chosen: estimate_lib.Estimate, ranked: list[estimate_lib.Estimate]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    parts = [k for k in chosen.memory if k != "total"]
    ax1.bar(parts, [chosen.memory[k] / 2**30 for k in parts], color="tab:blue")
    ax1.axhline(chosen.usable_bytes / 2**30, color="red", ls="--", label="usable HBM")
    ax1.set_ylabel("GiB per device")
    ax1.set_title("memory per device (chosen)")
    ax1.legend()
    ax1.tick_params(axis="x", rotation=30)
    labels = [",".join(f"{a[:3]}{n}" for a, n in e.run.sizes.items() if n > 1) + f" z{e.run.zero_stage} {e.remat}"
              for e in ranked]
    ax2.barh(labels[::-1], [e.mfu for e in ranked][::-1], color=["tab:green" if e.fits else "tab:gray"
                                                                  for e in ranked][::-1])
    ax2.set_xlabel("predicted MFU")
    ax2.set_title("ranked candidates")
    fig.tight_layout()
    with durable.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format=os.path.splitext(path)[1][1:].lower() or "png")


def _mesh_overridden(argv: list[str]) -> bool:
    return any(arg.startswith("--config.mesh.") for arg in argv)


def _progress(candidates: int, seconds: float, done: bool) -> None:
    """The search's progress on stderr (stdout keeps the table or the JSON)."""
    state = "priced" if done else "priced so far"
    print(f"plan: {candidates:,} candidate layouts {state} ({seconds:.0f} s)", file=sys.stderr, flush=True)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str]) -> None:
    config = _CONFIG.value
    if config is None:
        _fail("--config is required (e.g. --config configs/llama3_8b.py)")
    try:
        gpu = hardware.get_gpu(FLAGS.gpu)
    except ValueError as err:
        _fail(str(err))
    per_node = FLAGS["devices-per-node"].value
    searching = FLAGS.devices > 0 and not _mesh_overridden(sys.argv) and not FLAGS.goodput
    out: dict = {}
    try:
        if searching:
            ranked = estimate_lib.search(config, FLAGS.devices, gpu, per_node, progress=_progress)
            if not ranked:
                _fail(f"no valid mesh of {FLAGS.devices} devices for this model and batch "
                      "(check train.batch_size and the head / width divisibility)")
            fitting = [e for e in ranked if e.fits]
            if not fitting:
                smallest = min(ranked, key=lambda e: e.memory["total"])
                _fail(estimate_lib.no_fit_message(smallest, gpu, FLAGS.devices))
            chosen, shown = fitting[0], fitting[:FLAGS.top]
            out = {**chosen.as_json(), "candidates": [e.as_json() for e in shown]}
        else:
            sizes = config_lib.mesh_shape(config, FLAGS.devices) if FLAGS.devices else _configured_sizes(config)
            sizes = validate(config, math.prod(sizes.values()), inputs=False)
            chosen, shown = estimate_lib.estimate(config, sizes, gpu, per_node), []
            out = chosen.as_json()
            if not chosen.fits:
                out["message"] = estimate_lib.no_fit_message(chosen, gpu, math.prod(sizes.values()))
    except ValueError as err:
        _fail(str(err))
    out["gpu"] = gpu.name
    if not FLAGS.json:
        if shown:
            print(candidates_table(shown) + "\n\nchosen:")
        print(report(chosen))
        if "message" in out:
            print(out["message"])
    if FLAGS.goodput:
        out["goodput"] = _goodput(chosen, gpu, per_node, print_table=not FLAGS.json)
    if FLAGS.target and not FLAGS.verify:
        _fail("--target chooses the compiler of --verify: pass --verify too")
    if FLAGS.verify:
        try:
            out["verify"] = _verify(chosen, print_table=not FLAGS.json, target=FLAGS.target,
                                    devices_per_node=per_node)
        except aot.GpuCompilerMissing as error:
            _fail(str(error))
    if FLAGS.plot:
        plot(FLAGS.plot, chosen, shown or [chosen])
    if FLAGS.json:
        print(json.dumps(out, indent=1, default=float))


def _goodput(chosen: estimate_lib.Estimate, gpu: hardware.Gpu, per_node: int, print_table: bool) -> dict:
    """`goodput.best` with two tiers and with the persistent one alone, at the chosen run's step time."""
    for name in ("restart_seconds", "failures_per_gpu_hour", "persistent_bandwidth"):
        if not FLAGS[name].value > 0:
            _fail(f"--{name}={FLAGS[name].value}: must be > 0")
    cluster = goodput_lib.Cluster(math.prod(chosen.run.sizes.values()), gpu.host_bandwidth, gpu.network_bandwidth,
                                  per_node, FLAGS.failures_per_gpu_hour,
                                  goodput_lib.LLAMA3_PLANNED_RATE, FLAGS.restart_seconds, FLAGS.persistent_bandwidth)
    total = goodput_lib.checkpoint_bytes(chosen.run.model)
    plans = {"two tiers": goodput_lib.best(cluster, chosen.step_seconds, total, two_tiers=True),
             "persistent alone": goodput_lib.best(cluster, chosen.step_seconds, total, two_tiers=False)}
    floor = goodput_lib.persistent_floor(cluster, chosen.step_seconds, total)
    if print_table:
        print("\n" + goodput_lib.report(plans, cluster, total, f"a {chosen.step_seconds:.3f} s step", floor))
    return {"checkpoint_bytes": total, "mtbf_seconds": cluster.mtbf, "restart_seconds": cluster.restart_seconds,
            "persistent_bandwidth": cluster.persistent_bandwidth, "persistent_alone_floor_bandwidth": floor,
            **{name: plan.as_json() for name, plan in plans.items()}, "sources": list(goodput_lib.SOURCES)}


def _configured_sizes(config) -> dict[str, int]:
    sizes = {a: int(config.mesh[a]) for a in config_lib.MESH_AXES}
    if -1 in sizes.values():
        _fail("the mesh has a -1 (fill) axis: pass --devices N, or give every mesh axis")
    return sizes


def _verify(chosen: estimate_lib.Estimate, print_table: bool, target: str = "", devices_per_node: int = 8) -> dict:
    """Compile on as many fake CPU devices as the mesh has, or for as many `target` GPUs; JAX must not
    have started yet."""
    n = math.prod(chosen.run.sizes.values())
    config = chosen.config.copy_and_resolve_references()
    with config.unlocked():
        for axis, size in chosen.run.sizes.items():
            config.mesh[axis] = size
    if target:
        aot.target_config(target)  # a clear error for an unknown target before anything starts
        devices = list(aot.target_devices(target, n, devices_per_node))
        compile_cache.use_records(compile_cache.records_default() if FLAGS.compile_cache else None)
        result = verify.verify(config, devices, backend=comm.GPU)
        label = f"model vs the {target} compiler, GPU collective conventions"
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
        result = verify.verify(config, jax.devices()[:n])
        label = "model vs compiler, CPU collective conventions"
    if print_table:
        print(f"\nverify ({label}):\n" + result.table())
    return result.as_json()


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
