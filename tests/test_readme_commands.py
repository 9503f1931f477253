"""Every `python -m meshtrain...` command README.md and the pages under docs/ print runs to completion,
as a user would type it, with only its length cut: training commands get `--config.steps=2` (with a
warmup of 1) and a workdir of their own. A command printed on several pages runs once.

A launcher in front of the command (`srun ... python -m meshtrain.train ...`) is left out: outside
SLURM the command runs as one process. A command for one host of several (`--process_id=RANK`, with
`--coordinator_address=HEAD_HOST` and `--num_processes=N`) runs as N local processes joined on
127.0.0.1.

Commands are read from the README's code blocks and from inline code spans that carry arguments
(a bare `python -m meshtrain.plan` is a name, and must appear as a full command elsewhere).
Placeholders are filled: `<workdir>` with the main job's workdir, `HF_DIR` with a tiny Llama saved
by `transformers` (and a word-level `tokenizer.json`), `OUT_DIR` with a new folder, `PARQUET_DIR` with
a folder of one parquet file, `PROMPTS_FILE` with a JSON Lines file of prompts, `IMPORTED_RUN` with
the workdir `hf import --workdir` writes (the commands that read it run after that one);
`[optional ...]` groups are left out. Everything
runs in a temporary folder (with `configs/` linked in), datasets go to a temporary
`TFDS_DATA_DIR`, and nothing is written outside the test's tmp dirs. The commands that compile for a
GPU without one (`meshtrain.aot`, `--target`) need the `gpu` extra: tests/test_gpu_aot.py runs them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.utils import ROOT

pytestmark = pytest.mark.slow

MODULE = re.compile(r"python -m (meshtrain[\w.]*)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # README first: its main job is the one
LAUNCHER = re.compile(r"^(?:srun|mpirun)\s.*?(python -m meshtrain.*)$")
SHORTEN = ["--config.steps=2", "--config.train.warmup_steps=1", "--config.log_every=1"]  # training: length only


def _join_continuations(block: str) -> list[str]:
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(" ".join((current + line).split()))
        current = ""
    return [line for line in lines if line]


def readme_commands(text: str) -> tuple[list[str], set[str]]:
    """(full commands in README order, modules only named bare)."""
    commands: list[tuple[int, str]] = []
    for block in re.finditer(r"```[a-z]*\n(.*?)```", text, re.S):
        for i, line in enumerate(_join_continuations(block.group(1))):
            launched = LAUNCHER.match(line)
            if launched:
                line = launched.group(1)
            if line.startswith("python -m meshtrain"):
                commands.append((block.start(1) + i, line))
    outside = re.sub(r"```.*?```", lambda m: " " * len(m.group(0)), text, flags=re.S)
    for indented in re.finditer(r"(?m)^ {4}(python -m meshtrain.*)$", outside):
        commands.append((indented.start(), " ".join(indented.group(1).split())))
    bare = set()
    for span in re.finditer(r"`(python -m meshtrain[^`]*)`", outside):
        command = " ".join(span.group(1).split())
        if len(command.split()) == 3:
            bare.add(command.split()[2])
        else:
            commands.append((span.start(), command))
    return [c for _, c in sorted(commands)], bare


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    words = ["<unk>", "<s>", "</s>", "def", "return", "class", "x", "(", ")", ":", "=", "1"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return str(path)


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory) -> str:
    """A folder of parquet files with a `text` column: Python sources of the standard library."""
    import datasets

    from meshtrain.data import corpus

    path = tmp_path_factory.mktemp("parquet")
    docs = [open(p, encoding="utf-8").read() for p in corpus.default_corpus_files()[:60]]
    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(path / "part-0.parquet"))
    return str(path)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory) -> str:
    """One datasets folder for this worker's commands: the default corpus is prepared once."""
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def jax_cache(compilation_cache) -> str:
    """The run's persistent compilation cache for the commands: a program another command (or an
    earlier run) compiled, the same step, the evaluation's scoring, is loaded, not compiled again."""
    return str(compilation_cache)


def needs_gpu_compiler(command: str) -> bool:
    """Whether the command compiles for a GPU target (the `gpu` extra; tests/test_gpu_aot.py runs it)."""
    return MODULE.match(command).group(1) == "meshtrain.aot" or "--target" in command.split()


def command_env(tfds_dir: str, jax_cache: str | None) -> dict[str, str]:
    """The environment a README command runs in: CPU JAX, LLVM's lowest optimisation level (as in the
    other tests: half the CPU code generation time), this test's datasets folder and compilation cache."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TFDS_DATA_DIR": tfds_dir, "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    if jax_cache:
        env.update(JAX_COMPILATION_CACHE_DIR=jax_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def prepare_command(command: str, index: int, tmp_path, filled: dict[str, str]) -> list[str]:
    command = re.sub(r"\s*\[[^\]]*\]", "", command)
    for placeholder, value in filled.items():
        command = command.replace(placeholder, value)
    args = shlex.split(command)
    module = args[2]
    if module in ("meshtrain.train", "meshtrain.launch"):
        args += [*SHORTEN, f"--config.workdir={tmp_path / f'run{index}'}"]
    return [sys.executable, *args[1:]]


def docs_commands() -> tuple[list[str], set[str]]:
    """(every distinct command of README.md and docs/*.md, first occurrence first; modules named bare)."""
    commands, bare = [], set()
    for path in DOCS:
        found, named = readme_commands(path.read_text())
        commands += [c for c in dict.fromkeys(found) if c not in commands]
        bare |= named
    return commands, bare


def test_docs_name_only_commands_they_also_print():
    commands, bare = docs_commands()
    modules = {MODULE.match(c).group(1) for c in commands}
    assert bare <= modules, bare - modules
    assert {"meshtrain.train", "meshtrain.data.prepare", "meshtrain.launch", "meshtrain.plan", "meshtrain.hf",
            "meshtrain.report", "meshtrain.config_reference"} <= modules


COMMANDS = docs_commands()[0]
CPU_COMMANDS = [i for i, c in enumerate(COMMANDS) if not needs_gpu_compiler(c)]
MAIN = next(i for i, c in enumerate(COMMANDS) if MODULE.match(c).group(1) == "meshtrain.train" and "explain" not in c)
# commands that read the main job's workdir run right after it, in its case; likewise those reading the
# run `hf import --workdir IMPORTED_RUN` writes
ON_MAIN = [i for i, c in enumerate(COMMANDS) if "<workdir>" in c]
IMPORT = next(i for i, c in enumerate(COMMANDS)
              if c.startswith("python -m meshtrain.hf import") and "IMPORTED_RUN" in c)
ON_IMPORT = [i for i, c in enumerate(COMMANDS) if "IMPORTED_RUN" in c and i != IMPORT]


@pytest.mark.parametrize("index", [i for i in CPU_COMMANDS if i not in ON_MAIN + ON_IMPORT],
                         ids=lambda i: f"{i}-{MODULE.match(COMMANDS[i]).group(1).split('.', 1)[1]}")
def test_every_readme_command_runs(tmp_path, hf_dir, tfds_dir, parquet_dir, jax_cache, index):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "lm_eval").symlink_to(ROOT / "tests" / "lm_eval")  # the evaluation's example tasks
    env = command_env(tfds_dir, jax_cache)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def "}\n"class A("\n{"prompt": "x = ("}\n')
    for i in [index, *(ON_MAIN if index == MAIN else []), *(ON_IMPORT if index == IMPORT else [])]:
        command = COMMANDS[i]
        filled = {"HF_DIR": hf_dir, "OUT_DIR": str(tmp_path / f"export{i}"), "<workdir>": str(tmp_path / f"run{MAIN}"),
                  "PARQUET_DIR": parquet_dir, "PROMPTS_FILE": str(prompts), "IMPORTED_RUN": str(tmp_path / "imported")}
        if "RANK" in command:  # one host's command of several: all of them, here
            _run_on_local_hosts(command, i, tmp_path, filled, env)
            continue
        args = prepare_command(command, i, tmp_path, filled)
        result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        if i == MAIN:
            assert (tmp_path / f"run{MAIN}" / "metrics.jsonl").exists()


def _run_on_local_hosts(command: str, index: int, tmp_path, filled: dict[str, str], env: dict[str, str]) -> None:
    """`command` with HEAD_HOST and RANK filled in, once per process of `--num_processes=N`, all at once."""
    import portpicker

    count = int(re.search(r"--num_processes=(\d+)", command).group(1))
    head = f"127.0.0.1:{portpicker.pick_unused_port()}"
    procs = []
    for rank in range(count):
        host = {**filled, "HEAD_HOST": head, "RANK": str(rank)}
        args = prepare_command(command, index, tmp_path, host)
        procs.append(subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{command} (RANK={rank})\n{out[-2000:]}\n{err[-3000:]}"
    assert (tmp_path / f"run{index}" / "metrics.jsonl").exists()
