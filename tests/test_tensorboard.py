"""TensorBoard scalars read back from the event files, the profiler's step window, config checks."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import config as config_lib, tensorboard
from meshtrain.validate import validate
from tests.utils import ROOT, tiny_config


def test_scalars_round_trip_through_event_files(tmp_path):
    writer = tensorboard.TensorBoardWriter(str(tmp_path))
    records = [{"step": s, "loss": 5.0 - 0.25 * s, "learning_rate": 1e-3 * s, "mfu": None, "flag": True,
                "tokens_per_sec": 1234.5 + s} for s in (1, 2, 5)]
    for record in records:
        writer.write(record)
    writer.close()
    scalars = tensorboard.read_scalars(str(tmp_path / "tb"))
    assert set(scalars) == {"loss", "learning_rate", "tokens_per_sec"}  # None and bools are not scalars
    for key in scalars:
        steps, values = zip(*scalars[key], strict=True)
        assert steps == (1, 2, 5)
        np.testing.assert_allclose(values, [r[key] for r in records], rtol=1e-7)  # float32 storage


def test_the_writer_does_not_import_torch_and_torch_still_imports_after(tmp_path):
    """tensorboardX imports torch when it is installed (the test extra installs it): seconds of every
    run's start. The writer hides it while tensorboardX is imported; a later `import torch` works."""
    script = (f"import sys; from meshtrain import tensorboard; w = tensorboard.TensorBoardWriter({str(tmp_path)!r}); "
              "w.write({'step': 1, 'loss': 2.5}); w.close(); print('torch' in sys.modules); "
              "import importlib.util; print(importlib.util.find_spec('torch') is None or bool(__import__('torch')))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "True"], result.stdout
    assert tensorboard.read_scalars(str(tmp_path / "tb")) == {"loss": [(1, 2.5)]}


def test_disabled_writer_writes_nothing(tmp_path):
    writer = tensorboard.TensorBoardWriter(str(tmp_path), enabled=False)
    writer.write({"step": 1, "loss": 1.0})
    writer.close()
    assert not (tmp_path / "tb").exists()


def test_profiler_traces_only_its_steps(tmp_path):
    profiler = tensorboard.StepProfiler(str(tmp_path), (2, 3))
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((16, 16))
    for step in range(1, 5):
        profiler.before(step)
        assert profiler.active == (step in (2, 3))
        profiler.after(step, f(x))
    profiler.stop()
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert list((tmp_path / "profile").rglob("perfetto_trace.json.gz"))


def test_trace_op_times_ranks_a_traces_operations(tmp_path):
    """`trace_op_times` reads the trace a profiled stretch wrote: per process, operations by summed
    duration, with their calls and shares; three calls of one jitted function appear as three calls."""
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            f(x).block_until_ready()
    found = tensorboard.trace_op_times(str(tmp_path), top=50)
    assert found
    for ops in found.values():
        times = [o["ms"] for o in ops]
        assert times == sorted(times, reverse=True) and all(o["calls"] >= 1 for o in ops)
        assert 0 < sum(o["share"] for o in ops) <= 1 + 0.5e-4 * len(ops)  # shares rounded to 4 places
    executions = [o for ops in found.values() for o in ops if "Execute" in o["name"]]
    assert executions and all(o["calls"] % 3 == 0 for o in executions)  # once (or k times) a call
    with pytest.raises(FileNotFoundError, match="no .*trace.json.gz"):
        tensorboard.trace_op_times(str(tmp_path / "empty"))


def test_profiler_off_by_default(tmp_path):
    profiler = tensorboard.StepProfiler(str(tmp_path), tuple(config_lib.default_config().profile.steps))
    profiler.before(1)
    profiler.after(1, None)
    assert not profiler.active and not (tmp_path / "profile").exists()


@pytest.mark.parametrize("steps", [(3, 2), (0, 5), (1, 101), (1, 2, 3), (1.0, 2)])
def test_profile_steps_validation(steps):
    config = tiny_config(**{"profile.steps": steps, "steps": 100})
    with pytest.raises(config_lib.ConfigError, match=r"config.profile.steps="):
        validate(config, 1)
