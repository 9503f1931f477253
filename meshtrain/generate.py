"""Sampling with a KV cache: one jitted program of a prefill and a `lax.scan` of decode steps.

    tokens = generate(model_config, params, [[1, 70, 72]], max_new_tokens=32,
                      sampling=Sampling(temperature=0.8, top_k=40, seed=0))

Prompts are left-padded to a common length P (padding has segment id 0, so no query attends to
it, and RoPE positions count real tokens only); the cache holds S = P + max_new_tokens slots
per row, created by `Transformer(decode=True).init` on a [B, S] input and sharded by the same
rules as the activations (batch over the batch axes, KV heads over `tensor`). The prefill writes
the prompt into the cache in one forward pass; each scan step picks a token from the previous
logits (greedy at temperature 0, else temperature / top-k / top-p with a key folded from the
seed and the step), feeds it, and writes one slot. Rows that produced EOS keep running (fixed
shapes) and their later tokens are dropped from the result.

Runs on the mesh the parameters live on (any mix of the batch axes and `tensor`; pipelines and
sequence splits are not sampled from: `sample.py` refuses them); the rows are split over the batch
axes, so a batch smaller than their product is filled with copies of the first prompt. The
results come back replicated, so every process of a multi-process run reads them.

`continue_text` is the text-level call: `python -m meshtrain.sample` and the training loop's
`sample_every` both use it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain import config as config_lib
from meshtrain.config import BATCH_AXES, ModelConfig
from meshtrain.mesh import compiler_options
from meshtrain.model import Transformer, params_mesh
from meshtrain.sharding_rules import Rules


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy at temperature 0; else from softmax(logits / temperature)
    restricted to the `top_k` most likely tokens (0: all) and the smallest set whose probability
    reaches `top_p` (1: all). The same seed gives the same tokens."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be >= 0 (0: no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")


def pick(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token ids [B] from float32 logits [B, V]."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        cutoff = jnp.min(jnp.where(before < sampling.top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, positions, segment_ids) [B, P] of prompts right-aligned at P = the longest."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (the tokenizer's BOS, for an empty text)")
    width = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    segments = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = prompt
        segments[row, width - len(prompt):] = 1
    positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0).astype(np.int32)
    return tokens, positions, segments


def generate(model_config: ModelConfig, params: dict, prompts: list[list[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), *, eos_id: int | None = None, vocab_limit: int | None = None,
             return_logits: bool = False):
    """Continues each prompt (token ids) by up to `max_new_tokens` tokens.

    Args:
      vocab_limit: only ids below it are sampled (the tokenizer's size when `model.vocab_size` is padded).
      return_logits: also return the float32 logits [B, max_new_tokens, V] each token was picked from.

    Returns:
      Per prompt, the new token ids, ending at (and including) the first `eos_id`; with
      `return_logits`, (that list, logits).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be >= 1")
    mesh = params_mesh(params)
    rows = len(prompts)
    split = math.prod(mesh.shape[a] for a in BATCH_AXES)  # rows are split over the batch axes: fill them
    tokens, positions, segments = left_pad(list(prompts) + [prompts[0]] * (-rows % split))
    rules = Rules.for_mesh(mesh, model=model_config)
    program = sampling_program(model_config, rules, mesh, max_new_tokens, sampling, vocab_limit)
    with jax.set_mesh(mesh):
        new, logits = program(params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    new, logits = np.asarray(new)[:rows], np.asarray(logits)[:rows]
    out = []
    for row in new:
        row = row.tolist()
        out.append(row[:row.index(eos_id) + 1] if eos_id is not None and eos_id in row else row)
    return (out, logits) if return_logits else out


def continue_text(model_config: ModelConfig, params: dict, tokenizer, prompt: str, max_new_tokens: int,
                  sampling: Sampling = Sampling(), stop: tuple[str, ...] = ()) -> str:
    """The text `generate` continues `prompt` with, through `tokenizer` (`meshtrain.data.tokenizers`):
    BOS first when the tokenizer has one, the EOS that ends it left out, cut before the first of the
    `stop` strings."""
    return continue_texts(model_config, params, tokenizer, [prompt], max_new_tokens, sampling, stop)[0]


def continue_texts(model_config: ModelConfig, params: dict, tokenizer, prompts: list[str], max_new_tokens: int,
                   sampling: Sampling = Sampling(), stop: tuple[str, ...] = ()) -> list[str]:
    """`continue_text` of every prompt, decoded together in one batch on the parameters' mesh."""
    rows = prompt_rows(tokenizer, prompts)
    out = []
    for new in generate(model_config, params, rows, max_new_tokens, sampling, eos_id=tokenizer.eos_id,
                        vocab_limit=tokenizer.vocab_size):
        if tokenizer.eos_id is not None and new and new[-1] == tokenizer.eos_id:
            new = new[:-1]
        out.append(cut(tokenizer.decode(new), stop))
    return out


def prompt_rows(tokenizer, prompts: list[str]) -> list[list[int]]:
    """The token ids `continue_texts` decodes from: BOS first when the tokenizer has one (an empty prompt
    without BOS: the pad id alone)."""
    rows = []
    for prompt in prompts:
        ids = [int(i) for i in tokenizer.encode(prompt)]
        rows.append([tokenizer.bos_id, *ids] if tokenizer.bos_id is not None else ids or [tokenizer.pad_id])
    return rows


def check_context(rows: list[list[int]], max_new_tokens: int, context: int, source: str) -> None:
    """Refuses (ValueError, one line) a request whose longest prompt and `max_new_tokens` together pass
    the model's `context` (the sequence length it trained on, or a Hugging Face folder's
    `max_position_embeddings`; `source` says which); 0: not known, nothing checked."""
    longest = max(len(row) for row in rows)
    if context and longest + max_new_tokens > context:
        raise ValueError(f"--max_new_tokens={max_new_tokens}: the longest prompt ({longest} tokens) and "
                         f"{max_new_tokens} new ones make {longest + max_new_tokens}, past the model's context of "
                         f"{context} tokens ({source}); ask for at most {max(context - longest, 0)}")


def cut(text: str, stop: tuple[str, ...]) -> str:
    """`text` up to the first occurrence of any of the `stop` strings."""
    ends = [text.find(s) for s in stop if s and s in text]
    return text[:min(ends)] if ends else text


def validate_config(config, sizes: dict[str, int]) -> None:
    """The in-loop sample's rules (`sample_every`; gathered by `meshtrain.validate`). Raises ConfigError."""
    if not config.sample_every:
        return
    require = config_lib.require
    for axis in ("stage", "sequence"):
        require(sizes[axis] == 1, "sample_every", config.sample_every,
                f"sampling runs every layer on whole sequences: mesh.{axis} must be 1 (or sample_every 0)")
    require(isinstance(config.sample_prompt, str) and config.sample_prompt != "", "sample_prompt",
            config.sample_prompt, "must be a non-empty string")
    require(isinstance(config.sample_max_new_tokens, int) and config.sample_max_new_tokens >= 1,
            "sample_max_new_tokens", config.sample_max_new_tokens, "must be a positive integer")
    require(config.sample_temperature >= 0, "sample_temperature", config.sample_temperature, "must be >= 0 (0: greedy)")
    require(isinstance(config.sample_top_k, int) and config.sample_top_k >= 0, "sample_top_k", config.sample_top_k,
            "must be a non-negative integer (0: every token)")


def sampling_program(model_config: ModelConfig, rules: Rules, mesh: jax.sharding.Mesh, max_new_tokens: int,
                     sampling: Sampling = Sampling(), vocab_limit: int | None = None):
    """The jitted sampling program of `generate` on `mesh` (also compiled ahead of time by `meshtrain.aot`):
    (params, tokens, positions, segment_ids) [B, P] -> (new tokens [B, max_new_tokens], their logits)."""
    # decoding runs every matmul in the compute dtype (an FP8-trained model too: its weights are float32)
    cfg = dataclasses.replace(model_config, remat_policy="none", attention_impl="xla", fused_norm=False,
                              fused_loss=False, sequence_parallel=False, matmul_precision="bf16")
    return _program(cfg, rules, mesh, max_new_tokens, sampling, int(vocab_limit or cfg.vocab_size))


@functools.cache
def _program(cfg: ModelConfig, rules: Rules, mesh: jax.sharding.Mesh, steps: int, sampling: Sampling,
             vocab_limit: int):
    """The jitted (params, tokens, positions, segment_ids) -> (new tokens [B, steps], logits [B, steps, V])."""
    model = Transformer(cfg, rules, decode=True)

    def run(params, tokens, positions, segments):
        width = tokens.shape[1]
        ids = jnp.zeros((tokens.shape[0], width + steps), jnp.int32)
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids + 1)["cache"])
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        logits, variables = model.apply({"params": params, "cache": cache}, tokens, positions, segments,
                                        mutable=["cache"])
        allowed = jnp.arange(logits.shape[-1]) < vocab_limit
        key = jax.random.key(sampling.seed)

        def step(carry, i):
            cache, last_logits, position = carry
            token = pick(jnp.where(allowed, last_logits, -jnp.inf), jax.random.fold_in(key, i), sampling)
            logits, variables = model.apply({"params": params, "cache": cache}, token[:, None], position[:, None],
                                            jnp.ones_like(token)[:, None], mutable=["cache"])
            return (variables["cache"], logits[:, 0], position + 1), (token, last_logits)

        carry = (variables["cache"], logits[:, -1], positions[:, -1] + 1)
        _, (new, picked_from) = jax.lax.scan(step, carry, jnp.arange(steps))
        return new.T, jnp.swapaxes(picked_from, 0, 1)

    # replicated results: every process of a multi-process run reads the whole batch
    return jax.jit(run, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                   compiler_options=compiler_options(mesh))
