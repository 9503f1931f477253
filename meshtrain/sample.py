"""`python -m meshtrain.sample --config configs/tiny.py --config.workdir=runs/tiny --prompt "def "`.

Loads the newest checkpoint of `config.workdir` (or `--config.checkpoint.restore_from`, or a
Hugging Face folder with `--hf_dir`) onto the mesh the flags give, continues the prompt with
`generate.generate` (KV cache, greedy at `--temperature=0`, else temperature / top-k / top-p from
`--seed`) and prints the text through the run's tokenizer (`config.data.tokenizer`). The mesh may
use the batch axes and `tensor` (tensor-parallel decode); `stage` and `sequence` must be 1.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import jax
from absl import app, flags
from ml_collections import config_flags

from meshtrain import checkpoint, cli, config as config_lib, generate, hf, train_step
from meshtrain.data import tokenizers
from meshtrain.run import Run
from meshtrain.validate import validate

log = logging.getLogger("meshtrain")


def in_loop(run: Run) -> Callable[[dict], str]:
    """What the training loop logs every `sample_every` steps: params -> the model's continuation of
    `sample_prompt` (KV-cache decoding on the run's mesh, seeded by `config.seed`), what this command
    prints from that step's checkpoint."""
    c = run.config
    tokenizer = tokenizers.load_tokenizer(c.data.tokenizer)
    sampling = generate.Sampling(c.sample_temperature, c.sample_top_k, seed=c.seed)

    def continuation(params: dict) -> str:
        return generate.continue_text(run.model, params, tokenizer, c.sample_prompt, c.sample_max_new_tokens, sampling)

    return continuation


def load_params(resolved: Run, hf_dir: str = "") -> dict:
    """The parameters to sample from, on the run's mesh: a Hugging Face folder, else the newest
    checkpoint of the run (`checkpoint.restore_from` or `<workdir>/checkpoints`)."""
    config = resolved.config
    if hf_dir:
        _, params = hf.load(hf_dir, resolved.mesh)
        return params
    factory, _ = train_step.build(resolved)
    root, step = checkpoint.checkpoint_root(config.workdir), None
    if config.checkpoint.restore_from:
        root, step = checkpoint.resolve_restore_from(config.checkpoint.restore_from)
    try:
        ckpt = checkpoint.Checkpointer(root, read_only=True)
    except ValueError as error:
        raise config_lib.ConfigError("workdir", config.workdir, f"no checkpoint to sample from ({error})") from None
    try:
        if not ckpt.all_steps():
            raise config_lib.ConfigError("workdir", config.workdir, f"{root} holds no finished checkpoint: train first")
        restored = ckpt.restore(factory.abstract, step)
    except checkpoint.CheckpointDamaged as error:
        raise config_lib.ConfigError("checkpoint.restore_from", config.checkpoint.restore_from or root,
                                     str(error)) from None
    finally:
        ckpt.close()
    log.info("sampling from %s (step %d)", restored.path, restored.step)
    return factory.from_canonical(restored.state).params


def sample(config, prompt: str, max_new_tokens: int, sampling: generate.Sampling, hf_dir: str = "") -> str:
    """The prompt's continuation as text."""
    if hf_dir:
        config.init.from_hf = hf_dir  # the checkpoint decides the architecture (cli.setup_runtime)
    cli.setup_runtime(config)
    validate(config, jax.device_count())
    resolved = Run.resolve(config)
    for axis in ("stage", "sequence"):
        config_lib.require(resolved.sizes[axis] == 1, f"mesh.{axis}", resolved.sizes[axis],
                           "sampling runs every layer on whole sequences: use the batch axes and tensor only")
    tokenizer = tokenizers.load_tokenizer(config.data.tokenizer)
    params = load_params(resolved, hf_dir)
    return generate.continue_text(resolved.model, params, tokenizer, prompt, max_new_tokens, sampling)


def define_flags() -> None:
    """The command's flags (defined only when it runs: `meshtrain.train` defines --config too)."""
    config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)
    flags.DEFINE_string("prompt", "", "Text to continue (empty: start from BOS).")
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most (stops earlier at EOS).")
    flags.DEFINE_float("temperature", 0.0, "0: greedy; else softmax temperature.")
    flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).")
    flags.DEFINE_float("top_p", 1.0, "Sample from the smallest set of tokens whose probability reaches p.")
    flags.DEFINE_integer("seed", 0, "Random seed of the sampling.")
    flags.DEFINE_string("hf_dir", "", "Sample from a Hugging Face checkpoint folder instead of a run.")


def main(argv) -> None:
    del argv
    cli.setup_logging(sys.stderr)  # stdout holds the text only
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on opening checkpoints read-only
    f = flags.FLAGS
    config = f.config
    if config is None:
        raise app.UsageError("--config is required, e.g. --config configs/tiny.py")
    try:
        sampling = generate.Sampling(f.temperature, f.top_k, f.top_p, f.seed)
        if f.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens={f.max_new_tokens}: must be >= 1")
        text = sample(config, f.prompt, f.max_new_tokens, sampling, f.hf_dir)
    except (config_lib.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f.prompt + text)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
