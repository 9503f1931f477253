"""`python -m meshtrain.sample --config.workdir=runs/tiny --prompt "def "`.

Loads the parameters of the newest checkpoint of `config.workdir` (or `--config.checkpoint.restore_from`,
or a Hugging Face folder with `--hf_dir`) onto the mesh the flags give, continues the prompt with
`generate.generate` (KV cache, greedy at `--temperature=0`, else temperature / top-k / top-p from
`--seed`) and prints the text. The run describes itself (`run_record`): its checkpoints give the model
and the tokenizer, so `--config.workdir` is all it needs (`--config FILE` still works; a
`--config.model.*` flag that contradicts the run is refused). A Hugging Face folder brings its own
`tokenizer.json`. The mesh may use the batch axes and `tensor` (tensor-parallel decode); `stage` and
`sequence` must be 1.

Many prompts at once: `--prompts_file=in.jsonl` (one {"prompt": ...} object, or a JSON string, a
line) decodes them together in one batch and writes {"prompt", "completion"} lines to
`--output_file` (default: standard output). `--stop` strings end a completion (it is cut before the
first). `--dtype` picks the compute dtype of inference: by default the run's `model.dtype`, and float32
for `--hf_dir` (what reproduces `transformers` in float32); the choice is logged.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable

import jax
from absl import app, flags
from ml_collections import config_flags

from meshtrain import checkpoint, cli, config as config_lib, default_run, durable, generate, hf, run_record
from meshtrain.data import tokenizers
from meshtrain.run import Run
from meshtrain.validate import validate

log = logging.getLogger("meshtrain")
DTYPES = ("", *config_lib.DTYPES)


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
    """The parameters to sample from, on the run's mesh: a Hugging Face folder, else the parameters of the
    newest checkpoint of the run (`checkpoint.restore_from` or `<workdir>/checkpoints`), nothing else of it."""
    config = resolved.config
    if hf_dir:
        # in the shardings the sampling program's rules give them (its model: the run's, from the checkpoint)
        _, params = hf.load(hf_dir, shardings=hf.param_shardings(resolved.model, resolved.mesh))
        return params
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
        from meshtrain import train_step  # the parameters' shardings on the run's mesh

        abstract = train_step.build(resolved)[0].abstract.params  # stage = 1 here: canonical layer order
        restored = ckpt.restore_params(abstract, step)
    except checkpoint.CheckpointDamaged as error:
        raise config_lib.ConfigError("checkpoint.restore_from", config.checkpoint.restore_from or root,
                                     str(error)) from None
    except ValueError as error:
        raise config_lib.ConfigError("workdir", config.workdir, str(error)) from None
    finally:
        ckpt.close()
    log.info("sampling from %s (step %d)", restored.path, restored.step)
    return restored.params


def prepare(config, hf_dir: str = "", dtype: str = "", given: dict | None = None, what: str = "sampling") -> Run:
    """The run to read, resolved: its model and tokenizer from its checkpoints (`run_record`) or from a
    Hugging Face folder, the inference dtype chosen (and logged), the mesh without `stage` / `sequence`."""
    if hf_dir:
        config.init.from_hf = hf_dir  # the checkpoint decides the architecture (cli.setup_runtime)
        if "data.tokenizer" not in (given or {}) and tokenizers.folder_tokenizer(hf_dir):
            config.data.tokenizer = hf_dir  # the folder's own tokenizer.json, BOS / EOS and chat template
    cli.setup_runtime(config, given, adopt=not hf_dir)
    described = None if hf_dir else run_record.read(config.workdir)
    if dtype:
        config.model.dtype = dtype
        log.info("%s in %s (--dtype)", what, dtype)
    else:
        if hf_dir:
            config.model.dtype, why = "float32", "what reproduces a Hugging Face folder in float32"
        elif described and described["dtype"]:
            config.model.dtype, why = described["dtype"], "the run's own"
        else:
            why = "model.dtype"
        log.info("%s in %s (%s; --dtype to change)", what, config.model.dtype, why)
    validate(config, jax.device_count())
    resolved = Run.resolve(config)
    for axis in ("stage", "sequence"):
        config_lib.require(resolved.sizes[axis] == 1, f"mesh.{axis}", resolved.sizes[axis],
                           f"{what} runs every layer on whole sequences: use the batch axes and tensor only")
    return resolved


def sample(config, prompts: list[str], max_new_tokens: int, sampling: generate.Sampling, hf_dir: str = "",
           stop: tuple[str, ...] = (), dtype: str = "", given: dict | None = None) -> list[str]:
    """Each prompt's continuation as text, decoded together."""
    resolved = prepare(config, hf_dir, dtype, given)
    tokenizer = tokenizers.load_tokenizer(config.data.tokenizer)
    generate.check_context(generate.prompt_rows(tokenizer, prompts), max_new_tokens, *context(config, hf_dir))
    params = load_params(resolved, hf_dir)
    return generate.continue_texts(resolved.model, params, tokenizer, prompts, max_new_tokens, sampling, stop)


def context(config, hf_dir: str = "") -> tuple[int, str]:
    """(tokens, where the figure comes from) of the model's context: a Hugging Face folder's
    `max_position_embeddings`, else the sequence length the run trained on (its checkpoints' record);
    (0, "") where neither says."""
    if hf_dir:
        return int(hf.read_config(hf_dir).get("max_position_embeddings") or 0), f"{hf_dir}/config.json " \
            "max_position_embeddings"
    described = run_record.read(config.workdir)
    if not described or not described["context"]:
        return 0, ""
    return described["context"], f"the context the run in {config.workdir} records"


def read_prompts(path: str) -> list[str]:
    """The prompts of a JSON Lines file: one {"prompt": ...} object or one JSON string a line."""
    prompts = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                prompt = item.get("prompt") if isinstance(item, dict) else item
                if not isinstance(prompt, str):
                    raise ValueError(f"{path}:{number}: expected a JSON string or an object with a string "
                                     f"'prompt', got {line.strip()[:80]}")
                prompts.append(prompt)
    except OSError as error:
        raise ValueError(f"--prompts_file={path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--prompts_file={path}: line {error.lineno}: not JSON ({error.msg})") from None
    if not prompts:
        raise ValueError(f"--prompts_file={path}: holds no prompt")
    return prompts


def define_flags() -> None:
    """The command's flags (defined only when it runs: `meshtrain.train` defines --config too)."""
    config_flags.DEFINE_config_file("config", default_run.PATH, "A config file (configs/*.py); default: the "
                                    "defaults, the model and tokenizer coming from the run in --config.workdir.",
                                    lock_config=True)
    flags.DEFINE_string("prompt", "", "Text to continue (empty: start from BOS).")
    flags.DEFINE_string("prompts_file", "", "A JSON Lines file of prompts, decoded together in one batch.")
    flags.DEFINE_string("output_file", "", "With --prompts_file: where the completions go (default: stdout).")
    flags.DEFINE_multi_string("stop", [], "A string that ends a completion (cut before it); repeatable.")
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most (stops earlier at EOS).")
    flags.DEFINE_float("temperature", 0.0, "0: greedy; else softmax temperature.")
    flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).")
    flags.DEFINE_float("top_p", 1.0, "Sample from the smallest set of tokens whose probability reaches p.")
    flags.DEFINE_integer("seed", 0, "Random seed of the sampling.")
    flags.DEFINE_string("hf_dir", "", "Sample from a Hugging Face checkpoint folder instead of a run.")
    flags.DEFINE_enum("dtype", "", DTYPES, "Compute dtype (default: the run's model.dtype; float32 for --hf_dir).")


def main(argv) -> None:
    del argv
    cli.setup_logging(sys.stderr)  # stdout holds the text only
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on opening checkpoints read-only
    f = flags.FLAGS
    config = f.config
    try:
        sampling = generate.Sampling(f.temperature, f.top_k, f.top_p, f.seed)
        if f.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens={f.max_new_tokens}: must be >= 1")
        if f.prompt and f.prompts_file:
            raise ValueError("--prompt and --prompts_file: give one of them")
        prompts = read_prompts(f.prompts_file) if f.prompts_file else [f.prompt]
        texts = sample(config, prompts, f.max_new_tokens, sampling, f.hf_dir, tuple(f.stop), f.dtype,
                       cli.given_keys())
    except (config_lib.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if not f.prompts_file:
        print(f.prompt + texts[0])
        return
    lines = [json.dumps({"prompt": p, "completion": t}, ensure_ascii=False)
             for p, t in zip(prompts, texts, strict=True)]
    if f.output_file:
        try:
            durable.write_atomic(f.output_file, "\n".join(lines) + "\n")
        except durable.WriteError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(4)
        log.info("wrote %d completions to %s", len(lines), f.output_file)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
