"""What a test run compiled: programs requested, distinct programs, and the seconds spent tracing,
lowering and compiling, summed over the pytest-xdist workers and printed at the end of the run.

Counted in the test processes (a command a test runs in a child process is not: its compiles show
in the cache folder instead). A *request* is one call into XLA's compiler for a program JAX's
in-memory caches did not hold (an eager operation's small program included); a *distinct* program
is one persistent-cache key (`jax._src.cache_key`: the module, the compile options, the XLA flags,
the jaxlib and backend versions, the devices); a *read back* is a request the persistent cache
answered. Deviceless GPU compiles have no JAX cache key: `meshtrain.compile_cache`'s records count
them (`gpu requests`, `gpu distinct`, `gpu read back`).

`--compile-stats FILE` also writes the totals and each test's figures as JSON.
"""

from __future__ import annotations

import collections
import json
import logging

import pytest

_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
              "/jax/core/compile/backend_compile_duration": "compile"}
_HITS = "/jax/compilation_cache/cache_hits"
_JAX_KEY_MESSAGES = ("Persistent compilation cache hit", "PERSISTENT COMPILATION CACHE MISS")
_GPU_LOGGER = "meshtrain.compile_cache"


class _KeyHandler(logging.Handler):
    """Collects the persistent-cache keys JAX's compiler and meshtrain's GPU record cache log (DEBUG)."""

    def __init__(self, stats: CompileStats):
        super().__init__(logging.DEBUG)
        self.stats = stats

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        if record.name == _GPU_LOGGER and isinstance(record.args, tuple) and len(record.args) == 2:
            outcome, key = record.args
            self.stats.gpu_keys.add(key)
            self.stats.add("gpu requests")
            if outcome == "hit":
                self.stats.add("gpu read back")
        elif message.startswith(_JAX_KEY_MESSAGES) and isinstance(record.args, tuple) and len(record.args) == 2:
            self.stats.keys.add(record.args[1])


class CompileStats:
    """A pytest plugin: JAX's monitoring events and cache keys, per test and in total."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.totals: collections.Counter = collections.Counter()
        self.per_test: dict[str, dict[str, float]] = {}
        self.keys: set[str] = set()
        self.gpu_keys: set[str] = set()
        self._handler = _KeyHandler(self)

    def add(self, name: str, value: float = 1) -> None:
        self.totals[name] += value

    # -- listeners -------------------------------------------------------------------------------

    def _duration(self, event: str, duration_secs: float, **_) -> None:
        name = _DURATIONS.get(event)
        if name is not None:
            self.add(f"{name} s", duration_secs)
            if name == "compile":
                self.add("requests")

    def _event(self, event: str, **_) -> None:
        if event == _HITS:
            self.add("read back")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session) -> None:
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        for name in ("jax._src.compiler", _GPU_LOGGER):
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(self._handler)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = dict(self.totals)
        yield
        delta = {k: round(v - before.get(k, 0), 3) for k, v in self.totals.items() if v != before.get(k, 0)}
        if delta:
            self.per_test[item.nodeid] = delta

    # -- across xdist workers ----------------------------------------------------------------------

    def _payload(self) -> dict:
        return {"totals": dict(self.totals), "keys": sorted(self.keys), "gpu_keys": sorted(self.gpu_keys),
                "per_test": self.per_test}

    def pytest_sessionfinish(self, session) -> None:
        if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the figures to the controller
            session.config.workeroutput["compile_stats"] = json.dumps(self._payload())

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        payload = getattr(node, "workeroutput", {}).get("compile_stats")
        if payload:
            data = json.loads(payload)
            self.totals.update(data["totals"])
            self.keys.update(data["keys"])
            self.gpu_keys.update(data["gpu_keys"])
            self.per_test.update(data["per_test"])

    def summary(self) -> str:
        t = self.totals
        line = (f"compiles: {int(t['requests']):,} requested, {len(self.keys):,} distinct, "
                f"{int(t['read back']):,} read back from the persistent cache; seconds: trace "
                f"{t['trace s']:.0f}, lowering {t['lower s']:.0f}, XLA compile (or cache read) {t['compile s']:.0f}")
        if t["gpu requests"]:
            line += (f"; GPU compiles: {int(t['gpu requests']):,} requested, {len(self.gpu_keys):,} distinct, "
                     f"{int(t['gpu read back']):,} read back")
        return line

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workeroutput"):
            return
        terminalreporter.write_line(self.summary())
        path = self.config.getoption("compile_stats")
        if path:
            with open(path, "w") as f:
                json.dump({"summary": self.summary(), "distinct": len(self.keys), "gpu_distinct": len(self.gpu_keys),
                           **self._payload()}, f, indent=1, sort_keys=True)
