"""The CPU side of compiling for a GPU (`meshtrain.aot`) and of the GPU runbook (`bench/gpu/`).

What needs XLA's GPU compiler is in tests/test_gpu_aot.py (`-m gpu_aot`, the `gpu` extra). Here, on
the CPU suite's install: the target descriptions, the command's errors without the extra and for bad
input, the reading of compiled GPU modules (Triton kernels, GEMM precision), the choices that follow
the mesh's platform instead of the host's, multi-node device grouping, and the runbook's parts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import jax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from meshtrain import aot, config as config_lib, mesh as mesh_lib
from meshtrain.pallas_kernels import target_platform
from meshtrain.pallas_kernels._common import resolve_interpret
from meshtrain.parallel import layout
from meshtrain.plan import hardware, kernel_model
from tests.utils import ROOT, tiny_config


@pytest.mark.parametrize("target", sorted(aot.TARGETS))
def test_target_descriptions_are_complete(target):
    """Every target is a GpuTargetConfig with the fields XLA reads, named like the planner's GPU."""
    text = aot.target_config(target)
    fields = dict(re.findall(r"^\s*(\w+): ([\w.\"]+)", text, re.M))
    for key in ("core_count", "shared_memory_per_block_optin", "l2_cache_size", "memory_bandwidth",
                "device_memory_size", "clock_rate_ghz", "registers_per_core_limit"):
        assert float(fields[key].strip('"')) > 0, key
    assert fields["platform_name"] == '"CUDA"' and "cuda_compute_capability" in text
    assert target in hardware.GPUS
    assert int(fields["device_memory_size"]) >= hardware.GPUS[target].usable_bytes


def test_gpu_compile_options_are_typed():
    """XLA:GPU rejects the string 'true' for a bool option: every multi-device GPU compile failed on it.
    A string is an enum option's value, by name."""
    for name, value in mesh_lib.GPU_COMPILER_OPTIONS.items():
        assert isinstance(value, (bool, int)) or value.startswith("COLLECTIVE_PIPELINING_MODE_"), (name, value)


def test_collective_pipeliner_options_follow_the_jaxlib_that_compiles():
    """jaxlib 0.11.1 renamed the pipeliner's switches ("No such compile option" for the old names, which
    ended every multi-device GPU compile on the newest JAX): the names follow the running jaxlib."""
    old = mesh_lib.collective_pipeliner_options((0, 11, 0))
    new = mesh_lib.collective_pipeliner_options((0, 12, 0, 1))
    assert old == mesh_lib.collective_pipeliner_options((0, 10, 2)) == {
        "xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True}
    assert new == mesh_lib.collective_pipeliner_options((0, 11, 1)) == {
        f"xla_gpu_pipeline_{kind}": "COLLECTIVE_PIPELINING_MODE_ON" for kind in ("all_gather", "reduce_scatter",
                                                                                 "all_reduce")}
    running = mesh_lib.collective_pipeliner_options(mesh_lib.jaxlib_version())
    assert running.items() <= mesh_lib.GPU_COMPILER_OPTIONS.items()


def test_pipelines_get_eight_collectives_in_flight():
    """XLA's one asynchronous collective in flight leaves a pipeline tick's permutes waiting beside its
    `lax.switch`; the other meshes keep XLA's default (the limit costs them memory and overlaps nothing more)."""
    def mesh(**shape):
        return types.SimpleNamespace(devices=types.SimpleNamespace(flat=[types.SimpleNamespace(platform="cuda")]),
                                     size=8, shape=shape)
    key = "xla_gpu_experimental_parallel_collective_overlap_limit"
    assert mesh_lib.compiler_options(mesh(stage=4, fsdp=2))[key] == 8
    assert isinstance(mesh_lib.compiler_options(mesh(stage=2, fsdp=4), 400)[key], int)
    assert key not in mesh_lib.compiler_options(mesh(fsdp=8)) and key not in mesh_lib.compiler_options(mesh(stage=1))


def test_scheduler_budget_reaches_gpu_compiles_only():
    """`train.xla_gpu_memory_limit_slop_factor` becomes XLA's option (an int) for multi-device GPU
    meshes when it differs from XLA's default; CPU and one-device meshes never get it."""
    def mesh(platform: str, size: int):
        return types.SimpleNamespace(devices=types.SimpleNamespace(flat=[types.SimpleNamespace(platform=platform)]),
                                     size=size)
    assert mesh_lib.compiler_options(mesh("cuda", 8), 400)["xla_gpu_memory_limit_slop_factor"] == 400
    assert "xla_gpu_memory_limit_slop_factor" not in mesh_lib.compiler_options(mesh("cuda", 8))
    assert "xla_gpu_memory_limit_slop_factor" not in mesh_lib.compiler_options(mesh("cpu", 8), 400)
    assert mesh_lib.compiler_options(mesh("cuda", 1), 400) == {}
    assert config_lib.default_config().train.xla_gpu_memory_limit_slop_factor == mesh_lib.XLA_DEFAULT_SLOP


def test_missing_gpu_extra_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(aot, "gpu_compiler_installed", lambda: False)
    aot._topology_devices.cache_clear()
    with pytest.raises(aot.GpuCompilerMissing, match=re.escape("pip install -e '.[gpu]'")):
        aot.target_devices("h100", 8)


@pytest.mark.parametrize("args, message", [
    (["--target", "h900"], "error: --target=h900: must be one of a100, b200, h100, h200"),
    (["--devices", "12"], "error: --devices=12: must be a positive multiple of --devices_per_node=8"),
])
def test_bad_input_is_one_line(args, message):
    out = subprocess.run([sys.executable, "-m", "meshtrain.aot", "--config", "configs/tiny.py", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.skipif(aot.gpu_compiler_installed(), reason="the gpu extra is installed here: tests/test_gpu_aot.py")
def test_command_without_gpu_extra_says_how_to_install():
    out = subprocess.run([sys.executable, "-m", "meshtrain.aot", "--config", "configs/tiny.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and "pip install -e '.[gpu]'" in out.stderr and "Traceback" not in out.stderr


COMPILED = """HloModule step, is_scheduled=true

%gemm_f8 (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16]) -> f32[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_bf16 (p0: bf16[64,32], p1: f8e4m3fn[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  %c = bf16[32,16]{1,0} convert(%p1)
  ROOT %dot.2 = bf16[64,16]{1,0} dot(%p0, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f8e4m3fn[64,32], b: f8e4m3fn[32,16], x: bf16[64,32]) -> f32[64,16] {
  %a = f8e4m3fn[64,32]{1,0} parameter(0)
  %b = f8e4m3fn[32,16]{1,0} parameter(1)
  %x = bf16[64,32]{1,0} parameter(2)
  %f1 = f32[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_f8
  %f2 = bf16[64,16]{1,0} fusion(%x, %b), kind=kCustom, calls=%gemm_bf16
  %lt = (f32[64,16]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
  %k1 = bf16[64,32]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", \
backend_config={name = "rms_norm_forward", grid_x = 4 : i32}
  %k2 = bf16[64,32]{1,0} custom-call(%k1), custom_call_target="__gpu$xla.gpu.triton", \
backend_config={name = "rms_norm_forward", grid_x = 4 : i32}
  ROOT %k3 = f32[64,16]{1,0} custom-call(%f1), custom_call_target="__gpu$xla.gpu.triton", \
backend_config={name = "flash_attention_dq"}
}
"""


def test_compiled_module_reader_counts_fp8_gemms_and_triton_kernels():
    """A dot of two f8 operands and cuBLASLt's f8 call are FP8 GEMMs; a dot whose f8 operand is converted
    to bf16 first is a bf16 GEMM. Triton custom calls are counted by kernel name."""
    found = kernel_model.gemms(COMPILED)
    assert (found.total, found.fp8) == (3, 2)
    assert found.of_types("f8e4m3fn", "f8e4m3fn") == 2 and found.of_types("bf16", "bf16") == 1
    assert kernel_model.f8_conversions(COMPILED) == 1  # the bf16 GEMM's operand, widened from e4m3
    assert kernel_model.triton_kernels(COMPILED) == {"rms_norm_forward": 2, "flash_attention_dq": 1}


def _gpu_mesh(**sizes) -> AbstractMesh:
    names = tuple(sizes) or ("data",)
    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    return AbstractMesh(tuple(sizes.values()) or (1,), names, abstract_device=device)


def test_kernels_compile_for_the_mesh_platform_not_the_host():
    """On a CPU host, a trace under a GPU mesh lowers the kernels for Triton (not interpret mode)."""
    assert target_platform() == jax.default_backend() == "cpu" and resolve_interpret(None)
    with jax.sharding.use_abstract_mesh(_gpu_mesh(data=2)):
        assert target_platform() == "gpu" and not resolve_interpret(None)
    assert resolve_interpret(None)


@pytest.mark.parametrize("mesh, overrides, platform, flash", [
    ({"sequence": 2, "data": 4}, {"train.seq_len": 64}, "gpu", True),  # blocks of 64 / 2 / 2 = 16 tokens
    ({"sequence": 2, "data": 4}, {"train.seq_len": 32}, "gpu", False),  # blocks of 8: under the kernel's tile
    ({"sequence": 2, "data": 4}, {"train.seq_len": 64}, "cpu", False),
    ({"sequence": 2, "data": 4}, {"train.seq_len": 32, "attention.zigzag": False}, "gpu", True),
    ({"sequence": 1, "data": 8}, {"train.seq_len": 64}, "gpu", False),
])
def test_ring_attention_uses_flash_blocks_on_gpu(mesh, overrides, platform, flash):
    config = tiny_config(mesh, **{"attention.impl": "ring", **overrides})
    sizes = config_lib.mesh_shape(config, 8)
    assert layout.ring_flash(config, sizes, platform) is flash
    assert layout.uses_kernels(config, sizes, platform) is flash  # its regions then go unchecked


def test_multi_node_gpu_devices_group_by_process():
    """GPU devices all report slice 0: nodes are the processes (one per node) the devices belong to."""
    devices = [types.SimpleNamespace(id=i, process_index=i // 4, slice_index=0, platform="gpu",
                                     device_kind="NVIDIA H100 80GB HBM3") for i in range(8)]
    grid = mesh_lib._hybrid_device_array((1, 1, 1, 1, 1, 4), (2, 1, 1, 1, 1, 1), devices)  # data across nodes
    assert grid.shape == (2, 1, 1, 1, 1, 4)
    for node in range(2):  # each data index is one node's four devices: tensor stays inside a node
        assert {d.process_index for d in grid[node].flat} == {node}


# ---- the GPU runbook's CPU side ----------------------------------------------------------------


@pytest.mark.slow
def test_runbook_stops_at_once_without_a_gpu(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no nvidia-smi
    out = subprocess.run(["bash", "bench/gpu/run_all.sh", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "no NVIDIA GPU" in out.stderr
    assert not (tmp_path / "out").exists()


def test_runbook_install_keeps_a_jax_in_range_and_refuses_one_out_of_it(monkeypatch, capsys):
    """bench/gpu/_needs.py, which bench/gpu/install.sh asks before it installs anything."""
    spec = importlib.util.spec_from_file_location("needs", ROOT / "bench" / "gpu" / "_needs.py")
    needs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(needs)
    allowed = dict(needs.requirements())["jax"]
    for versions, code, words in [({"jax": jax.__version__, "jaxlib": jax.__version__}, 0, [f"kept {jax.__version__}"]),
                                  ({}, 0, ["missing"]),
                                  ({"jax": "0.9.0", "jaxlib": "0.9.0"}, 3, ["jax 0.9.0", allowed, "does not replace"]),
                                  ({"jax": jax.__version__}, 3, ["jaxlib is not installed"])]:
        monkeypatch.setattr(needs, "installed", versions.get)
        assert needs.main(["jax"]) == code
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1 and all(word in lines[0] for word in words), lines
    assert needs.satisfies("0.12.0.1", ">=0.10.2,<=0.12.0.1") and not needs.satisfies("0.12.1", "<=0.12.0.1")
    assert needs.satisfies("0.11.2+cuda13", ">=0.10.2") and not needs.satisfies("0.10.1", ">=0.10.2")


@pytest.mark.slow
def test_runbook_parts_write_their_json_on_cpu(tmp_path):
    """kernel_tests.py (interpret mode on CPU, one test) and mfu.py --quick (one variant) run and write
    the JSON line they print."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    kernel = subprocess.run([sys.executable, "bench/gpu/kernel_tests.py", "--out", str(tmp_path / "k.json"), "-k",
                             "test_default_blocks_depend_on_width"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=env)
    assert kernel.returncode == 0, kernel.stdout + kernel.stderr
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["mode"] == "interpret" and result["passed"] == result["tests"] == 1 and not result["failed"]
    mfu = subprocess.run([sys.executable, "bench/gpu/mfu.py", "--quick", "--variants", "bf16+kernels", "--out",
                          str(tmp_path / "m.json")], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert mfu.returncode == 0, mfu.stdout + mfu.stderr
    variants = json.loads((tmp_path / "m.json").read_text())["variants"]
    assert list(variants) == ["bf16+kernels"] and variants["bf16+kernels"]["tokens_per_s"] > 0
