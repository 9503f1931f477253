"""`python -m meshtrain.train --config configs/tiny.py [--config.key=value ...]`.

The one place that wires everything, top to bottom in the order of the data flow:
config -> resolved run (validated; mesh, rules, schedule) -> abstract state -> shardings ->
state created sharded (or restored) -> jitted step (state donated) in the loop (`run_loop.py`)
fed by the data iterator -> metrics and checkpoints.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import traceback

import jax
import ml_collections
from absl import app, flags
from ml_collections import config_flags

from meshtrain import (
    checkpoint,
    cli,
    compile_cache,
    config as config_lib,
    crash_points,
    data,
    default_run,
    durable,
    evaluate,
    hf,
    model,
    run_guards,
    run_loop,
    run_record,
    sample,
    sharding_rules,
    train_step,
    workdir_lock,
)
from meshtrain.run import Run
from meshtrain.validate import validate

log = logging.getLogger("meshtrain")

_CONFIG = config_flags.DEFINE_config_file("config", default_run.PATH, "A config file (configs/*.py); default: "
                                          "the defaults (a run in --config.workdir brings its own model).",
                                          lock_config=True)
# Multi-process runs (one process per host); shorthands for --config.distributed.*.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


def run(config: ml_collections.ConfigDict, given: dict | None = None) -> dict:
    """Trains for `config.steps` steps; returns the last logged metrics. A workdir whose checkpoints
    describe their run resumes with that run's model and tokenizer (`given`: the keys set on the
    command line, which must not contradict it)."""
    if problem := durable.unwritable(config.workdir):  # before anything reads, compiles or writes
        raise config_lib.ConfigError("workdir", config.workdir, f"{problem}: a run writes its checkpoints and "
                                     "metrics there; choose a folder this user can write")
    if problem := durable.wrong_kind(config.workdir):
        raise config_lib.ConfigError("workdir", config.workdir, f"{problem}: move it away (or choose another "
                                     "workdir); nothing was read or written")
    if config.init.from_hf and os.path.isdir(config.init.from_hf):  # its files' headers, before any compile
        try:
            hf.SafetensorsStore(config.init.from_hf)
        except hf.HFFormatError as error:
            raise config_lib.ConfigError("init.from_hf", config.init.from_hf, str(error)) from None
    metrics_file = os.path.join(os.path.expanduser(config.workdir), "metrics.jsonl")
    if os.path.isfile(metrics_file):  # damaged before its last line: one line now, before any thread starts
        durable.read_jsonl(metrics_file, warn=False)
    cli.setup_runtime(config, given)
    resume_layout(config, given or {})
    validate(config, jax.device_count())  # a bad config stops here, before anything compiles
    try:
        folder = compile_cache.use_for_run(config.train.compile_cache_dir)
    except OSError as error:
        raise config_lib.ConfigError("train.compile_cache_dir", config.train.compile_cache_dir,
                                     f"cannot be used as the compile cache ({error.strerror or error})") from None
    log.info("compile cache: %s", folder or "off (train.compile_cache_dir)")
    with workdir_lock.WorkdirLock(config.workdir, jax.process_index()):  # one run per workdir
        return _train(config)


def resume_layout(config: ml_collections.ConfigDict, given: dict) -> None:
    """A resume on another number of devices or processes than the newest checkpoint of the workdir was
    written on: the global batch stays (the same rows in the same order: the data's position is a global
    row) and `train.grad_accum_steps` is set so a data-parallel rank takes the sequences at once it took
    before (or as close below as the batch divides), unless the command line sets it or the batch
    changed; one line says what changed. Nothing happens on the same devices or without a checkpoint."""
    if config.checkpoint.restore_from:
        return
    found = run_record.newest_meta(checkpoint.checkpoint_root(os.path.expanduser(config.workdir)))
    before = found[1].get("layout") if found else None
    devices, processes = jax.device_count(), jax.process_count()
    if not before or (before["devices"], before["processes"]) == (devices, processes):
        return
    try:
        data_parallel = config_lib.data_parallel_size(config_lib.mesh_shape(config, devices))
    except config_lib.ConfigError:
        return  # a mesh these devices cannot hold: validate says so
    t, step = config.train, found[0]
    what = (f"resuming step {step} on {devices} devices in {processes} process(es), the checkpoint's on "
            f"{before['devices']} in {before['processes']}")
    if t.batch_size != before["batch_size"] or "train.grad_accum_steps" in given:
        log.warning("%s: train.batch_size %d and train.grad_accum_steps %d as configured", what, t.batch_size,
                    t.grad_accum_steps)
        return
    if t.batch_size % data_parallel:
        return  # these devices cannot split the batch: validate says so
    per_rank = t.batch_size // data_parallel
    accum = next(a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= before["micro_batch"])
    t.grad_accum_steps = accum
    log.warning("%s: global batch %d kept, %d sequence(s) a data-parallel rank at once (%d before); "
                "train.grad_accum_steps %d -> %d", what, t.batch_size, per_rank // accum, before["micro_batch"],
                before["grad_accum_steps"], accum)


def host_available_bytes() -> int | None:
    """The host memory available to new allocations (Linux's MemAvailable; else free pages), or None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(run: Run) -> None:
    """On CPU devices, which share the host's memory: refuses a model whose training state alone (parameters,
    gradients and Adam moments as the mesh places them, `plan.memory.state_memory`, summed over this
    process's devices) exceeds the memory available, before anything is allocated or compiled. A lower bound
    (activations come on top), so a run it lets through may still not fit; one it refuses cannot."""
    if jax.default_backend() != "cpu" or (available := host_available_bytes()) is None:
        return
    from meshtrain.plan import memory

    per_device = sum(memory.state_memory(memory.Step.from_config(run.config, run.sizes)).values())
    need = per_device * jax.local_device_count()
    if need > available:
        raise config_lib.ConfigError(
            "model", f"{model.num_params(run.model) / 1e9:.2f}B parameters",
            f"its training state alone needs {need / 2**30:.1f} GiB of host memory over this process's "
            f"{jax.local_device_count()} CPU devices ({per_device / 2**30:.1f} GiB each), {available / 2**30:.1f} "
            "GiB are available: a smaller model, ZeRO-3 over fsdp (train.zero_stage=3), or a GPU")


def _train(config: ml_collections.ConfigDict) -> dict:
    resolved = Run.resolve(config)
    for line in resolved.describe():
        log.info("%s", line)
    check_host_memory(resolved)
    factory, step_fn = train_step.build(resolved)
    if config.explain:
        print(sharding_rules.explain(factory.boxed, factory.specs, resolved.mesh))
        return {}
    log.info("model: %.2fM parameters, global batch %d x %d tokens, ZeRO-%d, data-parallel %d",
             model.num_params(resolved.model) / 1e6, config.train.batch_size, config.train.seq_len,
             config.train.zero_stage, resolved.data_parallel_size)
    loop = run_loop.Loop(resolved, factory,
                         evaluate_tasks=functools.partial(evaluate.in_loop, resolved) if config.eval_tasks else None,
                         sample=sample.in_loop(resolved) if config.sample_every else None)

    def fresh_state():
        if config.init.from_hf:
            return hf.initial_state(factory, config.init.from_hf, config.seed)
        return factory.create(config.seed)

    state, start, data_state = loop.start(fresh_state)
    it = data.make_iterator(resolved, "train", state=data_state)
    report, examples = data.read_report(config)
    if report:
        log.info("data: %d files, %d documents; skipped %d file(s) (binary, not UTF-8 or unreadable) and %d JSON "
                 "line(s) (not JSON, no %r, or not text)%s", report["data_files"], report["data_documents"],
                 report["data_skipped_files"], report["data_skipped_lines"], config.data.text_field,
                 f": e.g. {', '.join(examples[:3])}" if examples else "")
    result = loop.train(step_fn, state, start, it, first_record=report)
    if loop.ckpts.preemption.interrupted:  # Ctrl-C: saved, stopped; the shell's exit code for SIGINT
        saved = loop.ckpts.ckpt.last_saved
        raise run_guards.Interrupted(saved, loop.ckpts.ckpt.step_path(saved) if saved is not None else "nowhere")
    return result


def main(argv) -> None:
    del argv
    crash_points.install(_PROCESS_ID.value or 0)  # only where MESHTRAIN_CRASH_ROOTS asks (the crash-point sweep)
    cli.setup_logging(sys.stdout)
    # a failed asynchronous save leaves one unretrieved future per array write; the run reports it once
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    checkpoint.quiet_failed_save_threads()
    config = _CONFIG.value
    for flag, key in ((_COORDINATOR, "coordinator_address"), (_NUM_PROCESSES, "num_processes"),
                      (_PROCESS_ID, "process_id")):
        if flag.value is not None:
            config.distributed[key] = flag.value
    try:
        run(config, cli.given_keys())
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except run_guards.Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        _exit(run_guards.INTERRUPT_EXIT_CODE)
    except (run_guards.NonFiniteError, run_guards.SpikeError) as e:
        print(f"error: {e}", file=sys.stderr)
        _exit(3)
    except run_guards.PeerLost as e:
        print(f"error: {e}", file=sys.stderr)
        _exit(run_guards.HANG_EXIT_CODE)
    except (checkpoint.CheckpointSaveError, durable.WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        _exit(4)
    except durable.CorruptFileError as e:
        print(f"error: {e}", file=sys.stderr)
        _exit(2)
    except Exception:
        if jax.process_count() == 1:
            raise
        traceback.print_exc()
        _exit(1)
    _finish()


def _finish() -> None:
    """Ends a finished run without the interpreter's teardown: what the interpreter does first at exit
    (`threading._shutdown`: thread pools told to stop, the threads it started joined; then every exit
    handler, JAX's and the goodput ledger's last), then the process exits at once rather than free what
    it holds object by object (a restart waits on it; docs/benchmarks.md, "Restarts and goodput")."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:  # an interpreter without it: its own exit, teardown included
        return
    shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    app.run(main, flags_parser=cli.parse_flags)
