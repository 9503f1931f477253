"""What a test run compiled: programs requested, distinct programs, and the seconds spent tracing,
lowering and compiling, summed over the pytest-xdist workers and printed at the end of the run.

Counted in the test processes (a command a test runs in a child process is not: its compiles show
in the cache folder instead). A *request* is one call into XLA's compiler for a program JAX's
in-memory caches did not hold (an eager operation's small program included); a *distinct* program
is one persistent-cache key (`jax._src.cache_key`: the module, the compile options, the XLA flags,
the jaxlib and backend versions, the devices); a *read back* is a request the persistent cache
(or the guard's in-memory copy) answered; *not written* counts the CPU executables the guard keeps off
the disk (their collectives in more than one computation), compiled afresh in every run.
Deviceless GPU compiles have no JAX cache key: `meshtrain.compile_cache`'s record events
count them (`GPU compiles`: requested, distinct, read back).

`--compile-stats FILE` also writes the totals and each test's figures as JSON.
"""

from __future__ import annotations

import collections
import json

import pytest

_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
              "/jax/core/compile/backend_compile_duration": "compile"}
_HITS = "/jax/compilation_cache/cache_hits"


class CompileStats:
    """A pytest plugin: JAX's monitoring events and cache keys, per test and in total."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.totals: collections.Counter = collections.Counter()
        self.per_test: dict[str, dict[str, float]] = {}
        self.keys: set[str] = set()
        self.not_kept_keys: collections.Counter = collections.Counter()  # key -> compiles
        self.gpu_keys: set[str] = set()

    def add(self, name: str, value: float = 1) -> None:
        self.totals[name] += value

    # -- listeners -------------------------------------------------------------------------------

    def _duration(self, event: str, duration_secs: float, **_) -> None:
        name = _DURATIONS.get(event)
        if name is not None:
            self.add(f"{name} s", duration_secs)
            if name == "compile":
                self.add("requests")

    def _event(self, event: str, **kwargs) -> None:
        from meshtrain import compile_cache

        if event == _HITS:
            self.add("read back")
        elif event == compile_cache.NOT_KEPT_EVENT:
            self.add("not kept")
            self.not_kept_keys[kwargs.get("key", "")] += 1
        elif event == compile_cache.RECORD_EVENT:
            self.gpu_keys.add(kwargs["key"])
            self.add("gpu requests")
            if kwargs["outcome"] == "hit":
                self.add("gpu read back")

    def _key_logger(self, original):
        """JAX's `log_persistent_cache_hit` / `_miss`, also recording the key."""
        def log(module_name, cache_key):
            self.keys.add(cache_key)
            return original(module_name, cache_key)
        return log

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session) -> None:
        import jax
        from jax._src import compiler

        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        for name in ("log_persistent_cache_hit", "log_persistent_cache_miss"):  # the keys (a private API:
            if hasattr(compiler, name):  # without it, no distinct count)
                setattr(compiler, name, self._key_logger(getattr(compiler, name)))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = dict(self.totals)
        yield
        delta = {k: round(v - before.get(k, 0), 3) for k, v in self.totals.items() if v != before.get(k, 0)}
        if delta:
            self.per_test[item.nodeid] = delta

    # -- across xdist workers ----------------------------------------------------------------------

    def _payload(self) -> dict:
        return {"totals": dict(self.totals), "keys": sorted(self.keys), "not_kept_keys": dict(self.not_kept_keys),
                "gpu_keys": sorted(self.gpu_keys),
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
            self.not_kept_keys.update(data["not_kept_keys"])
            self.gpu_keys.update(data["gpu_keys"])
            self.per_test.update(data["per_test"])

    def summary(self) -> str:
        t = self.totals
        line = (f"compiles: {int(t['requests']):,} requested, {len(self.keys):,} distinct, "
                f"{int(t['read back']):,} read back from the persistent cache ({int(t['not kept']):,} compiled "
                f"and not written, {len(self.not_kept_keys):,} distinct: collectives in a loop, "
                f"`meshtrain.compile_cache`); seconds: trace "
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
