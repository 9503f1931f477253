"""Multi-token prediction (DeepSeek-V3, `model.mtp_depth=1`).

* Its targets: at position t the token after next, never across a document boundary or past a row's end.
* Its loss: the block's cross-entropy from the report's equations (the final hidden state and the next
  token's embedding, each RMS-normalised, joined, projected, one block, its norm, the shared head),
  weighted into the objective; the logged loss stays the main model's.
* The model with it trains equal to one device on data x fsdp x tensor, ring attention, ZeRO-3 with
  accumulation, and as the whole tiny DeepSeek-V3 (latent attention, the biased router, experts).
* Sampling reads the main model alone; a run starts from a Hugging Face checkpoint with a fresh block.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import generate, model as model_lib, train, train_step
from meshtrain.config import ConfigError
from meshtrain.validate import validate
from tests import utils

MTP = {"model.mtp_depth": 1, "model.mtp_loss_weight": 0.3}
STEPS = 3


def test_targets_are_the_token_after_next_within_a_document():
    targets = np.array([[11, 12, 13, 14, 21, 22, 23, 0]])  # two documents, then padding
    segments = np.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    mask = (segments > 0).astype(np.float32)
    got = model_lib.mtp_targets({"targets": jnp.asarray(targets), "loss_mask": jnp.asarray(mask),
                                 "segment_ids": jnp.asarray(segments)})
    want_mask = np.zeros_like(mask)
    want_targets = np.zeros_like(targets)
    for t in range(targets.shape[1] - 1):
        want_targets[0, t] = targets[0, t + 1]
        want_mask[0, t] = float(segments[0, t] == segments[0, t + 1] and mask[0, t + 1] > 0 and mask[0, t] > 0)
    np.testing.assert_array_equal(np.asarray(got["loss_mask"]), want_mask)
    np.testing.assert_array_equal(np.asarray(got["targets"])[want_mask > 0], want_targets[want_mask > 0])
    assert want_mask.sum() == 5  # 12 13 14 | 22 23 predicted from two tokens back; nothing across documents


def _ce_sum(logits, targets, mask):
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - picked) * mask)


def test_loss_is_the_reports_prediction_of_the_token_after_next():
    config = utils.tiny_config({}, **{**MTP, "model.dtype": "float32"})
    run = utils.resolve(config)
    factory, _ = train_step.build(run)
    params = factory.create(0).params
    batch = jax.tree.map(jnp.asarray, utils.synthetic_batches(config, 1)[0])
    model, cfg = factory.model, run.model
    main_sum, aux = model.apply({"params": params}, batch, method=model_lib.Transformer.loss)
    # the reference: written from the report's equations with the model's own pieces (norms, one block, head)
    h = model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"],
                    method=model_lib.Transformer.hidden)
    p = params["mtp"]

    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale

    nxt = jnp.take(params["embedding"], jnp.roll(batch["inputs"], -1, axis=1), axis=0)
    joined = jnp.concatenate([rms(nxt, p["embed_norm"]["scale"]), rms(h, p["hidden_norm"]["scale"])], -1) @ p["proj"]
    block = model_lib.Block(cfg, model.rules, model.attention_fn)
    out, _ = block.apply({"params": p["block"]}, joined, batch["positions"], batch["segment_ids"])
    logits = rms(out, p["norm"]["scale"]) @ params["head"]
    t = batch["targets"].shape[1]
    keep = (jnp.arange(t) < t - 1) & (jnp.roll(batch["segment_ids"], -1, 1) == batch["segment_ids"])
    mask = batch["loss_mask"] * jnp.roll(batch["loss_mask"], -1, 1) * keep
    want = _ce_sum(logits, jnp.roll(batch["targets"], -1, 1), mask)
    np.testing.assert_allclose(aux[model_lib.MTP_SUM], cfg.mtp_loss_weight * want, rtol=1e-5)
    np.testing.assert_allclose(main_sum, _ce_sum(h @ params["head"], batch["targets"], batch["loss_mask"]),
                               rtol=1e-5)


DEEPSEEK = {"model.kv_lora_rank": 32, "model.q_lora_rank": 24, "model.qk_rope_head_dim": 8, "model.head_dim": 24,
            "model.v_head_dim": 16, "model.n_heads": 8, "model.n_kv_heads": 8, "model.moe_router": "sigmoid",
            "model.moe_router_bias": True, "model.moe_groups": 4, "model.moe_topk_groups": 2,
            "model.moe_routed_scale": 2.5, "model.moe_dropless": True, "model.shared_expert": True,
            "model.first_dense_layers": 1, "model.moe_every": 1}


@functools.cache
def _trained(key: tuple, moe: bool, overrides: tuple = ()):
    config = utils.composed_config(dict(key), moe=moe)
    utils.apply_overrides(config, {**MTP, **(DEEPSEEK if moe else {}), **dict(overrides)})
    records, state = utils.train_synthetic(config, STEPS)
    return (np.array([[r["loss"], r["mtp_loss"], r["grad_norm"]] for r in records]),
            jax.tree.map(np.asarray, state.params))


CASES = [({"data": 2, "fsdp": 2, "tensor": 2}, False, ()),
         ({"sequence": 2, "tensor": 2, "data": 2}, False, (("attention.zigzag", False),)),
         ({"fsdp": 8}, False, (("train.grad_accum_steps", 2),)),
         ({"expert": 2, "fsdp": 2, "tensor": 2}, True, ()),
         # pipelines: the dense first layer on stage 0 (before its chunk), the block on the last stage (after
         # the head), the experts split over `expert` beside `stage`; 4 MoE layers on 2 stages
         ({"stage": 2, "expert": 2, "data": 2}, True, (("remat.policy", "full"), ("model.n_layers", 5))),
         ({"stage": 2, "fsdp": 2, "expert": 2}, True, (("pipeline.schedule", "zero_bubble"),
                                                       ("remat.policy", "full"), ("model.n_layers", 5))),
         ({"stage": 2, "data": 4}, True, (("pipeline.schedule", "gpipe"), ("remat.policy", "full"),
                                          ("model.n_layers", 5))),
         # the Pallas kernels (grouped matmul, flash attention) in the MoE stages: an unchecked loop, whose
         # router statistics' cotangents `pipeline.unchecked_aux_scale` scales (a strong balance loss here)
         ({"stage": 2, "expert": 2, "data": 2}, True, (("pipeline.schedule", "zero_bubble"), ("remat.policy", "full"),
                                                       ("model.n_layers", 5), ("model.moe_matmul", "pallas"),
                                                       ("attention.impl", "pallas"), ("train.seq_len", 64),
                                                       ("model.aux_loss_weight", 0.1)))]
LAYOUT = ("pipeline.", "remat.", "attention.", "train.grad_accum_steps", "model.moe_matmul")


@pytest.mark.parametrize("sizes, moe, overrides", CASES, ids=[
    "x".join(f"{a}{n}" for a, n in s.items()) + ("-deepseek" if m else "") + "".join(f"-{k}={v}" for k, v in o)
    for s, m, o in CASES])
def test_model_trains_like_one_device(sizes, moe, overrides):
    """Losses, MTP losses, gradient norms and parameters (the block's among them) of one device, to 1e-4."""
    got, params = _trained(tuple(sorted(sizes.items())), moe, overrides)
    want, ref_params = _trained((), moe, tuple(o for o in overrides if not o[0].startswith(LAYOUT)))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert (want[:, 1] > 0).all() and "mtp" in ref_params
    chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-5)


def test_sampling_reads_the_main_model_alone():
    config = utils.tiny_config({}, **{**MTP, "model.dtype": "float32"})
    run = utils.resolve(config)
    params = train_step.build(run)[0].create(0).params
    prompts = [[1, 70, 72, 75], [1, 90]]
    new, logits = generate.generate(run.model, params, prompts, 6, return_logits=True)
    for row, prompt in enumerate(prompts):
        full = np.asarray(model_lib.logits(run.model, params, np.array([prompt + new[row]])))[0]
        np.testing.assert_allclose(logits[row], full[len(prompt) - 1:len(prompt) + 5], rtol=1e-5, atol=1e-5)


def test_a_run_starts_from_a_hugging_face_checkpoint_with_a_fresh_block(tmp_path):
    """A tiny DeepSeek-V3 from transformers (which keeps no prediction block) trains 2 steps with one."""
    import torch  # the test extra's (not the newest-JAX environment's, which runs this file's quick tests)
    import transformers
    torch.manual_seed(0)
    hf_config = transformers.DeepseekV3Config(
        vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=4,
        topk_group=2, first_k_dense_replace=1)
    transformers.DeepseekV3ForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    config = utils.config_for(tmp_path / "run", mesh={"data": 8}, **{
        "init.from_hf": str(tmp_path / "hf"), "steps": 2, **MTP, "model.num_experts": 8, "mesh.expert": 1})
    assert train.run(config)["step"] == 2
    assert config.model.kv_lora_rank == 16 and config.model.first_dense_layers == 1


@pytest.mark.parametrize("override, match", [
    ({"model.mtp_depth": 2}, "must be 0 or 1"),
    ({"model.fused_loss": True}, "the fused loss serves the main head alone"),
    ({"mesh.sequence": 2, "mesh.data": 4, "attention.impl": "ring"}, "set attention.zigzag=False"),
    ({"mesh.stage": 2, "mesh.data": 4, "model.matmul_precision": "fp8"}, "FP8 amax histories ride through a pipeline"),
])
def test_validation_names_key_value_and_rule(override, match):
    config = utils.apply_overrides(utils.tiny_config({"data": 8}, **MTP), override)
    with pytest.raises(ConfigError, match=match):
        validate(config, 8)
