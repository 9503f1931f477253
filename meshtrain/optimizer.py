"""The optax chain from config: global-norm clipping, AdamW, linear warmup + cosine decay.

Playbook, "First Steps: Training on one GPU": Adam keeps two float32 moments per
parameter (the 12 bytes/parameter of optimizer state with float32 master weights).
"""

from __future__ import annotations

import jax
import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup to `train.learning_rate`, then cosine decay to `min_lr_ratio` of it at `steps`."""
    t = config.train
    warmup = min(t.warmup_steps, config.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.learning_rate, warmup_steps=warmup,
        decay_steps=max(config.steps, warmup + 1), end_value=t.learning_rate * t.min_lr_ratio)


def _decay_mask(params):
    """Weight decay on matrices only: not on norm scales."""
    def decays(path, _):
        return not any(getattr(k, "key", None) == "scale" for k in path)
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """clip_by_global_norm -> adamw(schedule). Gradients arrive already normalised per token."""
    t = config.train
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    parts.append(optax.adamw(learning_rate_schedule(config), b1=t.b1, b2=t.b2, eps=t.eps,
                             weight_decay=t.weight_decay, mask=_decay_mask))
    return optax.chain(*parts)
