"""The training loop's policy: when to save, preemption, the non-finite guard, evaluation windows,
and the metric records of logged steps.

    loop = Loop(run, factory, evaluate_tasks=..., sample=...)   # optional: lm-eval tasks, a text sample
    state, start, data_state = loop.start(lambda: factory.create(config.seed))
    last = loop.train(step_fn, state, start, data.make_iterator(run, "train", state=data_state))

Numerical faults (playbook, "Mixed Precision Training": low precision can diverge): the train step
withholds an update whose loss or gradient norm is not finite; `FiniteGuard` stops the run
(default) or counts the skip (`train.skip_nonfinite`). Preemption (SIGTERM) finishes the step,
saves and stops. A multi-process run whose peer hangs or dies ends with `PeerLost` (a collective
failed) or by `Watchdog` (no progress for `train.hang_timeout_s`). Checkpoint storage itself is
`checkpoint.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import ml_collections
import numpy as np

from meshtrain import (
    badput,
    checkpoint,
    data,
    faults,
    fp8 as fp8_lib,
    local_tier,
    mesh as mesh_lib,
    metrics as metrics_lib,
    run_record,
    tensorboard as tensorboard_lib,
)

if TYPE_CHECKING:
    from meshtrain.run import Run
    from meshtrain.train_step import StateFactory

log = logging.getLogger("meshtrain")


class Preemption:
    """SIGTERM -> finish the current step, save, exit 0; Ctrl-C (SIGINT) the same, exit 130, and a
    second Ctrl-C aborts at once (the default handler is back after the first).

    Single-process runs install their own handlers that set a flag. Multi-process runs use JAX's
    preemption sync manager (started by `jax.distributed.initialize`, which catches SIGTERM
    itself): `reached(step)` becomes true on every process at the same step, so all of them save
    the same checkpoint; a Ctrl-C there sends this process a SIGTERM, which joins that path.
    """

    def __init__(self):
        self._flag = False
        self.interrupted = False  # stopped by Ctrl-C (SIGINT), not by SIGTERM
        self._multi = jax.process_count() > 1
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers live in the main thread only (a run started from another thread keeps none)
        if not self._multi:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_signal(self, signum, frame) -> None:
        del signum, frame
        self._flag = True

    def _on_interrupt(self, signum, frame) -> None:
        del frame
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        log.warning("Ctrl-C: saving at the end of this step, then exiting (Ctrl-C again to abort now)")
        if self._multi:  # every process reaches JAX's preemption sync point at the same step
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self._on_signal(signum, None)

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
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


class Interrupted(RuntimeError):
    """The run stopped at a Ctrl-C, after saving (exit code 130, the shell's for SIGINT)."""

    def __init__(self, step: int, path: str):
        self.step = step
        super().__init__(f"interrupted (Ctrl-C) at step {step}; checkpoint saved at {path}: run the same command "
                         "to resume")


INTERRUPT_EXIT_CODE = 130


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was not finite and `train.skip_nonfinite` is off."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_good: str | None, suspect: str | None = None):
        self.step, self.loss, self.grad_norm, self.last_good = step, loss, grad_norm, last_good
        if suspect:  # the run restored it and has saved nothing since: what it holds may be what is wrong
            where = (f"the checkpoint this run restored, {suspect}, is suspect: no step since restoring it was "
                     "finite; an older checkpoint, or a new workdir, is the way on")
        else:
            where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
        super().__init__(f"non-finite values at step {step}: loss={loss}, grad_norm={grad_norm}; the update "
                         f"was not applied and the run stopped ({where}); set config.train.skip_nonfinite=True "
                         f"to skip such steps instead")


HANG_EXIT_CODE = 5  # PeerLost and Watchdog: the job lost a peer; relaunch it to resume


def newest_checkpoint(root: str) -> str:
    """Where a relaunch resumes: the newest finished step directory under `root`, for messages (a
    plain directory listing: it must work while orbax's own threads are blocked)."""
    steps = sorted(int(d) for d in (os.listdir(root) if os.path.isdir(root) else ()) if d.isdigit())
    return os.path.join(root, str(steps[-1])) if steps else f"none yet under {root}"


class PeerLost(RuntimeError):
    """A collective of a multi-process run failed: a peer process died or stopped responding."""

    def __init__(self, step: int, error: BaseException, root: str):
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(f"process {jax.process_index()}: step {step} failed in a collective ({reason}): a peer "
                         f"process died or stopped responding; relaunch the job to resume from the newest "
                         f"intact checkpoint ({newest_checkpoint(root)})")


class Watchdog:
    """Ends a multi-process run whose step or checkpoint save makes no progress for `timeout_s`.

    A peer that hangs (a stopped process, a wedged host) leaves the others waiting in a collective
    or a save barrier; some transports time out (gloo on CPU after 30 s), others wait for ever.
    The loop arms the watchdog before each step after the first (the first compiles) and before
    each save; when an armed deadline passes, a daemon thread prints one line naming the process,
    what it was waiting for and the checkpoint a relaunch resumes from, and exits the process with
    HANG_EXIT_CODE (without running shutdown barriers that would wait on the hung peer too).

        dog = Watchdog(300.0, root)
        dog.arm("step 7")   # ... the step ...
        dog.disarm()
        dog.close()
    """

    POLL_S = 0.5

    def __init__(self, timeout_s: float, root: str, enabled: bool = True):
        self.timeout_s, self.root = float(timeout_s), root
        self.enabled = enabled and self.timeout_s > 0
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        self._stop = threading.Event()
        self._thread = None
        self.on_expire: Callable[[], None] = lambda: None  # called before the process exits (the goodput ledger)
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, name="meshtrain-watchdog", daemon=True)
            self._thread.start()

    def arm(self, what: str) -> None:
        """From now, `what` must finish (the next `arm` or `disarm`) within timeout_s."""
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout_s, what

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.POLL_S):
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if expired:
                print(f"error: process {jax.process_index()}: no progress for {self.timeout_s:g} s in {what} "
                      f"(train.hang_timeout_s): a peer process is hung or dead; relaunch the job to resume from "
                      f"the newest intact checkpoint ({newest_checkpoint(self.root)})", file=sys.stderr, flush=True)
                sys.stdout.flush()
                self.on_expire()
                os._exit(HANG_EXIT_CODE)


class StragglerWatch:
    """Names a process that falls behind its peers (`train.straggler_every`, `train.straggler_factor`).

    Each process adds up the time it takes to get each step's batch, what a slow host, disk or data
    pipeline stretches (its peers then wait in the step's collectives, so step times alone are all
    alike; handing the step to the devices may wait on them too, so it is left out). Every `every`
    steps the processes share their means (`multihost_utils.process_allgather`, at the same step on
    every process); process 0 logs one line naming the slowest process when its mean is above `factor`
    x the median of the others and at least `SIGNIFICANT` of the step. A device slower than its peers shows in
    none of this: `profile.steps` traces it.
    """

    SIGNIFICANT = 0.05  # of the step: what is less is noise, whatever the ratio

    def __init__(self, every: int, factor: float):
        self.every, self.factor = every, factor
        self.enabled = every > 0 and jax.process_count() > 1
        self._names: list[str] | None = None
        self.reset(0)

    def reset(self, step: int) -> None:
        self.host, self.steps, self.since, self.start = 0.0, 0, step, time.perf_counter()

    def add(self, host_seconds: float) -> None:
        self.host += host_seconds
        self.steps += 1

    def check(self, step: int) -> str | None:
        """At a multiple of `every` (every process): the line naming a straggler (logged on process 0),
        else None."""
        if not self.enabled or step % self.every or not self.steps:
            return None
        from jax.experimental import multihost_utils

        wall = (time.perf_counter() - self.start) / self.steps
        shared = np.asarray(multihost_utils.process_allgather(np.array([self.host / self.steps, wall])))
        if self._names is None:
            name = socket.gethostname().encode()[:64].ljust(64, b"\0")
            hosts = np.asarray(multihost_utils.process_allgather(np.frombuffer(name, np.uint8)))
            self._names = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in hosts]
        first = self.since + 1
        self.reset(step)
        host, step_time = shared[:, 0], float(np.median(shared[:, 1]))
        worst = int(np.argmax(host))
        median = float(np.median(np.delete(host, worst)))
        if host[worst] <= self.factor * median or host[worst] - median < self.SIGNIFICANT * step_time:
            return None
        line = (f"straggler: process {worst} (host {self._names[worst]}) took {host[worst] * 1e3:.1f} ms a step to "
                f"get its batch over steps {first}..{step}, {host[worst] / max(median, 1e-9):.1f}x the median "
                f"{median * 1e3:.1f} ms of the other {len(host) - 1} process(es) (train.straggler_factor "
                f"{self.factor:g}); a step took {step_time * 1e3:.0f} ms")
        if jax.process_index() == 0:
            log.warning("%s", line)
        return line


class FiniteGuard:
    """Reads each step's metrics one step late, so the host never waits on the device.

    The train step itself leaves params and optimizer state unchanged when a step is not
    finite, so reading the flag late loses nothing; `check` must run before every save.
    """

    def __init__(self, skip: bool, skipped: int = 0):
        self.skip, self.skipped = skip, skipped
        self._pending: tuple[int, dict] | None = None

    def push(self, step: int, metrics: dict) -> tuple[int, dict, bool] | None:
        """Records step's metrics; returns the previous step's entry, now read (`_read`)."""
        previous, self._pending = self._pending, (step, metrics)
        return self._read(previous)

    def check(self) -> tuple[int, dict, bool] | None:
        """Reads the newest pushed step (before a save or at the end)."""
        pending, self._pending = self._pending, None
        return self._read(pending)

    def discard(self) -> None:
        """Forgets the pushed step unread (it belongs to a trajectory a rollback abandoned)."""
        self._pending = None

    def _read(self, entry) -> tuple[int, dict, bool] | None:
        """(step, metrics, not finite) of a pushed entry, waiting for its step."""
        if entry is None:
            return None
        step, metrics = entry
        nonfinite = bool(float(np.asarray(metrics["nonfinite"])))
        self.skipped += nonfinite
        return step, metrics, nonfinite


class SpikeError(RuntimeError):
    """The loss kept spiking after `train.spike_max_rollbacks` rollbacks."""


class SpikeGuard:
    """Loss-spike guard (`train.spike_*`; off when `spike_factor` is 0).

    Large public runs restart from the last checkpoint before a loss spike and skip the batches
    that caused it (playbook, "Mixed Precision Training" on instabilities; the OPT and PaLM logs).
    A step spikes when its loss exceeds `factor` times the median of the last `window` accepted
    losses (once `min(window, 8)` are known); `steps` spiking steps in a row are a spike: the loop
    rolls back to the newest checkpoint older than the first of them and skips their data rows.
    While a streak is open no checkpoint is written, so the one rolled back to predates it.
    """

    MIN_HISTORY = 8

    def __init__(self, config: ml_collections.ConfigDict):
        t = config.train
        self.factor, self.steps, self.window = float(t.spike_factor), int(t.spike_steps), int(t.spike_window)
        self.max_rollbacks, self.rollbacks = int(t.spike_max_rollbacks), 0
        self.enabled = self.factor > 0
        self.history: dict[int, float] = {}  # step -> loss of accepted steps
        self.streak: list[tuple[int, float]] = []  # (step, loss) of the open streak

    @property
    def active(self) -> bool:
        return bool(self.streak)

    def median(self) -> float | None:
        recent = [self.history[s] for s in sorted(self.history)[-self.window:]]
        return float(np.median(recent)) if len(recent) >= min(self.window, self.MIN_HISTORY) else None

    def observe(self, step: int, loss: float) -> bool:
        """Records a step's loss; True when it completes a spike (a rollback is due)."""
        if not self.enabled or not np.isfinite(loss):
            return False
        median = self.median()
        if median is not None and loss > self.factor * median:
            self.streak.append((step, loss))
            return len(self.streak) >= self.steps
        self.streak.clear()
        self.history[step] = loss
        return False

    def forget_after(self, step: int) -> None:
        """After a rollback to `step`: later losses belong to a trajectory that no longer exists."""
        self.history = {s: v for s, v in self.history.items() if s <= step}
        self.streak.clear()


class RollBack(Exception):
    """Raised by `RunCheckpoints.after_step` when a loss spike is complete; the loop rolls back."""

    def __init__(self, streak: list[tuple[int, float]], median: float):
        self.streak, self.median = list(streak), median
        super().__init__(f"loss spike at steps {streak[0][0]}..{streak[-1][0]}")


def layout_record(config: ml_collections.ConfigDict, data_parallel: int) -> dict:
    """How the run's global batch met its devices, kept in each checkpoint's meta: a restart on another
    number of devices keeps the global batch and the sequences a data-parallel rank takes at once
    (`train.resume_layout`)."""
    accum = int(config.train.grad_accum_steps)
    return {"devices": jax.device_count(), "processes": jax.process_count(), "data_parallel": int(data_parallel),
            "batch_size": int(config.train.batch_size), "grad_accum_steps": accum,
            "micro_batch": int(config.train.batch_size) // (accum * int(data_parallel))}


class RunCheckpoints:
    """Checkpoints, preemption, non-finite steps and loss spikes of one run, as the loop sees them.

        ckpts = RunCheckpoints(config, factory)
        state, start, data_state = ckpts.start(lambda: factory.create(config.seed))
        for step in range(start + 1, config.steps + 1):
            state, metrics = step_fn(state, next(it))
            if ckpts.after_step(step, state, metrics, it.state, last_step=config.steps):
                break  # preempted: saved at `step`
        ckpts.close()
    """

    def __init__(self, config: ml_collections.ConfigDict, factory: StateFactory, watchdog: Watchdog | None = None,
                 injection: faults.Injection = faults.NONE, attention: str = ""):
        """Checkpoints hold the layers in execution order (`StateFactory.to_canonical`); the run's
        state holds them in its schedule's order. `injection`: a fault to inject (`faults`). `attention`:
        the attention implementation the step runs (`attention.impl` resolved), recorded in each
        checkpoint's meta beside the run's description."""
        self.config, self.factory, self.abstract_state = config, factory, factory.canonical
        self.every = int(config.checkpoint.every)
        self.ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_root(config.workdir),
                                            keep=int(config.checkpoint.keep),
                                            async_save=bool(config.checkpoint.async_save))
        self.watchdog = watchdog or Watchdog(0, self.ckpt.root, enabled=False)
        self.local = local_tier.LocalTier(
            config.checkpoint.local_dir or local_tier.default_root(config.workdir), int(config.checkpoint.local_every),
            factory.canonical, local_tier.run_id(config.workdir), injection) if config.checkpoint.local_every else None
        self.guard = FiniteGuard(bool(config.train.skip_nonfinite))
        self.spikes = SpikeGuard(config)
        self.preemption = Preemption()
        self._record = checkpoint.config_record(config)
        self._described = {**run_record.record(config), **({"attention": attention} if attention else {})}
        self.injection = injection
        if injection.point == "save":  # once this process's part of the step is written, before the commit
            self.ckpt.on_written = lambda step: injection.at("save", step)
        self.failed = False  # set by the loop when it ends with an error
        self.ledger: badput.Ledger | None = None  # the wall clock's split: saves count as checkpoint time
        self.layout: dict = {}  # what a restart on another number of devices keeps (`layout_record`)
        self.resumed: int | None = None  # the step restored at start (suspect if the next steps are non-finite)
        self.finite_since_resume = False

    def start(self, create: Callable[[], object]) -> tuple[object, int, dict | None]:
        """(state, steps already done, data iterator state) from the newest checkpoint (the local tier's
        when it is not older than the persistent tier's), else fresh."""
        if self.local:
            local, persistent = self.local.agreed_step(max(self.ckpt.all_steps(), default=None))
            if local is not None and local >= (-1 if persistent is None else persistent):
                self.local.forget_after(local)
                return self._start_local(local)
        restored = checkpoint.resume(self.config, self.ckpt, self.abstract_state)
        if self.local:  # whatever the local tier holds past the step resumed from is another trajectory's
            self.local.forget_after(restored.step if restored is not None else 0)
        if restored is None:
            return create(), 0, None
        if restored.parameters_only:  # imported weights (`hf import --workdir`): the rest starts afresh
            log.info("starting from the parameters of %s (step %d); optimizer state and data order afresh",
                     restored.path, restored.step)
            fresh = self.factory.to_canonical(create())
            return self.factory.from_canonical(dataclasses.replace(fresh, params=restored.params)), restored.step, None
        self.resumed = restored.step
        self.guard.skipped = int(restored.meta.get("skipped_steps", 0))
        self.spikes.rollbacks = int(restored.meta.get("spike_rollbacks", 0))
        log.info("resumed from %s (step %d)", restored.path, restored.step)
        return self.factory.from_canonical(restored.state), restored.step, restored.data_state

    def _start_local(self, step: int) -> tuple[object, int, dict | None]:
        state, data_state, meta, from_peer = self.local.restore(step, self.abstract_state)
        if self.every and step % self.every == 0 and step not in self.ckpt.all_steps():
            # a persistent save of this step died with the process: made whole, as the run would have it
            self.ckpt.save(step, state, data_state, meta)
        self.resumed = step
        self.guard.skipped = int(meta.get("skipped_steps", 0))
        self.spikes.rollbacks = int(meta.get("spike_rollbacks", 0))
        self.ckpt.last_saved = max(self.ckpt.all_steps(), default=None)
        log.info("resumed from the local tier (step %d)", step)
        if from_peer:
            log.warning("process %d: its local copy of step %d is gone; restored from its peer's copy",
                        jax.process_index(), step, extra={"local": True})  # printed by this process
        return self.factory.from_canonical(state), step, data_state

    def after_step(self, step: int, state, metrics: dict, data_state: Callable[[], dict], last_step: int,
                   sync: bool = False) -> bool:
        """Fault checks, preemption and periodic saves after `step`; True when the run must stop now.

        Args:
          sync: the caller already waited for this step (a logged step): check it now.

        Raises:
          NonFiniteError: a non-finite step and `train.skip_nonfinite` off.
          RollBack: a loss spike is complete (the loop restores `rollback_target`).
        """
        self.ckpt.check()  # a save that failed since the last step ends the run now, not at the next save
        self._handle(self.guard.push(step, metrics))
        if sync or self.spikes.enabled and step == last_step:
            self._handle(self.guard.check())
        preempted = self.preemption.reached(step)
        if preempted or step == last_step or (self.every and step % self.every == 0):
            self._handle(self.guard.check())  # nothing non-finite is ever saved
            if self.spikes.active and step != last_step:
                log.warning("step %d: no checkpoint while the loss spikes (since step %d)", step,
                            self.spikes.streak[0][0])
            else:
                self.watchdog.arm(f"the checkpoint save at step {step}")
                if self.ledger:  # the step's own time, then the save's
                    jax.block_until_ready(state)
                    self.ledger.mark("productive")
                self.ckpt.save(step, self.factory.to_canonical(state), data_state(), self.meta(step))
                if self.ledger:
                    self.ledger.mark("checkpoint")
                    self.ledger.saved(step)
        if self.local and self.local.due(step) and not preempted and step != last_step:
            self._handle(self.guard.check())
            if not self.spikes.active:
                self.watchdog.arm(f"the local-tier save at step {step}")
                if self.ledger:
                    jax.block_until_ready(state)
                    self.ledger.mark("productive")
                self.local.save(step, self.factory.to_canonical(state), data_state(), self.meta(step))
                if self.ledger:
                    self.ledger.mark("checkpoint")
        if preempted:
            how = "interrupted (Ctrl-C)" if self.preemption.interrupted else "preempted"
            log.warning("%s: checkpoint saved at step %d; exiting", how, step)
        return preempted

    def meta(self, step: int) -> dict:
        return {"step": step, "seed": int(self.config.seed), "skipped_steps": self.guard.skipped,
                "spike_rollbacks": self.spikes.rollbacks, **self._described, "config": self._record,
                **({"layout": self.layout} if self.layout else {})}

    def _handle(self, entry: tuple[int, dict, bool] | None) -> None:
        if entry is None:
            return
        step, metrics, nonfinite = entry
        if nonfinite:
            loss, grad_norm = float(np.asarray(metrics["loss"])), float(np.asarray(metrics["grad_norm"]))
            if self.guard.skip:
                log.warning("step %d: non-finite loss=%s grad_norm=%s: update skipped (%d skipped so far)",
                            step, loss, grad_norm, self.guard.skipped)
                return
            self.ckpt.wait()
            latest = self.ckpt.latest_step()
            suspect = (self.ckpt.step_path(latest) if latest is not None and latest == self.resumed
                       and not self.finite_since_resume else None)
            raise NonFiniteError(step, loss, grad_norm, self.ckpt.step_path(latest) if latest is not None else None,
                                 suspect)
        self.finite_since_resume = True
        if self.spikes.enabled:
            median = self.spikes.median()
            if self.spikes.observe(step, float(np.asarray(metrics["loss"]))):
                raise RollBack(self.spikes.streak, median)

    def roll_back(self, spike: RollBack, create: Callable[[], object]) -> tuple[object, int, dict | None]:
        """(state, step, data state) of the newest checkpoint older than the spike (the fresh state
        at step 0 when there is none); SpikeError after `train.spike_max_rollbacks` rollbacks."""
        first = spike.streak[0][0]
        self.spikes.rollbacks += 1
        if self.spikes.rollbacks > self.spikes.max_rollbacks:
            raise SpikeError(f"loss spike at steps {first}..{spike.streak[-1][0]} after "
                             f"{self.spikes.max_rollbacks} rollbacks (train.spike_max_rollbacks): the loss keeps "
                             f"exceeding {self.spikes.factor:g} x its running median {spike.median:.4f}; the "
                             f"newest checkpoint is {newest_checkpoint(self.ckpt.root)}")
        self.ckpt.wait()
        older = [s for s in self.ckpt.all_steps() if s < first]
        self.guard.discard()  # the step still pending belongs to the abandoned trajectory
        if not older:
            self.spikes.forget_after(0)
            if self.local:
                self.local.forget_after(0)
            return create(), 0, None
        restored = self.ckpt.restore(self.abstract_state, older[-1])
        if self.local:
            self.local.forget_after(restored.step)
        self.ckpt.last_saved = restored.step
        self.spikes.forget_after(restored.step)
        return self.factory.from_canonical(restored.state), restored.step, restored.data_state

    def close(self) -> None:
        """Waits for the pending save (a finished checkpoint on disk) and restores the SIGTERM handler.

        After a failure in a multi-process run it does not wait: finishing a save needs every
        process, and a peer may be dead (the unfinished checkpoint stays invisible).
        """
        self.preemption.close()
        if self.failed and jax.process_count() > 1:
            return
        self.watchdog.disarm()  # the final save may take long: a peer lost there fails its barrier
        if self.local:
            self.local.wait()
        self.ckpt.close()


# ---------------------------------------------------------------------------------------------
# Evaluation and metric records.
# ---------------------------------------------------------------------------------------------


def make_eval_step(factory: StateFactory, compiler_options: dict[str, str]):
    """Jitted (state, batch) -> (loss_sum, valid tokens): the parameters, and under FP8 the amax
    histories, of the train state (the forward quantises as training does)."""
    def eval_step(state, batch):
        variables = {"params": state.params, **({fp8_lib.COLLECTION: state.fp8} if state.fp8 else {})}
        loss_sum, _ = factory.model.apply(variables, batch, method=factory.model.loss)
        return loss_sum, batch["loss_mask"].sum()
    return jax.jit(eval_step, compiler_options=compiler_options)


def evaluate(run: Run, eval_step, params) -> float:
    """Mean validation loss per token over `config.eval_batches` fixed batches (`params`: the train state)."""
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
        self.it = it
        self.reset()

    def reset(self) -> None:
        self.start, self.steps, self.input_start = time.perf_counter(), 0, self.it.input_seconds()

    def per_step(self) -> tuple[float, float]:
        """(step time, input time) averaged over the window's steps."""
        steps = max(self.steps, 1)
        return (time.perf_counter() - self.start) / steps, (self.it.input_seconds() - self.input_start) / steps


class Loop:
    """One run's step loop: the step function fed by the data iterator, logging every `log_every`
    steps (metrics.jsonl, TensorBoard, the console), evaluating every `eval_every`, sampling every
    `sample_every` (steps of either are logged too), profiling the configured steps,
    checkpointing and stopping on preemption or a non-finite step."""

    def __init__(self, run: Run, factory: StateFactory, *,
                 evaluate_tasks: Callable[[dict], dict[str, float]] | None = None,
                 sample: Callable[[dict], str] | None = None):
        """`evaluate_tasks(params)`: extra evaluation metrics at each `eval_every` step (lm-eval's tasks,
        `evaluate.in_loop`); `sample(params)`: the text logged every `sample_every` steps
        (`sample.in_loop`). Each is required when its config key asks for it."""
        config = run.config
        self.run, self.config = run, config
        if config.eval_every and config.eval_tasks and evaluate_tasks is None:
            raise ValueError("config.eval_tasks is set: Loop needs its evaluate_tasks function")
        if config.sample_every and sample is None:
            raise ValueError("config.sample_every is set: Loop needs its sample function")
        self.evaluate_tasks, self.sample = evaluate_tasks, sample
        self.is_main = jax.process_index() == 0
        self.watchdog = Watchdog(float(config.train.hang_timeout_s), checkpoint.checkpoint_root(config.workdir),
                                 enabled=jax.process_count() > 1)
        self.injection = faults.from_environment()  # MESHTRAIN_INJECT, read once
        self.ckpts = RunCheckpoints(config, factory, self.watchdog, self.injection, run.layout.attention_impl)
        self.ledger = self.ckpts.ledger = badput.Ledger(config.workdir, enabled=self.is_main)
        self.ckpts.layout = layout_record(config, run.data_parallel_size)
        self.watchdog.on_expire = lambda: self.ledger.close("hang")
        self._create: Callable[[], object] | None = None
        self.eval_step = make_eval_step(factory, mesh_lib.compiler_options(run.mesh)) if config.eval_every else None
        self.flops_per_token = metrics_lib.flops_per_token(run.model, config.train.seq_len)
        self.peak = metrics_lib.device_peak_flops(
            fp8_share=metrics_lib.fp8_flops_per_token(run.model) / self.flops_per_token)
        self.tokens_per_step = config.train.batch_size * config.train.seq_len
        self.stragglers = StragglerWatch(int(config.train.straggler_every), float(config.train.straggler_factor))

    def start(self, create: Callable[[], object]) -> tuple[object, int, dict | None]:
        """(state, steps already done, data state): resumed from the newest checkpoint, else `create()`."""
        self._create = create  # a loss-spike rollback with no older checkpoint starts over
        self.ledger.mark("startup")
        state, start, data_state = self.ckpts.start(create)
        self.ledger.mark("restore" if start else "startup")
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

    def train(self, step_fn, state, start: int, it, first_record: dict | None = None) -> dict:
        """Runs steps start+1 .. config.steps; returns the last logged record. `first_record`: fields the
        first record this run writes to metrics.jsonl keeps (what reading the data skipped)."""
        config, dog = self.config, self.watchdog
        writer = metrics_lib.MetricsWriter(config.workdir, enabled=self.is_main)
        tb = tensorboard_lib.TensorBoardWriter(config.workdir, enabled=False)  # opened in the try
        profiler = tensorboard_lib.StepProfiler(config.workdir, tuple(config.profile.steps))
        progress = metrics_lib.Progress(config.steps, start, enabled=self.is_main)
        window, last, evaluated, sampled = _Window(it), {}, False, False
        rows_at: dict[int, int] = {}  # step -> the global row its batch starts at
        skip_to: dict[int, int] = {}  # step -> the row its batch starts at instead (rows of a spike skipped)
        step, first = start, start + 1
        ledger = self.ledger
        ledger.data_seconds = lambda: window.it.input_seconds()
        ledger.mark("startup")
        try:
            writer.truncate_after(start)  # a resume from an older checkpoint: its later records were rolled back
            tb = tensorboard_lib.TensorBoardWriter(config.workdir, enabled=self.is_main)
            with jax.set_mesh(self.run.mesh):
                while step < config.steps:
                    step += 1
                    if step > first:  # the first step compiles: no bound on it
                        dog.arm(f"step {step}")
                    if step in skip_to:
                        it = window.it = _reposition(self.run, it, skip_to.pop(step))
                    rows_at[step] = int(it.state()["next_row"])
                    profiler.before(step)
                    fetching = time.perf_counter()
                    self.injection.at("batch", step)
                    batch = next(it)
                    self.stragglers.add(time.perf_counter() - fetching)
                    state, metrics = step_fn(state, batch)
                    if step == first:  # it compiled, on each process in its own time: not a straggler's sign
                        self.stragglers.reset(step)
                    self.injection.at("step", step)
                    profiler.after(step, metrics)
                    window.steps += 1
                    due_eval = bool(self.eval_step) and step % config.eval_every == 0
                    due_sample = bool(config.sample_every) and step % config.sample_every == 0
                    logged = (step % config.log_every == 0 or step == config.steps or step == first or due_eval
                              or due_sample)
                    if logged:
                        metrics = jax.device_get(metrics)  # waits for the step: timing covers the window
                        ledger.mark("productive")
                        last = self.record(step, metrics, *window.per_step())
                        if due_eval:
                            if not evaluated:  # the first evaluation compiles
                                dog.disarm()
                            last["eval_loss"] = evaluate(self.run, self.eval_step, state)
                            last["eval_perplexity"] = float(np.exp(last["eval_loss"]))
                            if self.evaluate_tasks is not None:  # lm-eval's requests take as long as they take
                                dog.disarm()
                                last.update(self.evaluate_tasks(state.params))
                            evaluated = True
                        if due_sample:
                            if not sampled:  # the first sample compiles
                                dog.disarm()
                            last["sample"] = self.sample(state.params)
                            sampled = True
                        if due_eval or due_sample:
                            ledger.mark("evaluation")
                        if step == first:
                            self._log_first_step(step)
                        last.update(ledger.fields())
                        if first_record:
                            last, first_record = {**last, **first_record}, None
                        writer.write(last)
                        tb.write(last)
                        progress.clear()
                        log.info(format_record(last))
                        if due_sample:
                            log.info("sample at step %d: %r", step, config.sample_prompt + last["sample"])
                        window.reset()
                    progress.update(step, last.get("loss", float("nan")))
                    self.stragglers.check(step)
                    try:
                        if self.ckpts.after_step(step, state, metrics, it.state, config.steps, sync=logged):
                            break  # preempted: saved at this step
                    except RollBack as spike:
                        dog.disarm()
                        ledger.mark("productive")
                        state, step, data_state = self.ckpts.roll_back(spike, self._create)
                        skip_to[spike.streak[0][0]] = rows_at[spike.streak[-1][0]] + config.train.batch_size
                        self._log_rollback(spike, step, rows_at, skip_to)
                        rows_at = {s: r for s, r in rows_at.items() if s <= step}
                        it = window.it = _reposition(self.run, it, None if data_state is None else
                                                     int(data_state["next_row"]))
                        writer.truncate_after(step)
                        self.stragglers.reset(step)
                        ledger.mark("rollback")
                        ledger.rolled_back(step)
                        progress.clear()
                        window.reset()
                    dog.disarm()
        except NonFiniteError as error:
            if last.get("step") != error.step:  # the faulty step's figures reach metrics.jsonl once
                writer.write({"step": error.step, "loss": error.loss, "grad_norm": error.grad_norm, "nonfinite": 1.0})
            raise
        except jax.errors.JaxRuntimeError as error:
            self.ckpts.failed = True
            if jax.process_count() > 1:  # a collective failed: a peer is gone
                ledger.mark("hang")  # the wait for it
                raise PeerLost(step, error, self.ckpts.ckpt.root) from error
            raise
        except BaseException:
            self.ckpts.failed = True  # a multi-process run does not wait on peers that may be dead
            raise
        finally:
            progress.clear()
            it.close()
            writer.close()
            try:
                self.ckpts.close()  # the pending save first: nothing below may keep it from finishing
            finally:
                ledger.close("checkpoint")
                dog.close()
                tb.close()
                profiler.stop()
        return {**last, "skipped_steps": self.ckpts.guard.skipped,
                "spike_rollbacks": self.ckpts.spikes.rollbacks} if last else last

    def _log_first_step(self, step: int) -> None:
        """One line at the first step: its time from the process's start, the compile seconds in it and
        what the persistent compile cache gave (`compile_cache`, `train.compile_cache_dir`)."""
        hits, misses = self.ledger.cache_reads()
        cache = (f"{hits} program(s) read back from the compile cache, {misses} compiled"
                 if hits + misses else "no persistent compile cache")
        log.info("first step (%d) done %.1f s after the process started: compile %.1f s (%s)", step,
                 self.ledger.fields()["wall_s"], self.ledger.parts["compile"], cache)

    def _log_rollback(self, spike: RollBack, restored: int, rows_at: dict[int, int], skip_to: dict[int, int]) -> None:
        first, end = spike.streak[0][0], spike.streak[-1][0]
        losses = ", ".join(f"{loss:.4f}" for _, loss in spike.streak)
        log.warning("loss spike at steps %d..%d (loss %s > %g x running median %.4f): rolled back to %s, "
                    "skipping data rows %d..%d (rollback %d of at most %d)", first, end, losses,
                    self.ckpts.spikes.factor, spike.median,
                    f"step {restored}" if restored else "the initial state", rows_at[first],
                    skip_to[first] - 1, self.ckpts.spikes.rollbacks, self.ckpts.spikes.max_rollbacks)


def _reposition(run: Run, it, next_row: int | None):
    """A fresh train iterator whose next batch starts at global row `next_row` (0 when None)."""
    state = {**it.state(), "next_row": int(next_row or 0)}
    it.close()
    return data.make_iterator(run, "train", state=state)
