"""Every mesh, schedule and feature the float32 equivalence tests cover also trains in the default
compute dtype (bfloat16), the program users compile.

Float32 proves the maths; this proves the bf16 step compiles (XLA:CPU aborted on several of these
meshes before `mesh.compiler_options`) and trains: 3 steps, every loss and gradient norm finite
and within BF16_RTOL of the float32 single-device run of the same model.

BF16_RTOL = 2**-8, bfloat16's unit roundoff (8 significant bits): one rounding of the float32
value. The loss and the gradient norm are float32 reductions over thousands of bf16 terms whose
rounding errors average out rather than add, so a correct bf16 step stays within one rounding of
float32 (measured: loss within 2e-5, gradient norm within 7e-4 relative on the dense meshes). With
routed experts the bf16 inputs can move a token's top-k, a discrete choice: the tiny DeepSeek-V3's gradient
norm moves 0.37% on one device (its pipelined case is an expected failure naming its figure). Exactness is
the float32 suites' job (test_parallel_equivalence, test_pipeline, test_moe_train, test_attention_impls).
"""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np
import pytest

from meshtrain import config as config_lib
from meshtrain.parallel import layout
from meshtrain.validate import validate
from tests import utils

BF16_RTOL = 2.0**-8
STEPS = 3


def _dense(mesh: dict, **overrides):
    return utils.tiny_config(mesh, **overrides)


def _pipeline(mesh: dict, **overrides):
    """The pipeline tests' model: 8 layers, short sequences, 4 micro-batches."""
    return utils.tiny_config(mesh, **{"model.n_layers": 8, "train.seq_len": 16, "pipeline.microbatches": 4,
                                      **overrides})


def _moe(mesh: dict, **overrides):
    c = utils.load_config_file("tiny_moe")
    c.model.dtype = "float32"
    c.data.source = "synthetic"
    c.train.seq_len = 32
    for axis in utils.AXES:
        c.mesh[axis] = mesh.get(axis, 1)
    for key, value in overrides.items():
        section, leaf = key.split(".")
        c[section][leaf] = value
    return c


KINDS = {"dense": _dense, "pipeline": _pipeline, "moe": _moe}
LATENT = {"model.kv_lora_rank": 32, "model.q_lora_rank": 24, "model.qk_rope_head_dim": 8, "model.head_dim": 24,
          "model.v_head_dim": 16, "model.n_heads": 8, "model.n_kv_heads": 8}
FAMILY = {"model.attention_bias": True, "model.qk_norm": True, "model.rope_scaling": "llama3",
                        "model.rope_factor": 8.0, "model.rope_original_max_positions": 32, "model.sliding_window": 24}
# Keys that choose how the step is laid out, never what it computes: the float32 reference drops them.
LAYOUT_KEYS = {"train.zero_stage", "train.grad_accum_steps", "model.sequence_parallel", "model.collective_matmul",
               "remat.policy", "attention.impl", "attention.ulysses_degree", "attention.scores_dtype",
               "model.fused_norm", "model.fused_loss",
               "pipeline.schedule", "pipeline.repeats", "pipeline.microbatches", "pipeline.weight_parts",
               "pipeline.layers_per_stage", "model.moe_fsdp"}


def _case(kind: str, mesh: dict, marks=(), **overrides):
    name = "-".join(f"{a}{n}" for a, n in mesh.items()) or "1dev"
    extra = "-".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items())
    return pytest.param(kind, mesh, overrides, id=f"{kind}-{name}" + (f"-{extra}" if extra else ""), marks=marks)


# Features ride along on meshes (remat policies, accumulation, ZeRO stages, dropless) so that each
# mesh and each feature of the float32 suites compiles in bf16 at least once, in as few compiles
# as that takes.
CASES = [
    # test_parallel_equivalence, test_grad_accum, the remat policies
    _case("dense", {}, **{"remat.policy": "none"}),
    _case("dense", {"data": 8}, **{"remat.policy": "full"}),
    _case("dense", {"fsdp": 8}, **{"train.zero_stage": 3, "train.grad_accum_steps": 2}),
    _case("dense", {"data": 2, "fsdp": 2, "tensor": 2}, **{"train.grad_accum_steps": 4}),
    _case("dense", {"fsdp": 4, "tensor": 2}, **{"model.sequence_parallel": True, "remat.policy": "attention"}),
    _case("dense", {"data": 2, "fsdp": 4}, **{"train.zero_stage": 0, "remat.policy": "offload"}),
    _case("dense", {"data": 2, "fsdp": 4}, **{"train.zero_stage": 1, "train.grad_accum_steps": 2}),
    _case("dense", {"data": 2, "fsdp": 4}, **{"train.zero_stage": 2}),
    _case("dense", {"data": 2, "fsdp": 4}, **{"train.zero_stage": 3}),
    _case("dense", {"tensor": 4, "data": 2}, **{"model.sequence_parallel": True, "train.zero_stage": 0}),
    _case("dense", {"expert": 2, "fsdp": 2, "data": 2}, **{"train.zero_stage": 2, "train.grad_accum_steps": 2}),
    _case("dense", {"tensor": 4, "data": 2}, **{"model.sequence_parallel": True, "model.collective_matmul": True,
                                                "train.zero_stage": 0}),
    # test_attention_impls: ring attention, the Pallas kernels
    _case("dense", {"sequence": 4, "data": 2}, **{"attention.impl": "ring"}),
    _case("dense", {"data": 2, "sequence": 2, "tensor": 2}, **{"attention.impl": "ring", "train.grad_accum_steps": 2}),
    _case("dense", {"data": 8}, **{"attention.impl": "ring"}),
    # test_attention_impls: Ulysses, alone and with a ring across its groups
    _case("dense", {"sequence": 4, "data": 2}, **{"attention.impl": "ulysses"}),
    _case("dense", {"data": 2, "sequence": 2, "tensor": 2}, **{"attention.impl": "ulysses"}),
    _case("dense", {"sequence": 4, "data": 2}, **{"attention.impl": "ulysses", "attention.ulysses_degree": 2}),
    _case("dense", {"data": 8}, **{"attention.impl": "pallas", "model.fused_norm": True, "model.fused_loss": True,
                                   "remat.policy": "attention"}),
    # test_attention_impls: the einsum attention's scores in the compute dtype
    _case("dense", {"data": 2, "fsdp": 2, "tensor": 2}, **{"attention.impl": "xla",
                                                           "attention.scores_dtype": "compute"}),
    _case("dense", {"data": 2}, **{"attention.impl": "pallas", "model.fused_norm": True, "model.fused_loss": True,
                                   "train.grad_accum_steps": 2}),
    # test_hf: the model families' features (Qwen2 biases, Qwen3 q/k norm, Llama 3.1 RoPE, Mistral's window)
    _case("dense", {"data": 2, "fsdp": 2, "tensor": 2}, **FAMILY),
    # test_pallas_cross_entropy: the fused loss on the head's vocabulary shard
    _case("dense", {"data": 2, "tensor": 2}, **{"model.fused_loss": True}),
    # test_pipeline: every schedule on its meshes, more micro-batches, ZeRO-3 under 1F1B
    *[_case("pipeline", mesh, **{"pipeline.schedule": s, "pipeline.repeats": 2 if s == "circular" else 1})
      for s in ("gpipe", "circular", "1f1b") for mesh in ({"stage": 4}, {"stage": 2, "data": 2, "tensor": 2})],
    _case("pipeline", {"stage": 2, "data": 4}, **{"pipeline.schedule": "gpipe"}),
    _case("pipeline", {"stage": 2, "data": 4}, **{"pipeline.schedule": "1f1b"}),
    _case("pipeline", {"stage": 4, "data": 2}, **{"pipeline.microbatches": 8, "train.batch_size": 16}),
    _case("pipeline", {"stage": 2, "fsdp": 2}, **{"pipeline.schedule": "1f1b", "train.zero_stage": 3}),
    # test_pipeline_tables: the slot-table schedules on their meshes
    *[_case("pipeline", mesh, **{"pipeline.schedule": s, "pipeline.repeats": 2 if s == "interleaved_1f1b" else 1,
                                 "train.zero_stage": zero})
      for s, mesh, zero in [("interleaved_1f1b", {"stage": 2, "data": 2, "tensor": 2}, 1),
                            ("zero_bubble", {"stage": 2, "data": 2, "tensor": 2}, 1),
                            ("zero_bubble", {"stage": 2, "fsdp": 2, "tensor": 2}, 3),
                            ("interleaved_1f1b", {"stage": 4, "data": 2}, 1),
                            ("zero_bubble", {"stage": 4, "tensor": 2}, 1),
                            ("interleaved_1f1b", {"stage": 4, "fsdp": 2}, 3)]],
    _case("pipeline", {"stage": 4, "fsdp": 2}, **{"pipeline.schedule": "zero_bubble", "train.zero_stage": 3,
                                                  "pipeline.weight_parts": 2}),
    _case("pipeline", {"stage": 4, "data": 2}, **{"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2,
                                                  "pipeline.overlap_transfers": True}),
    # test_pipeline_uneven: uneven stages (1 + 2 + 2 + 1 by default; 4 + 2 given) under 1F1B and zero bubble
    _case("pipeline", {"stage": 4, "data": 2}, **{"pipeline.schedule": "1f1b", "model.n_layers": 6}),
    # ... and uneven chunks: interleaved 1F1B in 2 and 3 chunks a stage, circular in 2 (10 layers on 4 stages)
    _case("pipeline", {"stage": 4, "data": 2}, **{"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2,
                                                  "model.n_layers": 10}),
    _case("pipeline", {"stage": 4, "fsdp": 2}, **{"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 3,
                                                  "model.n_layers": 10, "pipeline.overlap_transfers": True,
                                                  "remat.policy": "attention"}),
    _case("pipeline", {"stage": 4, "data": 2}, **{"pipeline.schedule": "circular", "pipeline.repeats": 2,
                                                  "model.n_layers": 10}),
    _case("pipeline", {"stage": 4, "tensor": 2}, **{"pipeline.schedule": "zero_bubble", "model.n_layers": 6,
                                                    "remat.policy": "none"}),
    _case("pipeline", {"stage": 2, "fsdp": 2, "tensor": 2}, **{"pipeline.schedule": "zero_bubble", "model.n_layers": 6,
                                                               "pipeline.layers_per_stage": (4, 2),
                                                               "train.zero_stage": 3}),
    _case("pipeline", {"stage": 4, "tensor": 2}, **{"pipeline.schedule": "1f1b", "model.n_layers": 6,
                                                    "model.sequence_parallel": True, "model.collective_matmul": True,
                                                    "remat.policy": "full"}),
    # test_pipeline / test_pipeline_tables: transfers beside the next tick's compute
    _case("pipeline", {"stage": 4, "data": 2}, **{"pipeline.schedule": "1f1b", "pipeline.overlap_transfers": True}),
    _case("pipeline", {"stage": 4, "fsdp": 2}, **{"pipeline.schedule": "zero_bubble", "train.zero_stage": 3,
                                                  "pipeline.overlap_transfers": True, "pipeline.weight_parts": 2,
                                                  "remat.policy": "full"}),
    # ... under the default remat: W's inputs from B there too, handed over in the loop step; and each W over
    # the two B's of its loop step (test_pipeline_tables.test_weight_span_equals_single_device)
    _case("pipeline", {"stage": 4, "data": 2}, **{"pipeline.schedule": "zero_bubble",
                                                  "pipeline.overlap_transfers": True}),
    _case("pipeline", {"stage": 2, "data": 2, "tensor": 2}, **{"pipeline.schedule": "zero_bubble",
                                                               "pipeline.overlap_transfers": True,
                                                               "pipeline.weight_span": 2}),
    # test_moe_train: expert parallelism alone, with data (the README's command), tensor, accumulation
    _case("moe", {"expert": 8}),
    _case("moe", {"expert": 4, "data": 2}),
    _case("moe", {"data": 2, "expert": 2, "tensor": 2}, **{"model.moe_dropless": True}),
    _case("moe", {"data": 2, "fsdp": 2, "expert": 2}, **{"train.grad_accum_steps": 2}),
    # ... and the grouped matmul kernel (interpreted here), its region manual over the width too
    _case("moe", {"expert": 2, "fsdp": 2, "tensor": 2}, **{"model.moe_dropless": True, "model.moe_matmul": "pallas"}),
    # the experts over fsdp (model.moe_fsdp auto, dropless): ZeRO-1 and ZeRO-3; and gathered along D instead
    _case("moe", {"fsdp": 8}, **{"model.moe_dropless": True}),
    _case("moe", {"fsdp": 4, "expert": 2}, **{"model.moe_dropless": True, "train.zero_stage": 3}),
    _case("moe", {"fsdp": 4, "expert": 2}, **{"model.moe_dropless": True, "model.moe_fsdp": "weights"}),
    _case("moe", {"stage": 2, "fsdp": 2, "expert": 2}, **{"model.moe_dropless": True, "pipeline.schedule": "1f1b",
                                                        "train.zero_stage": 3}),
    # test_moe_router: DeepSeek-V3's router, its balancing bias moved by the step
    _case("moe", {"data": 2, "expert": 2, "tensor": 2}, **{
        "model.moe_dropless": True, "model.moe_router": "sigmoid", "model.moe_router_bias": True,
        "model.moe_groups": 4, "model.moe_topk_groups": 2, "model.moe_routed_scale": 2.5}),
    # test_latent_attention: multi-head latent attention, heads over tensor under ZeRO-3; beside the experts
    _case("dense", {"data": 2, "fsdp": 2, "tensor": 2}, **LATENT, **{"train.zero_stage": 3}),
    _case("moe", {"expert": 2, "fsdp": 2, "tensor": 2}, **LATENT, **{"model.moe_dropless": True}),
    # test_multi_token: the whole tiny DeepSeek-V3 (latent attention, the biased grouped router, a shared expert,
    # a dense first layer, multi-token prediction)
    _case("moe", {"data": 2, "expert": 2, "tensor": 2}, **LATENT, **{
        "model.moe_dropless": True, "model.moe_router": "sigmoid", "model.moe_router_bias": True,
        "model.moe_groups": 4, "model.moe_topk_groups": 2, "model.moe_routed_scale": 2.5, "model.shared_expert": True,
        "model.first_dense_layers": 1, "model.moe_every": 1, "model.mtp_depth": 1}),
    # ... and in zero bubble's stages (the dense layer on stage 0, the prediction block on the last). Its
    # gradient norm at step 2 sits on BF16_RTOL's edge, and one device sits nearly there: the bf16 inputs move
    # the router's top-k (a discrete choice), not one rounding. Which side of the edge depends on the host
    # (it passed on the CI host of 6523d90 and fails on an AVX512-BF16 host), so the expected failure is not
    # strict: the run shows XFAIL or XPASS. The compile and the finite steps are checked either way (any other
    # exception fails the test).
    _case("moe", {"stage": 2, "fsdp": 2, "expert": 2}, marks=pytest.mark.xfail(
        strict=False, raises=AssertionError,
        reason="bf16 gradient norm at step 2 is 0.393% from float32 on an AVX512-BF16 host (1.04269 against 1.03861; "
               "BF16_RTOL 0.391%); one device in bf16 is 0.370% from it, data2 x expert2 x fsdp2 0.391%: top-k "
               "flips under bf16 inputs (jax 0.10.2, numpy 2.4.6)"), **LATENT, **{
        "model.moe_dropless": True, "model.moe_router": "sigmoid", "model.moe_router_bias": True,
        "model.moe_groups": 4, "model.moe_topk_groups": 2, "model.moe_routed_scale": 2.5, "model.shared_expert": True,
        "model.first_dense_layers": 1, "model.moe_every": 1, "model.mtp_depth": 1, "model.n_layers": 5,
        "pipeline.schedule": "zero_bubble", "remat.policy": "full"}),
]


@functools.cache
def _reference(kind: str, mesh: tuple, model_overrides: tuple) -> tuple[list[dict], np.ndarray]:
    """(batches, [STEPS, 2] loss and gradient norm) of the float32 run on `mesh`."""
    config = KINDS[kind](dict(mesh), **dict(model_overrides))
    batches = utils.synthetic_batches(config, STEPS)
    records, _, _ = utils.train(config, batches)
    return batches, np.array([[r["loss"], r["grad_norm"]] for r in records])


@pytest.mark.parametrize("kind, mesh, overrides", CASES)
def test_trains_in_default_dtype_like_float32(kind, mesh, overrides):
    config = KINDS[kind](mesh, **overrides)
    config.model.dtype = config_lib.default_config().model.dtype  # what users compile
    assert config.model.dtype == "bfloat16"
    model_overrides = tuple(sorted((k, v) for k, v in overrides.items() if k not in LAYOUT_KEYS))
    batches, want = _reference(kind, (), model_overrides)
    sizes = validate(config, len(utils.devices_for(config)))
    perm = layout.data_permutation(config, sizes)  # ring attention's zig-zag token order
    if perm is not None:
        batches = [{k: v[:, perm] for k, v in b.items()} for b in batches]
    records, _, _ = utils.train(config, batches)
    got = np.array([[r["loss"], r["grad_norm"]] for r in records])
    if not np.isfinite(got).all():  # a failure, not the expected one of a case marked for its tolerance
        pytest.fail(f"non-finite loss or gradient norm in bf16: {got}")
    np.testing.assert_allclose(got, want, rtol=BF16_RTOL)


# test_compose: the triples that pair `stage` with `sequence` or `expert`, or `sequence` with
# `expert` (the other triples are the meshes above), and the Pallas kernels in stages and beside MoE.
COMPOSED = [t for t in itertools.combinations(config_lib.MESH_AXES, 3)
            if {"stage", "sequence"} <= set(t) or {"stage", "expert"} <= set(t) or {"sequence", "expert"} <= set(t)]
KERNELS = {"attention.impl": "pallas", "model.fused_norm": True, "model.fused_loss": True}
COMPOSED_CASES = [pytest.param(dict.fromkeys(t, 2), {}, id="-".join(t)) for t in COMPOSED] + [
    pytest.param({"stage": 2, "data": 2, "tensor": 2}, KERNELS, id="kernels-stage-data-tensor"),
    pytest.param({"expert": 2, "data": 2}, KERNELS, id="kernels-expert-data")] + [
    # test_compose's Ulysses meshes: beside MoE, in 1F1B's slots, ring x Ulysses in the slots
    pytest.param(mesh, {"attention.impl": "ulysses", "attention.ulysses_degree": degree},
                 id="ulysses-" + "-".join(f"{a}{n}" for a, n in mesh.items())) for mesh, degree in (
        ({"sequence": 2, "expert": 2, "data": 2}, 0), ({"sequence": 2, "stage": 2, "data": 2}, 0),
        ({"sequence": 4, "stage": 2}, 2))]


@functools.cache
def _composed_reference(moe: bool, ring: bool) -> tuple[list[dict], np.ndarray]:
    config = utils.composed_config({"expert": 2 if moe else 1, "sequence": 2 if ring else 1})
    for axis in utils.AXES:
        config.mesh[axis] = 8 if axis == "data" else 1
    batches = utils.synthetic_batches(config, STEPS)
    records, _, _ = utils.train(config, batches)
    return batches, np.array([[r["loss"], r["grad_norm"]] for r in records])


@pytest.mark.parametrize("mesh, overrides", COMPOSED_CASES)
def test_composed_mesh_trains_in_default_dtype_like_float32(mesh, overrides):
    config = utils.composed_config(mesh)
    for key, value in overrides.items():
        section, leaf = key.split(".")
        config[section][leaf] = value
    config.model.dtype = config_lib.default_config().model.dtype
    batches, want = _composed_reference("expert" in mesh, "sequence" in mesh)
    run = utils.resolve(config)
    if run.layout.permutation is not None:
        batches = [{k: v[:, run.layout.permutation] for k, v in b.items()} for b in batches]
    records, _, _ = utils.train(config, batches)
    got = np.array([[r["loss"], r["grad_norm"]] for r in records])
    assert np.isfinite(got).all(), got
    np.testing.assert_allclose(got, want, rtol=BF16_RTOL)


def test_bfloat16_parameters_train_sharded_like_one_device():
    """`model.param_dtype=bfloat16` (parameters and AdamW moments stored in bf16): 3 steps on
    fsdp=2 x data=2 under ZeRO-3 give one device's losses and gradient norms within one bf16
    rounding, and they stay finite."""
    def run(mesh):
        config = utils.tiny_config(mesh, **{"model.param_dtype": "bfloat16", "train.zero_stage": 3})
        config.model.dtype = "bfloat16"
        batches = utils.synthetic_batches(config, STEPS)
        records, state, _ = utils.train(config, batches)
        assert {str(p.dtype) for p in jax.tree.leaves(state.params)} == {"bfloat16"}
        return np.array([[r["loss"], r["grad_norm"]] for r in records])

    single, sharded = run({}), run({"fsdp": 2, "data": 2})
    assert np.isfinite(sharded).all(), sharded
    np.testing.assert_allclose(sharded, single, rtol=BF16_RTOL)
