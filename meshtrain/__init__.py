"""meshtrain: LLM training on one six-axis JAX device mesh."""

import atexit as _atexit

# Callables run at the interpreter's exit after the exit handlers of every module imported later (JAX's
# included: handlers run last-registered first), by name: the newest run's `badput.Ledger` times its
# shutdown to here.
LAST_AT_EXIT: dict = {}
_atexit.register(lambda: [f() for f in list(LAST_AT_EXIT.values())])
