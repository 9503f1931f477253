"""What a run's checkpoints say about the run: its model and tokenizer, as JSON.

Every checkpoint's `meta` item holds `record(config)`: the resolved `model.*` keys that decide the
parameters and what they compute (`MODEL_KEYS`) and the tokenizer (`data.tokenizer`; a path inside
the workdir is stored relative to it, so the workdir can move). Nothing in it is ever executed: a
config file is Python, a checkpoint is data.

The commands that read a run (`train` resuming, `sample`, `evaluate`, `lm_eval`, `hf export`)
`adopt` the newest checkpoint's record: `--config.workdir=W` is all they need. A value a config file
gave is replaced (and logged); a value given on the command line that contradicts the record is
refused with one line naming the key, both values and the run.
"""

from __future__ import annotations

import json
import logging
import os

import ml_collections

from meshtrain import config as config_lib

log = logging.getLogger("meshtrain")

# The model keys that decide the parameters and the function they compute (not how a step is laid out
# or in which dtype it computes: `model.dtype`, the fused kernels, FP8 and sequence parallelism stay
# the command's own).
MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "rope_theta",
              "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
              "rope_original_max_positions", "family", "attention_bias", "qk_norm", "sliding_window", "norm_eps",
              "tie_embeddings", "param_dtype", "num_experts", "experts_per_token", "moe_every", "capacity_factor",
              "moe_dropless", "moe_mlp_dim", "shared_expert", "shared_expert_dim", "moe_norm_topk", "moe_router",
              "moe_routed_scale", "moe_router_bias", "moe_groups", "moe_topk_groups", "kv_lora_rank", "q_lora_rank",
              "qk_rope_head_dim", "v_head_dim", "first_dense_layers", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
              "rope_mscale_all_dim", "mtp_depth")
TOKENIZER_KEY = "data.tokenizer"


def record(config: ml_collections.ConfigDict) -> dict:
    """{"model": {key: value}, "tokenizer": spec, "dtype": the compute dtype, "context": the sequence length
    it trained on} of a resolved config (stored in each checkpoint; the dtype is what reading the run
    computes in by default, never adopted; the context bounds what sampling asks of it)."""
    return {"model": {key: config.model[key] for key in MODEL_KEYS},
            "tokenizer": _relative(config.data.tokenizer, config.workdir), "dtype": config.model.dtype,
            "context": int(config.train.seq_len)}


def _relative(spec: str, workdir: str) -> str:
    if spec == "bytes" or not workdir:
        return spec
    path, root = os.path.realpath(spec), os.path.realpath(workdir)
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


def newest_meta(root: str) -> tuple[int, dict] | None:
    """(step, meta JSON) of the newest finished checkpoint under a checkpoint root, read as a file
    (no orbax, no JAX: commands call this before the runtime starts); None without one."""
    if not os.path.isdir(root):
        return None
    steps = sorted((int(name) for name in os.listdir(root) if name.isdigit()
                    and os.path.isfile(os.path.join(root, name, "meta", "metadata"))), reverse=True)
    for step in steps:
        path = os.path.join(root, str(step), "meta", "metadata")
        try:
            with open(path) as f:
                return step, json.load(f)
        except (OSError, ValueError) as error:
            log.warning("checkpoint %s: its meta is unreadable (%s); trying the previous one", path, error)
    return None


def read(workdir: str) -> dict | None:
    """The newest checkpoint's record of the run in `workdir` ({"model", "tokenizer", "step", "dtype",
    "parameters_only", "attention": the attention implementation its steps ran, "" before they said,
    "context": the sequence length it trained on, 0 before checkpoints said}),
    or None (no checkpoint, or one written before checkpoints described their run)."""
    found = newest_meta(os.path.join(os.path.expanduser(workdir), "checkpoints")) if workdir else None
    if found is None or "model" not in found[1]:
        return None
    step, meta = found
    return {"model": meta["model"], "tokenizer": meta.get("tokenizer", "bytes"), "step": step,
            "dtype": meta.get("dtype", ""), "parameters_only": bool(meta.get("parameters_only", False)),
            "attention": meta.get("attention", ""), "context": int(meta.get("context", 0))}


def adopt(config: ml_collections.ConfigDict, given: dict) -> dict[str, tuple]:
    """Sets `config`'s model and tokenizer from the run in `config.workdir` (when it has a record).

    `given`: the dotted keys set on the command line ({"model.n_layers": 8}); one that contradicts the
    record raises ConfigError. Returns {key: (old, new)} for the values it changed (each is logged).
    """
    found = read(config.workdir)
    if found is None:
        return {}
    wanted = {f"model.{key}": value for key, value in found["model"].items() if key in config.model}
    tokenizer = found["tokenizer"]
    if tokenizer != "bytes" and not os.path.isabs(tokenizer):
        tokenizer = os.path.join(os.path.expanduser(config.workdir), tokenizer)
    wanted[TOKENIZER_KEY] = tokenizer
    changed = {}
    for key, value in wanted.items():
        section, name = key.split(".")
        current = config[section][name]
        same = os.path.realpath(current) == os.path.realpath(value) if key == TOKENIZER_KEY and current != "bytes" \
            and value != "bytes" else current == value
        if same:
            continue
        if key in given:
            raise config_lib.ConfigError(key, given[key], f"contradicts the run in {config.workdir} (step "
                                         f"{found['step']}), whose checkpoints hold {key}={value!r}: drop the flag "
                                         "or use another workdir")
        changed[key] = (current, value)
        config[section][name] = type(current)(value) if not isinstance(current, bool) else bool(value)
    for key, (old, new) in changed.items():
        log.info("the run in %s: %s = %r (was %r)", config.workdir, key, new, old)
    return changed
