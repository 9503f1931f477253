"""Compiled programs kept across runs (`meshtrain.compile_cache`).

* JAX's persistent cache in a folder of the test's: a second process reads the program back (no
  compile), with the same result; a truncated entry is dropped and rebuilt, never an error or another
  result; entries are written whole (no temporary file is left behind); the pipeline steps XLA:CPU
  runs wrongly once deserialized are never read back, whoever wrote them.
* Records of deviceless GPU compiles (`gpu_aot`, the `gpu` extra): the same program is read back with
  the same module text and memory figures; another compile option, XLA flag or program is another
  key; a truncated or corrupted record is compiled again and rewritten; a compiler error writes nothing.
* The per-user folder and its environment variable; `prune` keeps the most recently used entries.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import compile_cache
from tests.utils import ROOT

# One process: an 8-device sharded gradient compiled with the cache in argv[1]; prints the result and
# JAX's cache hits and writes as JSON.
PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 8)
from meshtrain import compile_cache
compile_cache.use_jax_cache(sys.argv[1])
events = {"hits": 0, "writes": 0}
def listen(event, **_):
    if event == "/jax/compilation_cache/cache_hits": events["hits"] += 1
    if event == "/jax/compilation_cache/cache_misses": events["writes"] += 1
jax.monitoring.register_event_listener(listen)
mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
x = jax.device_put(jnp.arange(64.0).reshape(8, 8) / 64, rows)
grad = jax.jit(jax.grad(lambda w: jnp.sum(jnp.tanh(w @ w.T) ** 2)))
out = grad(x)
print(json.dumps({"sum": float(out.sum()), "first": float(out[0, 0]), **events}))
"""


# The gpipe pipeline step (stage 2 x data 4; the circular one behaves alike), 2 steps, with the cache
# in argv[1], guarded (argv[2] == "guarded") or as plain JAX keeps it: read back unguarded, it
# deadlocked in its collectives and XLA aborted the process (`compile_cache.readable_back`).
PIPELINE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
from meshtrain import compile_cache
if sys.argv[2] == "guarded":
    compile_cache.use_jax_cache(sys.argv[1])
else:
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
events = []
jax.monitoring.register_event_listener(lambda e, **_: events.append(e))
from tests import utils
out = {}
c = utils.tiny_config({"stage": 2, "data": 4}, **{"model.n_layers": 4, "train.seq_len": 16, "train.warmup_steps": 1,
                      "pipeline.microbatches": 4, "pipeline.schedule": "gpipe"})
for run in ["gpipe", "again"] if sys.argv[2] == "guarded" else ["gpipe"]:  # again: the same program, a new trace
    hits = events.count("/jax/compilation_cache/cache_hits")
    out[run] = utils.run_steps(c, utils.synthetic_batches(c, 2))[0].tolist()
    out[run + "_hits"] = events.count("/jax/compilation_cache/cache_hits") - hits
print(json.dumps({**out, "not_kept": events.count(compile_cache.NOT_KEPT_EVENT),
                  "writes": events.count("/jax/compilation_cache/cache_misses")}))
"""


def _run(directory: pathlib.Path, program: str = PROGRAM, *args: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", program, str(directory), *args], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


def _entry(directory: pathlib.Path) -> pathlib.Path:
    """The cache entry of the gradient: the largest file (the other entries are small eager programs)."""
    return max((p for p in directory.iterdir() if p.name.endswith("-cache")), key=lambda p: p.stat().st_size)


@pytest.mark.slow
def test_jax_cache_reads_back_and_rebuilds_a_truncated_entry(tmp_path):
    first = _run(tmp_path)
    assert first["writes"] > 0 and first["hits"] == 0
    second = _run(tmp_path)  # a new process: every program read back, none compiled
    assert second["hits"] == first["writes"] and second["writes"] == 0
    assert second["sum"] == first["sum"] and second["first"] == first["first"]

    entry = _entry(tmp_path)
    whole = entry.stat().st_size
    with open(entry, "r+b") as f:  # what a process killed mid-write (by another JAX) leaves
        f.truncate(whole // 3)
    third = _run(tmp_path)
    assert third["sum"] == first["sum"] and third["first"] == first["first"]
    assert third["writes"] == 1  # the truncated one compiled again and written back
    assert entry.stat().st_size > whole // 3
    fourth = _run(tmp_path)  # ... whole: every program read back again
    assert fourth["hits"] == first["writes"] and fourth["writes"] == 0 and fourth["sum"] == first["sum"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


@pytest.mark.slow
def test_pipeline_steps_are_compiled_not_read_back_into_a_deadlock(tmp_path):
    """Guarded: the steps XLA:CPU would run wrongly once deserialized are not written, so every run
    compiles them and trains to the same losses (read back, they aborted after 40 s)."""
    first = _run(tmp_path, PIPELINE, "guarded")
    second = _run(tmp_path, PIPELINE, "guarded")
    assert first["not_kept"] >= 1 and second["not_kept"] == first["not_kept"]
    assert second["gpipe"] == first["gpipe"] == first["again"]
    assert first["again_hits"] > 0  # the second run in one process: the executable compiled before it


@pytest.mark.slow
def test_an_entry_written_without_the_guard_is_compiled_again(tmp_path):
    """A process without meshtrain's guard (plain JAX) wrote the steps; a guarded one drops them when
    read back, says so, and trains to the same losses."""
    plain = _run(tmp_path, PIPELINE, "plain")
    assert plain["writes"] > 0 and plain["not_kept"] == 0
    guarded = _run(tmp_path, PIPELINE, "guarded")
    assert guarded["gpipe"] == plain["gpipe"]
    assert "would not run correctly read back; compiling it instead" in guarded["stderr"]


HLO = """HloModule step

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %p), index=1
  %cp = f32[4]{0} collective-permute(f32[4]{0} %x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %cp)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %init), condition=%cond, body=%body
  %ar = f32[4]{0} all-reduce(f32[4]{0} %x), channel_id=2, replica_groups={{0,1}}, to_apply=%add
}
"""


def test_collectives_are_counted_by_the_computation_holding_them():
    assert compile_cache.collective_computations(HLO) == 2  # the loop's permute and the entry's all-reduce
    assert compile_cache.collective_computations(HLO.replace("all-reduce(", "add(")) == 1
    assert compile_cache.collective_computations(HLO.replace("collective-permute(", "negate(")
                                                 .replace("all-reduce(", "add(")) == 0
    assert compile_cache.collective_computations(HLO.replace("all-reduce(", "all-reduce-start(")) == 2


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "mine"))
    assert compile_cache.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(compile_cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "meshtrain"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.cache_dir() == pathlib.Path.home() / ".cache" / "meshtrain"
    env = compile_cache.jax_cache_env(tmp_path)
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path)
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"


def test_prune_drops_the_least_recently_used_first(tmp_path):
    now = time.time()
    for i in range(5):
        path = tmp_path / f"entry{i}-cache"
        path.write_bytes(b"x" * 100)
        os.utime(path, (now - 100 + i, now - 100 + i))  # entry4 used last
    stale = tmp_path / ".entry9-cache.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (now - 7200, now - 7200))
    assert compile_cache.prune(tmp_path, 250) == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry3-cache", "entry4-cache"]


# --------------------------------------------------------------------------------------------
# Records of deviceless GPU compiles.
# --------------------------------------------------------------------------------------------


@pytest.fixture
def records(tmp_path):
    before = compile_cache.records_dir()
    compile_cache.use_records(tmp_path / "records")
    yield tmp_path / "records"
    compile_cache.use_records(before)


def _lowered(options: dict | None = None, scale: float = 1.0):
    from meshtrain import aot

    devices = list(aot.target_devices("h100", 8))
    mesh = jax.make_mesh((8,), ("x",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x")))
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    step = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) * scale)), compiler_options=options)
    return step.lower(w, x), devices


@pytest.mark.gpu_aot
def test_gpu_records_read_back_and_key_on_every_input(records, monkeypatch):
    lowered, devices = _lowered()
    first = compile_cache.compile(lowered, devices)
    second = compile_cache.compile(_lowered()[0], devices)
    assert not first.from_cache and second.from_cache
    assert second.as_text() == first.as_text() and second.memory_analysis() == first.memory_analysis()
    assert second.compile_seconds == first.compile_seconds > 0
    assert "all-gather" in first.as_text() or "all-reduce" in first.as_text()
    assert len(list(records.iterdir())) == 1

    keys = {compile_cache.record_key(lowered, devices)}
    keys.add(compile_cache.record_key(_lowered({"xla_gpu_memory_limit_slop_factor": 120})[0], devices))  # options
    keys.add(compile_cache.record_key(_lowered(scale=2.0)[0], devices))  # the program
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0")
    keys.add(compile_cache.record_key(lowered, devices))  # XLA flags
    assert len(keys) == 4 and None not in keys  # the compile options were found on this JAX


@pytest.mark.gpu_aot
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_gpu_record_damaged_is_compiled_again(records, damage):
    lowered, devices = _lowered()
    first = compile_cache.compile(lowered, devices)
    (path,) = records.iterdir()
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    again = compile_cache.compile(lowered, devices)
    assert not again.from_cache and again.as_text() == first.as_text()
    assert compile_cache.compile(lowered, devices).from_cache  # rewritten whole


@pytest.mark.gpu_aot
def test_gpu_compile_error_writes_no_record(records):
    lowered, devices = _lowered({"xla_gpu_no_such_option_exists": True})
    with pytest.raises(Exception, match="xla_gpu_no_such_option_exists"):
        compile_cache.compile(lowered, devices)
    assert not records.exists() or not list(records.iterdir())


def test_programs_on_attached_devices_compile_as_jax_does(records):
    """Devices this process has: JAX's own Compiled (runnable), no record."""
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
    compiled = compile_cache.compile(lowered, jax.devices()[:1])
    np.testing.assert_array_equal(compiled(jnp.ones(4)), 2 * np.ones(4))
    assert not records.exists()
