"""Hugging Face checkpoints <-> meshtrain runs, on the command line:

    python -m meshtrain.hf import HF_DIR                  # print the model config and parameter table
    python -m meshtrain.hf import HF_DIR --workdir W      # write a run: step 0, the parameters only
    python -m meshtrain.hf export HF_DIR OUT_DIR          # HF -> meshtrain -> HF (re-sharded / cast)
    python -m meshtrain.hf export --workdir W OUT_DIR     # a run's newest parameters -> HF

DeepSeek-V3's multi-token prediction layer (`model.mtp_depth` 1) travels only when asked: `import --mtp`
reads it into the run (its training continues with it), `export --mtp` writes it back as the checkpoint's
one layer after the last. Without the flag an import leaves it unread and an export leaves it out.

An imported run is a workdir like any other: its checkpoint describes the model and the tokenizer
(the folder's tokenizer files are copied into `W/tokenizer/`), so `python -m meshtrain.sample
--config.workdir=W` samples from it, `python -m meshtrain.train --config.workdir=W` continues it
(its optimizer state starting afresh) and `python -m meshtrain.evaluate` scores it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import jax

from meshtrain import checkpoint, config as config_lib, durable, model, run_record
from meshtrain.hf.formats import DTYPE_NAMES, read_config
from meshtrain.hf.io import load, save

# what a Hugging Face folder says about its tokenizer, copied beside an imported run's parameters
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshtrain.hf", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="load a checkpoint: print it, or write it as a run (--workdir)")
    imp.add_argument("hf_dir")
    imp.add_argument("--workdir", default="", help="write a run there: step 0, the parameters only")
    imp.add_argument("--mtp", action="store_true",
                     help="also read DeepSeek-V3's multi-token prediction layer (the run gets model.mtp_depth=1)")
    exp = sub.add_parser("export", help="write a checkpoint (an HF folder's, or a run's newest) as HF safetensors")
    exp.add_argument("source", nargs="?", default="", help="a Hugging Face folder (or give --workdir)")
    exp.add_argument("out_dir")
    exp.add_argument("--workdir", default="", help="export this run's newest parameters instead")
    exp.add_argument("--dtype", choices=sorted(DTYPE_NAMES))
    exp.add_argument("--max-shard-bytes", type=int, default=2 << 30)
    exp.add_argument("--overwrite", action="store_true")
    exp.add_argument("--mtp", action="store_true",
                     help="also write the multi-token prediction block (model.mtp_depth=1), DeepSeek-V3's layout")
    args = parser.parse_args(argv)
    try:
        if args.command == "import" and args.workdir:
            step = import_run(args.hf_dir, args.workdir, mtp=args.mtp)
            print(f"wrote {args.workdir} (step {step}, parameters only)")
            return 0
        if args.command == "import":
            cfg, params = load(args.hf_dir, mtp=args.mtp)
            print(cfg)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
                print(f"{jax.tree_util.keystr(path):40s} {tuple(leaf.shape)} {leaf.dtype}")
            print(f"{model.num_params(cfg) / 1e6:.2f}M parameters")
            return 0
        if bool(args.source) == bool(args.workdir):
            raise ValueError("export: give a Hugging Face folder or --workdir (one of them)")
        cfg, params = run_params(args.workdir) if args.workdir else load(args.source, mtp=args.mtp)
        save(cfg, params, args.out_dir, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes,
             overwrite=args.overwrite, mtp=args.mtp)
        print(f"wrote {args.out_dir}")
    except ValueError as e:  # HFFormatError and ConfigError are ValueErrors
        print(f"error: {e}")
        return 2
    except OSError as e:  # a full disk, a read-only folder: one line (the save keeps the previous export)
        wrapped = durable.as_write_error(getattr(args, "out_dir", "") or getattr(args, "workdir", ""), e)
        if wrapped is None:
            raise
        print(f"error: {wrapped}")
        return 4
    return 0


def _config(workdir: str):
    """The defaults with `workdir`: the parameters replicated on every device of this process's mesh."""
    config = config_lib.default_config()
    config.workdir = workdir
    return config


def import_run(hf_dir: str, workdir: str, mtp: bool = False) -> int:
    """Writes a run in `workdir` from a Hugging Face folder: a checkpoint at step 0 holding the parameters
    only, described by its model (the folder's config.json) and tokenizer (its files, copied to
    `workdir/tokenizer/`). Refuses a workdir that holds checkpoints already. Returns the step. `mtp`: with
    DeepSeek-V3's multi-token prediction layer (`model.mtp_depth` 1)."""
    from meshtrain import train_step
    from meshtrain.hf import apply_model_config
    from meshtrain.run import Run
    from meshtrain.validate import validate

    root = checkpoint.checkpoint_root(workdir)
    if os.path.isdir(root) and any(name.isdigit() for name in os.listdir(root)):
        raise config_lib.ConfigError("workdir", workdir, f"{root} holds checkpoints already: import into a new workdir")
    config = _config(workdir)
    config.init.from_hf = hf_dir
    apply_model_config(config)
    config.model.mtp_depth = int(mtp)
    config.model.param_dtype = load_dtype(hf_dir)
    config.model.dtype = "float32"  # what reading the run computes in by default: float32 reproduces transformers
    tokenizer_dir = os.path.join(workdir, "tokenizer")
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, name))]
    if "tokenizer.json" in copied:
        os.makedirs(tokenizer_dir, exist_ok=True)
        for name in copied:
            with durable.atomic_path(os.path.join(tokenizer_dir, name)) as tmp:
                shutil.copyfile(os.path.join(hf_dir, name), tmp)
        config.data.tokenizer = tokenizer_dir
    validate(config, jax.device_count(), inputs=False)
    run = Run.resolve(config)
    factory, _ = train_step.build(run)
    _, params = load(hf_dir, run.mesh, mtp=mtp)
    params = jax.tree.map(lambda a, target: jax.device_put(a, target.sharding), params, factory.canonical.params)
    ckpt = checkpoint.Checkpointer(root, async_save=False)
    try:
        meta = {"step": 0, "seed": int(config.seed), "parameters_only": True, "imported_from": os.path.abspath(hf_dir),
                **run_record.record(config), "config": checkpoint.config_record(config),
                "context": int(read_config(hf_dir).get("max_position_embeddings") or 0)}
        ckpt.save(0, {"params": params}, {}, meta)
    finally:
        ckpt.close()
    return 0


def load_dtype(hf_dir: str) -> str:
    """The storage dtype of a Hugging Face folder's parameters (its config.json's)."""
    from meshtrain.hf.convert import model_config_from_hf

    return model_config_from_hf(read_config(hf_dir)).param_dtype


def run_params(workdir: str):
    """(model config, parameters) of a run's newest checkpoint, its model from its record (`run_record`)."""
    from meshtrain import sample

    config = _config(workdir)
    if run_record.read(workdir) is None:
        raise config_lib.ConfigError("workdir", workdir, "holds no checkpoint that describes its model (train or "
                                     "import one first)")
    resolved = sample.prepare(config, what="export")
    return resolved.model, sample.load_params(resolved)


if __name__ == "__main__":
    sys.exit(main())
