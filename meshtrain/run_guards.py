"""What stops or steers a run between its steps: preemption and Ctrl-C, non-finite steps, loss
spikes, a hung or lost peer, a straggling host. The loop (`run_loop.Loop`) and its checkpoint policy
(`run_checkpoints.RunCheckpoints`) use them; each is small enough to test alone.

Numerical faults (playbook, "Mixed Precision Training": low precision can diverge): the train step
withholds an update whose loss or gradient norm is not finite; `FiniteGuard` reads that flag one step
late and the policy stops the run (`NonFiniteError`, the default) or counts the skip
(`train.skip_nonfinite`). `SpikeGuard` finds a loss spike and the loop rolls back (`RollBack`).
Preemption (SIGTERM) finishes the step, saves and stops (`Preemption`; Ctrl-C: `Interrupted`). A
multi-process run whose peer hangs or dies ends with `PeerLost` (a collective failed) or by
`Watchdog` (no progress for `train.hang_timeout_s`), exit code `HANG_EXIT_CODE`; `StragglerWatch`
names a host that falls behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

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
