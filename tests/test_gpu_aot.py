"""The step compiled for H100 by XLA's GPU compiler, without a GPU (`meshtrain.aot`; the `gpu` extra).

Marked `gpu_aot`: the CPU suite leaves these out (`addopts`), `.ci/run` runs them in an environment
with the `gpu` extra (`pytest -m gpu_aot`). Without the extra they fail with its install line.

* Every composition the equivalence tests prove on CPU compiles for 8 (64 for all six axes) H100s
  in bf16, as users run it: the 20 three-axis meshes and the six-axis mesh (tests/test_compose.py),
  with the Pallas kernels on where a mesh allows them, which must then be Triton calls; and the
  features the other equivalence tests cover (ZeRO stages, accumulation, sequence parallelism, FP8,
  each pipeline schedule, ring attention without zig-zag, selective remat, the sampling program;
  capacity MoE is in every triple with `expert` but not `sequence`).
* llama3_8b (2 layers) with the kernels: every kernel, forward and backward, is a Triton call.
* FP8 (`model.matmul_precision=fp8`): every quantised matmul runs as three FP8 GEMMs a step (forward
  e4m3 x e4m3; input and weight gradients e5m2 with e4m3), no FP8 value is converted back to bf16,
  the step's temporaries are no larger than bf16's and the amax reductions add at most 2 all-reduces.
* The planner's per-device memory against the compiler's for the acceptance meshes: within 10%.
* Multi-node targets: 64 devices as 8 nodes of 8 give the devices of 8 processes.
* The `meshtrain.aot` and `plan --target` commands of README.md and docs/ run.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import aot, attention, compile_cache, config as config_lib, local_tier, mesh as mesh_lib, train_step
from meshtrain.parallel import layout
from meshtrain.plan import hlo, kernel_model, verify
from tests import test_readme_commands as readme
from tests.utils import ROOT, apply_overrides, composed_config, load_config_file

pytestmark = pytest.mark.gpu_aot


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Each test compiles programs for thousands of devices that no later test reuses: JAX's caches would
    keep them (and their host memory) for the worker's life, and two workers then crowd 24 GiB."""
    yield
    jax.clear_caches()
    gc.collect()

AXES = config_lib.MESH_AXES
TRIPLES = [dict.fromkeys(t, 2) for t in itertools.combinations(AXES, 3)]
KERNELS = aot.KERNELS
KERNEL_NAMES = {"flash_attention_forward", "flash_attention_dq", "flash_attention_dkdv", "rms_norm_forward",
                "rms_norm_backward", "cross_entropy_forward"}


def _bf16_composed(mesh: dict, **overrides):
    """`composed_config(mesh)` in bf16 with sequences of 64 (ring blocks of 16 tokens: the flash kernel's
    smallest tile), the kernels on where the mesh allows them (flash attention unless `sequence` runs
    ring attention; none in MoE pipeline stages), then `overrides`."""
    config = composed_config(mesh)
    config.model.dtype = "bfloat16"
    config.train.seq_len = 64
    if not (mesh.get("expert", 1) > 1 and mesh.get("stage", 1) > 1):
        kernels = dict(KERNELS)
        if mesh.get("sequence", 1) > 1:
            kernels.pop("attention.impl")
        apply_overrides(config, kernels)
    return apply_overrides(config, overrides)


def _compile(config, devices: int = 8, sample=None) -> aot.Report:
    return aot.compile_report(config, "h100", devices, sample=sample)


# the MoE's grouped kernels (dropless, `model.moe_matmul` auto on a GPU): the fused SwiGLU's five
GROUPED_KERNELS = {"grouped_swiglu", "grouped_matmul", "grouped_swiglu_dx", "grouped_dual_dx", "grouped_matmul_dw"}


def _kernel_names(report: aot.Report) -> set[str]:
    """The Pallas kernels of the compiled step by name (a grouped kernel's tiles and rows left off)."""
    return {re.sub(r"_m\d+w\d+_rows\d+$", "", name) for name in report.step.kernels}


def _kernels_expected(config, report: aot.Report) -> set[str]:
    expected = set()
    m = config.model
    if m.num_experts and m.moe_dropless and config_lib.moe_matmul(config, "gpu") == "pallas":
        expected |= GROUPED_KERNELS
    documents_in_flash = (config_lib.attention_impl(config, "gpu") == "cudnn"
                          and config.model.head_dim >= attention.PALLAS_DOCUMENTS_MIN_HEAD_DIM)
    flash = config_lib.attention_impl(config, "gpu") == "pallas"  # asked for, or auto's for latent attention
    if flash or layout.ring_flash(config, report.sizes, "gpu") or documents_in_flash:
        expected |= {"flash_attention_forward", "flash_attention_dq", "flash_attention_dkdv"}
    if config.model.fused_norm:
        expected |= {"rms_norm_forward", "rms_norm_backward"}
    if config.model.fused_loss:
        expected |= {"cross_entropy_forward"}  # its backward: XLA GEMMs over chunks of tokens
    return expected


# First in the file: the 405B command is the longest test (about 45 s); started first, it does not
# leave one worker running alone at the end of the parallel run.
GPU_COMMANDS = [c for c in readme.COMMANDS if readme.needs_gpu_compiler(c)]


def _command_id(command: str) -> str:
    """`meshtrain.aot-llama3_8b`: the module and the config file's name."""
    config = re.search(r"--config (\S+)", command)
    return command.split()[2] + (f"-{pathlib.Path(config.group(1)).stem}" if config else "")


@pytest.mark.parametrize("command", GPU_COMMANDS, ids=_command_id)
def test_readme_gpu_compiler_commands_run(tmp_path, command):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    args = readme.prepare_command(command, 0, tmp_path, {"OUT_DIR": str(tmp_path / "out")})
    result = subprocess.run(args, cwd=tmp_path, env=readme.command_env(str(tmp_path / "tfds"), None),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    if "llama3_405b" in command:  # the paper's layout on 16,384 H100s: fits, the planner within 10%, overlap
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["fits"] and report["sizes"] == {"data": 1, "fsdp": 128, "tensor": 8, "sequence": 1, "expert": 1,
                                                      "stage": 16}
        assert report["planner_over_compiler"] == pytest.approx(1, abs=0.10), report["planner_over_compiler"]
        # the acceptance point: at least 40% modeled MFU (the kernel model's step), the planner's compute
        # and bubble within 10% of it
        assert report["modeled_mfu"] >= 0.40, report["modeled_mfu"]
        assert report["planner_over_kernel_model"] == pytest.approx(1, abs=0.10), report["planner_over_kernel_model"]
        # the sequence-parallel gathers and scatters and the stage permutes beside compute (the
        # config's raised scheduler budget): at least 80% of what a step runs (each pair as often as it
        # runs: the pipeline's warm-up loop compiles the forward layers a second time)
        pairs = {k: report["step"]["collectives"][k] for k in ("all-gather", "reduce-scatter", "collective-permute")}
        overlapped = sum(p["overlapped_runs"] for p in pairs.values()) / sum(p["runs"] for p in pairs.values())
        assert overlapped >= 0.8, pairs
        # interleaved 1F1B with its transfers overlapped: every stage permute has compute beside it
        assert pairs["collective-permute"]["overlapped"] == pairs["collective-permute"]["pairs"] > 0, pairs


@pytest.mark.parametrize("mesh", TRIPLES + [dict.fromkeys(AXES, 2)],
                         ids=["-".join(m) for m in TRIPLES] + ["all-six"])
def test_composed_mesh_compiles_for_h100(mesh):
    config = _bf16_composed(mesh)
    devices = 8 if len(mesh) == 3 else 64
    report = _compile(config, devices)
    assert report.sizes == {a: mesh.get(a, 1) for a in AXES}
    assert _kernel_names(report) == _kernels_expected(config, report)
    assert bool(report.step.cudnn_attention) == (config_lib.attention_impl(config, "gpu") == "cudnn")
    assert report.step.memory["peak"] > 0 and report.fits


LATENT = {"model.kv_lora_rank": 32, "model.q_lora_rank": 24, "model.qk_rope_head_dim": 8, "model.head_dim": 24,
          "model.v_head_dim": 16, "model.n_heads": 8, "model.n_kv_heads": 8}
FEATURES = {
    "zero1-accumulation": ({"fsdp": 4, "data": 2}, {"train.zero_stage": 1, "train.grad_accum_steps": 2}),
    "zero2": ({"fsdp": 8}, {"train.zero_stage": 2}),
    "zero0-data": ({"data": 8}, {"train.zero_stage": 0}),
    "sequence-parallel": ({"tensor": 4, "fsdp": 2}, {"model.sequence_parallel": True}),
    # SP's gathers and scatters in pieces beside the matmuls; in 1F1B's slots and the empty slots' cond
    "collective-matmul": ({"tensor": 4, "data": 2}, {"model.sequence_parallel": True, "model.collective_matmul": True}),
    # uneven stages (1 + 2 + 2 + 1) under 1F1B: the empty slots' lax.cond (plain uneven 1F1B is the README's
    # 405B command's, 7 + 14 x 8 + 7)
    "collective-matmul-uneven-1f1b": ({"stage": 4, "tensor": 2}, {"model.sequence_parallel": True,
                                                                  "model.collective_matmul": True,
                                                                  "model.n_layers": 6, "pipeline.microbatches": 4}),
    "fp8": ({"fsdp": 4, "tensor": 2}, {"model.matmul_precision": "fp8"}),
    "fp8-accumulation": ({"data": 2, "fsdp": 4}, {"model.matmul_precision": "fp8", "train.grad_accum_steps": 2}),
    "gpipe": ({"stage": 2, "data": 4}, {"pipeline.schedule": "gpipe"}),
    "circular": ({"stage": 2, "data": 4}, {"pipeline.schedule": "circular", "pipeline.repeats": 2}),
    "interleaved-1f1b": ({"stage": 2, "fsdp": 4}, {"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2}),
    "zero-bubble": ({"stage": 2, "tensor": 2, "data": 2}, {"pipeline.schedule": "zero_bubble",
                                                           "pipeline.weight_parts": 2}),
    # under full remat W's matmul inputs come from B's pullback (`SlotPlan.inputs_at_b`)
    "zero-bubble-full-remat": ({"stage": 2, "tensor": 2, "data": 2}, {"pipeline.schedule": "zero_bubble",
                                                                      "remat.policy": "full"}),
    # uneven chunks under interleaved 1F1B (10 layers on 4 stages in 2 chunks: 1 1 1 2 2 1 1 1), transfers
    # behind compute: the empty slots' lax.cond picked by the chunk a tick runs
    "uneven-interleaved": ({"stage": 4, "data": 2}, {"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2,
                                                     "model.n_layers": 10, "pipeline.microbatches": 4,
                                                     "pipeline.overlap_transfers": True}),
    # uneven stages under zero bubble (1 + 2): the empty slots' lax.cond
    "uneven-zero-bubble": ({"stage": 2, "tensor": 2, "data": 2}, {"pipeline.schedule": "zero_bubble",
                                                                  "model.n_layers": 3}),
    "ring-contiguous": ({"sequence": 4, "data": 2}, {"attention.zigzag": False}),
    "ulysses-tensor": ({"data": 2, "sequence": 2, "tensor": 2}, {"attention.impl": "ulysses"}),
    "ulysses-hybrid": ({"sequence": 4, "data": 2}, {"attention.impl": "ulysses", "attention.ulysses_degree": 2}),
    "ulysses-expert": ({"sequence": 2, "expert": 2, "data": 2}, {"attention.impl": "ulysses"}),
    "ulysses-hybrid-1f1b": ({"sequence": 4, "stage": 2}, {"attention.impl": "ulysses", "attention.ulysses_degree": 2}),
    "remat-selective": ({"fsdp": 8}, {"remat.policy": "selective"}),
    # cuDNN's attention (auto picks it at head dims of 64 and up; the tiny model's is 8) where its custom
    # partitioning and its gradients' missing variance met the manual regions: the accumulation loop,
    # heads over tensor, the split-backward pipeline's vmapped weight pass
    "cudnn-accumulation": ({"data": 2, "fsdp": 4}, {"attention.impl": "cudnn", "train.grad_accum_steps": 2}),
    "cudnn-tensor": ({"fsdp": 4, "tensor": 2}, {"attention.impl": "cudnn"}),
    "cudnn-zero-bubble": ({"stage": 2, "tensor": 2, "data": 2}, {"attention.impl": "cudnn",
                                                                 "pipeline.schedule": "zero_bubble"}),
    # the einsum attention's scores in bf16 (attention.scores_dtype=compute)
    "scores-bf16": ({"fsdp": 4, "tensor": 2}, {"attention.impl": "xla", "attention.scores_dtype": "compute"}),
    # the model families' features (tests/test_hf.py); a sliding window is einsum attention's only
    "families": ({"fsdp": 4, "tensor": 2}, {"model.attention_bias": True, "model.qk_norm": True,
                                             "model.rope_scaling": "llama3", "model.rope_factor": 8.0,
                                             "model.rope_original_max_positions": 32, "model.sliding_window": 24,
                                             "attention.impl": "xla"}),
    # multi-head latent attention (tests/test_latent_attention.py): heads over tensor, ZeRO-3's latents; in
    # 1F1B's slots beside ring attention
    "latent-attention": ({"fsdp": 4, "tensor": 2}, {**LATENT, "train.zero_stage": 3}),
    "latent-attention-ring-1f1b": ({"sequence": 2, "stage": 2, "data": 2}, LATENT),
    # DeepSeek-V3's head widths (192 for queries and keys, 128 for values): auto takes the flash kernel,
    # its tiles fitted to the head padded to 256 (128 x 128 bf16 tiles asked 329 KB of shared memory)
    "latent-attention-deepseek-heads": ({"fsdp": 4, "tensor": 2}, {
        **LATENT, "model.head_dim": 192, "model.qk_rope_head_dim": 64, "model.v_head_dim": 128,
        "attention.impl": "auto"}),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_compiles_for_h100(name):
    mesh, overrides = FEATURES[name]
    config = _bf16_composed(mesh, **overrides)
    report = _compile(config)
    assert _kernel_names(report) == _kernels_expected(config, report)
    assert bool(report.step.cudnn_attention) == (config_lib.attention_impl(config, "gpu") == "cudnn")
    if config.model.matmul_precision == "fp8":
        assert report.step.gemms > 0


@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_remat_attention_reruns_only_the_mlp_input_matmul(impl):
    """remat.policy=attention compiled for H100s: the backward runs no attention forward again (cuDNN's
    call or the Pallas flash kernel: as many as without remat, fewer than under `full`), and of the
    layer's matmuls only gate + up again, where `full` reruns three (q, k, v; the output projection;
    gate + up): a third of the GEMMs `full` adds to the program without remat."""
    forward = {"cudnn": lambda r: r.step.cudnn_attention.get("__cudnn$fmhaSoftmax", 0),
               "pallas": lambda r: r.step.kernels.get("flash_attention_forward", 0)}[impl]
    reports = {policy: _compile(_bf16_composed({"fsdp": 8}, **{"attention.impl": impl, "remat.policy": policy}))
               for policy in ("none", "attention", "full")}
    calls = {policy: forward(r) for policy, r in reports.items()}
    assert calls["attention"] == calls["none"] < calls["full"], calls
    gemms = {policy: r.step.gemms for policy, r in reports.items()}
    assert 3 * (gemms["attention"] - gemms["none"]) == gemms["full"] - gemms["none"] > 0, gemms


@pytest.mark.parametrize("overrides", [{}, LATENT], ids=["kv-cache", "latent-cache"])
def test_sampling_program_compiles_for_h100(overrides):
    config = _bf16_composed({"tensor": 2, "fsdp": 4}, **overrides)
    report = aot.compile_report(config, "h100", 8, sample=(16, 8))
    assert report.sampling is not None and report.sampling.gemms > 0
    assert report.sampling.memory["argument"] > 0


# attention.impl=auto on an NVIDIA GPU (`attention.cudnn_attention`, `attention.DOCUMENT_BRANCHES`): cuDNN's
# causal call, on a Hopper its packed call (rows of up to attention.max_documents documents), and past that the
# document-masked fallback, a bias call, or from head dim `PALLAS_DOCUMENTS_MIN_HEAD_DIM` on the Pallas flash
# kernel; each with its backward
CAUSAL_CUDNN_CALLS = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
PACKED_CUDNN_CALLS = {call + kernel_model.PACKED for call in CAUSAL_CUDNN_CALLS}
BIAS_CUDNN_CALLS = {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}
CUDNN_CALLS = CAUSAL_CUDNN_CALLS | PACKED_CUDNN_CALLS | BIAS_CUDNN_CALLS
FLASH_KERNELS = {"flash_attention_forward", "flash_attention_dq", "flash_attention_dkdv"}


def _assert_cudnn_document_branch(config, report):
    """cuDNN's causal and packed calls (every target here a Hopper), and past the packed call's limit cuDNN's
    bias calls or, at head dim PALLAS_DOCUMENTS_MIN_HEAD_DIM and up, the Pallas flash kernels as Triton calls."""
    if config.model.head_dim >= attention.PALLAS_DOCUMENTS_MIN_HEAD_DIM:
        assert set(report.step.cudnn_attention) == CAUSAL_CUDNN_CALLS | PACKED_CUDNN_CALLS, report.step.cudnn_attention
        assert set(report.step.kernels) >= FLASH_KERNELS, report.step.kernels
    else:
        assert set(report.step.cudnn_attention) == CUDNN_CALLS, report.step.cudnn_attention


def test_runbook_step_runs_cudnn_attention_on_h200():
    """The GPU runbook's 1.5B step (`bench/gpu/mfu.py`, default `attention.impl=auto`) compiled for one
    H200: cuDNN's attention calls (its packed call for rows of documents), no Triton kernels, and the kernel
    model's MFU (printed by `meshtrain.aot`, its target in `bench/aot.py`) between the measured einsum step's
    and the peak. The packed call is priced as the causal call over the whole row (an upper bound on the work
    the documents leave): the step on packed rows within 1% of the step on rows of one document each."""
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import mfu

    config = mfu.bench_config(False, "bf16", False, "auto")
    report = aot.compile_report(config, "h200", 1, sample=None)
    assert set(report.step.cudnn_attention) == CUDNN_CALLS and not report.step.kernels
    assert report.fits and 0.121 < report.modeled_mfu < 1.0
    assert report.step.modeled_seconds <= 1.01 * report.step.modeled_seconds_one_document


def test_before_hopper_rows_of_documents_take_the_bias_call():
    """On an A100 (cuDNN's packed call needs a Hopper) the runbook's rows of documents take the bias call, and
    its step on packed rows models slower than on rows of one document (on an H200 the two are within 1%:
    `test_runbook_step_runs_cudnn_attention_on_h200`)."""
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import mfu

    config = apply_overrides(mfu.bench_config(False, "bf16", False, "auto"), {"model.n_layers": 2})
    report = aot.compile_report(config, "a100", 1, sample=None)
    assert set(report.step.cudnn_attention) == CAUSAL_CUDNN_CALLS | BIAS_CUDNN_CALLS, report.step.cudnn_attention
    assert report.step.modeled_seconds > 1.01 * report.step.modeled_seconds_one_document


def test_each_target_answers_its_own_compute_capability():
    """One process compiling for an A100 and then an H100 (the devices of each kept once made): what is traced
    for the H100 again has cuDNN's packed call (a Hopper's), what is traced for the A100 has not."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    for target, count, hopper in (("h100", 8, True), ("a100", 1, False), ("h100", 8, True), ("a100", 1, False)):
        aot.target_devices(target, count)
        assert cudnn.check_compute_capability("9.0") is hopper, target
        assert attention.cudnn_packs_documents() is hopper, target


def test_llama3_8b_kernels_are_triton_calls():
    """llama3_8b (batch 8 x 8192) on fsdp=8 with every kernel (`aot.REFERENCE_MESHES` 8b-fsdp8-kernels: the
    program the planner's memory test and bench/aot.py compile, read back here): each of the six kernels
    (flash forward, dq, dk/dv; RMSNorm forward, backward; the fused cross-entropy forward, whose
    backward is XLA GEMMs) is a Triton custom call in the compiled module, and the step fits an H100."""
    config_name, devices, overrides = PLANNER["8b-fsdp8-kernels"]
    report = _compile(apply_overrides(load_config_file(config_name), overrides), devices)
    assert set(report.step.kernels) == KERNEL_NAMES
    assert report.fits and report.step.collectives["all-gather"]["overlapped"] > 0


# FP8 on H100: the meshes of the FP8 equivalence tests' kinds (GSPMD fsdp, data-parallel accumulation
# region, expert parallelism, 1F1B's loop) and llama3_8b's real widths. Remat `none` (`selective` for
# the 8B and the pipeline, which refuses FP8 under `none`: both save the matmul outputs), so each forward
# GEMM runs once.
FP8_MESHES = {
    # the tiny models with cuDNN's attention, as the 8B runs it by default (auto at head_dim 128)
    "tiny-fsdp8": ("tiny", {"mesh.fsdp": 8, "remat.policy": "none", "attention.impl": "cudnn"}),
    # tiny_moe on data 8 counts the same matmuls as on data 4 x expert 2 (last measured: 18 FP8 GEMMs,
    # 6 -> 7 all-reduces); the expert-split mesh is the one kept, for the set's time
    "tiny_moe-expert2": ("tiny_moe", {"mesh.data": 4, "mesh.expert": 2, "remat.policy": "none",
                                      "attention.impl": "cudnn"}),
    "tiny-1f1b": ("tiny", {"mesh.data": 4, "mesh.stage": 2, "pipeline.schedule": "1f1b", "remat.policy": "selective",
                           "model.n_layers": 2, "attention.impl": "cudnn"}),  # a layer a stage: 3/5 the compile
    "llama3_8b-2layers": ("llama3_8b", {"mesh.fsdp": 8, "train.batch_size": 8, "model.n_layers": 2,
                                        "remat.policy": "selective"}),
}


def _bf16_params_per_device(run) -> int:
    """Bytes a device's share of the parameters takes in the compute dtype (bf16): one copy of them."""
    factory, _ = train_step.build(run)
    leaves = jax.tree.leaves(factory.abstract.params)
    return sum(2 * math.prod(leaf.sharding.shard_shape(leaf.shape)) for leaf in leaves)


def _precision_pair(name: str):
    """(bf16 report, fp8 report, fp8 GEMMs as executed, quantised matmuls run per device per step)."""
    config_name, overrides = FP8_MESHES[name]
    reports = {}
    for precision in ("bf16", "fp8"):
        config = apply_overrides(load_config_file(config_name), {
            **{f"mesh.{a}": 1 for a in AXES}, "data.source": "synthetic", "model.dtype": "bfloat16", **overrides,
            "model.matmul_precision": precision})
        compiled, run, _ = aot.compile_step(config, "h100", 8)
        reports[precision] = (compiled.as_text(), verify.compiled_memory(compiled), run)
    text, _, run = reports["fp8"]
    pipe = run.layout.pipeline
    executed = kernel_model.gemms(text, executed=True, branch_weights=run.layout.branch_share())
    factory, _ = train_step.build(run)
    runs = sum(math.prod(h.shape[:-2]) for h in jax.tree.leaves(factory.abstract.fp8))  # sites x scanned units
    runs = runs // pipe.stages * pipe.microbatches if pipe else runs * run.config.train.grad_accum_steps
    return reports["bf16"], reports["fp8"], executed, runs


@pytest.mark.parametrize("name", list(FP8_MESHES))
def test_fp8_matmuls_are_fp8_gemms_on_h100(name):
    (bf16_text, bf16_memory, _), (text, memory, run), executed, runs = _precision_pair(name)
    assert executed.of_types("f8e4m3fn", "f8e4m3fn") == pytest.approx(runs)  # forward
    assert executed.of_types("f8e4m3fn", "f8e5m2") == pytest.approx(2 * runs)  # input and weight gradients
    # the kernel model prices those GEMMs on the FP8 tensor cores, as it runs them: no fewer launches
    launches = sum(k.runs for k in kernel_model.kernels(text, branch_weights=run.layout.branch_share()) if k.fp8)
    assert launches == pytest.approx(executed.fp8)
    assert kernel_model.f8_conversions(text) == 0  # no quantised tensor widened again: no bf16 copy of a weight
    # nor does FP8 keep one beside its e4m3 copies: its temporaries exceed bf16's by less than a bf16 copy
    # of the device's parameters (since the SwiGLU backward's custom gradient the two differ by 0.1 to 2%,
    # either way, where a kept copy would add the whole copy)
    assert memory["temp"] - bf16_memory["temp"] < _bf16_params_per_device(run)
    n = math.prod(run.sizes.values())
    all_reduces = [c for c in hlo.collectives(text, n) if c.kind == "all-reduce"]
    assert len(all_reduces) <= len([c for c in hlo.collectives(bf16_text, n) if c.kind == "all-reduce"]) + 2


PLANNER = aot.REFERENCE_MESHES
CHECKED = [name for name in PLANNER if name != "8b-fsdp4-sequence2-ring"]  # bench/aot.py compiles all of them


@pytest.mark.parametrize("name", CHECKED)
def test_planner_memory_within_10_percent_of_the_h100_compiler(name):
    config_name, devices, overrides = PLANNER[name]
    config = apply_overrides(load_config_file(config_name), overrides)
    report = _compile(config, devices)
    compiled, planned = report.step.memory["peak"], report.planner["peak"]
    assert planned == pytest.approx(compiled, rel=0.10), (
        f"{name}: planner {planned / 2**30:.2f} GiB, compiler {compiled / 2**30:.2f} GiB")
    if config_lib.attention_impl(config, "gpu") == "cudnn":  # attention.impl=auto on the GPU
        _assert_cudnn_document_branch(config, report)
    if config.pipeline.overlap_transfers:  # each tick's transfers beside the next tick's compute
        found = report.step.collectives
        assert found["collective-permute"]["overlapped"] == found["collective-permute"]["pairs"] > 0, found
        for kind in ("all-gather", "reduce-scatter"):  # the stage weights' gathers, the gradients' scatters
            assert found[kind]["overlapped"] >= 0.8 * found[kind]["pairs"] > 0, found


def test_zero_over_sequence_holds_the_state_of_fsdp8():
    """llama3_8b (2 layers, sequences of 2,048) on fsdp4 x sequence2 under ZeRO (the config's stage),
    ring and Ulysses: the state rests sharded over sequence x fsdp, so the compiled step's argument
    bytes per device are within 5% of fsdp8's (the sequence devices hold no replicas)."""
    arguments = {}
    for name, overrides in {"fsdp8": {"mesh.fsdp": 8},
                            **{impl: {"mesh.fsdp": 4, "mesh.sequence": 2, "attention.impl": impl}
                               for impl in ("ring", "ulysses")}}.items():
        # sequences of 2,048: the state, not the activations, is what the arguments hold
        config = apply_overrides(load_config_file("llama3_8b"), {"model.n_layers": 2, "train.batch_size": 8,
                                                                  "train.seq_len": 2048, **overrides})
        arguments[name] = _compile(config).step.memory["argument"]
    for impl in ("ring", "ulysses"):
        assert arguments[impl] <= 1.05 * arguments["fsdp8"], (impl, arguments[impl] / 2**30, arguments["fsdp8"] / 2**30)


def test_multi_node_target_is_nodes_of_eight():
    devices = aot.target_devices("h100", 64)
    assert len(devices) == 64 and len({d.process_index for d in devices}) == 8
    assert all(d.device_kind == "NVIDIA H100 80GB HBM3" for d in devices)
    config = _bf16_composed({"data": 16, "fsdp": 2, "tensor": 2}, **{"mesh.dcn_data": 8, "train.batch_size": 32})
    # 16 x 2 x 2 = 64: data across the 8 nodes (and 2 ways inside), fsdp x tensor inside each node
    mesh = mesh_lib.make_mesh(config, list(devices))
    for axis in ("tensor", "fsdp"):  # the in-node axes' groups never leave a node
        groups = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])
        assert all(len({d.process_index for d in group}) == 1 for group in groups), axis
    report = _compile(config, 64)
    assert report.devices == 64 and report.sizes["data"] == 16


def test_verify_compares_with_the_gpu_compiler():
    config = _bf16_composed({"fsdp": 4, "tensor": 2})
    result = verify.verify(config, list(aot.target_devices("h100", 8)), backend=verify.comm.GPU)
    assert "H100" in result.devices and result.compiler["temp"] > 0 and result.model["state"] > 0
    assert result.model["state"] == pytest.approx(result.compiler["state"], rel=0.05)


def test_stage_kernels_compiled_for_h100_compute_the_layers_matmuls():
    """`plan.kernel_model.kernels` on a pipeline stage's branches compiled for the H100 (`cost.stage_branches`):
    the forward's GEMM FLOPs, each scanned layer counted by the loop's trip count, are every layer's
    projections (q, k, v, o, gate, up, down) and attention's two products over the whole sequence; the
    split W's are the projections' weight GEMMs alone (x^T dy: as many FLOPs as each projection);
    `BranchCosts.from_gpu_compile` prices those kernels."""
    from meshtrain.parallel import cost
    from meshtrain.plan import hardware

    config = config_lib.default_config()
    d, heads, kv, head, f, tokens, layers, p = 128, 8, 4, 16, 384, 64, 4, 2
    config.model.update(d_model=d, n_heads=heads, n_kv_heads=kv, head_dim=head, mlp_dim=f, n_layers=layers,
                        vocab_size=264, dtype="bfloat16")
    for axis in AXES:
        config.mesh[axis] = 1
    config.mesh.stage = p
    config.train.update(batch_size=8, seq_len=tokens)
    config.pipeline.update(schedule="1f1b", microbatches=8)
    sizes = {**dict.fromkeys(AXES, 1), "stage": p}
    device = aot.target_devices("h100", 1)[0]
    _, branches, _ = cost.stage_branches(config, sizes, device)
    placed = jax.sharding.SingleDeviceSharding(device)

    def gemm_flops(name):
        fn, args = branches[name]
        lowered = jax.jit(fn, in_shardings=jax.tree.map(lambda _: placed, args)).lower(*args)
        text = compile_cache.compile(lowered, [device]).as_text()
        return sum(k.runs * k.flops for k in kernel_model.kernels(text))

    projections = 2 * tokens * d * (heads * head + 2 * kv * head + heads * head + 3 * f)
    attention = 2 * 2 * heads * tokens * tokens * head
    assert gemm_flops("forward") == (layers // p) * (projections + attention)
    assert gemm_flops("weight_grad") == (layers // p) * projections
    gpu = hardware.get_gpu("h100")
    costs = cost.BranchCosts.from_gpu_compile(config, sizes, gpu, device,
                                              module_seconds=kernel_model.module_seconds(gpu))
    assert 0 < costs.forward < costs.backward and costs.weight_grad < costs.backward


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_zero_bubble_holds_at_most_one_stash_more_than_1f1b(overlap):
    """The acceptance point of the split backward's memory (p=4, m=16, the tiny config at d_model 512,
    8 layers, one 128-token row a micro-batch), compiled for H100: zero bubble's temporary bytes at most
    1F1B's (with the same `pipeline.overlap_transfers`) plus one micro-batch's stash, the residuals a
    stage keeps from F to B (`pipeline_tables.SlotUnion`: the output gradients take the residuals'
    bytes once B has read them). Overlapped, with one W a micro-batch (`pipeline.weight_span=1`, the
    least memory, the default); a W over the two B's of a loop step (`weight_span=2`), which holds the first
    B's record until the step's W, within that bound plus one W record (the matmuls' inputs and output
    gradients)."""
    from meshtrain.parallel import cost
    from meshtrain.plan import memory
    from tests.test_pipeline_cost import _scaled_tiny, _sizes

    temps = {}
    for schedule, span in (("1f1b", 1), ("zero_bubble", 1)) + ((("zero_bubble", 2),) if overlap else ()):
        config = _scaled_tiny(4, 16)
        config.pipeline.update(schedule=schedule, overlap_transfers=overlap, weight_span=span)
        compiled = aot.compile_step(config, "h100", 4)[0]
        temps[schedule, span] = compiled.memory_analysis().temp_size_in_bytes
    _, branches, _ = cost.stage_branches(config, _sizes(stage=4), jax.devices("cpu")[0])
    forward, args = branches["forward"]
    stash = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(jax.eval_shape(forward, *args)[1]))
    step = memory.Step.from_config(config, _sizes(stage=4))
    inputs, grads = memory._split_per_layer(step, step.micro_tokens // step.microbatches)
    record = (inputs + grads) * step.stored_model.n_layers // 4
    print({name: round(t / 2**20, 2) for name, t in temps.items()}, "stash MiB", round(stash / 2**20, 2),
          "record MiB", round(record / 2**20, 2))
    assert temps["zero_bubble", 1] <= temps["1f1b", 1] + stash, (temps, stash)
    if overlap:
        assert temps["zero_bubble", 2] <= temps["1f1b", 1] + stash + record, (temps, stash, record)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_zero_bubble_at_llama3_8b_holds_1f1b_memory_and_one_record(remat):
    """Memory at real shapes (`aot.REFERENCE_MESHES` 8b-stage4-fsdp2-*-m8-overlap: llama3_8b, 4 layers on
    stage 4 x fsdp 2, batch 16, m 8, transfers overlapped), compiled for H100: zero bubble's temporaries at
    most 1F1B's plus one micro-batch's W record (its matmuls' inputs and output gradients, the planner's
    `_split_per_layer`), which B's switch hands to the W ticks of its loop step (`SlotPlan.handoff`, each W
    in its B's round). Without remat, where a micro-batch's stash already holds those inputs, at most
    1F1B's own."""
    from meshtrain.plan import memory

    temps = {}
    for schedule in ("1f1b", "zero_bubble"):
        config_name, devices, overrides = aot.REFERENCE_MESHES[f"8b-stage4-fsdp2-{schedule}-m8-overlap"]
        config = apply_overrides(load_config_file(config_name), {**overrides, "remat.policy": remat})
        compiled, run, _ = aot.compile_step(config, "h100", devices)
        temps[schedule] = compiled.memory_analysis().temp_size_in_bytes
    step = memory.Step.from_config(config, dict(run.sizes))  # zero bubble's
    assert step.pipeline.plan.handoff and not step.pipeline.defers_w
    inputs, grads = memory._split_per_layer(step, step.micro_tokens // step.microbatches)
    record = (inputs + grads) * step.stored_model.n_layers // step.sizes["stage"]
    print({name: round(t / 2**30, 2) for name, t in temps.items()}, "record GiB", round(record / 2**30, 2))
    assert temps["zero_bubble"] <= temps["1f1b"] + record
    if remat == "none":
        assert temps["zero_bubble"] <= temps["1f1b"]


def test_schedules_priced_from_the_h100_compile_beat_1f1b():
    """The acceptance point of the pipeline cost model (p=4, m=16, one 128-token row of the tiny config
    at d_model 512), each branch priced kernel by kernel from its H100 compile: interleaved 1F1B (v=2)
    takes at most 0.95 of 1F1B's step and zero bubble with its transfers behind compute, in aligned
    ticks, at most 0.90. `simulate`'s table for the same orders, whose ticks mix kinds (a B somewhere in
    most ticks), takes longer at the same costs."""
    from meshtrain.parallel import cost, schedules
    from meshtrain.plan import hardware
    from tests.test_pipeline_cost import _scaled_tiny, _sizes

    gpu = hardware.get_gpu("h100")
    device = aot.target_devices("h100", 1)[0]
    costs = cost.BranchCosts.from_gpu_compile(_scaled_tiny(4, 16), _sizes(stage=4), gpu, device,
                                              module_seconds=kernel_model.module_seconds(gpu))
    parts = cost.weight_parts(costs, 2)
    base = cost.step_time("1f1b", 4, 16, 1, costs).seconds
    interleaved = cost.step_time("interleaved_1f1b", 4, 16, 2, costs).seconds / base
    from meshtrain.parallel import pipeline as pipeline_lib

    config = _scaled_tiny(4, 16)  # the table the trainer runs: overlapped, each W in its B's round
    split, policy = config.pipeline.split_backward, config.remat.policy
    deferred = pipeline_lib.defers_w(split, policy, True)
    span = pipeline_lib.w_span("zero_bubble", split, policy, True, config.pipeline.weight_span)
    aligned = cost.step_time("zero_bubble", 4, 16, 1, costs, cost.weight_parts(costs, 2, span), overlap=True,
                             defer_w=deferred, span=span).seconds / base
    price = {schedules.F: costs.forward_split, schedules.B: costs.input_grad,
             schedules.W: costs.weight_grad / parts}
    mixed = sum(max([costs.transfer] + [price[op.kind] for op in row if op is not None])
                for row in schedules.simulate("zero_bubble", 4, 16, 1, parts, latency=1)) / base
    print({"units": costs.units(), "interleaved_1f1b": round(interleaved, 3), "zero_bubble_overlap": round(aligned, 3),
           "simulate_table": round(mixed, 3)})
    assert interleaved <= 0.95
    assert aligned <= 0.90 and aligned < mixed


def test_the_local_tiers_ring_compiles_for_h100():
    """The local tier's exchange (`local_tier.ring`) for 4 nodes of 8 H100s: one collective-permute that
    sends each node's rows to the next node's devices, nothing else moving bytes."""
    devices = aot.target_devices("h100", 32)
    fn, sharding = local_tier.ring(tuple(devices), 1)
    rows = jax.ShapeDtypeStruct((32, 1024, 256), jnp.bfloat16, sharding=sharding)
    text = compile_cache.compile(fn.lower(rows), list(devices)).as_text()
    assert "collective-permute" in text and not re.search(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all)", text)
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", text).group(1)
    sent = {(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)}
    assert sent == {(i, (i + 8) % 32) for i in range(32)}
