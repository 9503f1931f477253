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

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
# Architecture fields that a Hugging Face checkpoint decides when it starts a run (config.init.from_hf).
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
                       "rope_theta", "norm_eps", "tie_embeddings", "num_experts", "experts_per_token",
                       "moe_every", "moe_mlp_dim", "shared_expert")


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    rope_type = rope.get("rope_type", (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        raise HFFormatError(f"config.json rope_parameters.rope_type={rope_type!r}: only the default "
                            "(unscaled) RoPE is supported")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def model_config_from_hf(hf: dict, param_dtype: str | None = None) -> ModelConfig:
    """A `config.json` dict -> ModelConfig (compute in float32, no remat: the reference setup)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFFormatError(f"config.json model_type={model_type!r}: supported are {sorted(ARCHITECTURES)}")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise HFFormatError(f"config.json {key}={hf[key]!r}: only {want!r} is supported")
    if hf.get("sliding_window") is not None:
        log.warning("config.json sliding_window=%s: meshtrain attends to the whole causal context; "
                    "logits match only for sequences up to that length", hf["sliding_window"])
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        values = dict(
            vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or d // heads), mlp_dim=int(hf["intermediate_size"]),
            rope_theta=_rope_theta(hf), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
        if model_type == "mixtral":
            values.update(num_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                          moe_dropless=True, moe_mlp_dim=int(hf["intermediate_size"]))
    except KeyError as e:
        raise HFFormatError(f"config.json has no key {e.args[0]!r}, needed for model_type={model_type!r}") from None
    dtype = param_dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in DTYPE_NAMES:
        raise HFFormatError(f"config.json dtype={dtype!r}: supported are {sorted(DTYPE_NAMES)}")
    return ModelConfig(**values, param_dtype=dtype)


def hf_config_from_model(cfg: ModelConfig, dtype: str) -> dict:
    """ModelConfig -> a `config.json` dict that `transformers` loads."""
    moe = cfg.num_experts > 0
    model_type = "mixtral" if moe else "llama"
    hf = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": (cfg.moe_mlp_dim or cfg.mlp_dim) if moe else cfg.mlp_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "max_position_embeddings": 8192,
        "dtype": dtype, "torch_dtype": dtype, "use_cache": True,
    }
    if moe:
        hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                  output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    else:
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
        raise HFFormatError(f"model.moe_every={cfg.moe_every}, model.shared_expert={cfg.shared_expert}: Mixtral "
                            "checkpoints have a mixture of experts in every layer and no shared expert")
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
    fe, e = cfg.moe_mlp_dim or cfg.mlp_dim, cfg.num_experts
    experts, two = f"{hf_layer}.block_sparse_moe.experts.{{expert}}", ("layer", "expert")
    return {
        ("embedding",): Layout("model.embed_tokens.weight", (), ((v,), (d,)), (0, 1)),
        ("final_norm", "scale"): Layout("model.norm.weight", (), ((d,),), (0,)),
        ("head",): Layout("lm_head.weight", (), ((v,), (d,)), (1, 0)),
        ("attn", "wq"): Layout(f"{attn}.q_proj.weight", one, ((h, dh), (d,)), (2, 0, 1)),
        ("attn", "wk"): Layout(f"{attn}.k_proj.weight", one, ((k, dh), (d,)), (2, 0, 1)),
        ("attn", "wv"): Layout(f"{attn}.v_proj.weight", one, ((k, dh), (d,)), (2, 0, 1)),
        ("attn", "wo"): Layout(f"{attn}.o_proj.weight", one, ((d,), (h, dh)), (1, 2, 0)),
        ("attn_norm", "scale"): Layout(f"{hf_layer}.input_layernorm.weight", one, ((d,),), (0,)),
        ("mlp_norm", "scale"): Layout(f"{hf_layer}.post_attention_layernorm.weight", one, ((d,),), (0,)),
        ("mlp", "w_gate"): Layout(f"{mlp}.gate_proj.weight", one, ((f,), (d,)), (1, 0)),
        ("mlp", "w_up"): Layout(f"{mlp}.up_proj.weight", one, ((f,), (d,)), (1, 0)),
        ("mlp", "w_down"): Layout(f"{mlp}.down_proj.weight", one, ((d,), (f,)), (1, 0)),
        ("moe", "router"): Layout(f"{hf_layer}.block_sparse_moe.gate.weight", one, ((e,), (d,)), (1, 0)),
        ("moe", "w_gate"): Layout(f"{experts}.w1.weight", two, ((fe,), (d,)), (1, 0)),
        ("moe", "w_up"): Layout(f"{experts}.w3.weight", two, ((fe,), (d,)), (1, 0)),
        ("moe", "w_down"): Layout(f"{experts}.w2.weight", two, ((d,), (fe,)), (1, 0)),
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
