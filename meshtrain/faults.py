"""Faults injected for real, for tests and `bench/faults.py`: `MESHTRAIN_INJECT=<action>:<point>:<step>[:<process>]`.

    MESHTRAIN_INJECT=stop:step:6:1   # process 1 stops itself (SIGSTOP) once step 6 is dispatched
    MESHTRAIN_INJECT=stop:save:8:1   # ... once its part of checkpoint 8 is being written

The training loop calls `point("step", step)` after dispatching a step and `point("save", step)`
right after a checkpoint save has started. A stopped process holds its sockets and sends no
heartbeats: to its peers it is a hung host, the fault `run_loop.Watchdog` and the collectives'
own timeouts must turn into one clear error. Unset (the default), `point` does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import jax

ENV = "MESHTRAIN_INJECT"
ACTIONS = ("stop",)
POINTS = ("step", "save")


@dataclasses.dataclass(frozen=True)
class Injection:
    action: str
    point: str
    step: int
    process: int | None  # None: every process


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


def point(name: str, step: int) -> None:
    """Carries out the injection configured for (`name`, `step`) on this process, if any."""
    injection = parse(os.environ.get(ENV, ""))
    if injection is None or (injection.point, injection.step) != (name, step):
        return
    if injection.process is not None and injection.process != jax.process_index():
        return
    if injection.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
