"""Bad configs end with one ValueError naming the key, before anything compiles."""

import os
import subprocess
import sys

import pytest

from meshtrain.validate import validate
from tests.utils import ROOT, tiny_config

BAD = [
    # (mesh, overrides, key named in the message)
    ({}, {"train.spike_factor": 0.5}, "train.spike_factor"),
    ({}, {"attention.max_documents": -1}, "attention.max_documents"),
    ({}, {"train.spike_steps": 0}, "train.spike_steps"),
    ({}, {"train.spike_window": 0}, "train.spike_window"),
    ({}, {"train.spike_max_rollbacks": -1}, "train.spike_max_rollbacks"),
    ({}, {"train.hang_timeout_s": -1.0}, "train.hang_timeout_s"),
    ({"data": 3}, {}, "mesh"),                                    # product != device count
    ({"data": -1, "fsdp": -1}, {}, "mesh."),                      # two fill axes
    ({"data": 0}, {}, "mesh.data"),                               # non-positive axis
    ({"tensor": 8}, {}, "model.n_kv_heads"),                      # 8 heads ok, 4 KV heads not divisible by 8
    ({"tensor": 3, "data": -1}, {}, "mesh"),                      # 3 does not divide 8 devices
    ({"stage": 8}, {}, "model.n_layers"),                         # 4 layers over 8 stages
    ({"sequence": 8}, {"train.seq_len": 100}, "train.seq_len"),
    ({"data": 8}, {"train.batch_size": 12}, "train.batch_size"),  # batch vs data parallel
    ({"data": 4, "tensor": 2}, {"train.batch_size": 16, "train.grad_accum_steps": 8}, "train.batch_size"),
    ({"tensor": 2}, {"model.vocab_size": 263}, "model.vocab_size"),
    ({"tensor": 2}, {"model.mlp_dim": 191}, "model.mlp_dim"),
    ({"fsdp": 8}, {"model.d_model": 60, "train.zero_stage": 3}, "model.d_model"),
    ({}, {"model.n_heads": 6}, "model.n_heads"),                  # heads vs kv heads
    ({}, {"train.zero_stage": 4}, "train.zero_stage"),
    ({}, {"remat.policy": "most"}, "remat.policy"),
    ({}, {"attention.impl": "flash"}, "attention.impl"),
    ({}, {"model.dtype": "int8"}, "model.dtype"),
    ({}, {"steps": 0}, "steps"),
    ({}, {"train.learning_rate": -1.0}, "train.learning_rate"),
    ({}, {"model.n_layers": -4}, "model.n_layers"),
    ({"fsdp": 2, "tensor": 4}, {"model.sequence_parallel": True, "train.seq_len": 6}, "train.seq_len"),
    ({"tensor": 2}, {"model.collective_matmul": True}, "model.collective_matmul"),  # needs sequence parallelism
    ({"tensor": 2}, {"model.collective_matmul": True, "model.sequence_parallel": True,
                     "model.matmul_precision": "fp8"}, "model.collective_matmul"),
    ({"tensor": 2}, {"model.collective_matmul": True, "model.sequence_parallel": True,
                     "remat.policy": "offload"}, "model.collective_matmul"),
    ({}, {"train.xla_gpu_memory_limit_slop_factor": 0}, "train.xla_gpu_memory_limit_slop_factor"),
    ({"data": 2, "fsdp": 4}, {"mesh.dcn_data": 3}, "mesh.dcn_data"),
    ({}, {"sample_every": -1}, "sample_every"),
    ({"stage": 2, "data": 4}, {"sample_every": 10}, "sample_every"),   # sampling runs whole sequences
    ({"sequence": 2, "data": 4}, {"sample_every": 10, "attention.impl": "ring"}, "sample_every"),
    ({}, {"sample_every": 10, "sample_max_new_tokens": 0}, "sample_max_new_tokens"),
    ({}, {"sample_every": 10, "sample_temperature": -0.5}, "sample_temperature"),
    ({}, {"sample_every": 10, "sample_top_k": -1}, "sample_top_k"),
    ({}, {"sample_every": 10, "sample_prompt": ""}, "sample_prompt"),
    # model families (tests/test_hf.py): a sliding window is einsum attention's only
    ({}, {"model.sliding_window": 4, "attention.impl": "pallas"}, "model.sliding_window"),
    ({"sequence": 2, "data": 4}, {"model.sliding_window": 4, "attention.impl": "ring"}, "model.sliding_window"),
    ({}, {"model.sliding_window": -1}, "model.sliding_window"),
    ({}, {"model.rope_scaling": "dynamic"}, "model.rope_scaling"),
    ({}, {"model.rope_scaling": "yarn", "model.rope_beta_fast": 1.0}, "model.rope_beta_fast"),
    ({}, {"model.rope_scaling": "llama3", "model.rope_high_freq_factor": 0.5}, "model.rope_high_freq_factor"),
    ({}, {"model.rope_factor": 0.0}, "model.rope_factor"),
    ({}, {"model.family": "gpt2"}, "model.family"),
    ({}, {"model.shared_expert_dim": 64}, "model.shared_expert_dim"),  # no shared expert to widen
    ({}, {"model.shared_expert_dim": -1}, "model.shared_expert_dim"),
    # FP8 in a pipeline stage under remat none: its loss NaN (pipeline.validate_config)
    ({"stage": 2}, {"model.matmul_precision": "fp8", "remat.policy": "none", "pipeline.schedule": "1f1b"},
     "remat.policy"),
]


@pytest.mark.parametrize("mesh,overrides,key", BAD)
def test_bad_config_names_the_key(mesh, overrides, key):
    config = tiny_config({"data": -1, **mesh}, **overrides)
    with pytest.raises(ValueError) as info:
        validate(config, 8)
    assert f"config.{key}" in str(info.value), str(info.value)


def test_good_meshes_validate():
    """Every 8-device mesh with tensor <= 4 and stage <= 4 is valid for the tiny config."""
    for mesh in ({"data": 8}, {"fsdp": 8}, {"tensor": 4, "data": 2}, {"stage": 4, "data": 2},
                 {"expert": 8}, {"data": 2, "fsdp": 2, "tensor": 2}):
        sizes = validate(tiny_config(mesh), 8)
        assert sizes["data"] * sizes["fsdp"] * sizes["tensor"] * sizes["sequence"] * sizes["expert"] \
            * sizes["stage"] == 8


def test_fill_axis():
    sizes = validate(tiny_config({"data": -1, "tensor": 2}), 8)
    assert sizes["data"] == 4


@pytest.mark.slow
def test_cli_rejects_bad_value_and_unknown_key(tmp_path):
    """One line naming the key, exit code 2, nothing compiled; unknown keys refused by the locked config."""
    base = [sys.executable, "-m", "meshtrain.train", "--config", str(ROOT / "configs/tiny.py"),
            f"--config.workdir={tmp_path}", "--config.data.source=synthetic"]
    bad = subprocess.run(base + ["--config.mesh.tensor=3"], capture_output=True, text=True, timeout=120,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2
    assert "config.mesh" in bad.stderr and "Traceback" not in bad.stderr
    unknown = subprocess.run(base + ["--config.model.nonexistent=1"], capture_output=True, text=True, timeout=120,
                             env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert unknown.returncode != 0 and "nonexistent" in unknown.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("source, expected", [
    ("def get_config(:\n", "the file fails to import (line 1): SyntaxError: invalid syntax"),
    ("import no_such_module_here\n", "the file fails to import: ModuleNotFoundError: No module named "
                                      "'no_such_module_here'"),
    ("def get_config():\n    raise RuntimeError('no such size')\n", "get_config() raised RuntimeError: no such size"),
    ("x = 1\n", "the file defines no get_config()"),
], ids=["syntax-error", "import-error", "get-config-raises", "no-get-config"])
def test_a_config_file_that_gives_no_config_is_one_line_and_exit_code_2(source, expected, tmp_path, capsys):
    """A config file that fails to import or whose get_config raises: one line naming the file, exit 2,
    before the flags are parsed (`cli.parse_flags`, which every command runs first); the syntax error through
    `python -m meshtrain.train` itself, whose workdir stays unwritten."""
    from meshtrain import cli

    path = tmp_path / "broken.py"
    path.write_text(source)
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_flags(["meshtrain.train", "--config", str(path)])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert stderr.count("\n") == 1 and stderr.startswith(f"error: --config {path}: "), stderr
    assert expected in stderr, stderr
    if "SyntaxError" not in expected:
        return
    result = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", str(path),
                             f"--config.workdir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert (result.returncode, result.stderr) == (2, stderr)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, expected", [
    ("--config.model.n_layer=3", "--config.model.n_layer: config.model has no key 'n_layer'; closest: n_layers"),
    ("--config.modl.n_layers=3", "config has no key 'modl'; closest: model"),
    ("--config.model.n_layers=abc", "--config.model.n_layers=abc"),
])
def test_a_bad_override_is_one_line_and_exit_code_2(flag, expected, tmp_path):
    result = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", str(ROOT / "configs/tiny.py"), flag],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr[-2000:]
    assert expected in result.stderr
