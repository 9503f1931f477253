"""The run report, and one end-to-end run that starts from Hugging Face weights, writes TensorBoard
events, traces two steps with the profiler and is summarised by `python -m meshtrain.report`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from meshtrain import badput, report, tensorboard
from tests.utils import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss", "eval_loss", "tokens_per_sec", "learning_rate")


def _write_metrics(workdir, records) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_summary_figures(tmp_path):
    records = [
        {"step": 1, "loss": 5.0, "learning_rate": 0.0, "tokens_per_sec": 10.0, "mfu": None},  # compile step
        {"step": 2, "loss": 4.0, "learning_rate": 1e-3, "tokens_per_sec": 100.0, "mfu": 0.2,
         "peak_bytes_in_use": 3 * 2**30},
        {"step": 3, "loss": "nan", "learning_rate": 2e-3, "tokens_per_sec": 300.0, "mfu": 0.4, "eval_loss": 4.5},
        {"step": 4, "loss": 9.0, "learning_rate": 3e-3, "tokens_per_sec": 200.0, "mfu": 0.3},
        # resumed from step 3: its records replace the first run's
        {"step": 4, "loss": 3.5, "learning_rate": 3e-3, "tokens_per_sec": 400.0, "mfu": 0.5,
         "peak_bytes_in_use": 2**30, "eval_loss": 4.25},
    ]
    _write_metrics(tmp_path, records)
    summary = report.summarize(report.read_metrics(str(tmp_path)))
    assert summary == {"steps": 4, "last_loss": 3.5, "best_loss": 3.5, "last_eval_loss": 4.25,
                       "best_eval_loss": 4.25, "median_tokens_per_sec": 300.0, "median_mfu": 0.4,
                       "peak_memory_bytes": 3 * 2**30}
    text = report.format_summary(summary)
    assert "300" in text and "40.0%" in text and "3.00 GiB" in text


def test_missing_or_bad_metrics_is_a_clear_error(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{oops\n{"step": 2, "loss": 0.5}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        report.read_metrics(str(tmp_path))
    # a torn last line is what a crash during its write leaves: dropped, the rest reported
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert report.read_metrics(str(tmp_path)) == [{"step": 1, "loss": 1.0}]
    assert report.main([str(tmp_path)]) == 0


def test_plots_only_what_was_logged(tmp_path):
    _write_metrics(tmp_path, [{"step": s, "loss": 1.0 / s, "learning_rate": 0.1} for s in (1, 2, 3)])
    _, paths = report.report(str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["learning_rate.png", "loss.png"]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A 6-step CLI run on 8 devices from a random transformers Llama, profiling steps 2-3."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(root / "hf")
    workdir = root / "work"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, "-m", "meshtrain.train", "--config", str(ROOT / "configs/tiny.py"),
         f"--config.workdir={workdir}", "--config.steps=6", "--config.train.warmup_steps=2", "--config.log_every=1",
         "--config.eval_every=3",
         "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
         "--config.profile.steps=(2, 3)", f"--config.init.from_hf={root / 'hf'}"],
        capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result.stdout + result.stderr


@pytest.mark.slow
def test_run_from_hf_weights(hf_run):
    _, log = hf_run
    assert "init.from_hf: model.d_model = 32 (was 64)" in log
    assert "0.03M parameters" in log


@pytest.mark.slow
def test_run_writes_tensorboard_scalars(hf_run):
    workdir, _ = hf_run
    records = report.read_metrics(str(workdir))
    scalars = tensorboard.read_scalars(str(workdir / "tb"))
    numeric = {k for r in records for k, v in r.items() if k != "step" and isinstance(v, int | float)}
    assert numeric <= set(scalars) and {"loss", "eval_loss", "learning_rate", "tokens_per_sec"} <= numeric
    for key in numeric:
        logged = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
        assert [s for s, _ in scalars[key]] == [s for s, _ in logged], key
        np.testing.assert_allclose([v for _, v in scalars[key]], [v for _, v in logged], rtol=1e-6)


@pytest.mark.slow
def test_run_writes_profile_trace(hf_run):
    workdir, _ = hf_run
    assert len(list((workdir / "profile").rglob("*.xplane.pb"))) == 1
    assert list((workdir / "profile").rglob("perfetto_trace.json.gz"))


@pytest.mark.slow
def test_report_cli_on_the_run(hf_run):
    workdir, _ = hf_run
    out = subprocess.run([sys.executable, "-m", "meshtrain.report", str(workdir)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    records = report.read_metrics(str(workdir))
    losses = [r["loss"] for r in records]
    assert f"{min(losses):.4f}" in out.stdout and out.stdout.startswith("steps                    6")
    # every record splits the wall clock so far, all of it; the one process lifetime is reported
    for r in records:
        parts = r["productive_s"] + sum(r[f"badput_{part}_s"] for part in badput.PARTS)
        assert parts == pytest.approx(r["wall_s"], rel=1e-9), r["step"]
    last = records[-1]
    assert last["badput_compile_s"] > 0 and last["badput_startup_s"] > 0 and last["badput_evaluation_s"] > 0
    assert last["badput_restore_s"] == 0 and last["productive_s"] > 0
    summary = badput.summarize(str(workdir))
    assert summary["segments"] == 1 and summary["killed"] == 0
    assert f"goodput {summary['goodput']:.1%}" in out.stdout and "badput evaluation" in out.stdout
    for stem in PLOTS:
        png = workdir / "report" / f"{stem}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000, stem
