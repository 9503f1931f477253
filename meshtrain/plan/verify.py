"""`--verify`: compile the configured step ahead of time and set the compiler's figures beside the model's.

Nothing is allocated: the state is `factory.abstract` (ShapeDtypeStructs with shardings) and the
batch is [B, T] ShapeDtypeStructs, so the real llama3_8b shapes compile on a laptop's fake CPU
devices. `memory_analysis()` gives per-device argument / temporary bytes; the HLO gives the
collectives (see `hlo.py`). The comparison uses the CPU backend's conventions (`comm.CPU`):
all-reduce + dynamic-slice for the partitioner's reduce-scatters, float32 collectives.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import ml_collections

from meshtrain import compile_cache, train_step
from meshtrain.plan import comm, hlo, memory
from meshtrain.plan.estimate import memory_breakdown
from meshtrain.run import Run
from meshtrain.validate import validate

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@dataclasses.dataclass
class Verification:
    sizes: dict[str, int]
    compile_seconds: float
    compiler: dict[str, float]  # argument, state, temp, peak bytes per device
    model: dict[str, float]
    compiler_comm: dict[str, float]
    model_comm: dict[str, float]
    devices: str = "fake CPU devices"  # what the step was compiled for

    def as_json(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        rows = [("per device", "model", "compiler", "model/compiler")]
        for key in ("state", "temp", "peak"):
            rows.append((f"{key} bytes", _h(self.model[key]), _h(self.compiler[key]),
                         _ratio(self.model[key], self.compiler[key])))
        for axis in sorted(set(self.model_comm) | set(self.compiler_comm)):
            m, c = self.model_comm.get(axis, 0.0), self.compiler_comm.get(axis, 0.0)
            rows.append((f"{axis} bytes sent/step", _h(m), _h(c), _ratio(m, c)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join(lines + [f"AOT compile: {self.compile_seconds:.1f} s for {math.prod(self.sizes.values())} "
                                  f"{self.devices}"])


def _h(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**28 else f"{n / 2**20:.3f} MiB"


def _ratio(m: float, c: float) -> str:
    return f"{m / c:.3f}" if c else ("-" if not m else "inf")


def batch_structs(run: Run) -> dict:
    shape = (run.config.train.batch_size, run.config.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=run.batch_sharding)
            for k in BATCH_KEYS}


def batch_bytes(run: Run) -> int:
    """Bytes of one device's shard of the step's batch (every field 4 bytes per token)."""
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * 4 for s in batch_structs(run).values())


def compile_step(config: ml_collections.ConfigDict, devices: list | None = None, *, inputs: bool = True):
    """(compiled, run, seconds): the jitted step lowered from abstract inputs and compiled.

    `devices` may be another platform's (`aot.target_devices`): nothing is created on them, and the
    result is a `compile_cache.CompiledRecord` (read back from the compile cache when the same
    program was compiled before; `seconds` is then that compile's). `inputs=False` skips the rules
    that read files (the data need not exist to compile)."""
    devices = list(jax.devices() if devices is None else devices)
    validate(config, len(devices), inputs=inputs)
    run = Run.resolve(config, devices)
    factory, step_fn = train_step.build(run)
    start = time.perf_counter()
    with jax.set_mesh(run.mesh):
        compiled = compile_cache.compile(step_fn.lower(factory.abstract, batch_structs(run)), devices)
    return compiled, run, compile_seconds(compiled, time.perf_counter() - start)


def compile_seconds(compiled, elapsed: float) -> float:
    """A compile's seconds: those of the compile that made a record read back, else `elapsed`."""
    return compiled.compile_seconds if getattr(compiled, "from_cache", False) else elapsed


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program: argument, output, alias (outputs written into donated
    arguments), temp, and peak = argument + output - alias + temp (everything live at once, at most)."""
    stats = compiled.memory_analysis()
    out = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
           "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def model_memory(config: ml_collections.ConfigDict, sizes: dict[str, int], batch: int) -> dict[str, int]:
    """The planner's per-device figures for the configured step, in the compiler's terms: state
    (parameters + optimizer), temp (gradients + activations + temporaries), peak (+ the batch)."""
    mem = memory_breakdown(memory.Step.from_config(config, sizes), config.remat.policy)
    state = mem["params"] + mem["optimizer"]
    temp = mem["grads"] + mem["activations"] + mem["temporaries"]
    return {"state": state, "temp": temp, "peak": state + batch + temp}


def compiler_bytes(compiled, run: Run) -> dict[str, float]:
    """Bytes one device sends per step over each mesh axis, counted from the compiled HLO."""
    found = hlo.collectives(compiled.as_text(), math.prod(run.sizes.values()), run.layout.branch_share())
    return hlo.bytes_by_axis(found, dict(run.mesh.shape))  # device order: the mesh's


def verify(config: ml_collections.ConfigDict, devices: list | None = None, *,
           backend: comm.Backend = comm.CPU) -> Verification:
    """Compiles the configured step on `devices` and compares memory and per-axis bytes with the model.

    `backend`: the collective conventions of the compiler (`comm.CPU` for fake CPU devices,
    `comm.GPU` for a GPU target's devices)."""
    compiled, run, seconds = compile_step(config, devices, inputs=False)
    sizes = dict(run.sizes)
    mem = compiled_memory(compiled)
    comp = {"argument": mem["argument"], "state": mem["argument"] - batch_bytes(run), "temp": mem["temp"],
            "peak": mem["peak"]}
    model = model_memory(config, sizes, batch_bytes(run))
    compiler_comm = compiler_bytes(compiled, run)
    step = memory.Step.from_config(config, sizes)
    model_comm = comm.bytes_by_axis(comm.step_collectives(step, config.remat.policy, backend))
    platform = run.mesh.devices.flat[0]
    where = "fake CPU devices" if platform.platform == "cpu" else f"x {platform.device_kind}"
    return Verification(sizes, seconds, comp, model, compiler_comm, model_comm, where)
