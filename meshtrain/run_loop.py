"""The training loop: the step function fed by the data iterator, logged, evaluated and sampled on
schedule, checkpointed by its policy (`run_checkpoints`) and guarded (`run_guards`).

    loop = Loop(run, factory, evaluate_tasks=..., sample=...)   # optional: lm-eval tasks, a text sample
    state, start, data_state = loop.start(lambda: factory.create(config.seed))
    last = loop.train(step_fn, state, start, data.make_iterator(run, "train", state=data_state))

A logged step's record goes to metrics.jsonl, TensorBoard and the console (`format_record`; tests and
benchmarks read the console line back with `logged_steps` and `resumed_step`). Checkpoint storage
itself is `checkpoint.py`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np

from meshtrain import (
    badput,
    data,
    faults,
    fp8 as fp8_lib,
    mesh as mesh_lib,
    metrics as metrics_lib,
    tensorboard as tensorboard_lib,
)
from meshtrain.checkpoint import checkpoint_root
from meshtrain.run_checkpoints import RunCheckpoints, layout_record
from meshtrain.run_guards import NonFiniteError, PeerLost, RollBack, StragglerWatch, Watchdog

if TYPE_CHECKING:
    from meshtrain.run import Run
    from meshtrain.train_step import StateFactory

log = logging.getLogger("meshtrain")


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
        self.watchdog = Watchdog(float(config.train.hang_timeout_s), checkpoint_root(config.workdir),
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
        config, dog, ledger = self.config, self.watchdog, self.ledger
        self._writer = metrics_lib.MetricsWriter(config.workdir, enabled=self.is_main)
        self._tb = tensorboard_lib.TensorBoardWriter(config.workdir, enabled=False)  # opened in the try
        profiler = tensorboard_lib.StepProfiler(config.workdir, tuple(config.profile.steps))
        self._progress = metrics_lib.Progress(config.steps, start, enabled=self.is_main)
        self._window, self._first_record = _Window(it), first_record
        self._compiled = set()  # "eval", "sample": compiled already (the first of each has no time bound)
        self._rows_at: dict[int, int] = {}  # step -> the global row its batch starts at
        self._skip_to: dict[int, int] = {}  # step -> the row its batch starts at instead (a spike's rows skipped)
        last: dict = {}
        step, first = start, start + 1
        ledger.data_seconds = lambda: self._window.it.input_seconds()
        ledger.mark("startup")
        try:
            self._writer.truncate_after(start)  # resumed from an older checkpoint: its later records were rolled back
            self._tb = tensorboard_lib.TensorBoardWriter(config.workdir, enabled=self.is_main)
            with jax.set_mesh(self.run.mesh):
                while step < config.steps:
                    step += 1
                    if step > first:  # the first step compiles: no bound on it
                        dog.arm(f"step {step}")
                    if step in self._skip_to:
                        it = self._window.it = _reposition(self.run, it, self._skip_to.pop(step))
                    self._rows_at[step] = int(it.state()["next_row"])
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
                    self._window.steps += 1
                    due_eval = bool(self.eval_step) and step % config.eval_every == 0
                    due_sample = bool(config.sample_every) and step % config.sample_every == 0
                    logged = (step % config.log_every == 0 or step == config.steps or step == first or due_eval
                              or due_sample)
                    if logged:
                        metrics = jax.device_get(metrics)  # waits for the step: timing covers the window
                        last = self._log_step(step, first, state, metrics, due_eval, due_sample)
                    self._progress.update(step, last.get("loss", float("nan")))
                    self.stragglers.check(step)
                    try:
                        if self.ckpts.after_step(step, state, metrics, it.state, config.steps, sync=logged):
                            break  # preempted: saved at this step
                    except RollBack as spike:
                        state, step, it = self._roll_back(spike, it)
                    dog.disarm()
        except NonFiniteError as error:
            if last.get("step") != error.step:  # the faulty step's figures reach metrics.jsonl once
                self._writer.write({"step": error.step, "loss": error.loss, "grad_norm": error.grad_norm,
                                    "nonfinite": 1.0})
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
            self._progress.clear()
            self._window.it.close()
            self._writer.close()
            try:
                self.ckpts.close()  # the pending save first: nothing below may keep it from finishing
            finally:
                ledger.close("checkpoint")
                dog.close()
                self._tb.close()
                profiler.stop()
        return {**last, "skipped_steps": self.ckpts.guard.skipped,
                "spike_rollbacks": self.ckpts.spikes.rollbacks} if last else last

    def _log_step(self, step: int, first: int, state, metrics: dict, due_eval: bool, due_sample: bool) -> dict:
        """A logged step (its metrics on the host): its record, with the evaluation and the sample when
        due, written to metrics.jsonl, TensorBoard and the console; returns the record."""
        ledger, dog = self.ledger, self.watchdog
        ledger.mark("productive")
        record = self.record(step, metrics, *self._window.per_step())
        if due_eval:
            if "eval" not in self._compiled:  # the first evaluation compiles
                dog.disarm()
            record["eval_loss"] = evaluate(self.run, self.eval_step, state)
            record["eval_perplexity"] = float(np.exp(record["eval_loss"]))
            if self.evaluate_tasks is not None:  # lm-eval's requests take as long as they take
                dog.disarm()
                record.update(self.evaluate_tasks(state.params))
            self._compiled.add("eval")
        if due_sample:
            if "sample" not in self._compiled:  # the first sample compiles
                dog.disarm()
            record["sample"] = self.sample(state.params)
            self._compiled.add("sample")
        if due_eval or due_sample:
            ledger.mark("evaluation")
        if step == first:
            self._log_first_step(step)
        record.update(ledger.fields())
        if self._first_record:
            record, self._first_record = {**record, **self._first_record}, None
        self._writer.write(record)
        self._tb.write(record)
        self._progress.clear()
        log.info(format_record(record))
        if due_sample:
            log.info("sample at step %d: %r", step, self.config.sample_prompt + record["sample"])
        self._window.reset()
        return record

    def _roll_back(self, spike: RollBack, it) -> tuple[object, int, object]:
        """(state, step, iterator) after a loss spike: the newest checkpoint before it restored, the data
        rows of the spike's steps skipped when the run reaches them again, the later records dropped."""
        config, ledger = self.config, self.ledger
        self.watchdog.disarm()
        ledger.mark("productive")
        state, step, data_state = self.ckpts.roll_back(spike, self._create)
        self._skip_to[spike.streak[0][0]] = self._rows_at[spike.streak[-1][0]] + config.train.batch_size
        self._log_rollback(spike, step, self._rows_at, self._skip_to)
        self._rows_at = {s: r for s, r in self._rows_at.items() if s <= step}
        it = self._window.it = _reposition(self.run, it, None if data_state is None else int(data_state["next_row"]))
        self._writer.truncate_after(step)
        self.stragglers.reset(step)
        ledger.mark("rollback")
        ledger.rolled_back(step)
        self._progress.clear()
        self._window.reset()
        return state, step, it

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
