"""Hugging Face import / export against `transformers` itself: logits, round trips, bad input.

Random tiny Llama (GQA; untied and tied head) and Mixtral models are written with
`save_pretrained` into temporary folders; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.torch import save_file

from meshtrain import config as config_lib, generate, hf, model as model_lib
from meshtrain.hf import __main__ as hf_cli, convert as hf_convert, formats as hf_formats, io as hf_io
from meshtrain.run import Run
from meshtrain.sharding_rules import Rules
from meshtrain.validate import validate
from tests.utils import mesh_of, tiny_config

VOCAB, SEQ = 96, 12
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.2, rms_norm_eps=1e-5, rope_theta=50000.0)
MESHES = [None, {"fsdp": 4, "tensor": 2}]


def _save(path, model_cls, config_cls, seed: int, dtype=torch.float32, **kwargs) -> str:
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(dtype).eval()
    model.save_pretrained(path, max_shard_size="40KB")  # several shards + index
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    llama, mixtral = (transformers.LlamaForCausalLM, transformers.LlamaConfig), (
        transformers.MixtralForCausalLM, transformers.MixtralConfig)
    return {
        "llama": _save(root / "llama", *llama, seed=0, **LLAMA),
        "llama_tied": _save(root / "llama_tied", *llama, seed=1, tie_word_embeddings=True, **LLAMA),
        "llama_bf16": _save(root / "llama_bf16", *llama, seed=2, dtype=torch.bfloat16, **LLAMA),
        "mixtral": _save(root / "mixtral", *mixtral, seed=3, num_local_experts=4, num_experts_per_tok=2, **LLAMA),
        "mistral": _save(root / "mistral", transformers.MistralForCausalLM, transformers.MistralConfig, seed=4,
                         sliding_window=None, **LLAMA),
    }


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(4, SEQ))


def _reference_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _mesh(sizes):
    if sizes is None:
        return None
    return mesh_of(**sizes)


def _tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("mesh", MESHES, ids=["1dev", "fsdp4_tensor2"])
@pytest.mark.parametrize("name", ["llama", "llama_tied", "mixtral"])
def test_logits_equal_transformers(checkpoints, name, mesh):
    tokens = _tokens()
    expected = _reference_logits(checkpoints[name], tokens)
    cfg, params = hf.load(checkpoints[name], _mesh(mesh))
    assert cfg.n_kv_heads == 2 and cfg.n_heads == 4 and cfg.tie_embeddings == (name == "llama_tied")
    assert cfg.num_experts == (4 if name == "mixtral" else 0)
    got = np.asarray(model_lib.logits(cfg, params, tokens))
    assert got.dtype == np.float32 and got.shape == (4, SEQ, VOCAB)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits


def test_mistral_logits_equal_transformers(checkpoints):
    tokens = _tokens(3)
    cfg, params = hf.load(checkpoints["mistral"])
    np.testing.assert_allclose(np.asarray(model_lib.logits(cfg, params, tokens)),
                               _reference_logits(checkpoints["mistral"], tokens), atol=1e-4, rtol=1e-4)


def test_loads_straight_into_mesh_shardings(checkpoints):
    mesh = _mesh({"fsdp": 4, "tensor": 2})
    _, params = hf.load(checkpoints["llama"], mesh)
    wq = params["layers"]["attn"]["wq"]  # [L, D_fsdp, H_tensor, Dh]
    assert wq.sharding.spec == P(None, "fsdp", "tensor") and wq.sharding.mesh == mesh
    assert params["head"].sharding.spec == P("fsdp", "tensor")
    shard = wq.addressable_shards[0]
    assert shard.data.shape == (2, 32 // 4, 4 // 2, 8)
    # The shard holds exactly its block of the Hugging Face q_proj (rows = heads x Dh, cols = D).
    q_proj = _tensors(checkpoints["llama"])["model.layers.1.self_attn.q_proj.weight"].numpy()
    full = q_proj.T.reshape(32, 4, 8)
    np.testing.assert_array_equal(np.asarray(shard.data)[1], full[shard.index[1:]])


@pytest.mark.parametrize("name", ["llama", "llama_tied", "llama_bf16", "mixtral"])
def test_round_trip_is_bitwise_and_loads_in_transformers(checkpoints, name, tmp_path):
    cfg, params = hf.load(checkpoints[name], _mesh({"fsdp": 4, "tensor": 2}))
    out = str(tmp_path / "export")
    hf.save(cfg, params, out, max_shard_bytes=20_000)
    assert os.path.exists(os.path.join(out, hf_formats.INDEX_FILE))
    original, exported = _tensors(checkpoints[name]), _tensors(out)
    assert sorted(original) == sorted(exported)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype, key
        assert torch.equal(exported[key].view(torch.uint8), tensor.view(torch.uint8)), key
    tokens = _tokens(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == hf_convert.ARCHITECTURES["mixtral" if name == "mixtral" else "llama"]
    with torch.no_grad():
        got = model(torch.tensor(tokens)).logits.float().numpy()
    np.testing.assert_array_equal(got, _reference_logits_dtype(checkpoints[name], tokens))


def _reference_logits_dtype(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def test_single_file_export_and_bfloat16_cast(checkpoints, tmp_path):
    cfg, params = hf.load(checkpoints["llama"])
    out = str(tmp_path / "bf16")
    hf.save(cfg, params, out, dtype="bfloat16")
    assert sorted(os.listdir(out)) == ["config.json", hf_formats.SINGLE_FILE]
    tensors = _tensors(out)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    cfg16, params16 = hf.load(out)
    assert cfg16.param_dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(params16["embedding"]).astype(np.float32),
                                  np.asarray(params["embedding"].astype("bfloat16")).astype(np.float32))


def test_cli_import_and_export(checkpoints, tmp_path, capsys):
    assert hf_cli.main(["import", checkpoints["llama"]]) == 0
    assert "['layers']['attn']['wq']" in capsys.readouterr().out
    out = str(tmp_path / "cli")
    assert hf_cli.main(["export", checkpoints["llama"], out]) == 0
    assert hf_cli.main(["export", checkpoints["llama"], out]) == 2  # exists, no --overwrite
    assert "exists" in capsys.readouterr().out
    assert hf_cli.main(["export", checkpoints["llama"], out, "--overwrite"]) == 0


# ------------------------------------------------------------------------------------------------
# Bad input: one clear error naming the key or the tensor.
# ------------------------------------------------------------------------------------------------


def _copy(src: str, dst, edit_config=None, edit_tensors=None) -> str:
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as fh:
        config = json.load(fh)
    if edit_config:
        edit_config(config)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    tensors = {k: v.contiguous() for k, v in _tensors(src).items()}
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, hf_formats.SINGLE_FILE), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("case, match", [
    ("model_type", r"model_type='gpt2'"),
    ("rope_scaling", r"rope_type='llama3'"),
    ("bias", r"attention_bias=True"),
    ("missing", r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    ("shape", r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(16, 32\); the config says \(32, 32\)"),
    ("dtype", r"tensor 'model.norm.weight': dtype F64 is not supported"),
    ("extra", r"model.layers.0.self_attn.q_proj.bias"),
])
def test_bad_checkpoints_name_the_key_or_tensor(checkpoints, tmp_path, case, match):
    src = checkpoints["llama"]
    edits = {
        "model_type": dict(edit_config=lambda c: c.update(model_type="gpt2")),
        "rope_scaling": dict(edit_config=lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0})),
        "bias": dict(edit_config=lambda c: c.update(attention_bias=True)),
        "missing": dict(edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "shape": dict(edit_config=lambda c: c.update(num_key_value_heads=4)),
        "dtype": dict(edit_tensors=lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()})),
        "extra": dict(edit_tensors=lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})),
    }[case]
    bad = _copy(src, tmp_path / case, **edits)
    with pytest.raises(hf.HFFormatError, match=match):
        hf.load(bad)


@pytest.mark.parametrize("damage, match", [
    ("truncated", r"model.safetensors: damaged \(truncated\?\): tensor '.*' ends at byte \d+ of a \d+-byte file"),
    ("header-length", r"model.safetensors: damaged or not a safetensors file \(its header length"),
    ("header-json", r"model.safetensors: damaged or not a safetensors file \(its header is not JSON"),
    ("empty", r"model.safetensors: damaged or not a safetensors file \(its header length, -1"),
])
def test_a_damaged_safetensors_file_is_named(checkpoints, tmp_path, damage, match):
    """A checkpoint file cut short, overwritten at its start, or empty: one error naming the file (and the first
    tensor past its end), from `hf import` as one line with exit code 2."""
    bad = _copy(checkpoints["llama"], tmp_path / damage)
    path = os.path.join(bad, hf_formats.SINGLE_FILE)
    data = open(path, "rb").read()
    data = {"truncated": data[:len(data) // 2], "header-length": b"\xff" * 8 + data[8:],
            "header-json": data[:8] + b"\x00" * 16 + data[24:], "empty": b""}[damage]
    open(path, "wb").write(data)
    with pytest.raises(hf.HFFormatError, match=match):
        hf.load(bad)
    assert hf_cli.main(["import", bad]) == 2
    if damage == "truncated":  # a run started from it: the same line under its key, before anything compiles
        from meshtrain import train

        config = tiny_config({"data": 8}, **{"init.from_hf": bad, "workdir": str(tmp_path / "run")})
        with pytest.raises(config_lib.ConfigError, match=r"config\.init\.from_hf=.*" + match):
            train.run(config)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_no_safetensors_and_no_config(tmp_path):
    with pytest.raises(hf.HFFormatError, match="no config.json"):
        hf.load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **LLAMA}))
    with pytest.raises(hf.HFFormatError, match="neither model.safetensors.index.json nor model.safetensors"):
        hf.load(str(tmp_path))


def test_failed_export_leaves_nothing_that_looks_complete(checkpoints, tmp_path, monkeypatch):
    cfg, params = hf.load(checkpoints["llama"])
    calls = []

    def fail_on_second_file(path, tensors, blocks):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(path, tensors, blocks)

    real = hf_formats.write_safetensors
    monkeypatch.setattr(hf_io, "write_safetensors", fail_on_second_file)
    out = tmp_path / "export"
    with pytest.raises(OSError, match="disk full"):
        hf.save(cfg, params, str(out), max_shard_bytes=20_000)
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # the temporary folder is gone too
    with pytest.raises(ValueError, match="dtype='float64'"):
        hf.save(cfg, params, str(out), dtype="float64")


# ------------------------------------------------------------------------------------------------
# Training from Hugging Face weights (config.init.from_hf).
# ------------------------------------------------------------------------------------------------


def test_train_state_from_hf_gives_transformers_loss(checkpoints):
    from meshtrain import train_step as train_step_lib

    config = tiny_config({"fsdp": 4, "tensor": 2}, **{"init.from_hf": checkpoints["llama"],
                                                      "train.batch_size": 4, "train.seq_len": SEQ})
    changed = hf.apply_model_config(config)
    assert changed["d_model"] == (64, 32) and config.model.vocab_size == VOCAB
    run = Run.resolve(config, jax.devices()[:8])
    factory, step_fn = train_step_lib.build(run)
    mesh = run.mesh
    state = hf.initial_state(factory, checkpoints["llama"])
    _, reference = hf.load(checkpoints["llama"])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state.params, reference)
    tokens = np.random.default_rng(2).integers(0, VOCAB, size=(4, SEQ + 1))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (4, SEQ)).copy(),
             "segment_ids": np.ones((4, SEQ), np.int32), "loss_mask": np.ones((4, SEQ), np.float32)}
    batch = {k: np.asarray(v, np.float32 if k == "loss_mask" else np.int32) for k, v in batch.items()}
    with jax.set_mesh(mesh):
        _, metrics = step_fn(state, batch)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    with torch.no_grad():
        logits = model(torch.tensor(tokens[:, :-1])).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     torch.tensor(tokens[:, 1:]).reshape(-1)).item()
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5, atol=1e-5)


def test_from_hf_must_be_a_checkpoint_folder(tmp_path):
    config = tiny_config(**{"init.from_hf": str(tmp_path)})
    with pytest.raises(config_lib.ConfigError, match=r"config.init.from_hf=.*config.json"):
        validate(config, 1)
    with pytest.raises(config_lib.ConfigError, match=r"config.init.from_hf"):
        hf.apply_model_config(config)


# ---- model families: Llama 3.1 (RoPE scaling), Qwen2 (q, k, v biases), Qwen3 (q/k norm), Mistral (window) ----

FAMILY_MESHES = [None, {"data": 2, "fsdp": 2, "tensor": 2}]
ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # short: SEQ spans all three bands
DEEPSEEK = {"rope_theta": 50000.0, "num_key_value_heads": 4, "num_hidden_layers": 3, "n_routed_experts": 8,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "kv_lora_rank": 16,
            "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "n_group": 4,
            "topk_group": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "eos_token_id": None}  # its default, 1, would end transformers' greedy decoding (the test runs to length)
FAMILIES = {
    "llama3.1": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {"rope_parameters": ROPE_LLAMA3}),
    "llama-linear": (transformers.LlamaForCausalLM, transformers.LlamaConfig,
                     {"rope_parameters": {"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {"rope_theta": 50000.0}),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"head_dim": 16, "rope_theta": 50000.0,
                                                                        "tie_word_embeddings": True}),
    "mistral-window": (transformers.MistralForCausalLM, transformers.MistralConfig,
                       {"sliding_window": 5, "rope_theta": 50000.0}),
    # Qwen3-MoE: q/k norm, 4 experts of width 16, top-2, the top-k weights renormalised (Qwen3-30B-A3B) or not
    **{name: (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
              {"head_dim": 16, "rope_theta": 50000.0, "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 16, "norm_topk_prob": norm})
       for name, norm in (("qwen3-moe", True), ("qwen3-moe-unnormalised", False))},
    # DeepSeek-V3: latent attention (both latents; the second without the query latent, with YaRN), the sigmoid
    # router with its balancing bias, 4 groups of 2 experts (top-2 groups), a shared expert, a dense first layer
    "deepseek-v3": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config, DEEPSEEK),
    # Moonlight's layout: two shared experts, one SwiGLU of twice the routed experts' width
    "deepseek-v3-two-shared": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config,
                               {**DEEPSEEK, "n_shared_experts": 2}),
    "deepseek-v3-yarn": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config, {
        **DEEPSEEK, "q_lora_rank": None, "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 16}}),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, str]:
    """A random tiny model of each family, its biases and norm scales drawn too (they start at 0 and 1)."""
    root, out = tmp_path_factory.mktemp("families"), {}
    base = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    for seed, (name, (model_cls, config_cls, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**{**base, **extra})).eval()
        with torch.no_grad():
            for key, p in model.named_parameters():
                if key.endswith("bias") or "norm" in key:
                    p.add_(0.3 * torch.randn_like(p))
            for key, b in model.named_buffers():  # DeepSeek-V3's balancing bias (a buffer: not trained)
                if key.endswith("e_score_correction_bias"):
                    b.add_(0.1 * torch.randn_like(b))
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("mesh", FAMILY_MESHES, ids=["1dev", "data2-fsdp2-tensor2"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_logits_equal_transformers(families, name, mesh):
    tokens = _tokens(5)
    expected = _reference_logits(families[name], tokens)
    cfg, params = hf.load(families[name], _mesh(mesh))
    assert (cfg.rope_scaling, cfg.attention_bias, cfg.qk_norm, cfg.sliding_window) == {
        "llama3.1": ("llama3", False, False, 0), "llama-linear": ("linear", False, False, 0),
        "qwen2": ("none", True, False, 0), "qwen3": ("none", False, True, 0),
        "mistral-window": ("none", False, False, 5), "qwen3-moe": ("none", False, True, 0),
        "qwen3-moe-unnormalised": ("none", False, True, 0), "deepseek-v3": ("none", False, False, 0),
        "deepseek-v3-two-shared": ("none", False, False, 0), "deepseek-v3-yarn": ("yarn", False, False, 0)}[name]
    if name.startswith("deepseek"):
        extra = FAMILIES[name][2]
        assert (cfg.num_experts, cfg.moe_router, cfg.moe_router_bias, cfg.moe_groups, cfg.moe_topk_groups,
                cfg.moe_routed_scale, cfg.shared_expert, cfg.first_dense_layers, cfg.kv_lora_rank, cfg.q_lora_rank,
                cfg.head_dim, cfg.v_head_dim) == (8, "sigmoid", True, 4, 2, 2.5, True, 1, 16,
                                                  extra["q_lora_rank"] or 0, 24, 12)
        wide = extra["n_shared_experts"] * extra["moe_intermediate_size"]  # the shared experts as one SwiGLU
        assert cfg.shared_expert_dim == (wide if extra["n_shared_experts"] > 1 else 0)
        assert {leaf.shape[-1] for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                if "shared_gate" in jax.tree_util.keystr(path)} == {wide}
    if name.startswith("qwen3-moe"):
        assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_mlp_dim, cfg.moe_norm_topk) == (
            4, 2, 16, name == "qwen3-moe")
    got = np.asarray(model_lib.logits(cfg, params, tokens))
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert np.abs(expected).max() > 1.0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_round_trip_is_bitwise(families, name, tmp_path):
    cfg, params = hf.load(families[name], _mesh(FAMILY_MESHES[1]))
    out = str(tmp_path / "export")
    hf.save(cfg, params, out)
    original, exported = _tensors(families[name]), _tensors(out)
    assert sorted(original) == sorted(exported)
    for key, tensor in original.items():
        assert torch.equal(exported[key].view(torch.uint8), tensor.view(torch.uint8)), key
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == type(transformers.AutoModelForCausalLM.from_pretrained(families[name])).__name__
    tokens = _tokens(6)
    with torch.no_grad():
        np.testing.assert_array_equal(model(torch.tensor(tokens)).logits.numpy(),
                                      _reference_logits(families[name], tokens))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_greedy_decoding_gives_transformers_tokens(families, name):
    prompts = [[5, 17, 33, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47]]
    cfg, params = hf.load(families[name])
    ours = generate.generate(cfg, params, prompts, 12)
    model = transformers.AutoModelForCausalLM.from_pretrained(families[name], dtype=torch.float32).eval()
    for prompt, new in zip(prompts, ours, strict=True):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        assert new == theirs


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ({"attention_bias": True}, "attention_bias=True"),
])
def test_unsupported_family_variants_are_refused(families, tmp_path, change, match):
    folder = tmp_path / "variant"
    folder.mkdir()
    config = json.load(open(os.path.join(families["llama3.1"], "config.json")))
    json.dump({**config, **change}, open(folder / "config.json", "w"))
    with pytest.raises(hf_formats.HFFormatError, match=re.escape(match)):
        hf_convert.model_config_from_hf(hf_formats.read_config(str(folder)))


@pytest.mark.parametrize("change, match", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
])
def test_unsupported_qwen3_moe_variants_are_refused(families, tmp_path, change, match):
    """Dense layers between the sparse ones (Qwen3-MoE's decoder_sparse_step, mlp_only_layers) are refused."""
    folder = tmp_path / "variant"
    folder.mkdir()
    config = json.load(open(os.path.join(families["qwen3-moe"], "config.json")))
    json.dump({**config, **change}, open(folder / "config.json", "w"))
    with pytest.raises(hf_formats.HFFormatError, match=re.escape(match)):
        hf_convert.model_config_from_hf(hf_formats.read_config(str(folder)))


def test_logits_take_any_batch_size_on_a_sharded_mesh(checkpoints):
    """One row on data2 x fsdp2 x tensor2 (rows padded to fill the batch axes, then dropped)."""
    tokens = _tokens(7)[:1]
    cfg, params = hf.load(checkpoints["llama"], _mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    np.testing.assert_allclose(np.asarray(model_lib.logits(cfg, params, tokens)),
                               _reference_logits(checkpoints["llama"], tokens), atol=1e-5, rtol=1e-5)


def test_deepseek_v3_imports_as_a_run_that_samples_and_exports_unchanged(families, tmp_path):
    """`hf import DIR --workdir W` of a tiny DeepSeek-V3, then `meshtrain.sample --config.workdir=W` (the latent
    cache) as a user types it, then `hf export --workdir W` gives back the checkpoint's tensors bit for bit."""
    import shutil
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests import utils

    src = tmp_path / "deepseek"
    shutil.copytree(families["deepseek-v3"], src)
    words = ["<unk>", "<s>", "</s>", "def", "return", "class", "x", "(", ")", ":", "=", "1"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    run = tmp_path / "run"
    assert hf_cli.main(["import", str(src), "--workdir", str(run)]) == 0
    result = subprocess.run([sys.executable, "-m", "meshtrain.sample", f"--config.workdir={run}", "--prompt", "def x",
                             "--max_new_tokens=6"], capture_output=True, text=True, timeout=600,
                            env=utils.subprocess_env(utils.jax_cache_dir()))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()
    out = str(tmp_path / "export")
    assert hf_cli.main(["export", "--workdir", str(run), out]) == 0
    original, exported = _tensors(families["deepseek-v3"]), _tensors(out)
    assert sorted(original) == sorted(exported)
    for key, tensor in original.items():
        assert torch.equal(exported[key].view(torch.uint8), tensor.view(torch.uint8)), key


def test_fp8_block_scaled_checkpoint_imports_dequantised(families, tmp_path):
    """DeepSeek-V3's release format: the projection and expert weights e4m3 with a float32 `weight_scale_inv`
    per 16 x 16 block here (128 x 128 in the release). The import equals that of the same checkpoint with the
    weights dequantised beforehand (e4m3 x scale, written as float32), and transformers' logits on it."""
    import ml_dtypes

    block = 16
    quantised, reference = {}, {}
    for name, tensor in _tensors(families["deepseek-v3"]).items():
        w = tensor.numpy()
        keep = w.ndim != 2 or "embed_tokens" in name or "lm_head" in name or name.endswith("mlp.gate.weight")
        if keep:
            quantised[name] = reference[name] = tensor
            continue
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = np.zeros((rows * block, cols * block), np.float32)
        padded[:w.shape[0], :w.shape[1]] = np.abs(w)
        scale = padded.reshape(rows, block, cols, block).max(axis=(1, 3)) / 448.0
        full = np.repeat(np.repeat(scale, block, 0), block, 1)[:w.shape[0], :w.shape[1]]
        fp8 = (w / full).astype(ml_dtypes.float8_e4m3fn)
        quantised[name] = torch.from_numpy(fp8.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        quantised[name + "_scale_inv"] = torch.from_numpy(scale.astype(np.float32))
        reference[name] = torch.from_numpy(fp8.astype(np.float32) * full)
    config = json.load(open(os.path.join(families["deepseek-v3"], "config.json")))
    for folder, tensors, extra in (("fp8", quantised, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
            "activation_scheme": "dynamic"}}), ("dequantised", reference, {})):
        (tmp_path / folder).mkdir()
        json.dump({**config, **extra}, open(tmp_path / folder / "config.json", "w"))
        save_file(tensors, str(tmp_path / folder / hf_formats.SINGLE_FILE), metadata={"format": "pt"})
    assert sum(t.dtype == torch.float8_e4m3fn for t in quantised.values()) >= 20
    cfg, params = hf.load(str(tmp_path / "fp8"), param_dtype="float32")
    _, want = hf.load(str(tmp_path / "dequantised"), param_dtype="float32")
    for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=jax.tree_util.keystr(path))
    tokens = _tokens(8)
    np.testing.assert_allclose(np.asarray(model_lib.logits(cfg, params, tokens)),
                               _reference_logits(str(tmp_path / "dequantised"), tokens), atol=1e-5, rtol=1e-5)


def test_fp8_without_its_scales_is_refused(families, tmp_path):
    def quantise_one(tensors):
        name = "model.layers.1.self_attn.kv_b_proj.weight"
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)

    bad = _copy(families["deepseek-v3"], tmp_path / "bad", edit_tensors=quantise_one, edit_config=lambda c: c.update(
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}))
    with pytest.raises(hf.HFFormatError, match=r"kv_b_proj.weight' is FP8 without its .*_scale_inv"):
        hf.load(bad)
    other = _copy(families["deepseek-v3"], tmp_path / "other", edit_config=lambda c: c.update(
        quantization_config={"quant_method": "bitsandbytes"}))
    with pytest.raises(hf.HFFormatError, match="quantization_config=.*only FP8"):
        hf.load(other)


def _with_prediction_block(cfg, params, seed: int = 0):
    """The model with `model.mtp_depth` 1 and a random multi-token prediction block (transformers' DeepSeek-V3
    keeps none): DeepSeek-V3's released checkpoint as this tiny one would hold it."""
    import dataclasses

    cfg = dataclasses.replace(cfg, mtp_depth=1)
    rng = np.random.default_rng(seed)
    boxes = model_lib.abstract_params(cfg)["mtp"]
    block = jax.tree.map(lambda box: (0.3 * rng.standard_normal(box.value.shape)).astype(np.float32), boxes,
                         is_leaf=lambda x: hasattr(x, "names"))
    return cfg, {**params, "mtp": block}


def test_deepseek_v3_prediction_block_round_trips_as_its_extra_layer(families, tmp_path):
    """`hf.save(..., mtp=True)` writes the block as DeepSeek-V3's checkpoints hold it: layer n_layers is a decoder
    layer of the same tensors as the last one, with enorm, hnorm, eh_proj, shared_head.norm and copies of the
    embedding and the head; transformers loads the folder (leaving that layer out) with the original logits,
    and `hf.load(..., mtp=True)` reads every tensor back bit for bit."""
    cfg, params = _with_prediction_block(*hf.load(families["deepseek-v3"]))
    out = str(tmp_path / "with-mtp")
    hf.save(cfg, params, out, mtp=True)
    original, exported, n = _tensors(families["deepseek-v3"]), _tensors(out), cfg.n_layers
    last = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.") for k in original
            if k.startswith(f"model.layers.{n - 1}.")}
    own = {f"model.layers.{n}.{name}" for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                    "shared_head.norm.weight", "shared_head.head.weight",
                                                    "embed_tokens.weight")}
    assert set(exported) == set(original) | last | own
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    assert torch.equal(exported[f"model.layers.{n}.embed_tokens.weight"], original["model.embed_tokens.weight"])
    assert torch.equal(exported[f"model.layers.{n}.shared_head.head.weight"], original["lm_head.weight"])
    assert json.load(open(os.path.join(out, "config.json")))["num_nextn_predict_layers"] == 1
    tokens = _tokens(3)
    np.testing.assert_array_equal(_reference_logits(out, tokens), _reference_logits(families["deepseek-v3"], tokens))
    cfg_back, back = hf.load(out, mtp=True)
    assert cfg_back == cfg
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    with pytest.raises(hf_formats.HFFormatError, match="no multi-token prediction layer"):
        hf.load(families["deepseek-v3"], mtp=True)


def test_deepseek_v3_prediction_layer_computes_the_reports_equations_in_transformers_layers(families, tmp_path):
    """The block read from a DeepSeek-V3 checkpoint predicts token t + 2 as the report's equations 21-23 do with
    the checkpoint's own tensors in transformers' layers: h_t the main model's final hidden state, the next
    token's embedding, each RMS-normalised (enorm, hnorm), concatenated (embedding first) through eh_proj, then
    layer n_layers (a DeepSeek-V3 decoder layer: latent attention and its MoE) and shared_head.norm, and the
    shared head. meshtrain's prediction loss on those logits equals the one transformers' layers give, to 1e-5."""
    cfg, params = _with_prediction_block(*hf.load(families["deepseek-v3"]))
    out = str(tmp_path / "with-mtp")
    hf.save(cfg, params, out, mtp=True)
    cfg, params = hf.load(out, mtp=True)
    tokens = _tokens(4)
    n, t = cfg.n_layers, tokens.shape[1]
    # transformers: the same architecture one layer deeper holds layer n (the prediction block's decoder layer)
    import shutil

    deeper_dir = tmp_path / "one-layer-deeper"
    shutil.copytree(out, deeper_dir)
    hf_config = json.load(open(deeper_dir / "config.json"))
    json.dump({**hf_config, "num_hidden_layers": n + 1}, open(deeper_dir / "config.json", "w"))
    deeper = transformers.AutoModelForCausalLM.from_pretrained(deeper_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    main = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tensors = _tensors(out)
    head = tensors[f"model.layers.{n}.shared_head.head.weight"]

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * tensors[name]

    with torch.no_grad():
        ids = torch.tensor(tokens)
        h = main.model(ids).last_hidden_state  # after the final norm: what the head reads
        nxt = main.model.embed_tokens(torch.roll(ids, -1, 1))
        joined = torch.cat([rms(nxt, f"model.layers.{n}.enorm.weight"), rms(h, f"model.layers.{n}.hnorm.weight")], -1)
        x = joined @ tensors[f"model.layers.{n}.eh_proj.weight"].T
        positions = torch.arange(t)[None].expand(len(tokens), t)
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(len(tokens), 1, t, t)
        x = deeper.model.layers[n](x, attention_mask=causal, position_ids=positions,
                                    position_embeddings=deeper.model.rotary_emb(x, positions))
        x = x[0] if isinstance(x, tuple) else x
        logits = rms(x, f"model.layers.{n}.shared_head.norm.weight") @ head.T
    want = torch.nn.functional.cross_entropy(logits[:, :t - 2].reshape(-1, cfg.vocab_size),
                                             ids[:, 2:].reshape(-1), reduction="sum").item()
    batch = {"inputs": tokens[:, :t - 1], "targets": tokens[:, 1:], "positions": np.tile(np.arange(t - 1), (4, 1)),
             "segment_ids": np.ones((4, t - 1), np.int32), "loss_mask": np.ones((4, t - 1), np.float32)}
    mesh = model_lib.params_mesh(params)
    module = model_lib.Transformer(cfg, Rules.for_mesh(mesh, model=cfg))
    with jax.set_mesh(mesh):
        _, aux = module.apply({"params": params}, jax.tree.map(jax.numpy.asarray, batch),
                              method=model_lib.Transformer.loss)
    np.testing.assert_allclose(float(aux[model_lib.MTP_SUM]) / cfg.mtp_loss_weight, want, rtol=1e-5)


def test_deepseek_v3_prediction_block_travels_through_a_run_when_asked(families, tmp_path):
    """`hf import --mtp --workdir W` keeps the checkpoint's prediction layer in the run and `hf export --mtp
    --workdir W` writes it back bit for bit; a run started from the checkpoint with `model.mtp_depth=1` starts
    from that block (from a checkpoint without one, from a fresh block); without `--mtp` the export leaves it
    out, and asking for it from a model without one is one line, exit 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from meshtrain import train_step
    from tests import utils

    cfg, params = _with_prediction_block(*hf.load(families["deepseek-v3"]))
    src = str(tmp_path / "with-mtp")
    hf.save(cfg, params, src, mtp=True)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "def"])},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(src, "tokenizer.json"))
    run_dir, out, plain = str(tmp_path / "run"), str(tmp_path / "export"), str(tmp_path / "plain")
    assert hf_cli.main(["import", src, "--workdir", run_dir, "--mtp"]) == 0
    assert hf_cli.main(["export", "--workdir", run_dir, out, "--mtp"]) == 0
    original, exported = _tensors(src), _tensors(out)
    assert sorted(original) == sorted(exported)
    for key, tensor in original.items():
        assert torch.equal(exported[key].view(torch.uint8), tensor.view(torch.uint8)), key
    assert hf_cli.main(["export", "--workdir", run_dir, plain]) == 0
    assert sorted(_tensors(plain)) == sorted(_tensors(families["deepseek-v3"]))
    assert hf_cli.main(["export", families["deepseek-v3"], str(tmp_path / "none"), "--mtp"]) == 2

    config = utils.config_for(tmp_path / "train", mesh={"data": 8}, **{"init.from_hf": src, "model.mtp_depth": 1,
                                                                      "data.tokenizer": src})
    hf.apply_model_config(config)
    factory = train_step.build(utils.resolve(config))[0]
    state = hf_io.initial_state(factory, src)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state.params["mtp"]),
                                 jax.tree.leaves(params["mtp"]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    fresh = hf_io.initial_state(factory, families["deepseek-v3"]).params["mtp"]
    assert not np.array_equal(np.asarray(fresh["proj"]), params["mtp"]["proj"])
