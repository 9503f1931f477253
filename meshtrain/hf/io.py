"""Hugging Face checkpoints into the mesh and back: load, the initial train state, save.

Import builds every parameter directly in its mesh sharding with `jax.make_array_from_callback`:
each device reads only the rows and columns of its own shard from the memory-mapped files, so no
process ever holds a whole model (the playbook's "shapes before bytes" applied to loading, and
what makes the ZeRO-3 / tensor-parallel layouts of "ZeRO" and "Tensor Parallelism" reachable from
a 70B checkpoint). Export streams one layer at a time into a temporary folder renamed into place
only when complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator

import jax
import ml_dtypes
import numpy as np
from flax import linen as nn

from meshtrain import model
from meshtrain.config import ModelConfig
from meshtrain.hf.convert import (
    ARCHITECTURE_FIELDS,
    MTP_DROPPED,
    MTP_FRESH,
    MTP_SHARED,
    check_tensors,
    has_mtp,
    hf_config_from_model,
    layouts,
    meshtrain_shape,
    model_config_from_hf,
    product,
    stack_counts,
)
from meshtrain.hf.formats import (
    DTYPE_NAMES,
    INDEX_FILE,
    SINGLE_FILE,
    ST_DTYPES,
    DequantisingStore,
    HFFormatError,
    SafetensorsStore,
    fp8_block,
    read_config,
    write_safetensors,
)
from meshtrain.mesh import single_device_mesh
from meshtrain.sharding_rules import Rules

log = logging.getLogger(__name__)


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh):
    """Storage shardings of the parameters with every rule on (ZeRO-3 layout over `fsdp`)."""
    rules = Rules.for_mesh(mesh, model=cfg)

    def sharding(box: nn.LogicallyPartitioned) -> jax.sharding.NamedSharding:
        names = tuple(box.names)
        return jax.sharding.NamedSharding(mesh, rules.spec(names, box.value.shape, what="/".join(map(str, names))))

    return jax.tree.map(sharding, model.abstract_params(cfg), is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def load(hf_dir: str, mesh: jax.sharding.Mesh | None = None, *, shardings=None,
         param_dtype: str | None = None, mtp: bool = False) -> tuple[ModelConfig, dict]:
    """Imports a Hugging Face checkpoint folder.

    Args:
      hf_dir: folder with `config.json` and `model.safetensors` or `model.safetensors.index.json`.
      mesh: build each parameter in its ZeRO-3 storage sharding on this mesh (default: one device).
      shardings: an explicit tree of NamedShardings for the parameters (e.g. a StateFactory's),
        instead of `mesh`.
      param_dtype: storage dtype; default: the checkpoint's `dtype`.
      mtp: also read DeepSeek-V3's multi-token prediction layer (`convert.mtp_layouts`) into `params["mtp"]`,
        the config with `mtp_depth` 1; the checkpoint must hold it. Without it the layer is not read.

    Returns:
      (model config, parameter tree) matching `meshtrain.model.Transformer`.
    """
    hf_config = read_config(hf_dir)
    cfg = model_config_from_hf(hf_config, param_dtype)
    store = SafetensorsStore(hf_dir)
    block = fp8_block(hf_config)
    if block is not None:  # DeepSeek-V3's release format: e4m3 weights with block scales
        store = DequantisingStore(store, block)
        log.info("%s: %d FP8 (e4m3) weights dequantised with their %dx%d block scales (weight x scale_inv), "
                 "stored as %s", hf_dir, len(store.scaled), *block, cfg.param_dtype)
    if mtp:
        cfg = dataclasses.replace(cfg, mtp_depth=1)
        if not has_mtp(store, cfg):
            raise HFFormatError(f"{hf_dir}: no multi-token prediction layer (model.layers.{cfg.n_layers}.eh_proj."
                                "weight): the checkpoint has none to read")
        log.info("%s: multi-token prediction block read from model.layers.%d", hf_dir, cfg.n_layers)
    table = layouts(cfg, mtp=mtp)
    check_tensors(store, table, cfg)
    if shardings is None:
        shardings = param_shardings(cfg, mesh or single_device_mesh())
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)

    def build(path, sharding):
        key = tuple(k.key for k in path)
        if key[0] == "mtp" and not mtp:  # not read: `initial_state` puts a fresh block here
            return None
        if key not in table:
            raise HFFormatError(f"meshtrain parameter {'/'.join(key)} has no Hugging Face source")
        layout = table[key]
        shape = meshtrain_shape(layout, cfg)
        return jax.make_array_from_callback(
            shape, sharding, lambda index: layout.read(store, index, shape).astype(dtype))

    params = jax.tree_util.tree_map_with_path(build, shardings)
    return cfg, params


def initial_state(factory, hf_dir: str, seed: int = 0):
    """A TrainState at step 0 with the checkpoint's weights, in the factory's shardings
    (`StateFactory.from_params`: the optimizer state is initialised from those weights)."""
    want = factory.model.cfg
    read = bool(want.mtp_depth) and has_mtp(SafetensorsStore(hf_dir), want)  # DeepSeek-V3's, when it has one
    cfg, params = load(hf_dir, shardings=factory.canonical_shardings.params, param_dtype=want.param_dtype, mtp=read)
    for field in ARCHITECTURE_FIELDS:
        if getattr(cfg, field) != getattr(want, field):
            raise HFFormatError(f"{hf_dir}: {field}={getattr(cfg, field)!r} but the run's model has "
                                f"{getattr(want, field)!r} (call apply_model_config first)")
    if want.mtp_depth and not read:  # the multi-token prediction block is the run's own, freshly initialised
        log.info(MTP_FRESH)
        params = {**params, "mtp": factory.create(seed).params["mtp"]}
    return factory.from_params(params, seed)


def _host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save(cfg: ModelConfig, params: dict, out_dir: str, *, dtype: str | None = None,
         max_shard_bytes: int = 2 << 30, overwrite: bool = False, mtp: bool = False) -> None:
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
      mtp: also write the multi-token prediction block (`model.mtp_depth` 1) as DeepSeek-V3's checkpoints
        hold it, one layer after the last with copies of the embedding and the head (`convert.mtp_layouts`);
        transformers' DeepSeek-V3 loads the folder and leaves that layer out. Otherwise the block is dropped.
    """
    dtype = dtype or cfg.param_dtype
    if cfg.mtp_depth and not mtp:
        log.info(MTP_DROPPED)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPE_NAMES)}")
    if os.path.exists(out_dir) and not overwrite:
        raise ValueError(f"out_dir={out_dir!r} exists; pass overwrite=True to replace it")
    code = DTYPE_NAMES[dtype]
    table = layouts(cfg, mtp=mtp)
    counts = stack_counts(cfg)
    tensors = []  # (hf name, hf shape, params path, stacked ids)
    for key, layout in table.items():
        for ids in product([range(counts[s]) for s in layout.stack]):
            tensors.append((layout.tensor_name(ids), layout.hf_shape, key, ids))
    if mtp:  # the prediction layer's copies of what it shares with the main model
        for name, key in MTP_SHARED.items():
            key = key if key in table else ("embedding",)  # a tied head is the embedding
            tensors.append((f"model.layers.{cfg.n_layers}.{name}", table[key].hf_shape, key, ()))
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
    _recover_set_aside(out_dir)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    old = None
    try:
        names = [SINGLE_FILE] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards, strict=True):
            write_safetensors(os.path.join(tmp, name), [(t[0], t[1], code) for t in shard],
                               _blocks(shard, flat, table))
        if len(shards) > 1:
            total = sum(math.prod(t[1]) * ST_DTYPES[code].itemsize for t in tensors)
            index = {"metadata": {"total_size": total},
                     "weight_map": {t[0]: name for name, shard in zip(names, shards, strict=True) for t in shard}}
            with open(os.path.join(tmp, INDEX_FILE), "w") as fh:
                json.dump(index, fh, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as fh:  # last: marks the folder complete
            json.dump(hf_config_from_model(cfg, dtype, mtp=mtp), fh, indent=2)
        if os.path.exists(out_dir):  # set aside, not deleted, until the new folder has its name
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old, "model"))
        os.rename(tmp, out_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old and not os.path.exists(out_dir) and os.path.isdir(os.path.join(old, "model")):
            os.rename(os.path.join(old, "model"), out_dir)  # the previous export back under its name
            shutil.rmtree(old, ignore_errors=True)
        raise


def _recover_set_aside(out_dir: str) -> None:
    """A previous export set aside by a save killed before its replacement got the name: back under
    `out_dir` when that is missing; otherwise (replaced) the leftover is removed."""
    parent, name = os.path.dirname(os.path.abspath(out_dir)), os.path.basename(out_dir)
    if not os.path.isdir(parent):
        return
    for entry in sorted(os.listdir(parent)):
        if not entry.startswith(f".{name}.old-"):
            continue
        leftover = os.path.join(parent, entry, "model")
        if os.path.isdir(leftover) and not os.path.exists(out_dir):
            os.rename(leftover, out_dir)
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


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
