"""What meshtrain's commands share: flag parsing, config files, logging and the runtime's start.

A bad `--config.*` flag is one line and exit code 2.

ml_collections applies `--config.a.b=v` overrides while absl parses the command line, before any
command code runs; a mistyped key would end there in a long traceback. `parse_flags` (absl's
`app.run(main, flags_parser=parse_flags)`) turns it into one line naming the key and the closest
valid keys, like every other config error (`config.ConfigError`).
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import pathlib
import sys

import ml_collections
from absl import flags
from ml_collections import config_flags

from meshtrain import compile_cache, config as config_lib, hf, mesh as mesh_lib, run_record


def parse_flags(argv: list[str]) -> list[str]:
    """The command line parsed (one line and exit code 2 for a bad flag); JAX's persistent compilation
    cache, where the environment sets one (JAX_COMPILATION_CACHE_DIR), guarded before any compile
    (`compile_cache.guard_jax_cache`)."""
    config_file = _config_path(argv)
    if config_file is not None and not pathlib.Path(config_file).is_file():  # ml_collections defers it
        print(f"error: --config {config_file}: no such config file ({_config_hint(config_file)})", file=sys.stderr)
        sys.exit(2)
    if config_file is not None and (broken := _config_file_error(config_file, _config_arg(argv))):
        print(f"error: --config {config_file}: {broken}", file=sys.stderr)  # ml_collections would raise it
        sys.exit(2)
    try:
        rest = flags.FLAGS(argv)
    except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
        print(f"error: {describe(argv, e)}", file=sys.stderr)
        sys.exit(2)
    compile_cache.guard_jax_cache()
    return rest


def describe(argv: list[str], error: Exception) -> str:
    """One line for a failed parse: the unknown key and its closest siblings, or absl's own message."""
    config = _config_file(argv)
    if config is not None:
        for arg in argv[1:]:
            if arg.startswith("--config.") and (missing := _missing_key(config, arg[len("--config."):].split("=")[0])):
                return missing
    text = str(error).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a repr'd message
        text = text[1:-1]
    return " ".join(part.strip() for part in text.replace("\\n", "\n").splitlines())


def _config_value(argv: list[str]) -> str | None:
    """What the command line gives `--config` (`--config VALUE` or `--config=VALUE`; the last wins), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
    return value


def _config_path(argv: list[str]) -> str | None:
    """The config file the command line names (without a `:arg`), or None."""
    value = _config_value(argv)
    return None if value is None else value.split(":")[0]


def _config_arg(argv: list[str]) -> str | None:
    """The argument after `:` of `--config PATH:ARG` (ml_collections passes it to `get_config`), or None."""
    value = _config_value(argv)
    return value.split(":", 1)[1] if value and ":" in value else None


def _config_file_error(path: str, arg: str | None) -> str | None:
    """What stops the config file at `path` giving a config, in one line (it fails to import, has no
    `get_config`, or its `get_config` raises), or None. Run before ml_collections runs the file."""
    spec = importlib.util.spec_from_file_location("meshtrain_config_check", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any error of the user's file is reported as one line
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        return f"the file fails to import{where}: {type(e).__name__}: {getattr(e, 'msg', None) or e}"
    if not callable(getattr(module, "get_config", None)):
        return "the file defines no get_config() (a config file returns its ConfigDict from get_config)"
    try:
        module.get_config(*(() if arg is None else (arg,)))
    except Exception as e:  # noqa: BLE001
        return f"get_config({'' if arg is None else repr(arg)}) raised {type(e).__name__}: {e}"
    return None


def _config_hint(path: str) -> str:
    """What to pass instead of a config file that does not exist: the files of its folder, or configs/'s."""
    folder = pathlib.Path(path).parent
    if not folder.is_dir() or not list(folder.glob("*.py")):
        folder = pathlib.Path(__file__).resolve().parent.parent / "configs"
    names = sorted(p.name for p in folder.glob("*.py") if not p.name.startswith("_"))
    return f"{folder}/ holds {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}" if names \
        else "give the path of a configs/*.py file"


def _config_file(argv: list[str]) -> ml_collections.ConfigDict | None:
    """The config the command line names, loaded, or None."""
    path = _config_path(argv)
    if path is None or not pathlib.Path(path).is_file():
        return None
    try:
        return load_config_file(path)
    except Exception:  # noqa: BLE001 - the config file's own error is reported by the command
        return None


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """`get_config()` of the Python config file at `path` (configs/*.py). Raises ConfigError when
    there is no such file."""
    if not pathlib.Path(path).is_file():
        raise config_lib.ConfigError("config", path, "no such config file (e.g. configs/tiny.py)")
    spec = importlib.util.spec_from_file_location("meshtrain_config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """`config` with each dotted key of `overrides` ({"mesh.tensor": 2}) set, as `--config.*` flags
    set them; an unknown key is a ConfigError naming its closest valid keys."""
    for key, value in overrides.items():
        if missing := _missing_key(config, key):
            raise config_lib.ConfigError(key, value, missing.split(": ", 1)[1])
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        try:
            node[leaf] = value
        except (TypeError, ValueError) as error:
            raise config_lib.ConfigError(key, value, f"not a valid value ({error})") from None
    return config


def _missing_key(config: ml_collections.ConfigDict, dotted: str) -> str | None:
    node, parts = config, dotted.split(".")
    for depth, name in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict):
            return None
        if name not in node:
            parent = ".".join(["config", *parts[:depth]])
            keys = sorted(node.keys())
            close = difflib.get_close_matches(name, keys, n=3, cutoff=0.5)
            hint = f"closest: {', '.join(close)}" if close else f"valid keys: {', '.join(keys)}"
            return f"--config.{dotted}: {parent} has no key {name!r}; {hint}"
        node = node[name]
    return None


def setup_logging(stream=sys.stdout, quiet: tuple[str, ...] = ("absl", "jax", "orbax", "etils", "grain")) -> None:
    """meshtrain's lines as plain "time message" on `stream` (absl's handler on the root logger would
    prefix each with level, pid and file); the libraries in `quiet` log warnings only."""
    log = logging.getLogger("meshtrain")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    for noisy in quiet:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def setup_runtime(config: ml_collections.ConfigDict, given: dict | None = None, *, adopt: bool = True) -> None:
    """Before anything else touches JAX: the model and tokenizer of the run in `workdir` when its
    checkpoints describe it (`run_record.adopt`, unless `adopt` is False; `given`: the keys set on the
    command line, which must not contradict it), fake CPU devices (`cpu_devices`), the multi-process
    start (`distributed.*`), and the model shape of the Hugging Face checkpoint a new run starts from
    (`init.from_hf`: the checkpoint decides the architecture)."""
    described = adopt and run_record.read(config.workdir) is not None
    if described:
        run_record.adopt(config, given or {})
    mesh_lib.fake_cpu_devices(config.cpu_devices)
    mesh_lib.maybe_initialize_distributed(config)
    if config.init.from_hf and not described:
        hf.apply_model_config(config)
    quiet_other_processes()


class _OwnLinesOnly(logging.Filter):
    """What a process other than 0 prints: errors, and warnings about itself (logged with
    `extra={"local": True}`); the run's own lines and warnings come once, from process 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return record.levelno >= logging.WARNING and getattr(record, "local", False)


def quiet_other_processes() -> None:
    """In a multi-process run process 0 prints the run's lines; the others only their own warnings and errors."""
    import jax

    if jax.process_count() > 1 and jax.process_index() > 0:
        logging.getLogger("meshtrain").addFilter(_OwnLinesOnly())


def given_keys() -> dict:
    """The dotted config keys this command line set (`--config.model.n_layers=8` -> {"model.n_layers": 8});
    {} when no `--config` flag was parsed (meshtrain used as a library)."""
    try:
        return dict(config_flags.get_override_values(flags.FLAGS["config"]))
    except (KeyError, TypeError, AttributeError, flags.UnparsedFlagAccessError):
        return {}
