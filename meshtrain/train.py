"""`python -m meshtrain.train --config configs/tiny.py [--config.key=value ...]`.

The one place that wires everything, in the order of the data flow:
config -> validated config -> mesh + rules -> abstract state -> shardings -> state created
sharded -> jitted step (state donated) in a loop fed by the data iterator -> metrics.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import jax
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from meshtrain import (
    attention as attention_lib,
    checkpoint as checkpoint_lib,
    config as config_lib,
    mesh as mesh_lib,
    metrics as metrics_lib,
    pipeline,
    sharding_rules,
    tensorboard as tensorboard_lib,
    train_step as train_step_lib,
)

log = logging.getLogger("meshtrain")

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                          lock_config=True)
# Multi-process runs (one process per host); shorthands for --config.distributed.*.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


def setup_runtime(config: ml_collections.ConfigDict) -> dict[str, int]:
    """Fake CPU devices, multi-process start, and config validation: all before anything compiles."""
    mesh_lib.fake_cpu_devices(config.cpu_devices)
    mesh_lib.maybe_initialize_distributed(config)
    import meshtrain.data  # noqa: F401  (registers the data validators)

    if config.init.from_hf:  # the checkpoint decides the architecture
        from meshtrain import hf

        hf.apply_model_config(config)
    return config_lib.validate(config, jax.device_count())


def evaluate(config, mesh, factory, eval_step, state) -> float:
    """Mean validation loss per token over `config.eval_batches` fixed batches."""
    from meshtrain import data

    it = data.make_iterator(config, mesh, split="validation",
                            permutation=attention_lib.data_permutation(config, dict(mesh.shape)))
    try:
        total_loss = total_tokens = 0.0
        for _ in range(config.eval_batches):
            loss_sum, tokens = eval_step(state.params, next(it))
            total_loss += float(loss_sum)
            total_tokens += float(tokens)
    finally:
        it.close()
    return total_loss / max(total_tokens, 1.0)


def make_eval_step(factory):
    """Jitted (params, batch) -> (loss_sum, valid tokens)."""
    def eval_step(params, batch):
        loss_sum, _ = factory.model.apply({"params": params}, batch, method=factory.model.loss)
        return loss_sum, batch["loss_mask"].sum()
    return jax.jit(eval_step, compiler_options=mesh_lib.compiler_options(factory.mesh))


def run(config: ml_collections.ConfigDict) -> dict:
    """Trains for `config.steps` steps; returns the last logged metrics."""
    sizes = setup_runtime(config)
    mesh = mesh_lib.make_mesh(config)
    is_main = jax.process_index() == 0
    log.info("%s", mesh_lib.describe(mesh))
    if (pipeline_schedule := pipeline.describe(config, sizes)) is not None:
        log.info("%s", pipeline_schedule)  # ticks, bubble, in-flight micro-batches per stage
    factory, step_fn, _ = train_step_lib.build(config, mesh)
    if config.explain:
        print(sharding_rules.explain(factory.boxed, factory.specs, mesh))
        return {}
    from meshtrain import data

    model_cfg = factory.model.cfg
    log.info("model: %.2fM parameters, global batch %d x %d tokens, ZeRO-%d, data-parallel %d",
             model_cfg.num_params() / 1e6, config.train.batch_size, config.train.seq_len,
             config.train.zero_stage, config_lib.data_parallel_size(sizes))
    ckpts = checkpoint_lib.RunCheckpoints(config, factory.abstract)

    def fresh_state():
        if config.init.from_hf:
            from meshtrain import hf

            return hf.initial_state(factory, config.init.from_hf, config.seed)
        return factory.create(config.seed)

    state, start, data_state = ckpts.start(fresh_state)
    if start >= config.steps:
        log.info("already at step %d of config.steps=%d: nothing left to train (raise config.steps to go on)",
                 start, config.steps)
    permutation = attention_lib.data_permutation(config, sizes)  # ring attention's zig-zag token order
    it = data.make_iterator(config, mesh, split="train", state=data_state, permutation=permutation)
    writer = metrics_lib.MetricsWriter(config.workdir, enabled=is_main)
    tb = tensorboard_lib.TensorBoardWriter(config.workdir, enabled=is_main)
    profiler = tensorboard_lib.StepProfiler(config.workdir, tuple(config.profile.steps))
    eval_step = make_eval_step(factory) if config.eval_every else None
    peak = metrics_lib.device_peak_flops()
    flops_token = metrics_lib.flops_per_token(model_cfg, config.train.seq_len)
    tokens_per_step = config.train.batch_size * config.train.seq_len
    progress = metrics_lib.Progress(config.steps, start, enabled=is_main)
    last: dict = {}
    window_start, window_steps, input_start = time.perf_counter(), 0, it.input_seconds()
    try:
        with jax.set_mesh(mesh):
            for step in range(start + 1, config.steps + 1):
                profiler.before(step)
                state, metrics = step_fn(state, next(it))
                profiler.after(step, metrics)
                window_steps += 1
                logged = step % config.log_every == 0 or step == config.steps or step == start + 1
                if logged:
                    metrics = jax.device_get(metrics)  # waits for the step: timing covers the window
                    elapsed = time.perf_counter() - window_start
                    step_time = elapsed / window_steps
                    tokens_per_sec = tokens_per_step / step_time
                    last = {
                        "step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                        "learning_rate": float(metrics["learning_rate"]), "tokens_per_sec": tokens_per_sec,
                        "step_time_s": step_time,
                        "input_time_s": (it.input_seconds() - input_start) / window_steps,
                        "mfu": (tokens_per_sec * flops_token / (peak * mesh.size)) if peak else None,
                        **{k: float(v) for k, v in metrics.items()
                           if k not in ("loss", "grad_norm", "learning_rate", "tokens")},
                        **metrics_lib.memory_stats(),
                    }
                    if eval_step and step % config.eval_every == 0:
                        last["eval_loss"] = evaluate(config, mesh, factory, eval_step, state)
                        last["eval_perplexity"] = float(np.exp(last["eval_loss"]))
                    writer.write(last)
                    tb.write(last)
                    progress.clear()
                    log.info(_format(last))
                    window_start, window_steps, input_start = time.perf_counter(), 0, it.input_seconds()
                progress.update(step, last.get("loss", float("nan")))
                if ckpts.after_step(step, state, metrics, it.state, config.steps, sync=logged):
                    break  # preempted: saved at this step
    except checkpoint_lib.NonFiniteError as error:
        if last.get("step") != error.step:  # the faulty step's figures reach metrics.jsonl once
            writer.write({"step": error.step, "loss": error.loss, "grad_norm": error.grad_norm, "nonfinite": 1.0})
        raise
    except BaseException:
        ckpts.failed = True  # a multi-process run does not wait on peers that may be dead
        raise
    finally:
        progress.clear()
        it.close()
        writer.close()
        tb.close()
        profiler.stop()
        ckpts.close()
    return {**last, "skipped_steps": ckpts.guard.skipped} if last else last


def _format(record: dict) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}", f"grad_norm {record['grad_norm']:.3f}",
             f"lr {record['learning_rate']:.2e}", f"{record['tokens_per_sec']:.0f} tok/s",
             f"step {record['step_time_s'] * 1e3:.0f} ms", f"input {record['input_time_s'] * 1e3:.1f} ms"]
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu'] * 100:.1f}%")
    if "peak_bytes_in_use" in record:
        parts.append(f"peak mem {record['peak_bytes_in_use'] / 2**30:.2f} GiB")
    if "eval_loss" in record:
        parts.append(f"eval_loss {record['eval_loss']:.4f}")
    return " | ".join(parts)


def main(argv) -> None:
    del argv
    # absl's handler on the root logger prefixes every line with level, pid and file: meshtrain's
    # own lines get a plain "time message" handler instead.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    for noisy in ("absl", "jax", "orbax", "etils", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config configs/tiny.py")
    for flag, key in ((_COORDINATOR, "coordinator_address"), (_NUM_PROCESSES, "num_processes"),
                      (_PROCESS_ID, "process_id")):
        if flag.value is not None:
            config.distributed[key] = flag.value
    try:
        run(config)
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except checkpoint_lib.NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        _exit(3)
    except Exception:
        if jax.process_count() == 1:
            raise
        traceback.print_exc()
        _exit(1)


def _exit(code: int) -> None:
    """Exits; a multi-process run skips jax.distributed's shutdown barrier, which would wait for a
    dead peer until the heartbeat timeout instead of failing now."""
    if jax.process_count() == 1:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    app.run(main)
