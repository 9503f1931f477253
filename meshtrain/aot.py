"""Compile the configured step for a named GPU without one: `python -m meshtrain.aot`.

    python -m meshtrain.aot --config configs/llama3_8b.py --target h100 --devices 8
    python -m meshtrain.aot --config configs/llama3_70b.py --target h100 --devices 64 --config.mesh.fsdp=8

XLA's GPU compiler runs on any host: with the `gpu` extra installed (`jax[cuda12]`: the CUDA PJRT
plugin, ptxas) and JAX kept on the CPU, `jax.experimental.topologies.get_topology_desc` turns a
target description (an XLA `GpuTargetConfig`, shipped in `meshtrain/targets/`) into devices of that
GPU, nodes of `--devices_per_node`. The train step (and the sampling program) jitted over a mesh of
them goes through the real GPU pipeline: the SPMD partitioner, the GEMM rewriter, Triton for the
Pallas kernels and the GEMM fusions, the latency-hiding scheduler. Nothing is allocated and nothing
runs: `memory_analysis()` and the scheduled module are what a pod of that GPU would run.

Printed per device: argument / temporary / output bytes against the planner's figures (playbook,
"Memory usage in Transformers"), the Pallas kernels that are Triton calls (playbook, "Fused
Kernels", "Flash Attention"), the GEMMs and how many run in FP8 ("Mixed Precision Training"),
every asynchronous collective and how many have compute scheduled between start and done
(playbook, "Data Parallelism": overlap), the compile time; then one JSON line.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.resources
import importlib.util
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections

from meshtrain import compile_cache, config as config_lib
from meshtrain.parallel import schedules
from meshtrain.plan import estimate, hardware, hlo, kernel_model, verify

# --target name -> the target description in meshtrain/targets/ (each file says where its numbers come from).
# The names are the planner's GPUs (`plan.hardware.GPUS`), so a target's HBM and the planner's agree.
TARGETS: dict[str, str] = {
    "h100": "h100_sxm.txtpb",
    "h200": "h200_sxm.txtpb",
    "a100": "a100_sxm_80gb.txtpb",
    "b200": "b200.txtpb",
}

# The Pallas kernels, every one on (`attention.impl=pallas`, the fused RMSNorm, the fused head + loss).
KERNELS = {"attention.impl": "pallas", "model.fused_norm": True, "model.fused_loss": True}
# The meshes on which the planner's memory is checked against the H100 compiler's (`bench/aot.py`,
# `tests/test_gpu_aot.py`): name -> (config file in configs/, devices, overrides). The planner's
# per-device total (state + batch + gradients + activations + temporaries) against the compiler's
# (arguments + outputs not aliased + temporaries).
REFERENCE_MESHES: dict[str, tuple[str, int, dict]] = {
    "8b-fsdp8": ("llama3_8b", 8, {"mesh.fsdp": 8, "train.batch_size": 8}),
    "8b-fsdp4-tensor2": ("llama3_8b", 8, {"mesh.fsdp": 4, "mesh.tensor": 2, "train.batch_size": 4}),
    "8b-stage2-fsdp4-zero_bubble-m8": ("llama3_8b", 8, {"mesh.fsdp": 4, "mesh.stage": 2, "train.batch_size": 32,
                                                        "pipeline.schedule": "zero_bubble",
                                                        "pipeline.microbatches": 8}),
    "8b-stage2-fsdp4-zero_bubble-m8-pullback": ("llama3_8b", 8, {"mesh.fsdp": 4, "mesh.stage": 2,
                                                                 "train.batch_size": 32,
                                                                 "pipeline.schedule": "zero_bubble",
                                                                 "pipeline.microbatches": 8,
                                                                 "pipeline.split_backward": "pullback"}),
    # `pipeline.overlap_transfers`: every permute of the tick loop beside compute, at least 80% of the
    # FSDP gathers and reduce-scatters (tests/test_gpu_aot.py asserts it); every schedule that can overlap,
    # interleaved 1F1B (v=2, one layer a chunk) in its alternating ticks (docs/405b.md's 405B command's schedule).
    **{f"8b-stage4-fsdp2-{name}-m8-overlap": ("llama3_8b", 8, {
        "model.n_layers": 8 if entry.chunked else 4, "mesh.fsdp": 2, "mesh.stage": 4,
        "train.batch_size": 16, "pipeline.schedule": name, "pipeline.microbatches": 8,
        "pipeline.repeats": 2 if entry.chunked else 1, "pipeline.overlap_transfers": True})
       for name, entry in schedules.REGISTRY.items() if entry.overlapping},
    "70b-fsdp16-tensor4": ("llama3_70b", 64, {"mesh.fsdp": 16, "mesh.tensor": 4, "train.batch_size": 16}),
    "mixtral-expert8-tensor8": ("mixtral_8x7b", 64, {"mesh.fsdp": 1, "mesh.expert": 8, "mesh.tensor": 8,
                                                     "train.batch_size": 8}),
    "8b-fsdp8-kernels": ("llama3_8b", 8, {"mesh.fsdp": 8, "train.batch_size": 8, **KERNELS}),
    "8b-fsdp8-fp8": ("llama3_8b", 8, {"mesh.fsdp": 8, "train.batch_size": 8, "model.matmul_precision": "fp8"}),
    "8b-fsdp4-sequence2-ring": ("llama3_8b", 8, {"mesh.fsdp": 4, "mesh.sequence": 2, "train.batch_size": 4,
                                                 "attention.impl": "ring"}),
}
GPU_EXTRA = ("compiling for a GPU needs XLA's GPU compiler: pip install -e '.[gpu]' "
             "(jax[cuda12], about 5 GB of wheels with ptxas; no GPU needed)")


class GpuCompilerMissing(RuntimeError):
    """The `gpu` extra (the CUDA plugin with XLA's GPU compiler) is not installed."""


def gpu_compiler_installed() -> bool:
    """Whether JAX's CUDA plugin (the `gpu` extra) is importable."""
    for name in ("jax_plugins.xla_cuda12", "jax_cuda12_plugin"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # no jax_plugins namespace at all
            continue
    return False


def keep_jax_on_cpu() -> None:
    """JAX's own backend stays the host CPU: the CUDA plugin then only compiles (no cuInit, which fails
    without a GPU). Effective before JAX starts its backends; afterwards whatever started stays."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def target_config(target: str) -> str:
    """The `GpuTargetConfig` text of `target` (one of TARGETS)."""
    if target not in TARGETS:
        raise ValueError(f"--target={target}: must be one of {', '.join(sorted(TARGETS))}")
    return importlib.resources.files("meshtrain.targets").joinpath(TARGETS[target]).read_text()


def target_devices(target: str, count: int, devices_per_node: int = 8) -> tuple:
    """`count` devices of `target`, `devices_per_node` to a node (their process_index is the node); what
    is traced after this call asks JAX's cuDNN attention about `target`'s GPU (`answer_compute_capability`,
    on every call: one process compiles for several targets).

    Raises ValueError for a count that does not fill whole nodes and GpuCompilerMissing without the
    `gpu` extra.
    """
    devices = _topology_devices(target, count, devices_per_node)
    answer_compute_capability(target_config(target))
    return devices


@functools.cache
def _topology_devices(target: str, count: int, devices_per_node: int) -> tuple:
    config = target_config(target)
    per_node = min(count, devices_per_node)
    if count < 1 or count % per_node:
        raise ValueError(f"--devices={count}: must be a positive multiple of --devices_per_node={devices_per_node} "
                         "(whole nodes), or at most one node")
    if not gpu_compiler_installed():
        raise GpuCompilerMissing(GPU_EXTRA)
    from jax.experimental import topologies

    keep_jax_on_cpu()
    # a program compiled for devices that are not attached cannot be loaded back from JAX's persistent
    # compilation cache (it warns on every lookup): these compiles skip it
    jax.config.update("jax_enable_compilation_cache", False)
    topology = topologies.get_topology_desc(platform="cuda", topology=f"1x{count // per_node}x{per_node}",
                                            target_config=config)
    return tuple(topology.devices)


_CAPABILITY = re.compile(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)")


def answer_compute_capability(target_config_text: str) -> None:
    """JAX's cuDNN attention asks the attached GPU its compute capability (its packed call needs a Hopper);
    with none attached (JAX on the CPU, compiling for a target) it hears "none" and refuses. Here the answer
    is the target's, as its `GpuTargetConfig` states it; a process with a GPU keeps JAX's own."""
    found = _CAPABILITY.search(target_config_text)
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError:
        return
    if found is None or not hasattr(cudnn, "check_compute_capability") or jax.default_backend() == "gpu":
        return
    target = (int(found.group(1)), int(found.group(2)))

    def check_compute_capability(capability: str) -> bool:
        return target >= tuple(int(x) for x in capability.split("."))
    cudnn.check_compute_capability = check_compute_capability


# --------------------------------------------------------------------------------------------
# What a compiled module holds.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProgramReport:
    """One compiled program on the target: per-device bytes and what the scheduled module holds."""

    compile_seconds: float
    memory: dict[str, int]  # argument, output, alias, temp, peak (per device)
    kernels: dict[str, int]  # Pallas kernel name -> Triton calls in the module
    gemms: int
    fp8_gemms: int
    # kind -> {"pairs", "overlapped"}: instructions; {"runs", "overlapped_runs"}: as often as each runs a
    # step (`plan.hlo.overlap_runs`, a pipeline's switch branches by their share of its ticks)
    collectives: dict[str, dict[str, float]]
    cudnn_attention: dict[str, int] = dataclasses.field(default_factory=dict)  # cuDNN fused-attention target -> calls
    # the program's kernels one after another on one device, priced kernel by kernel (`kernel_model.KernelTimes`):
    # no communication; cuDNN's and the Pallas flash attention by their FLOPs at their measured efficiency
    # (`kernel_model.MEASURED_EFFICIENCY`), the other Pallas kernels by their bytes alone (their FLOPs are not in the
    # module's text); of a conditional (a pipeline tick's `lax.switch`, cuDNN attention's choice between
    # its causal and its document-masked call) the longest branch, as a lock-step tick lasts
    modeled_seconds: float = 0.0
    # the same with cuDNN attention's conditional on its causal call (rows of one document each: the
    # branch the runbook's batches take); equal to `modeled_seconds` where no such conditional exists
    modeled_seconds_one_document: float = 0.0
    top_kernels: list[dict] = dataclasses.field(default_factory=list)  # the most modeled time first
    from_cache: bool = False  # read back from the compile cache (`compile_seconds`: the compile that made it)

    @classmethod
    def of(cls, compiled, seconds: float, gpu: hardware.Gpu | None = None, top: int = 8,
           lockstep=None, branch_weights=None, slot_shares=None) -> ProgramReport:
        """`lockstep`: the pipeline loops' rows of switch branches (`Layout.lockstep_rows`), how the
        kernel model prices its ticks (`plan.kernel_model.kernels`), with each stage's share of its slots that run
        (`Layout.slot_shares`); `branch_weights`: their branches' shares (`Layout.branch_share`), how often
        each branch's collectives run."""
        text = compiled.as_text()
        gemm = kernel_model.gemms(text)
        by_kind: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"pairs": 0, "overlapped": 0})
        for pair in hlo.async_overlap(text):
            by_kind[pair.kind]["pairs"] += 1
            by_kind[pair.kind]["overlapped"] += pair.overlapped
        for kind, (runs, overlapped) in hlo.overlap_runs(text, branch_weights).items():
            by_kind[kind].update(runs=round(runs, 3), overlapped_runs=round(overlapped, 3))
        report = cls(seconds, verify.compiled_memory(compiled), dict(sorted(kernel_model.triton_kernels(text).items())),
                     gemm.total, gemm.fp8, dict(sorted(by_kind.items())),
                     dict(sorted(kernel_model.cudnn_attention_calls(text).items())),
                     from_cache=getattr(compiled, "from_cache", False))
        if gpu is not None:
            times = kernel_model.KERNEL_TIMES
            kernels = kernel_model.kernels(text, price=lambda ks: times.seconds(ks, gpu), lockstep=lockstep,
                                           slot_shares=slot_shares)
            priced = sorted(((times.seconds([k], gpu), k) for k in kernels), key=lambda sk: -sk[0])
            report.modeled_seconds = sum(s for s, _ in priced)
            report.modeled_seconds_one_document = times.seconds(
                kernel_model.kernels(text, price=lambda ks: times.seconds(ks, gpu), attention_branch="shortest",
                                     lockstep=lockstep, slot_shares=slot_shares),
                gpu)
            report.top_kernels = [{"name": k.name, "kind": k.opcode, "runs": k.runs, "seconds": s,
                                   "bytes": k.bytes * k.runs, "flops": k.flops * k.runs} for s, k in priced[:top]]
        return report


@dataclasses.dataclass
class Report:
    """The `meshtrain.aot` result: the train step (and the sampling program) compiled for a target."""

    target: str
    device_kind: str
    devices: int
    devices_per_node: int
    sizes: dict[str, int]
    step: ProgramReport
    planner: dict[str, int]  # the planner's per-device figures for the same step (state, temp, peak)
    usable_bytes: int
    sampling: ProgramReport | None = None
    sampling_note: str = ""
    # model FLOPs per device (`metrics.flops_per_token`, as the training log counts them) over the modeled
    # step, at the target's peak (FP8-weighted under matmul_precision=fp8); None when not priced
    modeled_mfu: float | None = None
    modeled_mfu_one_document: float | None = None  # `modeled_mfu` of `ProgramReport.modeled_seconds_one_document`
    # the planner's compute and pipeline bubble for the same step (`plan.estimate`: what the kernel model's
    # step holds, no communication), seconds
    planner_seconds: float | None = None

    @property
    def fits(self) -> bool:
        return self.step.memory["peak"] <= self.usable_bytes

    def as_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(aot=self.target, fits=self.fits,
                   planner_over_compiler=round(self.planner["peak"] / max(self.step.memory["peak"], 1), 4))
        if self.planner_seconds and self.step.modeled_seconds:
            out["planner_over_kernel_model"] = round(self.planner_seconds / self.step.modeled_seconds, 4)
        return out

    def table(self) -> str:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        mem, plan = self.step.memory, self.planner
        mesh = ", ".join(f"{a}={n}" for a, n in self.sizes.items() if n > 1) or "single device"
        nodes = self.devices // min(self.devices, self.devices_per_node)
        lines = [f"{self.devices} x {self.device_kind} ({self.target}; {nodes} node(s) of "
                 f"{min(self.devices, self.devices_per_node)}), mesh {mesh}",
                 f"train step compiled in {self.step.compile_seconds:.1f} s{_cached(self.step)}",
                 "per device            compiler     planner      planner/compiler"]
        rows = [("arguments", mem["argument"], None), ("temporaries", mem["temp"], plan["temp"]),
                ("outputs not aliased", mem["output"] - mem["alias"], None),
                ("total (peak)", mem["peak"], plan["peak"])]
        for name, c, p in rows:
            ratio = f"{p / c:.3f}" if p is not None and c else ""
            lines.append(f"  {name:<19} {gib(c):>11}  {gib(p) if p is not None else '':>11}  {ratio:>8}")
        lines.append(f"  usable HBM          {gib(self.usable_bytes):>11}  -> "
                     f"{'fits' if self.fits else 'DOES NOT FIT'}")
        if not self.fits:
            lines.append("  to fit: gradient accumulation (--config.train.grad_accum_steps), a smaller batch, the "
                         "Pallas kernels, or more devices; `python -m meshtrain.plan --devices N` searches")
        lines.append(_kernel_line(self.step))
        lines.append(f"GEMMs: {self.step.gemms} ({self.step.fp8_gemms} in FP8)")
        lines.append(_collective_lines(self.step))
        lines.append(_modeled_lines(self.step))
        if self.modeled_mfu is not None:
            lines.append(f"modeled MFU: {self.modeled_mfu:.1%} (model FLOPs a step, as the training log counts them, "
                         "over the modeled step at the target's peak; communication not included)")
            if self.modeled_mfu_one_document and abs(self.modeled_mfu_one_document - self.modeled_mfu) > 5e-4:
                lines.append(f"  {self.modeled_mfu_one_document:.1%} on rows of one document each "
                             f"({self.step.modeled_seconds_one_document:.4f} s: cuDNN's causal call; the figure above "
                             "prices the branch rows of packed documents take: cuDNN's packed call on a Hopper)")
        if self.planner_seconds and self.step.modeled_seconds:
            lines.append(f"planner (`meshtrain.plan`): compute + pipeline bubble {self.planner_seconds:.4f} s, "
                         f"{self.planner_seconds / self.step.modeled_seconds:.3f} of the kernel model's step")
        if self.sampling is not None:
            s = self.sampling
            lines.append(f"sampling program compiled in {s.compile_seconds:.1f} s{_cached(s)}: arguments "
                         f"{gib(s.memory['argument'])}, temporaries {gib(s.memory['temp'])} per device")
        elif self.sampling_note:
            lines.append(f"sampling program: {self.sampling_note}")
        return "\n".join(lines)


def _cached(program: ProgramReport) -> str:
    return " (read back from the compile cache; --nocompile_cache compiles again)" if program.from_cache else ""


def _kernel_line(program: ProgramReport) -> str:
    pallas = ", ".join(f"{k} x{n}" for k, n in program.kernels.items()) or "none"
    cudnn = ", ".join(f"{k.removeprefix('__cudnn$')} x{n}" for k, n in program.cudnn_attention.items()) or "none"
    return f"Pallas kernels as Triton calls: {pallas}\ncuDNN fused attention calls: {cudnn}"


def _modeled_lines(program: ProgramReport) -> str:
    """The step's modeled compute time and the kernels that take the most of it."""
    if not program.top_kernels:
        return "modeled compute: not priced"
    lines = [f"modeled compute per step, kernel by kernel: {program.modeled_seconds:.4f} s (no communication; "
             "attention kernels by their FLOPs at their measured efficiency, the other Pallas kernels by their bytes)",
             "  kernel                                   kind                  runs   share  GB moved   TFLOP"]
    for k in program.top_kernels:
        lines.append(f"  {k['name'][:40]:<40} {k['kind'][:20]:<20} {k['runs']:>6.0f} "
                     f"{k['seconds'] / program.modeled_seconds:7.1%} {k['bytes'] / 1e9:9.2f} {k['flops'] / 1e12:7.2f}")
    return "\n".join(lines)


def _collective_lines(program: ProgramReport) -> str:
    if not program.collectives:
        return "asynchronous collectives: none"
    lines = ["asynchronous collectives   pairs  compute between start and done   runs a step  of them beside compute"]
    for kind, row in program.collectives.items():
        lines.append(f"  {kind:<23} {row['pairs']:>6}  {row['overlapped']:>6}{'':>31}{row['runs']:>11.0f}"
                     f"  {row['overlapped_runs']:>9.0f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Compiling.
# --------------------------------------------------------------------------------------------


def compile_step(config: ml_collections.ConfigDict, target: str, devices: int, devices_per_node: int = 8):
    """(compiled, run, seconds): the configured train step compiled for `devices` x `target`."""
    return verify.compile_step(config, list(target_devices(target, devices, devices_per_node)), inputs=False)


def compile_sampling(run, factory, prompt_len: int, new_tokens: int):
    """(compiled, seconds) of the sampling program (`generate`: prefill + scanned decode) over the step's
    mesh, reading the parameters as training leaves them; one prompt row per data-parallel rank."""
    from meshtrain import generate

    structs = jax.ShapeDtypeStruct((run.data_parallel_size, prompt_len), jnp.int32, sharding=run.batch_sharding)
    start = time.perf_counter()
    with jax.set_mesh(run.mesh):
        program = generate.sampling_program(run.model, run.rules, run.mesh, new_tokens, generate.Sampling())
        lowered = program.lower(factory.abstract.params, structs, structs, structs)
        compiled = compile_cache.compile(lowered, list(run.mesh.devices.flat))
    return compiled, verify.compile_seconds(compiled, time.perf_counter() - start)


def modeled_mfu(run, step: ProgramReport, gpu: hardware.Gpu, seconds: float | None = None) -> float | None:
    """Model FLOPs a device does per step (`metrics.flops_per_token` x the step's tokens / devices) over
    the modeled step (`seconds`, else `ProgramReport.modeled_seconds`), at `gpu`'s peak (FP8-weighted as
    `metrics.device_peak_flops`); None when the step was not priced. Playbook, "Benchmarking thousands
    of configurations" (MFU)."""
    from meshtrain import metrics

    seconds = seconds or step.modeled_seconds
    if not seconds:
        return None
    t = run.config.train.seq_len
    per_token = metrics.flops_per_token(run.model, t)
    peak = metrics.blended_peak(gpu.peak_flops, gpu.peak_fp8_flops, metrics.fp8_flops_per_token(run.model) / per_token)
    return per_token * run.config.train.batch_size * t / run.mesh.devices.size / seconds / peak


def compile_report(config: ml_collections.ConfigDict, target: str, devices: int, devices_per_node: int = 8,
                   sample: tuple[int, int] | None = (128, 64), inspect=None) -> Report:
    """Compiles the configured step (and, with `sample` = (prompt length, new tokens), the sampling
    program) for `devices` x `target` and reads what the modules hold; `inspect(compiled, run)` is
    called with the compiled step first (a benchmark's own reading of its text)."""
    from meshtrain import train_step

    compiled, run, seconds = compile_step(config, target, devices, devices_per_node)
    if inspect is not None:
        inspect(compiled, run)
    gpu = hardware.get_gpu(target)
    step = ProgramReport.of(compiled, seconds, gpu, lockstep=run.layout.lockstep_rows(),
                            branch_weights=run.layout.branch_share(), slot_shares=run.layout.slot_shares())
    del compiled
    planner = verify.model_memory(config, dict(run.sizes), verify.batch_bytes(run))
    planned = estimate.estimate(config, dict(run.sizes), gpu, devices_per_node)
    report = Report(target, run.mesh.devices.flat[0].device_kind, devices, devices_per_node, dict(run.sizes),
                    step, planner, gpu.usable_bytes, modeled_mfu=modeled_mfu(run, step, gpu),
                    modeled_mfu_one_document=modeled_mfu(run, step, gpu, step.modeled_seconds_one_document),
                    planner_seconds=planned.compute_seconds + planned.bubble_seconds)
    if sample is None:
        report.sampling_note = "not compiled (--sample=false)"
    elif run.sizes["stage"] > 1 or run.sizes["sequence"] > 1:
        report.sampling_note = ("not compiled: sampling runs every layer on whole sequences "
                                "(mesh.stage and mesh.sequence must be 1)")
    else:
        factory, _ = train_step.build(run)
        compiled, seconds = compile_sampling(run, factory, *sample)
        report.sampling = ProgramReport.of(compiled, seconds, gpu)
    return report


# --------------------------------------------------------------------------------------------
# The command.
# --------------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    from absl import flags

    from meshtrain import cli

    del argv
    cli.setup_logging(sys.stderr)
    f = flags.FLAGS
    keep_jax_on_cpu()
    config = f.config
    if config is None:
        _fail("--config is required, e.g. --config configs/llama3_8b.py")
    compile_cache.use_records(compile_cache.records_default() if f.compile_cache else None)
    try:
        target_config(f.target)
        with config.unlocked():
            config.cpu_devices = 0  # compiled for the target's devices, never fake CPU ones
        sample = (f.sample_prompt_len, f.sample_new_tokens) if f.sample else None
        report = compile_report(config, f.target, f.devices, f.devices_per_node, sample)
    except GpuCompilerMissing as error:
        _fail(str(error))
    except (config_lib.ConfigError, ValueError) as error:
        _fail(str(error))
    print(report.table())
    print(json.dumps(report.as_json()))


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
    flags.DEFINE_string("target", "h100", f"GPU to compile for: one of {sorted(TARGETS)}.")
    flags.DEFINE_integer("devices", 8, "How many GPUs (a multiple of --devices_per_node, or one node at most).")
    flags.DEFINE_integer("devices_per_node", 8, "GPUs per node (a node's devices share a process).")
    flags.DEFINE_bool("compile_cache", True, "Read back an earlier compile of the same program (same module, "
                      "options, XLA flags, target and versions) from the per-user compile cache "
                      "(meshtrain.compile_cache) and keep new ones there.")
    flags.DEFINE_bool("sample", True, "Also compile the sampling program (prefill + decode) on the same mesh.")
    flags.DEFINE_integer("sample_prompt_len", 128, "Prompt length of the compiled sampling program.")
    flags.DEFINE_integer("sample_new_tokens", 64, "Decode steps of the compiled sampling program.")


if __name__ == "__main__":
    from absl import app

    from meshtrain import cli

    define_flags()
    app.run(main, flags_parser=cli.parse_flags)

