"""`python -m meshtrain.hf import HF_DIR` | `python -m meshtrain.hf export HF_DIR OUT_DIR [...]`."""

from __future__ import annotations

import argparse

import jax

from meshtrain import model
from meshtrain.hf.formats import DTYPE_NAMES
from meshtrain.hf.io import load, save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshtrain.hf",
                                     description="Hugging Face Llama / Mistral / Mixtral checkpoints <-> meshtrain")
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
            print(f"{model.num_params(cfg) / 1e6:.2f}M parameters")
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
