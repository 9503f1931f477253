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

from meshtrain import model
from meshtrain.config import ConfigError, ModelConfig
from meshtrain.hf.formats import DTYPE_NAMES, IGNORED_SUFFIXES, HFFormatError, SafetensorsStore, read_config

log = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_TYPES = ("mixtral", "qwen3_moe")
# Architecture fields that a Hugging Face checkpoint decides when it starts a run (config.init.from_hf).
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
                       "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_positions", "family", "attention_bias", "qk_norm", "sliding_window",
                       "norm_eps", "tie_embeddings", "num_experts", "experts_per_token", "moe_every", "moe_mlp_dim",
                       "shared_expert", "moe_norm_topk")


def _rope(hf: dict) -> dict:
    """RoPE's fields of ModelConfig from `rope_parameters` (transformers 5) or `rope_scaling` (earlier):
    the default, linear and llama3 (Llama 3.1) types."""
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
    except KeyError as e:
        raise HFFormatError(f"config.json rope_type={kind!r} has no {e.args[0]!r}") from None
    if kind != "default":
        raise HFFormatError(f"config.json rope_type={kind!r}: supported are default, linear and llama3")
    return out


def _hf_rope(cfg: ModelConfig) -> dict:
    """`rope_parameters` of a config.json (transformers 5), from ModelConfig."""
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor}
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
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    return dict(num_experts=int(experts), experts_per_token=int(hf["num_experts_per_tok"]), moe_dropless=True,
                moe_mlp_dim=int(hf["moe_intermediate_size"]), moe_norm_topk=bool(hf.get("norm_topk_prob", False)))


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
            **_rope(hf), **_attention_fields(hf, model_type), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
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


def hf_config_from_model(cfg: ModelConfig, dtype: str) -> dict:
    """ModelConfig -> a `config.json` dict that `transformers` loads."""
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
    return hf


# ---------------------------------------------------------------------------------------------
# Parameter layouts: meshtrain leaf <- one 2-D (or 1-D) Hugging Face tensor per layer / expert.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """meshtrain[stack..., *] = reshape(hf, split).transpose(perm) for each stacked (layer, expert) index.

    `name` formats with `layer` and `expert`; `stack` names the leading meshtrain dims ("layer",
    "expert") that select the Hugging Face tensor; `split` groups the meshtrain-side sizes of
    each Hugging Face dimension (e.g. q_proj rows = (H, Dh)).
    """

    name: str
    stack: tuple[str, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    def tensor_name(self, ids: tuple[int, ...]) -> str:
        """The Hugging Face tensor name at stacked index `ids` (layer, expert)."""
        return self.name.format(**dict(zip(self.stack, ids, strict=True)))

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(group) for group in self.split)

    def read(self, tensor: Callable[[str], np.ndarray], index: tuple[slice, ...], shape: tuple[int, ...]):
        """The block `index` of the meshtrain array, reading only the rows/columns it needs."""
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
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
        return np.ascontiguousarray(block.transpose(np.argsort(self.perm)).reshape(self.hf_shape))


def product(ranges):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in product(ranges[1:]):
            yield (i, *rest)


def layouts(cfg: ModelConfig) -> dict[tuple[str, ...], Layout]:
    """meshtrain parameter path -> its Hugging Face source (Llama / Mistral, or Mixtral when MoE).

    Walks the model's own parameter tree: a layer parameter is found by its module and name
    (`attn/wq`, `moe/w_gate`, ...) whatever the scanned unit around it.
    """
    if cfg.num_experts and (cfg.moe_every != 1 or cfg.shared_expert):
        raise HFFormatError(f"model.moe_every={cfg.moe_every}, model.shared_expert={cfg.shared_expert}: Mixtral and "
                            "Qwen3-MoE checkpoints have a mixture of experts in every layer and no shared expert")
    table = _leaf_layouts(cfg)
    out = {}
    for path, _ in model.param_leaves(cfg):
        key = tuple(path.split("/"))
        leaf = key[-2:] if key[0] == "layers" else key
        if leaf not in table:
            raise HFFormatError(f"meshtrain parameter {path} has no Hugging Face source")
        out[key] = table[leaf]
    return out


def _leaf_layouts(cfg: ModelConfig) -> dict[tuple[str, ...], Layout]:
    """(module, parameter) of a layer, or the top-level path -> Layout."""
    d, h, k, dh, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    hf_layer, one = "model.layers.{layer}", ("layer",)
    attn, mlp = f"{hf_layer}.self_attn", f"{hf_layer}.mlp"
    fe, e, two = cfg.moe_mlp_dim or cfg.mlp_dim, cfg.num_experts, ("layer", "expert")
    if cfg.num_experts and export_type(cfg) == "qwen3_moe":  # mlp.gate (the router), mlp.experts.{e}.gate_proj ...
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
        ("attn", "wo"): Layout(f"{attn}.o_proj.weight", one, ((d,), (h, dh)), (1, 2, 0)),
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
    }


def meshtrain_shape(layout: Layout, cfg: ModelConfig) -> tuple[int, ...]:
    """The meshtrain parameter's shape: the stacked (layer, expert) dims, then the permuted split."""
    counts = {"layer": cfg.n_layers, "expert": cfg.num_experts}
    split = [n for group in layout.split for n in group]
    return tuple(counts[s] for s in layout.stack) + tuple(split[p] for p in layout.perm)


def check_tensors(store: SafetensorsStore, table: dict, cfg: ModelConfig) -> None:
    """Every needed tensor exists with its shape and a supported dtype; nothing unexpected is left."""
    needed = set()
    for layout in table.values():
        counts = {"layer": cfg.n_layers, "expert": cfg.num_experts}
        for ids in product([range(counts[s]) for s in layout.stack]):
            name = layout.tensor_name(ids)
            needed.add(name)
            if store.shape(name) != layout.hf_shape:
                raise HFFormatError(f"tensor {name!r} has shape {store.shape(name)}; the config says "
                                    f"{layout.hf_shape}")
            store.dtype(name)
    extra = sorted(n for n in store.entries if n not in needed and not n.endswith(IGNORED_SUFFIXES))
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
