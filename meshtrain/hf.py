"""Hugging Face Llama / Mistral / Mixtral checkpoints <-> meshtrain parameters.

Import reads `config.json` and `*.safetensors` (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`) and builds every parameter directly in its mesh sharding with
`jax.make_array_from_callback`: each device reads only the rows and columns of its own shard
from the memory-mapped files, so no process ever holds a whole model (the playbook's "Shapes
before bytes" habit applied to loading, and what makes the ZeRO-3 / tensor-parallel layouts of
"ZeRO" and "Tensor Parallelism" reachable from a 70B checkpoint). Export writes sharded
safetensors and a `config.json` that `transformers` loads, into a temporary folder renamed into
place only when complete.

The layouts differ only by transposes and reshapes (meshtrain's RoPE is the rotate-half layout
of Hugging Face Llama, so q/k need no permutation):

    q_proj [H*Dh, D]  -> layers/attn/wq   [L, D, H, Dh]
    k_proj, v_proj    -> layers/attn/wk,v [L, D, K, Dh]
    o_proj [D, H*Dh]  -> layers/attn/wo   [L, H, Dh, D]
    gate/up_proj [F, D] -> layers/mlp/w_gate, w_up [L, D, F];  down_proj [D, F] -> w_down [L, F, D]
    embed_tokens [V, D] -> embedding [V, D];  lm_head [V, D] -> head [D, V]

CLI:
    python -m meshtrain.hf import HF_DIR            # prints the model config and parameter table
    python -m meshtrain.hf export HF_DIR OUT_DIR    # HF -> meshtrain -> HF (re-shards / casts)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator

import jax
import ml_dtypes
import numpy as np
from flax import linen as nn

from meshtrain.config import ModelConfig

log = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


class HFFormatError(ValueError):
    """A Hugging Face checkpoint that cannot be imported; the message names the key or tensor."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ---------------------------------------------------------------------------------------------


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
                  for ids in _product(stack_ranges)]
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


def _product(ranges):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


def layouts(cfg: ModelConfig) -> dict[tuple[str, ...], Layout]:
    """meshtrain parameter path -> its Hugging Face source (Llama / Mistral, or Mixtral when MoE)."""
    d, h, k, dh, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    moe = cfg.num_experts > 0
    if moe and (cfg.moe_every != 1 or cfg.shared_expert):
        raise HFFormatError(f"model.moe_every={cfg.moe_every}, model.shared_expert={cfg.shared_expert}: Mixtral "
                            "checkpoints have a mixture of experts in every layer and no shared expert")
    block = ("layers", "moe_layer") if moe else ("layers",)  # the scanned unit (model.scan_unit)
    hf_layer, one = "model.layers.{layer}", ("layer",)
    attn = f"{hf_layer}.self_attn"
    out = {
        ("embedding",): Layout("model.embed_tokens.weight", (), ((v,), (d,)), (0, 1)),
        ("final_norm", "scale"): Layout("model.norm.weight", (), ((d,),), (0,)),
        (*block, "attn", "wq"): Layout(f"{attn}.q_proj.weight", one, ((h, dh), (d,)), (2, 0, 1)),
        (*block, "attn", "wk"): Layout(f"{attn}.k_proj.weight", one, ((k, dh), (d,)), (2, 0, 1)),
        (*block, "attn", "wv"): Layout(f"{attn}.v_proj.weight", one, ((k, dh), (d,)), (2, 0, 1)),
        (*block, "attn", "wo"): Layout(f"{attn}.o_proj.weight", one, ((d,), (h, dh)), (1, 2, 0)),
        (*block, "attn_norm", "scale"): Layout(f"{hf_layer}.input_layernorm.weight", one, ((d,),), (0,)),
        (*block, "mlp_norm", "scale"): Layout(f"{hf_layer}.post_attention_layernorm.weight", one, ((d,),), (0,)),
    }
    if not cfg.tie_embeddings:
        out[("head",)] = Layout("lm_head.weight", (), ((v,), (d,)), (1, 0))
    if not moe:
        mlp = f"{hf_layer}.mlp"
        out[(*block, "mlp", "w_gate")] = Layout(f"{mlp}.gate_proj.weight", one, ((f,), (d,)), (1, 0))
        out[(*block, "mlp", "w_up")] = Layout(f"{mlp}.up_proj.weight", one, ((f,), (d,)), (1, 0))
        out[(*block, "mlp", "w_down")] = Layout(f"{mlp}.down_proj.weight", one, ((d,), (f,)), (1, 0))
        return out
    fe, e = cfg.moe_mlp_dim or cfg.mlp_dim, cfg.num_experts
    experts, two = f"{hf_layer}.block_sparse_moe.experts.{{expert}}", ("layer", "expert")
    out[(*block, "moe", "router")] = Layout(f"{hf_layer}.block_sparse_moe.gate.weight", one, ((e,), (d,)), (1, 0))
    out[(*block, "moe", "w_gate")] = Layout(f"{experts}.w1.weight", two, ((fe,), (d,)), (1, 0))
    out[(*block, "moe", "w_up")] = Layout(f"{experts}.w3.weight", two, ((fe,), (d,)), (1, 0))
    out[(*block, "moe", "w_down")] = Layout(f"{experts}.w2.weight", two, ((d,), (fe,)), (1, 0))
    return out


# ---------------------------------------------------------------------------------------------
# safetensors: memory-mapped lazy reads, streamed writes (the format is an 8-byte header length,
# a JSON header {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes).
# ---------------------------------------------------------------------------------------------


class SafetensorsStore:
    """The tensors of a checkpoint folder, opened lazily as read-only memory maps."""

    def __init__(self, hf_dir: str):
        index_path, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
        if os.path.exists(index_path):
            with open(index_path) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        elif os.path.exists(single):
            files = [SINGLE_FILE]
        else:
            raise HFFormatError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")
        self.entries: dict[str, tuple[str, dict]] = {}
        for file in files:
            for name, entry in _read_header(os.path.join(hf_dir, file))[0].items():
                self.entries[name] = (os.path.join(hf_dir, file), entry)
        self._maps: dict[str, tuple[np.memmap, int]] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._entry(name)["dtype"]
        if code not in ST_DTYPES:
            raise HFFormatError(f"tensor {name!r}: dtype {code} is not supported (supported: {sorted(ST_DTYPES)})")
        return ST_DTYPES[code]

    def __call__(self, name: str) -> np.ndarray:
        """The tensor as a lazy view of the memory map (reads happen on slicing)."""
        path, entry = self.entries[name]
        if path not in self._maps:
            self._maps[path] = (np.memmap(path, dtype=np.uint8, mode="r"), _read_header(path)[1])
        data, base = self._maps[path]
        start, end = entry["data_offsets"]
        return data[base + start:base + end].view(self.dtype(name)).reshape(self.shape(name))

    def _entry(self, name: str) -> dict:
        if name not in self.entries:
            raise HFFormatError(f"tensor {name!r} is missing from the checkpoint")
        return self.entries[name][1]


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _write_safetensors(path: str, tensors: list[tuple[str, tuple[int, ...], str]],
                       blocks: Iterator[np.ndarray]) -> None:
    """Writes the header from shapes first, then streams each tensor's bytes from `blocks`."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, code in tensors:
        nbytes = math.prod(shape) * ST_DTYPES[code].itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for (name, shape, code), block in zip(tensors, blocks, strict=True):
            block = np.ascontiguousarray(block, dtype=ST_DTYPES[code])
            assert block.shape == tuple(shape), (name, block.shape, shape)
            fh.write(block.tobytes())


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise HFFormatError(f"{hf_dir}: no config.json")
    with open(path) as fh:
        return json.load(fh)


def single_device_mesh() -> jax.sharding.Mesh:
    """All six axes of size 1 on the first device (the unsharded reference)."""
    from meshtrain.mesh import MESH_ORDER

    return jax.make_mesh((1,) * len(MESH_ORDER), MESH_ORDER, devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_ORDER))


def boxed_params(cfg: ModelConfig, mesh: jax.sharding.Mesh):
    """The abstract parameter tree with its logical-name boxes (nothing allocated)."""
    import jax.numpy as jnp

    from meshtrain.model import Transformer
    from meshtrain.sharding_rules import Rules

    model = Transformer(cfg, Rules.for_mesh(mesh))
    sizes = dict(mesh.shape)  # the smallest batch every activation rule divides
    ids = jnp.zeros((sizes["data"] * sizes["fsdp"] * sizes["expert"], sizes["sequence"] * sizes["tensor"]), jnp.int32)
    with jax.set_mesh(mesh):
        return jax.eval_shape(model.init, jax.random.key(0), ids, ids, ids + 1)["params"]


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh):
    """Storage shardings of the parameters with every rule on (ZeRO-3 layout over `fsdp`)."""
    from meshtrain.sharding_rules import Rules

    rules = Rules.for_mesh(mesh)

    def sharding(box: nn.LogicallyPartitioned) -> jax.sharding.NamedSharding:
        names = tuple(box.names)
        return jax.sharding.NamedSharding(mesh, rules.spec(names, box.value.shape, what="/".join(map(str, names))))

    return jax.tree.map(sharding, boxed_params(cfg, mesh), is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def _check_tensors(store: SafetensorsStore, table: dict, cfg: ModelConfig) -> None:
    """Every needed tensor exists with its shape and a supported dtype; nothing unexpected is left."""
    needed = set()
    for layout in table.values():
        counts = {"layer": cfg.n_layers, "expert": cfg.num_experts}
        for ids in _product([range(counts[s]) for s in layout.stack]):
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


def load(hf_dir: str, mesh: jax.sharding.Mesh | None = None, *, shardings=None,
         param_dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Imports a Hugging Face checkpoint folder.

    Args:
      hf_dir: folder with `config.json` and `model.safetensors` or `model.safetensors.index.json`.
      mesh: build each parameter in its ZeRO-3 storage sharding on this mesh (default: one device).
      shardings: an explicit tree of NamedShardings for the parameters (e.g. a StateFactory's),
        instead of `mesh`.
      param_dtype: storage dtype; default: the checkpoint's `dtype`.

    Returns:
      (model config, parameter tree) matching `meshtrain.model.Transformer`.
    """
    cfg = model_config_from_hf(read_config(hf_dir), param_dtype)
    store = SafetensorsStore(hf_dir)
    table = layouts(cfg)
    _check_tensors(store, table, cfg)
    if shardings is None:
        shardings = param_shardings(cfg, mesh or single_device_mesh())
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)

    def build(path, sharding):
        key = tuple(k.key for k in path)
        if key not in table:
            raise HFFormatError(f"meshtrain parameter {'/'.join(key)} has no Hugging Face source")
        layout = table[key]
        shape = _meshtrain_shape(layout, cfg)
        return jax.make_array_from_callback(
            shape, sharding, lambda index: layout.read(store, index, shape).astype(dtype))

    params = jax.tree_util.tree_map_with_path(build, shardings)
    return cfg, params


def _meshtrain_shape(layout: Layout, cfg: ModelConfig) -> tuple[int, ...]:
    counts = {"layer": cfg.n_layers, "expert": cfg.num_experts}
    split = [n for group in layout.split for n in group]
    return tuple(counts[s] for s in layout.stack) + tuple(split[p] for p in layout.perm)


# Architecture fields that a Hugging Face checkpoint decides when it starts a run (config.init.from_hf).
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
                       "rope_theta", "norm_eps", "tie_embeddings", "num_experts", "experts_per_token",
                       "moe_every", "moe_mlp_dim", "shared_expert")


def apply_model_config(config) -> dict[str, tuple]:
    """Sets `config.model`'s architecture fields from `config.init.from_hf`'s config.json.

    Returns {field: (old, new)} for each value that changed (each is logged): the checkpoint
    decides the architecture; precision, remat and parallelism stay the run's own.
    """
    from meshtrain.config import ConfigError

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


def initial_state(factory, hf_dir: str, seed: int = 0):
    """A TrainState at step 0 with the checkpoint's weights, built in the factory's shardings.

    The optimizer state is initialised from those weights inside one jit whose outputs are
    the factory's shardings: nothing is materialised whole.
    """
    import jax.numpy as jnp

    from meshtrain.train_step import TrainState, initial_rng

    want = factory.model.cfg
    cfg, params = load(hf_dir, shardings=factory.shardings.params, param_dtype=want.param_dtype)
    for field in ARCHITECTURE_FIELDS:
        if getattr(cfg, field) != getattr(want, field):
            raise HFFormatError(f"{hf_dir}: {field}={getattr(cfg, field)!r} but the run's model has "
                                f"{getattr(want, field)!r} (call apply_model_config first)")

    def init(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=factory.tx.init(params),
                          rng=initial_rng(jax.random.key(seed)))

    with jax.set_mesh(factory.mesh):
        return jax.jit(init, out_shardings=factory.shardings, donate_argnums=0)(params)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def _host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save(cfg: ModelConfig, params: dict, out_dir: str, *, dtype: str | None = None,
         max_shard_bytes: int = 2 << 30, overwrite: bool = False) -> None:
    """Exports parameters as a Hugging Face checkpoint folder (`transformers` loads it).

    Tensors stream out one layer at a time. The folder is assembled under a temporary name
    beside `out_dir` and renamed into place at the end, so a failed export never leaves a
    folder that looks complete. Only process 0 writes.

    Args:
      cfg: the model config of `params`.
      params: the parameter tree (sharded or not).
      out_dir: destination folder; must not exist unless `overwrite`.
      dtype: "float32", "bfloat16" or "float16"; default: `cfg.param_dtype`.
      max_shard_bytes: split into `model-0000i-of-0000N.safetensors` files of about this size.
      overwrite: replace an existing `out_dir`.
    """
    dtype = dtype or cfg.param_dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPE_NAMES)}")
    if os.path.exists(out_dir) and not overwrite:
        raise ValueError(f"out_dir={out_dir!r} exists; pass overwrite=True to replace it")
    code = DTYPE_NAMES[dtype]
    table = layouts(cfg)
    counts = {"layer": cfg.n_layers, "expert": cfg.num_experts}
    tensors = []  # (hf name, hf shape, params path, stacked ids)
    for key, layout in table.items():
        for ids in _product([range(counts[s]) for s in layout.stack]):
            tensors.append((layout.tensor_name(ids), layout.hf_shape, key, ids))
    tensors.sort(key=lambda t: _hf_order(t[0]))
    flat = {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    missing = sorted("/".join(k) for k in table if k not in flat)
    if missing:
        raise ValueError(f"params has no {missing}: not a tree for this model config")
    shards, size = [[]], 0
    for t in tensors:
        nbytes = math.prod(t[1]) * ST_DTYPES[code].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    if jax.process_index() != 0:
        for _ in _blocks([t for shard in shards for t in shard], flat, table):  # join the gathers
            pass
        return
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    try:
        names = [SINGLE_FILE] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards, strict=True):
            _write_safetensors(os.path.join(tmp, name), [(t[0], t[1], code) for t in shard],
                               _blocks(shard, flat, table))
        if len(shards) > 1:
            total = sum(math.prod(t[1]) * ST_DTYPES[code].itemsize for t in tensors)
            index = {"metadata": {"total_size": total},
                     "weight_map": {t[0]: name for name, shard in zip(names, shards, strict=True) for t in shard}}
            with open(os.path.join(tmp, INDEX_FILE), "w") as fh:
                json.dump(index, fh, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as fh:  # last: marks the folder complete
            json.dump(hf_config_from_model(cfg, dtype), fh, indent=2)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _blocks(tensors, flat, table) -> Iterator[np.ndarray]:
    """The Hugging Face tensor of each entry, gathering one layer / expert slice at a time."""
    for _, _, key, ids in tensors:
        leaf = flat[key]
        yield table[key].to_hf(_host(leaf[ids] if ids else leaf))


def _hf_order(name: str) -> tuple:
    """embed_tokens, then layers in numeric order, then norm and lm_head."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return (1, int(parts[2]), [int(p) if p.isdigit() else p for p in parts[3:]])
    return (0 if "embed_tokens" in name else 2, 0, [name])


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m meshtrain.hf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="load a checkpoint and print its config and parameter shapes")
    imp.add_argument("hf_dir")
    exp = sub.add_parser("export", help="load a checkpoint and write it back (re-sharded / cast)")
    exp.add_argument("hf_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--dtype", choices=sorted(DTYPE_NAMES))
    exp.add_argument("--max-shard-bytes", type=int, default=2 << 30)
    exp.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg, params = load(args.hf_dir)
        if args.command == "import":
            print(cfg)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
                print(f"{jax.tree_util.keystr(path):40s} {tuple(leaf.shape)} {leaf.dtype}")
            print(f"{cfg.num_params() / 1e6:.2f}M parameters")
        else:
            save(cfg, params, args.out_dir, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes,
                 overwrite=args.overwrite)
            print(f"wrote {args.out_dir}")
    except ValueError as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
