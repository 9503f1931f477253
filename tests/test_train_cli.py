"""The main job end to end: `python -m meshtrain.train --config configs/tiny.py`."""

import json
import os
import re
import subprocess
import sys

import pytest

from meshtrain import compile_cache
from tests.utils import ROOT, jax_cache_dir, load_config_file

pytestmark = pytest.mark.slow

REQUIRED = {"step", "loss", "grad_norm", "learning_rate", "tokens_per_sec", "step_time_s", "mfu"}


def _run(args, tmp_path, timeout=300, **env_changes):
    """The command as a user runs it (no XLA flags of the tests'), with the tests' compilation cache."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **compile_cache.jax_cache_env(jax_cache_dir())}
    env.pop("XLA_FLAGS", None)
    env.update(env_changes)
    for name in [k for k, v in env_changes.items() if v is None]:
        env.pop(name)
    return subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", str(ROOT / "configs/tiny.py"),
                           f"--config.workdir={tmp_path}", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)


def test_tiny_trains_end_to_end_on_default_corpus(tmp_path):
    """The main job on the default corpus: logs every key, and within 40 steps its validation loss is
    clearly below the corpus's unigram entropy (the best loss without context); the sample it logs at
    step 40 (`sample_every`, decoded in the default dtype on the sharded mesh) is printed too.
    As on a fresh machine (no $TFDS_DATA_DIR, an empty home): the corpus is prepared into
    `<workdir>/datasets`, nothing is written to the home directory, and the output's first 15 lines
    are meshtrain's own (no TensorFlow Datasets log line or progress bar)."""
    from meshtrain.data import corpus, sources

    home = tmp_path / "home"
    home.mkdir()
    result = _run(["--config.steps=40", "--config.log_every=10", "--config.eval_every=40",
                   "--config.sample_every=40", "--config.sample_max_new_tokens=16",
                   "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"], tmp_path,
                  TFDS_DATA_DIR=None, HOME=str(home))
    assert result.returncode == 0, result.stderr[-3000:]
    first = (result.stderr + result.stdout).splitlines()[:15]
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) for line in first), "\n".join(first)  # meshtrain's lines only
    files = len(corpus.expand_files(load_config_file("tiny").data.files))  # the default corpus
    assert sum(f" data: preparing {files} file(s) into " in line for line in first) == 1, "\n".join(first)
    assert os.listdir(home) == []
    assert (tmp_path / sources.DEFAULT_SUBDIR).is_dir()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40]
    assert all(REQUIRED <= set(r) for r in records)
    assert records[0]["mfu"] is None  # CPU: peak FLOP/s unknown
    assert records[-1]["loss"] < records[0]["loss"]
    config = load_config_file("tiny")
    config.data.data_dir = str(tmp_path / sources.DEFAULT_SUBDIR)  # the run's corpus, read back
    entropy = sources.prepare(config, progress=False)["splits"]["validation"]["unigram_entropy_nats"]
    assert records[-1]["eval_loss"] < 0.95 * entropy, (records[-1]["eval_loss"], entropy)
    assert [r["step"] for r in records if "sample" in r] == [40]
    assert f"sample at step 40: {'def ' + records[-1]['sample']!r}" in result.stdout + result.stderr


def test_explain_prints_table_and_exits(tmp_path):
    result = _run(["--config.explain=True", "--config.mesh.fsdp=8", "--config.mesh.data=1",
                   "--config.train.zero_stage=3"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "('layers', 'embed', 'heads', 'head_dim')" in result.stdout
    assert "P(None, 'fsdp', None, None)" in result.stdout or "P(None, 'fsdp')" in result.stdout
    assert not (tmp_path / "metrics.jsonl").exists()
