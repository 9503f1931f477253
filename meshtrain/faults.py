"""Faults injected for real, for tests and `bench/faults.py`: `MESHTRAIN_INJECT=<action>:<point>:<step>[:<process>]`.

    MESHTRAIN_INJECT=stop:step:6:1   # process 1 stops itself (SIGSTOP) once step 6 is dispatched
    MESHTRAIN_INJECT=stop:save:8:1   # ... once its part of checkpoint 8 is written, before the commit
    MESHTRAIN_INJECT=slow:batch:3:1  # process 1 waits SLOW_S before fetching each batch from step 3 on
    MESHTRAIN_INJECT=stop:local:8    # every process stops in its local-tier save of step 8, data written

The training loop reads the variable once (`from_environment`), calls the injection's
`at("batch", step)` before fetching each step's batch and `at("step", step)` after dispatching the
step, and the local tier `at("local", step)` once a step's data file is written, before its record;
the checkpointer calls `at("save", step)` from the save's background thread once this
process's files of the step are written (and checksummed), before the barrier that precedes the
commit: its peers find it hung in the middle of a save (the step's files are complete; whether the
step is committed once the launcher kills the stopped process is up to orbax's barrier, and the run
names whichever checkpoint is newest and intact). A stopped process holds its sockets and sends no
heartbeats: to its peers it is a hung host, the fault `run_guards.Watchdog` and the collectives' own
timeouts must turn into one clear error. A slow one (`slow`, from its step on, every step) is a
host that falls behind its peers: what `train.straggler_every` names.
Unset (the default), nothing happens (`NONE`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import jax

ENV = "MESHTRAIN_INJECT"
ACTIONS = ("stop", "slow")
POINTS = ("step", "save", "batch", "local")
SLOW_S = 0.25  # `slow`: seconds a step


@dataclasses.dataclass(frozen=True)
class Injection:
    action: str
    point: str
    step: int
    process: int | None  # None: every process

    def at(self, point: str, step: int) -> None:
        """Carries out the injection if it is meant for (`point`, `step`) on this process."""
        if self.point != point or (step < self.step if self.action == "slow" else step != self.step):
            return
        if self.process is not None and self.process != jax.process_index():
            return
        if self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "slow":
            time.sleep(SLOW_S)


NONE = Injection("", "", -1, None)  # nothing injected


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (an injected `stop` took effect), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def from_environment() -> Injection:
    """The injection `MESHTRAIN_INJECT` configures, parsed once (`NONE` when unset); ValueError if malformed."""
    return parse(os.environ.get(ENV, "")) or NONE


def parse(spec: str) -> Injection | None:
    """The injection `spec` describes (None for ""); ValueError naming the rule otherwise."""
    if not spec:
        return None
    parts = spec.split(":")
    rule = f"{ENV}={spec!r}: must be <action>:<point>:<step>[:<process>] with action in {ACTIONS}, point in {POINTS}"
    if len(parts) not in (3, 4) or parts[0] not in ACTIONS or parts[1] not in POINTS:
        raise ValueError(rule)
    try:
        numbers = [int(p) for p in parts[2:]]
    except ValueError:
        raise ValueError(rule) from None
    return Injection(parts[0], parts[1], numbers[0], numbers[1] if len(numbers) > 1 else None)
