"""Benchmarks with lm-eval-harness: `python -m meshtrain.evaluate --config configs/tiny.py
--config.workdir=runs/tiny --tasks=hellaswag` (or `--hf_dir=DIR`, `--include_path=DIR` for task
YAMLs of your own).

meshtrain is an lm-eval model (`MeshtrainLM`, registered as "meshtrain" when this module is
imported with lm-eval installed: `lm_eval.simple_evaluate(model="meshtrain", model_args="config=configs/tiny.py,
workdir=runs/tiny")`). It answers the harness's three request types:

* `loglikelihood` (multiple choice, cloze): log p(continuation | BOS + context) and whether the
  continuation is the greedy one, from one forward pass (BOS first, as training frames documents);
* `loglikelihood_rolling` (perplexity): the text cut into windows of `max_length` tokens, each
  predicting its tokens once with the rest of the window as context (the harness's own windows);
  with windows of `train.seq_len` this is what the run's `eval_loss` computes over packed rows;
* `generate_until`: `generate.generate`'s KV-cache decoding (greedy unless the task samples),
  cut at the first stop string.

Scoring is batched and sharded: `Scorer` pads each batch of sequences on the right (the causal
mask keeps real tokens from seeing the padding) to a power-of-two length bucket, fills the batch
to `batch_size` rows split over the mesh's batch axes (tensor-parallel matmuls as in training), and
returns per-token log-probabilities in float32; so a request's score does not depend on which
other requests share its batch or on the batch size. The playbook's "Tensor Parallelism" and
"Data Parallelism" sections are the layouts used; inference has no gradients to reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from meshtrain import cli, config as config_lib, default_run, durable, eval_tasks, generate, sample
from meshtrain.config import BATCH_AXES, ModelConfig
from meshtrain.data import tokenizers
from meshtrain.mesh import compiler_options
from meshtrain.model import Transformer, params_mesh
from meshtrain.run import Run
from meshtrain.sharding_rules import Rules

log = logging.getLogger("meshtrain")
MIN_BUCKET = 16


class Scorer:
    """Per-token log-probabilities of token sequences on the mesh the parameters live on."""

    def __init__(self, model_config: ModelConfig, params: dict, batch_size: int = 8):
        self.params, self.mesh = params, params_mesh(params)
        split = math.prod(self.mesh.shape[a] for a in BATCH_AXES)
        self.rows = -(-max(1, int(batch_size)) // split) * split  # rows divide over the batch axes
        self.cfg = dataclasses.replace(model_config, remat_policy="none", attention_impl="xla", fused_norm=False,
                                       fused_loss=False, sequence_parallel=False, matmul_precision="bf16")

    def score(self, sequences: list[list[int]], counts: list[int]) -> list[tuple[float, bool]]:
        """For each token sequence, (sum of log p of its last `count` tokens given the ones before,
        whether each of them is the most likely token). Sequences longer than 1 token."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))  # similar lengths batch together
        out: list[tuple[float, bool]] = [(0.0, True)] * len(sequences)
        for lo in range(0, len(order), self.rows):
            chosen = order[lo:lo + self.rows]
            width = max(len(sequences[i]) - 1 for i in chosen)
            bucket = max(MIN_BUCKET, 1 << (width - 1).bit_length())
            inputs = np.zeros((self.rows, bucket), np.int32)
            targets = np.zeros((self.rows, bucket), np.int32)
            for row, i in enumerate(chosen):
                seq = sequences[i]
                inputs[row, :len(seq) - 1], targets[row, :len(seq) - 1] = seq[:-1], seq[1:]
            with jax.set_mesh(self.mesh):
                logprobs, greedy = _program(self.cfg, Rules.for_mesh(self.mesh, model=self.cfg), self.mesh)(
                    self.params, jnp.asarray(inputs), jnp.asarray(targets))
            logprobs, greedy = np.asarray(logprobs), np.asarray(greedy)
            for row, i in enumerate(chosen):
                end, n = len(sequences[i]) - 1, counts[i]
                out[i] = (float(logprobs[row, end - n:end].sum()), bool(greedy[row, end - n:end].all()))
        return out


@functools.cache
def _program(cfg: ModelConfig, rules: Rules, mesh: jax.sharding.Mesh):
    """jitted (params, inputs [B, L], targets [B, L]) -> (log p(target) [B, L] float32, target is argmax [B, L])."""
    model = Transformer(cfg, rules)

    def run(params, inputs, targets):
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        logits = model.apply({"params": params}, inputs, positions, jnp.ones_like(inputs)).astype(jnp.float32)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(logits, axis=-1) == targets

    return jax.jit(run, compiler_options=compiler_options(mesh))


@functools.cache
def _lm_classes():
    """`MeshtrainLM`, defined on first use so that importing this module does not need lm-eval."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class MeshtrainLM(TemplateLM):
        """A meshtrain model as an lm-eval `LM` (see the module docstring)."""

        def __init__(self, config: str | None = None, workdir: str = "", hf_dir: str = "", batch_size: int = 8,
                     max_length: int | None = None, dtype: str = "", *, model_config: ModelConfig | None = None,
                     params: dict | None = None, tokenizer=None, device: str | None = None,
                     max_batch_size: int | None = None, **overrides):
            """`workdir` (a run, which describes its model and tokenizer) or `hf_dir`, optionally a config
            file (`config`), the compute `dtype` and dotted config keys as overrides
            (`model_args="workdir=runs/tiny,mesh.tensor=2"`); or a model already in memory
            (`model_config`, `params`, `tokenizer`). `device` and `max_batch_size`, which lm-eval passes
            to every model, are not used: the config's mesh places the model."""
            super().__init__()
            del device, max_batch_size
            if model_config is None:  # from lm-eval's --model_args: a run (or HF folder) and a config file
                model_config, params, tokenizer, seq_len = load(config, workdir, hf_dir, overrides, dtype)
                max_length = max_length or seq_len
            if max_length is None:
                raise ValueError("max_length: give the context length to score with (e.g. train.seq_len)")
            self.model_config, self.params, self.tok = model_config, params, tokenizer
            self.max_length, self.batch_size = int(max_length), int(batch_size)
            self.scorer = Scorer(model_config, params, self.batch_size)

        @property
        def eot_token_id(self) -> int:
            return self.tok.eos_id if self.tok.eos_id is not None else self.tok.pad_id

        @property
        def prefix_token_id(self) -> int:
            return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

        @property
        def tokenizer_name(self) -> str:
            return self.tok.name

        @property
        def chat_template(self) -> str | None:
            return getattr(self.tok, "chat_template", None)

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            """The conversation as the tokenizer's chat template writes it (a Hugging Face folder's
            `tokenizer_config.json`); lm-eval's `--apply_chat_template` calls this."""
            render = getattr(self.tok, "apply_chat_template", None)
            if render is None:
                raise ValueError(f"tokenizer {self.tok.name!r} has no chat template: --apply_chat_template needs "
                                 "a Hugging Face tokenizer folder that has one")
            return render(chat_history, add_generation_prompt=add_generation_prompt)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            del add_special_tokens, kwargs  # documents are framed by the caller (prefix token)
            return [int(i) for i in self.tok.encode(string)]

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            del disable_tqdm, kwargs
            sequences, counts = [], []
            for _, context, continuation in requests:
                context = list(context)
                if not context or context[0] != self.prefix_token_id:  # framed as training framed documents
                    context = [self.prefix_token_id, *context]
                whole = (context + list(continuation))[-(self.max_length + 1):]  # context cut on the left
                sequences.append(whole)
                counts.append(min(len(continuation), len(whole) - 1))
            results = self.scorer.score(sequences, counts)
            for (key, _, _), result in zip(requests, results, strict=True):
                self.cache_hook.add_partial("loglikelihood", key, result)
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            del disable_tqdm
            sequences, counts, owner = [], [], []
            for index, (string,) in enumerate(request.args for request in requests):
                windows = get_rolling_token_windows(self.tok_encode(string), self.prefix_token_id,
                                                    self.max_length, context_len=1)
                for context, predicted in map(make_disjoint_window, windows):
                    sequences.append(context + predicted)
                    counts.append(len(predicted))
                    owner.append(index)
            totals = [0.0] * len(requests)
            for index, (logprob, _) in zip(owner, self.scorer.score(sequences, counts), strict=True):
                totals[index] += logprob
            for request, total in zip(requests, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            del disable_tqdm
            groups: dict[str, list[int]] = {}
            for index, request in enumerate(requests):
                groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
            out = [""] * len(requests)
            for key, indices in groups.items():
                kwargs = dict(json.loads(key))
                until = kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                steps = int(kwargs.pop("max_gen_toks", 256))
                temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
                sampling = generate.Sampling(temperature=temperature, top_k=int(kwargs.pop("top_k", 0) or 0),
                                             top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                                             seed=int(kwargs.pop("seed", 0) or 0))
                keep = max(1, self.max_length - steps)
                for lo in range(0, len(indices), self.batch_size):
                    chosen = indices[lo:lo + self.batch_size]
                    prompts = [([self.prefix_token_id] + self.tok_encode(requests[i].args[0]))[-keep:] for i in chosen]
                    new = generate.generate(self.model_config, self.params, prompts, steps, sampling,
                                            eos_id=self.tok.eos_id, vocab_limit=self.tok.vocab_size)
                    for i, ids in zip(chosen, new, strict=True):
                        text = self.tok.decode([t for t in ids if t != self.tok.eos_id])
                        for stop in until:
                            text = text.split(stop)[0] if stop else text
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
            return out

    return MeshtrainLM


def lm_class():
    """The lm-eval model class (registered as "meshtrain"); raises ConfigError without lm-eval."""
    eval_tasks.require_lm_eval()
    return _lm_classes()


def __getattr__(name: str):
    if name == "MeshtrainLM":  # the registry's placeholder resolves here
        return lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register() -> None:
    """Registers "meshtrain" with lm-eval (a placeholder: the class is built when first asked for)."""
    try:
        import lm_eval.models  # noqa: F401  (the harness's own models first: it fills only an empty registry)
        from lm_eval.api.registry import model_registry
    except ImportError:  # lm-eval is optional
        return
    if "meshtrain" not in model_registry:
        model_registry.register("meshtrain", target=f"{__name__}:MeshtrainLM")


_register()


def load(config_path: str | None, workdir: str, hf_dir: str, overrides: dict, dtype: str = ""):
    """(model config, params on the config's mesh, tokenizer, train.seq_len) from a run's newest
    checkpoint (its model and tokenizer from its record: `run_record`) or a Hugging Face folder, and a
    config file (default: the defaults); `overrides` are dotted config keys."""
    config = cli.apply_overrides(cli.load_config_file(config_path or default_run.PATH), overrides)
    if workdir:
        config.workdir = workdir
    resolved, params = _restore(config, hf_dir, dtype, given=overrides)
    return resolved.model, params, tokenizers.load_tokenizer(config.data.tokenizer), int(config.train.seq_len)


def _restore(config, hf_dir: str, dtype: str = "", given: dict | None = None) -> tuple[Run, dict]:
    """The resolved run and its parameters (newest checkpoint, or `hf_dir`), on the config's mesh:
    the batch axes and `tensor` (evaluation runs every layer on whole sequences)."""
    resolved = sample.prepare(config, hf_dir, dtype, given, what="evaluation")
    return resolved, sample.load_params(resolved, hf_dir)


def in_loop(run, params: dict) -> dict[str, float]:
    """`config.eval_tasks` on the train state's parameters: {"lm_eval/<task>/<metric>": value}."""
    config = run.config
    lm = lm_class()(model_config=run.model, params=params, tokenizer=tokenizers.load_tokenizer(config.data.tokenizer),
                    batch_size=config.train.batch_size, max_length=config.train.seq_len)
    results = eval_tasks.run_tasks(lm, eval_tasks.task_list(config.eval_tasks),
                                   include_path=config.eval_tasks_include_path, limit=config.eval_tasks_limit or None)
    return {f"lm_eval/{key}": value for key, value in eval_tasks.summary(results).items()}


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", default_run.PATH, "A config file (configs/*.py); default: the "
                                    "defaults, the model and tokenizer coming from the run in --config.workdir.",
                                    lock_config=True)
    flags.DEFINE_enum("dtype", "", sample.DTYPES, "Compute dtype (default: the run's model.dtype; float32 for "
                      "--hf_dir).")
    flags.DEFINE_list("tasks", [], "lm-eval task names (comma-separated).")
    flags.DEFINE_string("include_path", "", "A folder of lm-eval task YAMLs of your own.")
    flags.DEFINE_integer("batch_size", 8, "Sequences per forward pass (rounded up to the mesh's batch axes).")
    flags.DEFINE_integer("max_length", 0, "Context length to score with (0: train.seq_len).")
    flags.DEFINE_float("limit", None, "Documents per task (a fraction if < 1); all if unset.")
    flags.DEFINE_integer("num_fewshot", None, "Few-shot examples (the task's default if unset).")
    flags.DEFINE_string("hf_dir", "", "Evaluate a Hugging Face checkpoint folder instead of a run.")
    flags.DEFINE_string("output_path", "", "Write lm-eval's full results (JSON) to this file.")


def main(argv) -> None:
    del argv
    cli.setup_logging(sys.stderr)  # stdout holds the table and the JSON line
    logging.getLogger("absl").setLevel(logging.ERROR)
    f = flags.FLAGS
    config = f.config
    try:
        if not f.tasks:
            raise config_lib.ConfigError("tasks", "", "name at least one lm-eval task, e.g. --tasks=lambada_openai")
        cls = lm_class()
        resolved, params = _restore(config, f.hf_dir, f.dtype, cli.given_keys())
        lm = cls(model_config=resolved.model, params=params, tokenizer=tokenizers.load_tokenizer(config.data.tokenizer),
                 batch_size=f.batch_size, max_length=f.max_length or config.train.seq_len)
        limit = None if f.limit is None else (f.limit if f.limit < 1 else int(f.limit))
        results = eval_tasks.run_tasks(lm, f.tasks, include_path=f.include_path, limit=limit, num_fewshot=f.num_fewshot)
    except (config_lib.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from lm_eval.utils import make_table

    print(make_table(results))
    if f.output_path:
        try:
            durable.write_json(f.output_path, {k: results[k] for k in ("results", "configs", "versions", "n-shot")
                                               if k in results}, indent=2, default=str)
        except durable.WriteError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(4)
    print(json.dumps({"tasks": f.tasks, **eval_tasks.summary(results)}))


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
