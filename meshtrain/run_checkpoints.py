"""When a run saves and what it resumes from: the loop's checkpoint policy over `checkpoint.py`'s
storage and the local tier (`local_tier.py`).

    ckpts = RunCheckpoints(config, factory)
    state, start, data_state = ckpts.start(lambda: factory.create(config.seed))
    ... after each step: ckpts.after_step(step, state, metrics, it.state, last_step=config.steps)

Every `checkpoint.every` steps, at the last step and on preemption it saves (never a non-finite state,
never while a loss spike is open: `run_guards`); every `checkpoint.local_every` steps the local tier
keeps a copy. At start the newest step complete in either tier wins. Each save's meta records the run
(`run_record`), its skipped steps and rollbacks, and how the global batch met the devices
(`layout_record`: a restart on another number of hosts keeps the global batch).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import ml_collections
import numpy as np

from meshtrain import badput, checkpoint, faults, local_tier, run_record
from meshtrain.run_guards import (
    FiniteGuard,
    NonFiniteError,
    Preemption,
    RollBack,
    SpikeError,
    SpikeGuard,
    Watchdog,
    newest_checkpoint,
)

if TYPE_CHECKING:
    from meshtrain.train_step import StateFactory

log = logging.getLogger("meshtrain")


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
