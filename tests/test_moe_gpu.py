"""Dropless MoE compiled for H100s by XLA's GPU compiler, without a GPU (the `gpu` extra; marked `gpu_aot`).

* The grouped matmul kernel's three kernels are Triton calls, at both tile shapes and weight orders.
* The tiny MoE's dropless step compiles on the meshes its equivalence tests cover, in bf16, with the
  grouped kernels and, under `expert`, the ragged all-to-all.
* At Qwen3-30B-A3B's shapes (2 layers) on 8 devices (expert 8) and 64 (expert 64): each exchange can
  move at most 1.15x the routed rows it carries, its start / done pairs have grouped matmuls between
  them, and the expert matmuls' FLOPs are within 1.25x of 2 x routed rows x d_model x width each.
"""

from __future__ import annotations

import gc
import math
import re
import runpy
import types

import jax
import jax.numpy as jnp
import pytest

from meshtrain import aot, moe_dropless
from meshtrain.pallas_kernels import grouped_matmul as gm
from meshtrain.plan import hlo, kernel_model
from tests.utils import ROOT, apply_overrides, composed_config, load_config_file

moe_bench = types.SimpleNamespace(**runpy.run_path(str(ROOT / "bench" / "_moe_modeled.py")))

pytestmark = pytest.mark.gpu_aot
KERNELS = {"grouped_matmul", "grouped_matmul_dx", "grouped_matmul_dw"}
# the SwiGLU's: gate and up, the down projection, the SwiGLU's gradient, x's, the three weights'
SWIGLU_KERNELS = {"grouped_swiglu", "grouped_matmul", "grouped_swiglu_dx", "grouped_dual_dx", "grouped_matmul_dw"}
QWEN3 = {"model.d_model": 2048, "model.n_heads": 32, "model.n_kv_heads": 4, "model.head_dim": 128,
         "model.qk_norm": True, "model.num_experts": 128, "model.moe_mlp_dim": 768, "model.experts_per_token": 8,
         "model.vocab_size": 151936, "model.n_layers": 2, "train.seq_len": 4096, "mesh.data": 1, "mesh.fsdp": 1,
         "mesh.tensor": 1}


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()


def _kernel_names(text: str) -> set[str]:
    return {re.sub(r"_m\d+w\d+_rows\d+$", "", name) for name in kernel_model.triton_kernels(text)}


@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("order", ["gkn", "kgn", "ngk"])
def test_grouped_kernels_are_triton_calls(tile, order):
    devices = aot.target_devices("h100", 1)
    mesh = jax.sharding.Mesh(devices, ("x",))
    groups, k, n = 8, 256, 512
    rows = gm.GroupLayout.capacity(4096, groups, tile)
    shape = {"g": groups, "k": k, "n": n}

    def loss(x, w, sizes):
        layout = gm.GroupLayout.pack(sizes, tile, rows)
        return jnp.sum(gm.grouped_matmul(x, w, layout, order=order).astype(jnp.float32))

    args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
            jax.ShapeDtypeStruct(tuple(shape[a] for a in order), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups,), jnp.int32))
    with jax.set_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower().compile().as_text()
    assert _kernel_names(text) == KERNELS
    warps = 8 if tile == 128 else 4
    assert all(f"_m{tile}w{warps}_" in name for name in kernel_model.triton_kernels(text))


@pytest.mark.parametrize("tile", [64, 128])
def test_fused_swiglu_kernels_are_triton_calls(tile):
    devices = aot.target_devices("h100", 1)
    mesh = jax.sharding.Mesh(devices, ("x",))
    groups, d, f = 8, 256, 512
    rows = gm.GroupLayout.capacity(4096, groups, tile)

    def loss(x, w_gate, w_up, w_down, sizes):
        layout = gm.GroupLayout.pack(sizes, tile, rows)
        return jnp.sum(gm.grouped_swiglu(x, w_gate, w_up, w_down, layout).astype(jnp.float32))

    weight = jax.ShapeDtypeStruct((groups, d, f), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((rows, d), jnp.bfloat16), weight, weight,
            jax.ShapeDtypeStruct((groups, f, d), jnp.bfloat16), jax.ShapeDtypeStruct((groups,), jnp.int32))
    with jax.set_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower().compile().as_text()
    assert _kernel_names(text) == SWIGLU_KERNELS


@pytest.mark.parametrize("mesh", [{"expert": 8}, {"data": 2, "expert": 4}, {"fsdp": 2, "expert": 2, "tensor": 2},
                                  {"expert": 2, "sequence": 2, "tensor": 2}, {"fsdp": 8}, {"data": 2, "fsdp": 4}],
                         ids=lambda m: "x".join(f"{a}{n}" for a, n in m.items()))
def test_tiny_moe_dropless_step_compiles_with_the_grouped_kernels(mesh):
    """Under `fsdp` the devices own whole experts (`model.moe_fsdp` auto): the tokens travel over it too."""
    config = composed_config(mesh, moe=True)
    apply_overrides(config, {"model.dtype": "bfloat16", "model.moe_dropless": True, "train.seq_len": 64})
    found = {}
    aot.compile_report(config, "h100", 8, sample=None,
                       inspect=lambda compiled, run: found.update(text=compiled.as_text(), run=run))
    assert _kernel_names(found["text"]) >= SWIGLU_KERNELS
    assert found["run"].rules.split_axes("expert") == tuple(a for a in ("expert", "fsdp") if mesh.get(a, 1) > 1)
    ragged = [c for c in hlo.collectives(found["text"], 8) if c.kind == "ragged-all-to-all"]
    assert bool(ragged) == (mesh.get("expert", 1) * mesh.get("fsdp", 1) > 1)
    assert "ragged-dot" not in found["text"] and "ragged_dot" not in found["text"]


def test_experts_over_fsdp_in_pipeline_stages_compile():
    """1F1B stages on fsdp x expert devices that own whole experts (dropless; ragged_dot in the stage loop):
    the tokens travel over both axes by the ragged all-to-all."""
    config = composed_config({"stage": 2, "fsdp": 2, "expert": 2}, moe=True)
    apply_overrides(config, {"model.dtype": "bfloat16", "model.moe_dropless": True, "train.seq_len": 64})
    found = {}
    aot.compile_report(config, "h100", 8, sample=None,
                       inspect=lambda compiled, run: found.update(text=compiled.as_text(), run=run))
    assert found["run"].rules.split_axes("expert") == ("expert", "fsdp")
    ragged = [c for c in hlo.collectives(found["text"], 8) if c.kind == "ragged-all-to-all"]
    assert ragged and all(len(c.groups[0]) == 4 for c in ragged if c.groups)


DEEPSEEK_ROUTER = {"model.moe_router": "sigmoid", "model.moe_router_bias": True, "model.moe_groups": 4,
                   "model.moe_topk_groups": 2, "model.moe_routed_scale": 2.5}


# the rest of the tiny DeepSeek-V3 (tests/test_latent_attention.py, test_multi_token.py): latent attention, a shared
# expert, a dense first layer, multi-token prediction
DEEPSEEK_REST = {"model.kv_lora_rank": 32, "model.q_lora_rank": 24, "model.qk_rope_head_dim": 8, "model.head_dim": 24,
                 "model.v_head_dim": 16, "model.n_heads": 8, "model.n_kv_heads": 8, "model.shared_expert": True,
                 "model.first_dense_layers": 1, "model.moe_every": 1, "model.mtp_depth": 1}


@pytest.mark.parametrize("mesh, whole", [({"fsdp": 2, "expert": 2, "tensor": 2}, False),
                                         ({"stage": 2, "fsdp": 2, "expert": 2}, False),
                                         ({"fsdp": 2, "expert": 2, "tensor": 2}, True),
                                         ({"stage": 2, "fsdp": 2, "expert": 2, "zero_bubble": 1}, True)],
                         ids=["fsdp2xexpert2xtensor2", "stage2xfsdp2xexpert2", "whole-deepseek-v3",
                              "whole-deepseek-v3-zero-bubble-stages"])
def test_deepseek_router_step_compiles(mesh, whole):
    """DeepSeek-V3's router (sigmoid, group-limited, the balancing bias moved by the step) beside the grouped
    kernels' region (manual over the width) and inside 1F1B's stages, as tests/test_moe_router.py trains it;
    and the whole tiny DeepSeek-V3 with it, also in zero bubble's stages (the dense first layer on stage 0,
    multi-token prediction on the last, as tests/test_multi_token.py trains them)."""
    mesh = dict(mesh)
    schedule = {"pipeline.schedule": "zero_bubble", "model.n_layers": 5, "remat.policy": "full",
                "pipeline.overlap_transfers": True} if mesh.pop("zero_bubble", 0) else {}
    config = composed_config(mesh, moe=True)
    apply_overrides(config, {"model.dtype": "bfloat16", "model.moe_dropless": True, "train.seq_len": 64,
                             **DEEPSEEK_ROUTER, **(DEEPSEEK_REST if whole else {}), **schedule})
    found = {}
    aot.compile_report(config, "h100", 8, sample=None,
                       inspect=lambda compiled, run: found.update(text=compiled.as_text()))
    assert "sign(" in found["text"]  # the bias's step toward balance is in the program
    if "stage" not in mesh:
        assert _kernel_names(found["text"]) >= SWIGLU_KERNELS


def _exchange_between(text: str) -> list[bool]:
    """For each ragged all-to-all start / done pair: whether a grouped matmul kernel runs between them."""
    comps, _ = hlo._computations(text)
    out = []
    for lines in comps.values():
        open_: dict[str, bool] = {}
        for line in lines:
            done = re.search(r"ragged-all-to-all-done\(\s*%?([\w.\-]+)", line)
            if done and done.group(1) in open_:
                out.append(open_.pop(done.group(1)))
                continue
            start = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*\sragged-all-to-all-start\(", line)
            if start:
                open_[start.group(1)] = False
            elif "grouped_matmul" in line and kernel_model._TRITON_CALL in line:
                for name in open_:
                    open_[name] = True
    return out


def _row(name: str) -> dict:
    """The compiled step of one of `bench/moe.py --modeled`'s rows (the same program: a compile of one
    is read back from the per-user compile cache by the other), its report and its text."""
    config_name, devices, overrides = moe_bench.ROWS[name]
    config = apply_overrides(load_config_file(config_name), overrides)
    found: dict = {"config": config}
    found["report"] = aot.compile_report(config, "h100", devices, sample=None,
                                         inspect=lambda compiled, run: found.update(text=compiled.as_text(), run=run))
    return found


def _chunks(run) -> int:
    """The chunks of a device's tokens its dropless MoE layers run in (`model.moe_chunks` as the layer reads it)."""
    ep = math.prod(run.sizes[a] for a in run.rules.split_axes("expert"))
    return moe_dropless.chunks_for(run.config.train.seq_len, run.model.moe_chunks, ep)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b expert 8", "qwen3-30b-a3b expert 64"], ids=["expert8", "expert64"])
def test_exchange_sends_the_routed_rows_beside_the_expert_matmuls(name):
    row = _row(name)
    text, run, config = row["text"], row["run"], row["config"]
    m, devices, chunks = run.model, run.mesh.devices.size, _chunks(run)
    routed = config.train.seq_len * m.experts_per_token // chunks  # one sequence a device, a chunk's rows
    carried = routed * m.d_model * 2
    exchanges = [c for c in hlo.collectives(text, devices) if c.kind == "ragged-all-to-all"]
    assert len(exchanges) >= 4 * m.n_layers * chunks  # dispatch and return, forward and backward
    assert max(c.result_bytes for c in exchanges) <= 1.15 * carried, [c.result_bytes / carried for c in exchanges]
    # no buffer of the sorted rows copied: the dispatch's gradient fills its own (`moe_dropless._ragged_dispatch`)
    # where JAX's transpose makes a constant zero buffer XLA hoists out of the layer loop and copies a layer
    sorted_rows = re.compile(rf"= bf16\[{routed},{m.d_model}\]\S* copy\(")
    assert not [line for line in text.splitlines() if sorted_rows.search(line)]
    # each expert matmul's FLOPs within 1.25x of 2 x routed rows x d_model x width (a fused kernel runs two)
    one = 2.0 * routed * m.d_model * m.moe_mlp_dim
    products = {}
    for line in text.splitlines():
        if (kernel_model._TRITON_CALL in line and (i := hlo._INSTRUCTION.match(line))
                and (n := kernel_model._KERNEL_NAME.search(line))):
            if found := kernel_model._GROUPED.match(n.group(1)):
                products[i.group(1)] = kernel_model._GROUPED_FUSED.get(found.group(1), (1,))[0]
    ratios = sorted({k.flops / products[k.name] / one for k in kernel_model.kernels(text) if k.name in products})
    assert ratios and all(1 <= r <= 1.25 for r in ratios), ratios
    # the planner: memory within 10% of the compiler's, compute within 15% of the kernel model's
    report = row["report"]
    assert report.planner["peak"] == pytest.approx(report.step.memory["peak"], rel=0.10)
    assert report.planner_seconds == pytest.approx(report.step.modeled_seconds, rel=0.15)


@pytest.mark.xfail(strict=True, reason="22 of 48 exchanges at expert 8 (jax 0.10.2; 18 of 41 on jax 0.12 before "
                   "cuDNN's packed call for rows of documents) have a grouped kernel between start and done, where 2 "
                   "chunks a layer can hide 24: XLA's latency-hiding scheduler places the fused kernels' neighbours "
                   "otherwise")
def test_exchange_runs_beside_the_other_chunks_grouped_matmuls():
    """In c chunks a layer's pass exchanges 2c times; all but the first chunk's dispatch and the last one's
    return can run beside another chunk's grouped matmuls: (c - 1) / c of them."""
    row = _row("qwen3-30b-a3b expert 8")
    chunks = _chunks(row["run"])
    between = _exchange_between(row["text"])
    assert between and sum(between) >= (chunks - 1) / chunks * len(between), (sum(between), len(between))


@pytest.mark.parametrize("name", list(moe_bench.MFU_TARGETS), ids=lambda n: n.replace(" ", "-"))
def test_modeled_mfu_and_memory_targets(name, request):
    """The modeled MFU and peak targets of `bench/moe.py --modeled`; one not met yet is a strict expected
    failure naming the figure measured (`OPEN` there): it runs, and passing it fails the test."""
    if name in moe_bench.OPEN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=moe_bench.OPEN[name]))
    report = _row(name)["report"]
    assert report.modeled_mfu >= moe_bench.MFU_TARGETS[name], report.modeled_mfu
    assert report.step.memory["peak"] <= moe_bench.PEAK_TARGETS.get(name, float("inf"))


@pytest.mark.xfail(strict=True, reason="671B layout short of the acceptance point (jax 0.10.2): peak 73.43 GiB (fits), "
                   "planner / compiler 1.063, modeled MFU 18.0% against 35% (docs/moe.md, 'At real size')")
def test_deepseek_v3_671b_layout_compiles_for_2048_h100s():
    """configs/deepseek_v3_671b.py as the report trained it (16 stages x 64-way experts x ZeRO-1, 2,048 H100s),
    compiled ahead of time, at the acceptance point: within 78 GiB, the planner within 10% of the compiler, at
    least 35% modeled MFU."""
    config = load_config_file("deepseek_v3_671b")
    report = aot.compile_report(config, "h100", 2048, sample=None)
    assert report.sizes == {"data": 1, "fsdp": 2, "tensor": 1, "sequence": 1, "expert": 64, "stage": 16}
    assert report.fits, report.step.memory["peak"] / 2**30
    planner_over_compiler = report.planner["peak"] / report.step.memory["peak"]
    assert planner_over_compiler == pytest.approx(1, abs=0.10), planner_over_compiler
    assert report.modeled_mfu >= 0.35, report.modeled_mfu
