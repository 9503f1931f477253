"""Hugging Face <-> meshtrain: `config.json` <-> `ModelConfig`, and one layout per parameter.

A layout says how a meshtrain parameter is assembled from Hugging Face tensors (one 2-D or 1-D
tensor per layer / expert): reshapes and a transpose. Layouts are keyed by the model's own
parameter paths (`model.param_leaves`), so the table follows the model's parameter tree.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable

import numpy as np

from meshtrain import model, moe
from meshtrain.config import ConfigError, ModelConfig
from meshtrain.hf.formats import DTYPE_NAMES, IGNORED_SUFFIXES, HFFormatError, SafetensorsStore, read_config

log = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
MOE_TYPES = ("mixtral", "qwen3_moe", "deepseek_v3")
# Architecture fields that a Hugging Face checkpoint decides when it starts a run (config.init.from_hf).
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
                       "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_positions", "family", "attention_bias", "qk_norm", "sliding_window",
                       "norm_eps", "tie_embeddings", "num_experts", "experts_per_token", "moe_every", "moe_mlp_dim",
                       "shared_expert", "shared_expert_dim", "moe_norm_topk", "first_dense_layers", "moe_router",
                       "moe_router_bias", "moe_groups", "moe_topk_groups", "moe_routed_scale", "kv_lora_rank",
                       "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "rope_beta_fast", "rope_beta_slow",
                       "rope_mscale", "rope_mscale_all_dim")


def _rope(hf: dict, model_type: str = "") -> dict:
    """RoPE's fields of ModelConfig from `rope_parameters` (transformers 5) or `rope_scaling` (earlier):
    the default, linear and llama3 (Llama 3.1) types; yarn for DeepSeek-V3 (whose attention also scales
    its scores by the all-dims mscale, as `model.score_scale` does)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise HFFormatError("config.json partial_rotary_factor: only RoPE over the whole head is supported")
    try:
        if kind == "linear":
            return {**out, "rope_scaling": "linear", "rope_factor": float(params["factor"])}
        if kind == "llama3":
            return {**out, "rope_scaling": "llama3", "rope_factor": float(params["factor"]),
                    "rope_low_freq_factor": float(params["low_freq_factor"]),
                    "rope_high_freq_factor": float(params["high_freq_factor"]),
                    "rope_original_max_positions": int(params["original_max_position_embeddings"])}
        if kind == "yarn" and model_type == "deepseek_v3":
            factor = params.get("factor") or hf["max_position_embeddings"] / params["original_max_position_embeddings"]
            if params.get("attention_factor") is not None:
                raise HFFormatError("config.json rope_parameters.attention_factor: yarn's is taken from its mscales")
            return {**out, "rope_scaling": "yarn", "rope_factor": float(factor),
                    "rope_original_max_positions": int(params["original_max_position_embeddings"]),
                    "rope_beta_fast": float(params.get("beta_fast") or 32), "rope_beta_slow": float(
                        params.get("beta_slow") or 1), "rope_mscale": float(params.get("mscale") or 0),
                    "rope_mscale_all_dim": float(params.get("mscale_all_dim") or 0)}
    except KeyError as e:
        raise HFFormatError(f"config.json rope_type={kind!r} has no {e.args[0]!r}") from None
    if kind != "default":
        raise HFFormatError(f"config.json rope_type={kind!r}: supported are default, linear and llama3 (and yarn "
                            "for DeepSeek-V3)")
    return out


def _hf_rope(cfg: ModelConfig) -> dict:
    """`rope_parameters` of a config.json (transformers 5), from ModelConfig."""
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "yarn":
        return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_max_positions, "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions}


def _attention_fields(hf: dict, model_type: str) -> dict:
    """Biases, q/k norm and sliding window: Qwen2 (q, k, v biases), Qwen3 (q/k RMSNorm), Mistral (a
    sliding window on every layer); other variants are refused with the key."""
    bias = {"qwen2": True}.get(model_type, bool(hf.get("attention_bias", False)))
    if bias and model_type != "qwen2":
        raise HFFormatError(f"config.json attention_bias=True ({model_type}: a bias on the output projection too): "
                            "only Qwen2's q, k, v biases are supported")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise HFFormatError("config.json use_sliding_window=True: per-layer sliding windows are not supported")
    window = hf.get("sliding_window") if model_type in ("mistral", "mixtral") else None
    family = {"mixtral": "llama", "qwen3_moe": "qwen3"}.get(model_type, model_type)
    return {"family": family, "attention_bias": bias, "qk_norm": family == "qwen3", "sliding_window": int(window or 0)}


def _moe_fields(hf: dict, model_type: str) -> dict:
    """The mixture of experts of Mixtral (`num_local_experts`, every layer) and Qwen3-MoE (`num_experts` of
    `moe_intermediate_size`, `norm_topk_prob`; every layer sparse: `decoder_sparse_step` 1, no `mlp_only_layers`)."""
    if model_type == "mixtral":
        return dict(num_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                    moe_dropless=True, moe_mlp_dim=int(hf["intermediate_size"]))
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise HFFormatError(f"config.json decoder_sparse_step={hf.get('decoder_sparse_step')}, mlp_only_layers="
                            f"{hf.get('mlp_only_layers')}: only a mixture of experts in every layer is supported "
                            "(decoder_sparse_step 1, no mlp_only_layers)")
    if model_type == "deepseek_v3":
        return _deepseek_moe_fields(hf)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    return dict(num_experts=int(experts), experts_per_token=int(hf["num_experts_per_tok"]), moe_dropless=True,
                moe_mlp_dim=int(hf["moe_intermediate_size"]), moe_norm_topk=bool(hf.get("norm_topk_prob", False)))


def _deepseek_moe_fields(hf: dict) -> dict:
    """DeepSeek-V3 (and Kimi K2, Moonlight): sigmoid router with the balancing bias, group-limited, routed
    scaling, the shared experts (n of them are one SwiGLU n times as wide: `model.shared_expert_dim`), the first
    `first_k_dense_replace` layers dense."""
    shared = int(hf.get("n_shared_experts") or 0)
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise HFFormatError(f"config.json scoring_func={hf.get('scoring_func')!r}, topk_method="
                            f"{hf.get('topk_method')!r}: DeepSeek-V3's sigmoid router with noaux_tc is supported")
    if int(hf.get("moe_layer_freq", 1)) != 1:
        raise HFFormatError(f"config.json moe_layer_freq={hf['moe_layer_freq']}: only every layer after "
                            "first_k_dense_replace sparse is supported")
    return dict(num_experts=int(hf["n_routed_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                moe_dropless=True, moe_mlp_dim=int(hf["moe_intermediate_size"]),
                moe_norm_topk=bool(hf.get("norm_topk_prob", True)), moe_router="sigmoid", moe_router_bias=True,
                moe_groups=int(hf.get("n_group") or 1), moe_topk_groups=int(hf.get("topk_group") or 0),
                moe_routed_scale=float(hf.get("routed_scaling_factor", 1.0)), shared_expert=shared >= 1,
                shared_expert_dim=int(hf["moe_intermediate_size"]) * shared if shared > 1 else 0,
                first_dense_layers=int(hf.get("first_k_dense_replace", 0)))


def _latent_fields(hf: dict) -> dict:
    """Multi-head latent attention's fields (DeepSeek-V2/V3): head_dim is the query / key head (nope + rope)."""
    heads = int(hf["num_attention_heads"])
    if int(hf.get("num_key_value_heads") or heads) != heads:
        raise HFFormatError(f"config.json num_key_value_heads={hf['num_key_value_heads']}: multi-head latent "
                            f"attention expands a key and a value per head (num_attention_heads={heads})")
    if not hf.get("rope_interleave", True):
        raise HFFormatError("config.json rope_interleave=False: DeepSeek-V3's interleaved RoPE layout is supported")
    if hf.get("attention_bias"):
        raise HFFormatError("config.json attention_bias=True: multi-head latent attention without biases is supported")
    return dict(n_kv_heads=heads, head_dim=int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]),
                kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                family="llama", attention_bias=False, qk_norm=False, sliding_window=0)


def model_config_from_hf(hf: dict, param_dtype: str | None = None) -> ModelConfig:
    """A `config.json` dict -> ModelConfig (compute in float32, no remat: the reference setup)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFFormatError(f"config.json model_type={model_type!r}: supported are {sorted(ARCHITECTURES)}")
    for key, want in (("hidden_act", "silu"), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise HFFormatError(f"config.json {key}={hf[key]!r}: only {want!r} is supported")
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        values = dict(
            vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or d // heads), mlp_dim=int(hf["intermediate_size"]),
            **_rope(hf, model_type), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
        values.update(_latent_fields(hf) if model_type == "deepseek_v3" else _attention_fields(hf, model_type))
        if model_type in MOE_TYPES:
            values.update(_moe_fields(hf, model_type))
    except KeyError as e:
        raise HFFormatError(f"config.json has no key {e.args[0]!r}, needed for model_type={model_type!r}") from None
    dtype = param_dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in DTYPE_NAMES:
        raise HFFormatError(f"config.json dtype={dtype!r}: supported are {sorted(DTYPE_NAMES)}")
    return ModelConfig(**values, param_dtype=dtype)


def export_type(cfg: ModelConfig) -> str:
    """The Hugging Face `model_type` that holds this model: with experts, qwen3_moe (q/k norm) or mixtral
    (neither q/k norm nor biases; the top-k weights renormalised); else `model.family`, which must have what
    the model uses (raises HFFormatError naming the key otherwise)."""
    if cfg.kv_lora_rank:
        if not (cfg.num_experts and cfg.moe_router == "sigmoid" and cfg.moe_router_bias and cfg.moe_every == 1):
            raise HFFormatError("model.kv_lora_rank > 0: latent attention exports as DeepSeek-V3, whose MoE has "
                                "model.moe_router='sigmoid', model.moe_router_bias=True and model.moe_every=1")
        return "deepseek_v3"
    if cfg.rope_scaling == "yarn":
        raise HFFormatError("model.rope_scaling='yarn': exports only as DeepSeek-V3 (with model.kv_lora_rank > 0)")
    if cfg.first_dense_layers or cfg.moe_router != "softmax" or cfg.moe_router_bias or cfg.moe_groups > 1 or (
            cfg.moe_routed_scale != 1.0):
        raise HFFormatError("model.first_dense_layers, moe_router, moe_router_bias, moe_groups and moe_routed_scale "
                            "are DeepSeek-V3's: they export with its latent attention (model.kv_lora_rank > 0)")
    if cfg.num_experts:
        if cfg.attention_bias:
            raise HFFormatError("model.attention_bias=True: neither Mixtral nor Qwen3-MoE has attention biases")
        if cfg.qk_norm:
            return "qwen3_moe"
        if not cfg.moe_norm_topk:
            raise HFFormatError("model.moe_norm_topk=False: Mixtral renormalises the top-k weights (Qwen3-MoE, with "
                                "model.qk_norm=True, takes either)")
        return "mixtral"
    wants = {"qwen2": (True, False), "qwen3": (False, True)}.get(cfg.family, (False, False))
    if (cfg.attention_bias, cfg.qk_norm) != wants:
        raise HFFormatError(f"model.family={cfg.family!r} has attention_bias={wants[0]}, qk_norm={wants[1]}; the "
                            f"model has {cfg.attention_bias}, {cfg.qk_norm}: set model.family to the architecture "
                            "(qwen2: q, k, v biases; qwen3: q/k norm)")
    if cfg.sliding_window and cfg.family != "mistral":
        raise HFFormatError(f"model.sliding_window={cfg.sliding_window}: only model.family='mistral' exports one")
    return cfg.family


def hf_config_from_model(cfg: ModelConfig, dtype: str, mtp: bool = False) -> dict:
    """ModelConfig -> a `config.json` dict that `transformers` loads (`mtp`: the checkpoint holds the
    multi-token prediction layer, `num_nextn_predict_layers` 1)."""
    model_type = export_type(cfg)
    moe = model_type == "mixtral"
    hf = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": (cfg.moe_mlp_dim or cfg.mlp_dim) if moe else cfg.mlp_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta, "rope_parameters": _hf_rope(cfg),
        "attention_bias": False, "attention_dropout": 0.0,
        "max_position_embeddings": max(8192, cfg.rope_original_max_positions if cfg.rope_scaling != "none" else 0),
        "dtype": dtype, "torch_dtype": dtype, "use_cache": True,
    }
    if moe:
        hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                  output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    elif model_type == "qwen3_moe":
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                  moe_intermediate_size=cfg.moe_mlp_dim or cfg.mlp_dim, norm_topk_prob=cfg.moe_norm_topk,
                  decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                  router_aux_loss_coef=cfg.aux_loss_weight, use_sliding_window=False, sliding_window=None,
                  max_window_layers=cfg.n_layers)
    elif model_type == "mistral":
        hf["sliding_window"] = cfg.sliding_window or None
    elif model_type in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if model_type == "llama":
        hf["mlp_bias"] = False
    if model_type == "deepseek_v3":
        hf.update(_hf_deepseek(cfg), num_nextn_predict_layers=int(mtp))
    return hf


def _hf_deepseek(cfg: ModelConfig) -> dict:
    """DeepSeek-V3's config.json fields beside the common ones (RoPE written interleaved: `ROPE_PERMUTED`)."""
    return dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.moe_mlp_dim or cfg.mlp_dim, n_shared_experts=_shared_experts(cfg),
                norm_topk_prob=cfg.moe_norm_topk, routed_scaling_factor=cfg.moe_routed_scale,
                n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups or cfg.moe_groups,
                first_k_dense_replace=cfg.first_dense_layers, kv_lora_rank=cfg.kv_lora_rank,
                q_lora_rank=cfg.q_lora_rank or None, qk_rope_head_dim=cfg.qk_rope_head_dim,
                qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim or cfg.head_dim,
                head_dim=cfg.qk_rope_head_dim, rope_interleave=True, num_nextn_predict_layers=0,
                intermediate_size=cfg.mlp_dim)


def _shared_experts(cfg: ModelConfig) -> int:
    """DeepSeek-V3's `n_shared_experts`: the shared expert's width in experts' widths."""
    fe, fs = cfg.moe_mlp_dim or cfg.mlp_dim, moe.shared_mlp_dim(cfg)
    if fs % fe:
        raise HFFormatError(f"model.shared_expert_dim={cfg.shared_expert_dim}: DeepSeek-V3 holds shared experts of "
                            f"the routed experts' width, so it must be a multiple of {fe}")
    return fs // fe


# ---------------------------------------------------------------------------------------------
# Parameter layouts: meshtrain leaf <- one 2-D (or 1-D) Hugging Face tensor per layer / expert.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """meshtrain[stack..., *] = reshape(hf, split).transpose(perm) for each stacked (layer, expert) index.

    `name` formats with `layer` and `expert`; `stack` names the leading meshtrain dims ("layer",
    "dense_layer", "expert") that select the Hugging Face tensor (`stack_counts`); `split` groups the
    meshtrain-side sizes of each Hugging Face dimension (e.g. q_proj rows = (H, Dh)). `layer_offset`: the
    Hugging Face layer of stacked layer 0 (the MoE stack after `model.first_dense_layers` dense ones).
    `rope` > 0: the last `rope` entries of the meshtrain array's last dimension are RoPE dimensions that
    Hugging Face stores interleaved (DeepSeek's layout, pairs (x0, x1), (x2, x3), ...) and meshtrain
    rotate-half (`ROPE_PERMUTED`).
    """

    name: str
    stack: tuple[str, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    layer_offset: int = 0
    rope: int = 0

    def tensor_name(self, ids: tuple[int, ...]) -> str:
        """The Hugging Face tensor name at stacked index `ids` (layer, expert)."""
        values = {}
        for kind, i in zip(self.stack, ids, strict=True):
            if kind == "layer":
                values["layer"] = i + self.layer_offset
            else:
                values["layer" if kind == "dense_layer" else kind] = i
        return self.name.format(**values)

    def _columns(self, last: int) -> np.ndarray:
        """For each entry of the meshtrain array's last dimension (`last` long): its Hugging Face entry."""
        cols = np.arange(last)
        if self.rope:
            start = last - self.rope
            cols[start:] = start + np.concatenate([np.arange(0, self.rope, 2), np.arange(1, self.rope, 2)])
        return cols

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(group) for group in self.split)

    def read(self, tensor: Callable[[str], np.ndarray], index: tuple[slice, ...], shape: tuple[int, ...]):
        """The block `index` of the meshtrain array, reading only the rows/columns it needs."""
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
        if self.rope:  # the last dimension whole, its RoPE entries reordered, then cut
            whole = self.read_plain(tensor, (*index[:-1], slice(0, shape[-1])), shape)
            return whole[..., self._columns(shape[-1])][..., index[-1]]
        return self.read_plain(tensor, index, shape)

    def read_plain(self, tensor: Callable[[str], np.ndarray], index: tuple[slice, ...], shape: tuple[int, ...]):
        """`read` without the RoPE reordering."""
        stack_ranges = [range(s.start, s.stop) for s in index[:len(self.stack)]]
        inner = index[len(self.stack):]
        blocks = [self._read_one(tensor(self.tensor_name(ids)), inner)
                  for ids in product(stack_ranges)]
        out_shape = tuple(len(r) for r in stack_ranges) + tuple(s.stop - s.start for s in inner)
        return np.stack(blocks).reshape(out_shape) if blocks else np.zeros(out_shape)

    def _read_one(self, hf: np.ndarray, inner: tuple[slice, ...]) -> np.ndarray:
        split_index: list[slice] = [slice(None)] * len(self.perm)
        for axis, src in enumerate(self.perm):
            split_index[src] = inner[axis]
        hf_index, post, pos = [], [], 0
        for group in self.split:  # the first size of a group is read as a contiguous row range
            first, rest = split_index[pos], split_index[pos + 1:pos + len(group)]
            step = math.prod(group[1:])
            hf_index.append(slice(first.start * step, first.stop * step))
            post += [slice(None), *rest]
            pos += len(group)
        block = np.asarray(hf[tuple(hf_index)])
        block = block.reshape([n for s, g in zip(hf_index, self.split, strict=True)
                               for n in ((s.stop - s.start) // math.prod(g[1:]), *g[1:])])
        return block[tuple(post)].transpose(self.perm)

    def to_hf(self, block: np.ndarray) -> np.ndarray:
        """One unstacked meshtrain block -> the Hugging Face tensor (the inverse of `read`)."""
        if self.rope:
            block = block[..., np.argsort(self._columns(block.shape[-1]))]
        return np.ascontiguousarray(block.transpose(np.argsort(self.perm)).reshape(self.hf_shape))


def product(ranges):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in product(ranges[1:]):
            yield (i, *rest)


def layouts(cfg: ModelConfig, mtp: bool = False) -> dict[tuple[str, ...], Layout]:
    """meshtrain parameter path -> its Hugging Face source (Llama / Mistral, or Mixtral when MoE).

    Walks the model's own parameter tree: a layer parameter is found by its module and name
    (`attn/wq`, `moe/w_gate`, ...) whatever the scanned unit around it. `mtp`: the multi-token prediction
    block too, as DeepSeek-V3's checkpoints hold it (`mtp_layouts`); otherwise it is left out (`MTP_DROPPED`).
    """
    deepseek = bool(cfg.num_experts) and export_type(cfg) == "deepseek_v3"
    if cfg.num_experts and (cfg.moe_every != 1 or (cfg.shared_expert and not deepseek)):
        raise HFFormatError(f"model.moe_every={cfg.moe_every}, model.shared_expert={cfg.shared_expert}: Mixtral and "
                            "Qwen3-MoE checkpoints have a mixture of experts in every layer and no shared expert")
    table = _leaf_layouts(cfg)
    out = {}
    for path, _ in model.param_leaves(cfg):
        key = tuple(path.split("/"))
        if key[0] == "mtp":  # multi-token prediction: a training-time block, exported when asked (`mtp_layouts`)
            continue
        leaf = key[-2:] if key[0] in ("layers", "dense_layers") else key
        if leaf not in table:
            raise HFFormatError(f"meshtrain parameter {path} has no Hugging Face source")
        layout = table[leaf]
        if key[0] == "dense_layers":  # the first layers, dense, before the MoE stack
            layout = dataclasses.replace(layout, stack=("dense_layer",) + layout.stack[1:])
        elif key[0] == "layers" and cfg.first_dense_layers:
            layout = dataclasses.replace(layout, layer_offset=cfg.first_dense_layers)
        out[key] = layout
    if mtp:
        out.update(mtp_layouts(cfg, table))
    return out


# DeepSeek-V3's checkpoint keeps its multi-token prediction module as one more layer after the last,
# `model.layers.{n_layers}`: a decoder layer (an MoE one) with `enorm` (the next token's embedding), `hnorm`
# (the main model's hidden state), `eh_proj` (their concatenation, embedding first, to d_model) and
# `shared_head.norm`, beside copies of the embedding and the head it shares (`MTP_SHARED`).
MTP_SHARED = {"embed_tokens.weight": ("embedding",), "shared_head.head.weight": ("head",)}


def mtp_layouts(cfg: ModelConfig, table: dict[tuple[str, ...], Layout] | None = None
                ) -> dict[tuple[str, ...], Layout]:
    """The multi-token prediction block's parameters (`model.MultiTokenPrediction`, `model.mtp_depth` 1) ->
    their tensors in DeepSeek-V3's layer `n_layers`. Only DeepSeek-V3 checkpoints hold one."""
    if not cfg.mtp_depth:
        raise HFFormatError("model.mtp_depth=0: the model has no multi-token prediction block to read or write")
    if not cfg.num_experts or export_type(cfg) != "deepseek_v3":
        raise HFFormatError("model.mtp_depth=1: the multi-token prediction block reads and writes as DeepSeek-V3's "
                            "(model.kv_lora_rank > 0 with its router); other checkpoints have none")
    table = table if table is not None else _leaf_layouts(cfg)
    d, prefix = cfg.d_model, f"model.layers.{cfg.n_layers}"
    out = {
        ("mtp", "embed_norm", "scale"): Layout(f"{prefix}.enorm.weight", (), ((d,),), (0,)),
        ("mtp", "hidden_norm", "scale"): Layout(f"{prefix}.hnorm.weight", (), ((d,),), (0,)),
        ("mtp", "proj"): Layout(f"{prefix}.eh_proj.weight", (), ((d,), (2 * d,)), (1, 0)),
        ("mtp", "norm", "scale"): Layout(f"{prefix}.shared_head.norm.weight", (), ((d,),), (0,)),
    }
    for path, _ in model.param_leaves(cfg):
        key = tuple(path.split("/"))
        if key[:2] != ("mtp", "block"):
            continue
        if key[-2:] not in table:
            raise HFFormatError(f"meshtrain parameter {path} has no Hugging Face source")
        layer = table[key[-2:]]  # the MoE layer's, at the one layer after the last
        out[key] = dataclasses.replace(layer, name=layer.name.replace("{layer}", str(cfg.n_layers)),
                                       stack=tuple(s for s in layer.stack if s != "layer"), layer_offset=0)
    return out


def has_mtp(store: SafetensorsStore, cfg: ModelConfig) -> bool:
    """Whether a DeepSeek-V3 checkpoint holds its multi-token prediction layer."""
    return f"model.layers.{cfg.n_layers}.eh_proj.weight" in store.entries


# Said where a model with multi-token prediction is exported or started from a checkpoint: its block is the
# run's own (initialised fresh by `io.initial_state`), neither read from nor written to Hugging Face.
MTP_DROPPED = ("model.mtp_depth=1: the multi-token prediction block (mtp/*) is training-time only; it is left out "
               "of the Hugging Face checkpoint (`hf export --mtp` writes it, DeepSeek-V3's layout)")
MTP_FRESH = ("model.mtp_depth=1: the checkpoint has no multi-token prediction layer; the block (mtp/*) starts "
             "freshly initialised")


def stack_counts(cfg: ModelConfig) -> dict[str, int]:
    """How many of each stacked dimension a Layout's `stack` names: the scanned layers (after the dense first
    ones), the dense first layers, the experts."""
    return {"layer": cfg.stacked_layers, "dense_layer": cfg.first_dense_layers, "expert": cfg.num_experts}


def _leaf_layouts(cfg: ModelConfig) -> dict[tuple[str, ...], Layout]:
    """(module, parameter) of a layer, or the top-level path -> Layout."""
    d, h, k, dh, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    hf_layer, one = "model.layers.{layer}", ("layer",)
    attn, mlp = f"{hf_layer}.self_attn", f"{hf_layer}.mlp"
    fe, e, two = cfg.moe_mlp_dim or cfg.mlp_dim, cfg.num_experts, ("layer", "expert")
    dv = cfg.v_head_dim or dh
    if cfg.num_experts and export_type(cfg) in ("qwen3_moe", "deepseek_v3"):  # mlp.gate, mlp.experts.{e}.gate_proj
        router, experts, names = f"{mlp}.gate", f"{mlp}.experts.{{expert}}", ("gate_proj", "up_proj", "down_proj")
    else:  # Mixtral: block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)
        sparse = f"{hf_layer}.block_sparse_moe"
        router, experts, names = f"{sparse}.gate", f"{sparse}.experts.{{expert}}", ("w1", "w3", "w2")
    return {
        ("embedding",): Layout("model.embed_tokens.weight", (), ((v,), (d,)), (0, 1)),
        ("final_norm", "scale"): Layout("model.norm.weight", (), ((d,),), (0,)),
        ("head",): Layout("lm_head.weight", (), ((v,), (d,)), (1, 0)),
        ("attn", "wq"): Layout(f"{attn}.q_proj.weight", one, ((h, dh), (d,)), (2, 0, 1)),
        ("attn", "wk"): Layout(f"{attn}.k_proj.weight", one, ((k, dh), (d,)), (2, 0, 1)),
        ("attn", "wv"): Layout(f"{attn}.v_proj.weight", one, ((k, dh), (d,)), (2, 0, 1)),
        ("attn", "wo"): Layout(f"{attn}.o_proj.weight", one, ((d,), (h, dv)), (1, 2, 0)),
        ("attn", "bq"): Layout(f"{attn}.q_proj.bias", one, ((h, dh),), (0, 1)),
        ("attn", "bk"): Layout(f"{attn}.k_proj.bias", one, ((k, dh),), (0, 1)),
        ("attn", "bv"): Layout(f"{attn}.v_proj.bias", one, ((k, dh),), (0, 1)),
        ("q_norm", "scale"): Layout(f"{attn}.q_norm.weight", one, ((dh,),), (0,)),
        ("k_norm", "scale"): Layout(f"{attn}.k_norm.weight", one, ((dh,),), (0,)),
        ("attn_norm", "scale"): Layout(f"{hf_layer}.input_layernorm.weight", one, ((d,),), (0,)),
        ("mlp_norm", "scale"): Layout(f"{hf_layer}.post_attention_layernorm.weight", one, ((d,),), (0,)),
        ("mlp", "w_gate"): Layout(f"{mlp}.gate_proj.weight", one, ((f,), (d,)), (1, 0)),
        ("mlp", "w_up"): Layout(f"{mlp}.up_proj.weight", one, ((f,), (d,)), (1, 0)),
        ("mlp", "w_down"): Layout(f"{mlp}.down_proj.weight", one, ((d,), (f,)), (1, 0)),
        ("moe", "router"): Layout(f"{router}.weight", one, ((e,), (d,)), (1, 0)),
        ("moe", "w_gate"): Layout(f"{experts}.{names[0]}.weight", two, ((fe,), (d,)), (1, 0)),
        ("moe", "w_up"): Layout(f"{experts}.{names[1]}.weight", two, ((fe,), (d,)), (1, 0)),
        ("moe", "w_down"): Layout(f"{experts}.{names[2]}.weight", two, ((d,), (fe,)), (1, 0)),
        **(_deepseek_layouts(cfg) if cfg.kv_lora_rank else {}),
    }


def _deepseek_layouts(cfg: ModelConfig) -> dict[tuple[str, ...], Layout]:
    """DeepSeek-V3's multi-head latent attention, router bias and shared expert; q_proj when there is no
    query latent. The query heads' and the shared key's RoPE parts are stored interleaved (`Layout.rope`)."""
    d, h, dh, p, r, rq = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    dv, fe, one = cfg.v_head_dim or dh, moe.shared_mlp_dim(cfg), ("layer",)
    attn, mlp = "model.layers.{layer}.self_attn", "model.layers.{layer}.mlp"
    return {
        ("attn", "wq"): Layout(f"{attn}.q_proj.weight", one, ((h, dh), (d,)), (2, 0, 1), rope=p),
        ("attn", "wq_a"): Layout(f"{attn}.q_a_proj.weight", one, ((rq,), (d,)), (1, 0)),
        ("q_a_norm", "scale"): Layout(f"{attn}.q_a_layernorm.weight", one, ((rq,),), (0,)),
        ("attn", "wq_b"): Layout(f"{attn}.q_b_proj.weight", one, ((h, dh), (rq,)), (2, 0, 1), rope=p),
        ("attn", "wkv_a"): Layout(f"{attn}.kv_a_proj_with_mqa.weight", one, ((r + p,), (d,)), (1, 0), rope=p),
        ("kv_a_norm", "scale"): Layout(f"{attn}.kv_a_layernorm.weight", one, ((r,),), (0,)),
        ("attn", "wkv_b"): Layout(f"{attn}.kv_b_proj.weight", one, ((h, dh - p + dv), (r,)), (2, 0, 1)),
        ("moe", "router_bias"): Layout(f"{mlp}.gate.e_score_correction_bias", one, ((cfg.num_experts,),), (0,)),
        ("moe", "shared_gate"): Layout(f"{mlp}.shared_experts.gate_proj.weight", one, ((fe,), (d,)), (1, 0)),
        ("moe", "shared_up"): Layout(f"{mlp}.shared_experts.up_proj.weight", one, ((fe,), (d,)), (1, 0)),
        ("moe", "shared_down"): Layout(f"{mlp}.shared_experts.down_proj.weight", one, ((d,), (fe,)), (1, 0)),
    }


def meshtrain_shape(layout: Layout, cfg: ModelConfig) -> tuple[int, ...]:
    """The meshtrain parameter's shape: the stacked (layer, expert) dims, then the permuted split."""
    counts = stack_counts(cfg)
    split = [n for group in layout.split for n in group]
    return tuple(counts[s] for s in layout.stack) + tuple(split[p] for p in layout.perm)


def check_tensors(store: SafetensorsStore, table: dict, cfg: ModelConfig) -> None:
    """Every needed tensor exists with its shape and a supported dtype; nothing unexpected is left."""
    needed = set()
    for layout in table.values():
        counts = stack_counts(cfg)
        for ids in product([range(counts[s]) for s in layout.stack]):
            name = layout.tensor_name(ids)
            needed.add(name)
            if store.shape(name) != layout.hf_shape:
                raise HFFormatError(f"tensor {name!r} has shape {store.shape(name)}; the config says "
                                    f"{layout.hf_shape}")
            store.dtype(name)
    mtp = f"model.layers.{cfg.n_layers}."  # DeepSeek-V3's multi-token prediction layer(s) after the last layer
    skipped = sorted(n for n in store.entries if n not in needed and n.startswith(mtp))
    if skipped:
        log.info("%d tensors of the checkpoint's multi-token prediction layer (%s*) are not read", len(skipped), mtp)
    extra = sorted(n for n in store.entries if n not in needed and not n.endswith(IGNORED_SUFFIXES)
                   and not n.startswith(mtp))
    if extra:
        raise HFFormatError(f"checkpoint tensors {extra[:5]}{'...' if len(extra) > 5 else ''} have no "
                            "meshtrain parameter (unsupported architecture variant?)")


def apply_model_config(config) -> dict[str, tuple]:
    """Sets `config.model`'s architecture fields from `config.init.from_hf`'s config.json.

    Returns {field: (old, new)} for each value that changed (each is logged): the checkpoint
    decides the architecture; precision, remat and parallelism stay the run's own.
    """
    hf_dir = config.init.from_hf
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConfigError("init.from_hf", hf_dir, "must be a Hugging Face checkpoint folder with a config.json")
    cfg = model_config_from_hf(read_config(hf_dir))
    changed = {}
    for field in ARCHITECTURE_FIELDS:
        new = getattr(cfg, field)
        if config.model[field] != new:
            changed[field] = (config.model[field], new)
            config.model[field] = type(config.model[field])(new)
    for field, (old, new) in changed.items():
        log.info("init.from_hf: model.%s = %r (was %r)", field, new, old)
    return changed
