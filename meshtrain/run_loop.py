"""The training loop's policy: when to save, preemption, the non-finite guard, evaluation windows,
and the metric records of logged steps.

    loop = Loop(run, factory)
    state, start, data_state = loop.start(lambda: factory.create(config.seed))
    last = loop.train(step_fn, state, start, data.make_iterator(run, "train", state=data_state))

Numerical faults (playbook, "Mixed Precision Training": low precision can diverge): the train step
withholds an update whose loss or gradient norm is not finite; `FiniteGuard` stops the run
(default) or counts the skip (`train.skip_nonfinite`). Preemption (SIGTERM) finishes the step,
saves and stops. Checkpoint storage itself is `checkpoint.py`.
"""

from __future__ import annotations

import logging
import re
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import ml_collections
import numpy as np

from meshtrain import checkpoint, data, metrics as metrics_lib, tensorboard as tensorboard_lib

if TYPE_CHECKING:
    from meshtrain.run import Run
    from meshtrain.train_step import StateFactory

log = logging.getLogger("meshtrain")


class Preemption:
    """SIGTERM -> finish the current step, save, exit 0.

    Single-process runs install their own SIGTERM handler that sets a flag. Multi-process runs
    use JAX's preemption sync manager (started by `jax.distributed.initialize`, which catches
    SIGTERM itself): `reached(step)` becomes true on every process at the same step, so all of
    them save the same checkpoint.
    """

    def __init__(self):
        self._flag = False
        self._multi = jax.process_count() > 1
        self._previous = None
        if not self._multi:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        del signum, frame
        self._flag = True

    def reached(self, step: int) -> bool:
        """True when the run must save at `step` and stop (call once per step, on every process)."""
        if self._multi:
            from jax.experimental import multihost_utils

            try:
                return bool(multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError:  # the preemption service is disabled
                return False
        return self._flag

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was not finite and `train.skip_nonfinite` is off."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_good: str | None):
        self.step, self.loss, self.grad_norm, self.last_good = step, loss, grad_norm, last_good
        where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
        super().__init__(f"non-finite values at step {step}: loss={loss}, grad_norm={grad_norm}; the update "
                         f"was not applied and the run stopped ({where}); set config.train.skip_nonfinite=True "
                         f"to skip such steps instead")


class FiniteGuard:
    """Reads each step's `finite` flag one step late, so the host never waits on the device.

    The train step itself leaves params and optimizer state unchanged when a step is not
    finite, so reading the flag late loses nothing; `check` must run before every save.
    """

    def __init__(self, skip: bool, skipped: int = 0):
        self.skip, self.skipped = skip, skipped
        self._pending: tuple[int, dict] | None = None

    def push(self, step: int, metrics: dict) -> tuple[int, dict] | None:
        """Records step's metrics; returns (step, host metrics) of the previous step if it was not finite."""
        previous, self._pending = self._pending, (step, metrics)
        return self._inspect(previous)

    def check(self) -> tuple[int, dict] | None:
        """Inspects the newest pushed step (before a save or at the end)."""
        pending, self._pending = self._pending, None
        return self._inspect(pending)

    def _inspect(self, entry) -> tuple[int, dict] | None:
        if entry is None:
            return None
        step, metrics = entry
        if not float(np.asarray(metrics["nonfinite"])):
            return None
        host = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
        self.skipped += 1
        return step, host


class RunCheckpoints:
    """Checkpoints, preemption and non-finite steps of one run, as the loop sees them.

        ckpts = RunCheckpoints(config, factory)
        state, start, data_state = ckpts.start(lambda: factory.create(config.seed))
        for step in range(start + 1, config.steps + 1):
            state, metrics = step_fn(state, next(it))
            if ckpts.after_step(step, state, metrics, it.state, last_step=config.steps):
                break  # preempted: saved at `step`
        ckpts.close()
    """

    def __init__(self, config: ml_collections.ConfigDict, factory: StateFactory):
        """Checkpoints hold the layers in execution order (`StateFactory.to_canonical`); the run's
        state holds them in its schedule's order."""
        self.config, self.factory, self.abstract_state = config, factory, factory.abstract
        self.every = int(config.checkpoint.every)
        self.ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_root(config.workdir),
                                            keep=int(config.checkpoint.keep),
                                            async_save=bool(config.checkpoint.async_save))
        self.guard = FiniteGuard(bool(config.train.skip_nonfinite))
        self.preemption = Preemption()
        self._record = checkpoint.config_record(config)
        self.failed = False  # set by the loop when it ends with an error

    def start(self, create: Callable[[], object]) -> tuple[object, int, dict | None]:
        """(state, steps already done, data iterator state) from the newest checkpoint, else fresh."""
        restored = checkpoint.resume(self.config, self.ckpt, self.abstract_state)
        if restored is None:
            return create(), 0, None
        self.guard.skipped = int(restored.meta.get("skipped_steps", 0))
        log.info("resumed from %s (step %d)", restored.path, restored.step)
        return self.factory.from_canonical(restored.state), restored.step, restored.data_state

    def after_step(self, step: int, state, metrics: dict, data_state: Callable[[], dict], last_step: int,
                   sync: bool = False) -> bool:
        """Fault check, preemption and periodic saves after `step`; True when the run must stop now.

        Args:
          sync: the caller already waited for this step (a logged step): check it now.
        """
        self._handle(self.guard.push(step, metrics))
        if sync:
            self._handle(self.guard.check())
        preempted = self.preemption.reached(step)
        if preempted or step == last_step or (self.every and step % self.every == 0):
            self._handle(self.guard.check())  # nothing non-finite is ever saved
            self.ckpt.save(step, self.factory.to_canonical(state), data_state(), self.meta(step))
        if preempted:
            log.warning("preempted: checkpoint saved at step %d; exiting", step)
        return preempted

    def meta(self, step: int) -> dict:
        return {"step": step, "seed": int(self.config.seed), "skipped_steps": self.guard.skipped,
                "config": self._record}

    def _handle(self, fault: tuple[int, dict] | None) -> None:
        if fault is None:
            return
        step, values = fault
        if self.guard.skip:
            log.warning("step %d: non-finite loss=%s grad_norm=%s: update skipped (%d skipped so far)",
                        step, values["loss"], values["grad_norm"], self.guard.skipped)
            return
        self.ckpt.wait()
        latest = self.ckpt.latest_step()
        raise NonFiniteError(step, values["loss"], values["grad_norm"],
                             self.ckpt.step_path(latest) if latest is not None else None)

    def close(self) -> None:
        """Waits for the pending save (a finished checkpoint on disk) and restores the SIGTERM handler.

        After a failure in a multi-process run it does not wait: finishing a save needs every
        process, and a peer may be dead (the unfinished checkpoint stays invisible).
        """
        self.preemption.close()
        if self.failed and jax.process_count() > 1:
            return
        self.ckpt.close()


# ---------------------------------------------------------------------------------------------
# Evaluation and metric records.
# ---------------------------------------------------------------------------------------------


def make_eval_step(factory: StateFactory, compiler_options: dict[str, str]):
    """Jitted (params, batch) -> (loss_sum, valid tokens)."""
    def eval_step(params, batch):
        loss_sum, _ = factory.model.apply({"params": params}, batch, method=factory.model.loss)
        return loss_sum, batch["loss_mask"].sum()
    return jax.jit(eval_step, compiler_options=compiler_options)


def evaluate(run: Run, eval_step, params) -> float:
    """Mean validation loss per token over `config.eval_batches` fixed batches."""
    it = data.make_iterator(run, split="validation")
    try:
        total_loss = total_tokens = 0.0
        for _ in range(run.config.eval_batches):
            loss_sum, tokens = eval_step(params, next(it))
            total_loss += float(loss_sum)
            total_tokens += float(tokens)
    finally:
        it.close()
    return total_loss / max(total_tokens, 1.0)


_LOGGED_STEP = re.compile(r"\bstep (\d+) \| loss ")
_RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\)")


def logged_steps(text: str) -> list[int]:
    """The steps whose log lines (`format_record`) appear in a run's output: the one reader of that
    format, for tests and benchmarks that watch a training process."""
    return [int(s) for s in _LOGGED_STEP.findall(text)]


def resumed_step(text: str) -> int | None:
    """The step a run's output says it resumed from (`Loop.start`), or None."""
    found = _RESUMED.findall(text)
    return int(found[0]) if found else None


def format_record(record: dict) -> str:
    """The log line of a logged step."""
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


_MAIN_KEYS = ("loss", "grad_norm", "learning_rate", "tokens")


class _Window:
    """Wall time, steps and input time since the last logged step."""

    def __init__(self, it):
        self._it = it
        self.reset()

    def reset(self) -> None:
        self.start, self.steps, self.input_start = time.perf_counter(), 0, self._it.input_seconds()

    def per_step(self) -> tuple[float, float]:
        """(step time, input time) averaged over the window's steps."""
        steps = max(self.steps, 1)
        return (time.perf_counter() - self.start) / steps, (self._it.input_seconds() - self.input_start) / steps


class Loop:
    """One run's step loop: the step function fed by the data iterator, logging every `log_every`
    steps (metrics.jsonl, TensorBoard, the console), evaluating every `eval_every`, profiling the
    configured steps, checkpointing and stopping on preemption or a non-finite step."""

    def __init__(self, run: Run, factory: StateFactory):
        config = run.config
        self.run, self.config = run, config
        self.is_main = jax.process_index() == 0
        self.ckpts = RunCheckpoints(config, factory)
        self.eval_step = make_eval_step(factory, run.compiler_options) if config.eval_every else None
        self.peak = metrics_lib.device_peak_flops()
        self.flops_per_token = metrics_lib.flops_per_token(run.model, config.train.seq_len)
        self.tokens_per_step = config.train.batch_size * config.train.seq_len

    def start(self, create: Callable[[], object]) -> tuple[object, int, dict | None]:
        """(state, steps already done, data state): resumed from the newest checkpoint, else `create()`."""
        state, start, data_state = self.ckpts.start(create)
        if start >= self.config.steps:
            log.info("already at step %d of config.steps=%d: nothing left to train (raise config.steps to go on)",
                     start, self.config.steps)
        return state, start, data_state

    def record(self, step: int, metrics: dict, step_time: float, input_time: float) -> dict:
        """The metrics.jsonl record of a logged step (metrics already on the host)."""
        tokens_per_sec = self.tokens_per_step / step_time
        mfu = tokens_per_sec * self.flops_per_token / (self.peak * self.run.mesh.size) if self.peak else None
        return {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                "learning_rate": float(metrics["learning_rate"]), "tokens_per_sec": tokens_per_sec,
                "step_time_s": step_time, "input_time_s": input_time, "mfu": mfu,
                **{k: float(v) for k, v in metrics.items() if k not in _MAIN_KEYS},
                **metrics_lib.memory_stats()}

    def train(self, step_fn, state, start: int, it) -> dict:
        """Runs steps start+1 .. config.steps; returns the last logged record."""
        config = self.config
        writer = metrics_lib.MetricsWriter(config.workdir, enabled=self.is_main)
        tb = tensorboard_lib.TensorBoardWriter(config.workdir, enabled=self.is_main)
        profiler = tensorboard_lib.StepProfiler(config.workdir, tuple(config.profile.steps))
        progress = metrics_lib.Progress(config.steps, start, enabled=self.is_main)
        window, last = _Window(it), {}
        try:
            with jax.set_mesh(self.run.mesh):
                for step in range(start + 1, config.steps + 1):
                    profiler.before(step)
                    state, metrics = step_fn(state, next(it))
                    profiler.after(step, metrics)
                    window.steps += 1
                    logged = step % config.log_every == 0 or step == config.steps or step == start + 1
                    if logged:
                        metrics = jax.device_get(metrics)  # waits for the step: timing covers the window
                        last = self.record(step, metrics, *window.per_step())
                        if self.eval_step and step % config.eval_every == 0:
                            last["eval_loss"] = evaluate(self.run, self.eval_step, state.params)
                            last["eval_perplexity"] = float(np.exp(last["eval_loss"]))
                        writer.write(last)
                        tb.write(last)
                        progress.clear()
                        log.info(format_record(last))
                        window.reset()
                    progress.update(step, last.get("loss", float("nan")))
                    if self.ckpts.after_step(step, state, metrics, it.state, config.steps, sync=logged):
                        break  # preempted: saved at this step
        except NonFiniteError as error:
            if last.get("step") != error.step:  # the faulty step's figures reach metrics.jsonl once
                writer.write({"step": error.step, "loss": error.loss, "grad_norm": error.grad_norm, "nonfinite": 1.0})
            raise
        except BaseException:
            self.ckpts.failed = True  # a multi-process run does not wait on peers that may be dead
            raise
        finally:
            progress.clear()
            it.close()
            writer.close()
            tb.close()
            profiler.stop()
            self.ckpts.close()
        return {**last, "skipped_steps": self.ckpts.guard.skipped} if last else last
