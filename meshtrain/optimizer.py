"""The optimizer from config: AdamW with linear warmup + cosine decay, and global-norm clipping.

Playbook, "First Steps: Training on one GPU": Adam keeps two float32 moments per
parameter (the 12 bytes/parameter of optimizer state with float32 master weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup to `train.learning_rate`, then cosine decay to `min_lr_ratio` of it at `steps`."""
    t = config.train
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
        decay_steps=max(config.steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)


def _decay_mask(params):
    """Weight decay on matrices only: not on norm scales, the attention biases (Qwen2) or the router's
    balancing bias (moved by the step alone: `moe.balance_router_bias`)."""
    def decays(path, _):
        return not any(getattr(k, "key", None) in ("scale", "bq", "bk", "bv", "router_bias") for k in path)
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """adamw(schedule). Gradients arrive already normalised per token and clipped by the step.

    The clipping is not an optax stage: the step computes the global gradient norm once (it is
    also the logged `grad_norm` and the non-finite check) and scales by `clip_scale` of it.
    """
    t = config.train
    return optax.adamw(learning_rate_schedule(config), b1=t.b1, b2=t.b2, eps=t.eps,
                       weight_decay=t.weight_decay, mask=_decay_mask)


def clip_scale(grad_norm: jax.Array, max_norm: float) -> jax.Array:
    """Factor that brings gradients of global norm `grad_norm` to at most `max_norm` (0: no clipping)."""
    if max_norm <= 0:
        return jnp.ones((), grad_norm.dtype)
    return jnp.minimum(1.0, max_norm / grad_norm)
