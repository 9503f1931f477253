"""FP8 matmuls (`model.matmul_precision='fp8'`, fp8.py): where the step quantises and which dots take FP8
operands (its CUDA lowering; tests/test_gpu_aot.py counts the FP8 GEMMs the H100 compiler makes),
that sharding, accumulation and resume leave the numbers unchanged, and that the default dtype trains.

Tolerances: with power-of-two scales every mesh quantises with the same scales, so what remains
between meshes is float32 summation order. That can move an operand across an FP8 rounding
boundary (one element changes by one e4m3 step, 1/16 to 1/8 of itself), and Adam turns the
slightly changed gradient of an element whose gradient is near zero into an update of up to the
learning rate: parameters are compared at 1e-4 (measured: 5e-6), losses at 1e-5 relative.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import config as config_lib, fp8, metrics, optimizer, train, train_step, validate
from tests import utils
from tests.test_checkpoint import hook_data

STEPS = 3
QUANTISED = {  # the matmuls that run in FP8, as amax-history paths: attention projections and MLPs
    "tiny": {"layers/attn/qkv", "layers/attn/out", "layers/mlp/gate_up", "layers/mlp/down"},
    "tiny_moe": {"layers/dense_0/attn/qkv", "layers/dense_0/attn/out", "layers/dense_0/mlp/gate_up",
                 "layers/dense_0/mlp/down", "layers/moe_layer/attn/qkv", "layers/moe_layer/attn/out",
                 "layers/moe_layer/moe/expert_gate", "layers/moe_layer/moe/expert_up",
                 "layers/moe_layer/moe/expert_down"},
}


def _config(name: str, mesh: dict, dtype: str = "float32", **overrides):
    c = utils.load_config_file(name)
    c.model.dtype, c.data.source = dtype, "synthetic"
    for axis in utils.AXES:
        c.mesh[axis] = mesh.get(axis, 1)
    c.train.seq_len, c.train.warmup_steps = 32, 1
    c.model.matmul_precision = "fp8"
    return utils.apply_overrides(c, overrides)


def _paths(tree) -> set[str]:
    return {"/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


@functools.cache
def _trained(name: str, mesh_key: tuple, dtype: str = "float32", overrides: tuple = ()):
    """(losses, final params, final amax histories) of STEPS steps on synthetic batches."""
    config = _config(name, dict(mesh_key), dtype, **dict(overrides))
    records, state, _ = utils.train(config, utils.synthetic_batches(config, STEPS))
    return (np.array([r["loss"] for r in records]), jax.tree.map(np.asarray, state.params),
            jax.tree.map(np.asarray, state.fp8))


def _key(mesh: dict) -> tuple:
    return tuple(sorted(mesh.items()))


def _assert_close(got, want):
    (losses, params, histories), (want_losses, want_params, want_histories) = got, want
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-4, rtol=0), params, want_params)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5), histories, want_histories)


# --- where the step quantises --------------------------------------------------------------


def _f8_converts(text: str, dtype: str) -> tuple[int, int]:
    """(quantisations to `dtype`, conversions back from it) in lowered StableHLO."""
    to = len(re.findall(rf"stablehlo\.convert [^\n]*-> tensor<[0-9x]*{dtype}>", text))
    back = len(re.findall(rf"stablehlo\.convert [^\n]*\(tensor<[0-9x]*{dtype}>\)", text))
    return to, back


_F8_DOT = re.compile(r"stablehlo\.dot_general [^\n]*: \(tensor<[0-9x]*(f8\w+)>, tensor<[0-9x]*(f8\w+)>\)")


def _f8_dots(text: str) -> dict[tuple[str, str], int]:
    """The two FP8 element types (sorted) -> dot_generals that multiply them, in lowered StableHLO."""
    found: dict[tuple[str, str], int] = {}
    for pair in _F8_DOT.findall(text):
        key = tuple(sorted(pair))
        found[key] = found.get(key, 0) + 1
    return found


@functools.cache
def _lowered(name: str, precision: str) -> tuple[str, object]:
    """The default-dtype (bf16) step lowered for CUDA on one device, without recomputation (each
    forward appears once), and the state's abstract amax histories."""
    config = _config(name, {}, "bfloat16", **{"remat.policy": "none", "model.matmul_precision": precision})
    run = utils.resolve(config)
    factory, step = train_step.build(run)
    batch = utils.synthetic_batches(config, 1)[0]
    with jax.set_mesh(run.mesh):
        text = step.trace(factory.abstract, batch).lower(lowering_platforms=("cuda",)).as_text()
    return text, factory.abstract.fp8


@pytest.mark.parametrize("name", ["tiny", "tiny_moe"])
def test_cuda_lowering_quantises_exactly_the_attention_and_mlp_matmuls(name):
    text, histories = _lowered(name, "fp8")
    assert _paths(histories) == QUANTISED[name]  # one amax history per FP8 matmul, none for head or router
    sites = len(QUANTISED[name])
    # forward: input and weight to e4m3; backward: the output gradient to e5m2, once per matmul; none
    # is converted back: the dots take the FP8 values (what XLA's GPU compiler makes FP8 GEMMs of)
    assert _f8_converts(text, "f8E4M3FN") == (2 * sites, 0)
    assert _f8_converts(text, "f8E5M2") == (sites, 0)
    # forward e4m3 x e4m3; input gradient and weight gradient e5m2 with e4m3 (einsum picks the order)
    assert _f8_dots(text) == {("f8E4M3FN", "f8E4M3FN"): sites, ("f8E4M3FN", "f8E5M2"): 2 * sites}
    plain, no_histories = _lowered(name, "bf16")
    assert no_histories == {}
    assert _f8_converts(plain, "f8E4M3FN") == (0, 0) and _f8_converts(plain, "f8E5M2") == (0, 0)
    assert text.count("stablehlo.dot_general") == plain.count("stablehlo.dot_general")  # no matmul added


@pytest.mark.parametrize("dot, shapes", [
    (fp8.einsum_dot("btd,df->btf"), ((2, 16, 32), (32, 24))),
    (fp8.einsum_dot("btd,dsn...->btsn..."), ((2, 16, 32), (32, 2, 3, 8))),  # the fused QKV projection
    (fp8.einsum_dot("necd,edf->necf"), ((2, 4, 8, 32), (4, 32, 16))),  # capacity experts
    (fp8.RAGGED_DOT, ((24, 32), (3, 32, 16))),  # dropless experts: rows sorted by group
], ids=["dense", "column-parallel", "experts", "grouped"])
def test_fp8_dots_and_their_transposes_equal_the_dequantised_matmul(dot, shapes):
    """`scaled_dot`'s forward, input gradient and weight gradient (dots of FP8 values, the scales
    applied after) equal the plain matmul of the dequantised operands and its autodiff, in float32."""
    keys = jax.random.split(jax.random.key(0), 3)
    x, w = (jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=False))
    extra = (jnp.array([10, 0, 14], jnp.int32),) if dot is fp8.RAGGED_DOT else ()
    history = jnp.zeros((3, 4), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: fp8.scaled_dot(dot, True, x, w, history, *extra), x, w)
    g = jax.random.normal(keys[2], y.shape, jnp.float32)
    dx, dw = vjp(g)

    def scale(a, dtype):
        return fp8.scale_for(jnp.zeros(4), fp8.amax(a), dtype)
    xq = fp8.quantize_dequantize(x, scale(x, fp8.E4M3), fp8.E4M3)
    wq = fp8.quantize_dequantize(w, scale(w, fp8.E4M3), fp8.E4M3)
    gq = fp8.quantize_dequantize(g, scale(g, fp8.E5M2), fp8.E5M2)
    want, want_vjp = jax.vjp(lambda a, b: dot(a, b, *extra), xq, wq)
    want_dx, want_dw = want_vjp(gq)
    for got, ref in ((y, want), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


# --- the same numbers on every mesh ---------------------------------------------------------


@functools.cache
def _first_step(name: str):
    """The state after one step on one device (host arrays) and the batches of the steps after it.

    The equivalence tests start from it: a step with an empty history scales by the current amax,
    which a manual region (the data-parallel accumulation loop) takes over each device's part of the
    batch, so only from the second step on do every mesh and accumulation quantise alike."""
    config = _config(name, {})
    batches = utils.synthetic_batches(config, STEPS + 1)
    run = utils.resolve(config)
    factory, step_fn = train_step.build(run)
    with jax.set_mesh(run.mesh):
        state, _ = step_fn(factory.create(config.seed), batches[0])
    return jax.tree.map(np.asarray, state), batches[1:]


@functools.cache
def _continued(name: str, mesh_key: tuple, overrides: tuple = ()):
    """(losses, final params, final amax histories) of STEPS steps on `mesh` from `_first_step`."""
    host_state, batches = _first_step(name)
    run = utils.resolve(_config(name, dict(mesh_key), **dict(overrides)))
    factory, step_fn = train_step.build(run)
    state = jax.tree.map(lambda a, target: jax.device_put(a, target.sharding), host_state, factory.abstract)
    state = factory.from_canonical(state)  # the schedule's layer order (circular, interleaved: not the execution order)
    losses = []
    with jax.set_mesh(run.mesh):
        for batch in batches:
            state, m = step_fn(state, batch)
            losses.append(float(m["loss"]))
    state = factory.to_canonical(state)
    return np.array(losses), jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, state.fp8)


@pytest.mark.parametrize("name, mesh", [("tiny", {"fsdp": 2, "tensor": 2, "data": 2}),
                                        ("tiny_moe", {"expert": 2, "data": 2})],
                         ids=["fsdp-tensor-data", "expert-data"])
def test_sharded_step_equals_one_device(name, mesh):
    """GSPMD's fsdp x tensor x data and expert parallelism: a step's loss, every gradient and every
    recorded amax equal one device's, from a shared state (the comparison of the pipeline schedules
    below). Compared after one step, not several: on one machine (AMD EPYC, jaxlib 0.10.2) the rounding
    flips of three steps moved parameters by up to 2e-4 through Adam (fsdp x tensor x data at XLA's
    default LLVM level, expert x data at the suite's level 0), where the gradients differ by flips alone."""
    _assert_one_step_equal(name, mesh, {}, {})
    assert all((h[..., :STEPS + 1] > 0).all() for h in jax.tree.leaves(_continued(name, ())[2]))  # every step


def _adam_drift_bound(config) -> float:
    """The most one parameter entry of two AdamW runs can drift apart over STEPS steps after `_first_step`,
    whatever their gradients: each update moves an entry by lr_t |m_t / sqrt(v_t)| (plus the decay, which
    moves both runs alike to first order), and by Cauchy-Schwarz |m_t / sqrt(v_t)| (bias-corrected) is at
    most (1 - b1) / sqrt(1 - b2) * sqrt(1 - b2^t) / (1 - b1^t) * sqrt(sum_{i<t} (b1^2 / b2)^i), so two
    runs part by at most twice the sum of lr_t times that over the steps."""
    b1, b2 = config.train.b1, config.train.b2
    schedule = optimizer.learning_rate_schedule(config)

    def most(t: int) -> float:
        return ((1 - b1) / math.sqrt(1 - b2) * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                * math.sqrt(sum((b1 * b1 / b2) ** i for i in range(t))))
    return 2 * sum(float(schedule(step)) * most(step + 1) for step in range(1, STEPS + 1))


@pytest.mark.parametrize("name, mesh", [("tiny", {"fsdp": 2, "tensor": 2, "data": 2}),
                                        ("tiny_moe", {"expert": 2, "data": 2})],
                         ids=["fsdp-tensor-data", "expert-data"])
def test_sharded_steps_follow_one_device(name, mesh):
    """STEPS optimizer steps on the sharded mesh against one device, from the shared state: every step's loss
    within float32 (1e-5), every parameter within the drift AdamW allows two runs whose gradients differ
    (`_adam_drift_bound`: near-zero gradient entries summed in another order turn into updates of either
    sign). A wrong scale, layer or micro-batch moves the losses. (The amaxes the later steps record follow the
    parameters' drift: 1 of 96 expert-data entries 6.3e-5 apart after three steps; the one-step comparison
    above holds them to 1e-5.)"""
    losses, params, _ = _continued(name, _key(mesh))
    want_losses, want_params, _ = _continued(name, ())
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    bound = _adam_drift_bound(_config(name, {}))
    jax.tree.map(functools.partial(np.testing.assert_allclose, atol=bound, rtol=0), params, want_params)


def test_accumulation_equals_one_pass():
    """Micro-batches take the largest amax of all of them (max-combined cotangents), so 2 micro-batches
    on the data-parallel accumulation loop quantise as one pass on one device."""
    got = _continued("tiny", _key({"data": 2, "fsdp": 2}), (("train.grad_accum_steps", 2),))
    _assert_close(got, _continued("tiny", ()))


def test_nonfinite_step_keeps_the_histories():
    """A withheld (non-finite) step leaves the amax histories as they were, with the parameters."""
    host_state, batches = _first_step("tiny")
    run = utils.resolve(_config("tiny", {}))
    factory, step_fn = train_step.build(run)
    poisoned = dict(host_state.params)
    poisoned["embedding"] = jax.tree.map(lambda a: np.full_like(a, np.nan), poisoned["embedding"])
    state = jax.device_put(host_state.replace(params=poisoned))
    with jax.set_mesh(run.mesh):
        after, m = step_fn(state, batches[0])
    assert float(m["nonfinite"]) == 1.0
    utils.assert_bitwise(after.fp8, host_state.fp8)
    assert int(after.step) == int(host_state.step)


# --- pipeline schedules --------------------------------------------------------------------------


@functools.cache
def _one_step_grads(name: str, mesh_key: tuple, overrides: tuple = ()):
    """(loss sum, gradients, amaxes) of one step from `_first_step`'s state on `mesh`, computed as the
    step computes them (`train_step.step_gradients`: autodiff, the manual accumulation loop, or a
    pipeline schedule's loop)."""
    host_state, batches = _first_step(name)
    config = _config(name, dict(mesh_key), **dict(overrides))
    run = utils.resolve(config)
    factory, _ = train_step.build(run)
    state = jax.tree.map(lambda a, target: jax.device_put(a, target.sharding), host_state, factory.abstract)
    state = factory.from_canonical(state)

    def step(state, batch):
        tokens = jnp.maximum(batch["loss_mask"].sum(), 1.0)
        loss_sum, _, grads, amaxes = train_step.step_gradients(
            state, batch, tokens, model=factory.model, grad_specs=factory.grad_specs, zero_shards=factory.zero_shards,
            accum_steps=config.train.grad_accum_steps, manual_axes=run.layout.accumulation_axes,
            grads_fn=run.layout.grads_function(train_step.grads_one_pass), checked=not run.layout.kernels)
        return loss_sum, state.replace(params=grads, fp8=fp8.from_grad(amaxes))
    with jax.set_mesh(run.mesh):
        loss_sum, out = jax.jit(step)(state, batches[0])
    out = factory.to_canonical(out)
    return float(loss_sum), jax.tree.map(np.asarray, out.params), jax.tree.map(np.asarray, out.fp8)


FLIPS = 1e-3  # at most this share of a gradient's entries moved by a rounding flip
FLIP_RTOL = 2e-2  # ... each by at most this much of itself


def _assert_equal_but_for_rounding_flips(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """float32 equality (1e-5, 1e-7 absolute) of every entry but those an FP8 rounding flip moved.

    Two layouts sum in different orders, so an operand within float32 rounding (1e-7 relative) of
    an e4m3 / e5m2 rounding boundary can round to the neighbouring FP8 value in one of them: that
    element moves by one FP8 step (an eighth of itself in e4m3, a quarter in e5m2), and the few
    weight-gradient entries it feeds move by about 1% (measured: 5 of 8192 entries of one leaf, 1.3%).
    A wrong scale, a lost micro-batch or a misplaced layer moves most entries, by far more."""
    close = np.isclose(got, want, rtol=1e-5, atol=1e-7)
    flipped = ~close
    assert flipped.mean() <= FLIPS, f"{name}: {flipped.sum()} of {got.size} entries differ beyond 1e-5"
    np.testing.assert_allclose(got[flipped], want[flipped], rtol=FLIP_RTOL, atol=1e-7, err_msg=name)


KERNELS = {"attention.impl": "pallas", "model.fused_norm": True, "model.fused_loss": True}
PIPELINES = [  # the stage loop under autodiff (laps, bubble ticks, layers stored out of order, Pallas kernels),
    # 1F1B's own loop, and the slot tables (B and W apart), beside data, fsdp (ZeRO-3), tensor and expert
    ("tiny", {"stage": 2, "fsdp": 2, "tensor": 2},
     {"pipeline.schedule": "circular", "pipeline.repeats": 2, "train.zero_stage": 3, **KERNELS}),
    ("tiny", {"stage": 2, "data": 2, "fsdp": 2}, {"pipeline.schedule": "1f1b"}),
    ("tiny_moe", {"stage": 2, "expert": 2, "data": 2},
     {"pipeline.schedule": "zero_bubble", "model.moe_balance_scope": "sequence"}),
    # transfers overlapped: W's inputs from B through the FP8 taps, B's record handed to W in the loop step
    ("tiny", {"stage": 2, "data": 2, "tensor": 2},
     {"pipeline.schedule": "zero_bubble", "pipeline.overlap_transfers": True}),
]
PIPELINE_IDS = [f"{o['pipeline.schedule']}-" + "-".join(m) for _, m, o in PIPELINES]


@pytest.mark.parametrize("name,mesh,overrides", PIPELINES, ids=PIPELINE_IDS)
def test_pipeline_schedules_equal_one_device(name, mesh, overrides):
    """Under every pipeline schedule a step's loss, every gradient and every recorded amax equal one
    device's (float32: 1e-5, as the float32 pipeline tests). Each stage records the amaxes of its own
    layers, on its micro-batches only (not in bubble ticks), each device its own, maximised once
    after the loop. Compared after one step from a shared state: over several steps Adam turns the
    float32 summation order of near-zero gradient entries into parameter differences (see above)."""
    reference = {k: v for k, v in overrides.items() if not k.startswith(("pipeline.", "train.zero_stage"))}
    _assert_one_step_equal(name, mesh, overrides, reference)


def _assert_one_step_equal(name: str, mesh: dict, overrides: dict, reference: dict) -> None:
    """One step on `mesh` with `overrides` against one device with `reference`: the loss (1e-5), every
    gradient but for FP8 rounding flips, every layer's newest amaxes (1e-5)."""
    loss, grads, amaxes = _one_step_grads(name, _key(mesh), tuple(overrides.items()))
    want_loss, want_grads, want_amaxes = _one_step_grads(name, (), tuple(reference.items()))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        want = functools.reduce(lambda t, k: t[k.key], path, want_grads)
        _assert_equal_but_for_rounding_flips(g, want, jax.tree_util.keystr(path))
    assert _paths(amaxes) == QUANTISED[name]
    for path, a in jax.tree_util.tree_leaves_with_path(amaxes):
        want = functools.reduce(lambda t, k: t[k.key], path, want_amaxes)
        assert (a[..., 0] > 0).all(), jax.tree_util.keystr(path)  # the newest amaxes (what `fp8.advance` reads)
        np.testing.assert_allclose(a[..., 0], want[..., 0], rtol=1e-5, err_msg=jax.tree_util.keystr(path))


# --- resume -------------------------------------------------------------------------------------


def test_resume_is_bitwise_equal_to_the_uninterrupted_run(tmp_path, monkeypatch, compilation_cache):
    """6 steps straight vs stopped (SIGTERM) after step 3 and resumed: the same losses, evaluation
    losses and final state (parameters, optimizer state and amax histories), bit for bit."""
    overrides = {"model.matmul_precision": "fp8", "steps": 6, "checkpoint.every": 3, "eval_every": 3,
                 "eval_batches": 1}
    straight = tmp_path / "straight"
    train.run(utils.config_for(straight, **overrides))
    hook_data(monkeypatch, lambda step, batch: (os.kill(os.getpid(), signal.SIGTERM) if step == 3 else None)
              or batch)
    resumed = tmp_path / "resumed"
    config = utils.config_for(resumed, **overrides)
    assert train.run(config)["step"] == 3
    assert train.run(config)["step"] == 6
    assert utils.losses_of(resumed) == utils.losses_of(straight)
    abstract = utils.abstract_state(config)
    a, b = utils.load(resumed, 6, abstract).state, utils.load(straight, 6, abstract).state
    assert jax.tree.leaves(a.fp8)  # the histories are in the checkpoint
    utils.assert_bitwise(a, b)
    with open(straight / "metrics.jsonl") as f:
        evals = [r["eval_loss"] for r in map(json.loads, f) if "eval_loss" in r]
    assert len(evals) == 2 and all(np.isfinite(evals))


# --- the default dtype -------------------------------------------------------------------------


@pytest.mark.parametrize("name,mesh,overrides", [
    ("tiny", {"sequence": 2, "tensor": 2, "fsdp": 2},
     {"attention.impl": "ring", "train.zero_stage": 3, "train.grad_accum_steps": 2, "remat.policy": "full",
      "model.sequence_parallel": True}),
    ("tiny_moe", {"expert": 2, "data": 2, "tensor": 2}, {"model.moe_dropless": True, "train.grad_accum_steps": 2}),
    *PIPELINES,
], ids=["ring-tensor-sp-zero3-accum", "moe-dropless-ep-accum", *PIPELINE_IDS])
def test_default_dtype_trains(name, mesh, overrides):
    losses, _, histories = _trained(name, _key(mesh), "bfloat16", tuple(overrides.items()))
    assert np.isfinite(losses).all()
    for h in jax.tree.leaves(histories):
        assert np.isfinite(h).all() and (h[..., :STEPS] > 0).all() and (h[..., STEPS:] == 0).all()


# --- config and peaks ---------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,key", [
    ({"model.matmul_precision": "fp16"}, "model.matmul_precision"),
    ({"model.fp8_history": 0}, "model.fp8_history"),
])
def test_bad_fp8_config_is_refused_before_compiling(overrides, key):
    config = utils.apply_overrides(utils.tiny_config(), overrides)
    with pytest.raises(config_lib.ConfigError) as error:
        validate.validate(config, 1, inputs=False)
    assert error.value.key == key


def test_mfu_counts_the_fp8_share_at_the_fp8_peak():
    cfg = config_lib.ModelConfig.from_config(_config("tiny", {}))
    d, h, k, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
    quantised = cfg.n_layers * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f)
    assert metrics.fp8_flops_per_token(cfg) == 6 * quantised
    share = 6 * quantised / metrics.flops_per_token(cfg, 32)
    peak = metrics.blended_peak(989e12, 1979e12, share)
    seconds = share / 1979e12 + (1 - share) / 989e12  # one FLOP's time at peak, each share at its rate
    assert peak == pytest.approx(1 / seconds, rel=1e-12)
    assert metrics.blended_peak(312e12, None, share) == 312e12  # no FP8 units: all at the bf16 rate
    bf16 = config_lib.ModelConfig.from_config(utils.tiny_config())
    assert metrics.fp8_flops_per_token(bf16) == 0


def test_history_advances_and_keeps_unused_rows():
    history = np.array([[3.0, 2.0, 1.0]] * 3, np.float32)
    cotangent = np.array([[5.0, -np.inf, -np.inf], [-np.inf] * 3, [7.0, -np.inf, -np.inf]], np.float32)
    got = np.asarray(fp8.advance(history, cotangent))
    np.testing.assert_array_equal(got, [[5.0, 3.0, 2.0], [3.0, 2.0, 1.0], [7.0, 3.0, 2.0]])
