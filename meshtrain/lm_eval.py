"""`python -m meshtrain.lm_eval ...`: lm-eval's own command line, with the "meshtrain" model known.

lm-eval's `lm_eval` command finds only the models it ships (it has no plugin hook for models), so
this is that command after `import meshtrain.evaluate` has registered meshtrain. Every argument is
lm-eval's:

    python -m meshtrain.lm_eval run --model meshtrain \\
        --model_args config=configs/tiny.py,workdir=runs/tiny --tasks lambada_openai

`--model_args` takes a config file, a run's `workdir` (or `hf_dir`) and any dotted config key
(`mesh.tensor=2`); see `evaluate.MeshtrainLM`.
"""

from __future__ import annotations

import sys


def main() -> None:
    from meshtrain import compile_cache, evaluate

    compile_cache.guard_jax_cache()  # as every meshtrain command (`cli.parse_flags`)
    evaluate.lm_class()  # lm-eval installed, or one line saying how to install it
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    try:
        main()
    except Exception as error:  # noqa: BLE001 (a missing lm-eval: one line, not a traceback)
        from meshtrain import config as config_lib

        if not isinstance(error, config_lib.ConfigError):
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
