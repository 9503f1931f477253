"""Compiled programs kept across runs: a program whose inputs did not change is read back, not compiled.

Two stores under one per-user folder, `$MESHTRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/meshtrain`, else
`~/.cache/meshtrain` (`cache_dir`):

* `jax/`: JAX's persistent compilation cache (`use_jax_cache`), for programs compiled for devices this
  process has (the CPU suite's 8 fake devices, a GPU). The key is JAX's own (`jax._src.cache_key`): a
  hash of the module (without source locations: a moved docstring changes nothing), the compile
  options (meshtrain's per-mesh XLA options included), the XLA flags in `XLA_FLAGS`, the jaxlib
  version, the backend's platform and version, and the devices; any change compiles afresh.
  meshtrain guards JAX's store (`guard_jax_cache`): an entry is written to a temporary name and
  renamed (a process killed mid-write leaves no half entry); an entry that cannot be read back
  (truncated, corrupted) is deleted and rebuilt by the next compile instead of being skipped on every
  lookup; a CPU executable whose collectives sit in more than one computation is neither written nor
  read back (XLA:CPU runs it wrongly once deserialized), only reused as compiled within the process
  that compiled it; each read refreshes the entry's time, and `prune` drops the least recently used
  entries past a size.
* `gpu-aot/`: records of deviceless GPU compiles (`compile`): a program compiled for a GPU that is not
  attached (`meshtrain.aot`'s target devices) cannot be loaded back as an executable, and nothing
  runs it: what is read from it (the compiled module's text and its memory analysis) is the whole
  result. A record's key hashes the lowered module's text, the compile options, `XLA_FLAGS`,
  the target descriptions in `meshtrain/targets/`, the device kind and count, and the versions of
  jax, jaxlib and the CUDA plugin; a compiler error or crash writes nothing, and a record whose
  checksum does not match is compiled again and rewritten.

Playbook, "Profiling" and "Finding the best training configuration": fast feedback on a layout comes
from compiling it; compiling the same program twice teaches nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.metadata
import importlib.resources
import json
import logging
import os
import pathlib
import re
import tempfile
import time
import zlib
from typing import Any

import jax

ENV_VAR = "MESHTRAIN_CACHE_DIR"
DEFAULT_MAX_BYTES = 8 * 2**30  # `prune`'s default size limit for each store
_log = logging.getLogger(__name__)


def cache_dir() -> pathlib.Path:
    """The per-user cache folder: `$MESHTRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/meshtrain`, else
    `~/.cache/meshtrain`."""
    if os.environ.get(ENV_VAR):
        return pathlib.Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "meshtrain"


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    """`data` in `path`, whole or not at all: written to a temporary name beside it, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with _suppressed():
            os.unlink(tmp)
        raise


class _suppressed:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


def prune(directory: pathlib.Path, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Deletes the least recently used files of `directory` (by modification time, which a read
    refreshes) until the rest take at most `max_bytes`; returns the bytes left. Leftover temporary
    files of a killed writer older than an hour go first."""
    if not directory.is_dir():
        return 0
    files, now = [], time.time()
    for path in directory.iterdir():
        with _suppressed():
            stat = path.stat()
            if path.name.startswith(".") and now - stat.st_mtime > 3600:
                path.unlink()
                continue
            if path.is_file():
                files.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        with _suppressed():
            path.unlink()
            total -= size
    return total


# --------------------------------------------------------------------------------------------
# JAX's persistent compilation cache.
# --------------------------------------------------------------------------------------------


class _RepairingStore:
    """JAX's file store, with whole-file writes and unreadable entries deleted (so rebuilt)."""

    def __init__(self, base):
        self._base = base
        self._path = base._path

    def get(self, key: str) -> bytes | None:
        from jax._src import compilation_cache as cc

        value = self._base.get(key)
        if value is None:
            return None
        path = self._path / f"{key}-cache"
        try:
            cc.decompress_executable(value)
        except Exception as error:  # truncated or corrupted: delete it so the compile that follows rewrites it
            _log.warning("compile cache: dropping an unreadable entry %s (%s: %s)", path.name,
                         type(error).__name__, error)
            with _suppressed():
                path.unlink()
            return None
        with _suppressed():
            os.utime(path)  # recently used: `prune` keeps it
        return value

    def put(self, key: str, value: bytes) -> None:
        path = self._path / f"{key}-cache"
        if not path.exists():
            _atomic_write(path, value)

    def clear(self) -> None:
        self._base.clear()


# XLA:CPU (jaxlib 0.10.2 to 0.12.0.1) orders a program's collectives through one shared
# "communicator" resource; an executable deserialized from the cache gets a resource of its own in
# every nested computation (a while loop's body, a conditional's branch, a called computation: XLA's
# WhileThunkFromProto deserializes them with fresh state). A collective inside a loop and one outside
# it are then unordered, devices enter them in different orders, and XLA aborts the process after its
# 40-s rendezvous timeout. Measured on 8 fake CPU devices: the gpipe and circular pipeline steps
# (stage 2 x data 4) on every read back; a tensor 2 x data 4 step in the training loop now and then.
# Compiled afresh, all of them run. So on the CPU an executable whose collectives sit in more than
# one computation is never written, and one read back is dropped and compiled again.
_COLLECTIVE = re.compile(r"= [^=]*\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|"
                         r"collective-broadcast|ragged-all-to-all)(-start)?\(")


NOT_KEPT_EVENT = "/meshtrain/compile_cache/not_kept"  # a jax.monitoring event per executable not written


def collective_computations(hlo_text: str) -> int:
    """How many computations of a compiled HLO module's text hold a collective."""
    count, holds = 0, False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):  # a computation's header
            count, holds = count + holds, False
        elif _COLLECTIVE.search(line):
            holds = True
    return count + holds


def readable_back(executable) -> bool:
    """Whether XLA:CPU runs this executable correctly once deserialized: its collectives, if any, all
    in one computation."""
    try:
        modules = executable.hlo_modules()
    except Exception:  # noqa: BLE001 - no module to look at: not safe to assume
        return False
    return all(collective_computations(m.to_string()) <= 1 for m in modules)


# The executables not written, as compiled (never deserialized), for a later request of the same
# program in this process: key -> (executable, compile seconds), the most recent `_KEPT_IN_MEMORY`.
_in_memory: collections.OrderedDict = collections.OrderedDict()
_KEPT_IN_MEMORY = 16


def _guarded_put(original):
    def put_executable_and_time(cache_key, module_name, executable, backend, compile_time):
        if backend.platform == "cpu" and not readable_back(executable):
            jax.monitoring.record_event(NOT_KEPT_EVENT, key=cache_key)
            _in_memory[cache_key] = (executable, compile_time)
            while len(_in_memory) > _KEPT_IN_MEMORY:
                _in_memory.popitem(last=False)
            return None  # compiled again in another process rather than read back into a deadlock
        return original(cache_key, module_name, executable, backend, compile_time)
    put_executable_and_time.meshtrain_guard = True
    return put_executable_and_time


def _guarded_get(original):
    # jax 0.10.2: (cache_key, compile_options, backend, executable_devices); later versions add arguments
    def get_executable_and_time(cache_key, compile_options, backend, *args, **kwargs):
        if cache_key in _in_memory:  # the same program compiled earlier in this process, never serialized
            _in_memory.move_to_end(cache_key)
            return _in_memory[cache_key]
        executable, seconds = original(cache_key, compile_options, backend, *args, **kwargs)
        if executable is not None and backend.platform == "cpu" and not readable_back(executable):
            _log.warning("compile cache: %s was written by a process without meshtrain's guard and would not "
                         "run correctly read back; compiling it instead", cache_key.split("-")[0])
            return None, None
        return executable, seconds
    get_executable_and_time.meshtrain_guard = True
    return get_executable_and_time


def guard_jax_cache() -> None:
    """Makes JAX's persistent cache, where this process has one (`jax_compilation_cache_dir`, e.g.
    from JAX_COMPILATION_CACHE_DIR), safe: whole-file writes, unreadable entries rebuilt, and no CPU
    executable read back that XLA would run wrongly (above). Every meshtrain command calls it
    (`cli.parse_flags`); idempotent."""
    from jax._src import compilation_cache as cc

    if not jax.config.jax_compilation_cache_dir:
        return
    try:
        if not getattr(cc.put_executable_and_time, "meshtrain_guard", False):
            cc.put_executable_and_time = _guarded_put(cc.put_executable_and_time)
        if not getattr(cc.get_executable_and_time, "meshtrain_guard", False):
            cc.get_executable_and_time = _guarded_get(cc.get_executable_and_time)
        cc._initialize_cache()  # JAX builds its store lazily: now, to wrap it
        if getattr(cc, "_cache", None) is not None and not isinstance(cc._cache, _RepairingStore) \
                and hasattr(cc._cache, "_path"):
            cc._cache = _RepairingStore(cc._cache)
    except AttributeError as error:  # a JAX whose cache module differs: no cache rather than an unsafe one
        _log.warning("compile cache: off (JAX's cache module is not the one meshtrain guards: %s)", error)
        jax.config.update("jax_enable_compilation_cache", False)


def use_jax_cache(directory: pathlib.Path | None = None) -> pathlib.Path:
    """JAX's persistent compilation cache in `directory` (default `cache_dir() / "jax"`) for this
    process, every program cached however quickly it compiled, guarded (`guard_jax_cache`); returns
    the folder. Child processes get the same through `jax_cache_env`."""
    from jax._src import compilation_cache as cc

    directory = pathlib.Path(directory or cache_dir() / "jax")
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.reset_cache()
    guard_jax_cache()
    return directory


def use_for_run(setting: str) -> str:
    """The persistent cache a training run uses (`train.compile_cache_dir`): "off" none (JAX's cache
    turned off for this process); "" the one this process has already (JAX_COMPILATION_CACHE_DIR, a
    test's), else the per-user folder; else that folder. Returns the folder, or "" when off."""
    if setting == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return ""
    if not setting and jax.config.jax_compilation_cache_dir:
        guard_jax_cache()
        return str(jax.config.jax_compilation_cache_dir)
    return str(use_jax_cache(pathlib.Path(os.path.expanduser(setting)) if setting else None))


def jax_cache_env(directory: pathlib.Path) -> dict[str, str]:
    """Environment variables that give a child process the same persistent cache."""
    return {"JAX_COMPILATION_CACHE_DIR": str(directory), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


# --------------------------------------------------------------------------------------------
# Records of deviceless GPU compiles.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """The fields of XLA's memory analysis that meshtrain reads (per device, bytes)."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    generated_code_size_in_bytes: int = 0


@dataclasses.dataclass
class CompiledRecord:
    """What a deviceless compile gives: the compiled module's text and XLA's memory analysis. Reads
    like a `jax.stages.Compiled` for `as_text` and `memory_analysis`; nothing can run it."""

    text: str
    memory: MemoryAnalysis
    compile_seconds: float  # of the compile that made the record
    from_cache: bool = False

    def as_text(self) -> str:
        return self.text

    def memory_analysis(self) -> MemoryAnalysis:
        return self.memory

    @classmethod
    def of(cls, compiled, seconds: float) -> CompiledRecord:
        stats = compiled.memory_analysis()
        memory = MemoryAnalysis(**{f.name: int(getattr(stats, f.name, 0) or 0)
                                   for f in dataclasses.fields(MemoryAnalysis)})
        return cls(compiled.as_text(), memory, seconds)

    def to_bytes(self) -> bytes:
        meta = json.dumps({"memory": dataclasses.asdict(self.memory),
                           "compile_seconds": self.compile_seconds}).encode()
        payload = zlib.compress(len(meta).to_bytes(8, "big") + meta + self.text.encode(), 6)
        return hashlib.sha256(payload).digest() + payload

    @classmethod
    def from_bytes(cls, data: bytes) -> CompiledRecord:
        """Raises ValueError for a record that is truncated or corrupted."""
        digest, payload = data[:32], data[32:]
        if len(data) < 32 or hashlib.sha256(payload).digest() != digest:
            raise ValueError("checksum mismatch")
        raw = zlib.decompress(payload)
        n = int.from_bytes(raw[:8], "big")
        meta = json.loads(raw[8:8 + n])
        return cls(raw[8 + n:].decode(), MemoryAnalysis(**meta["memory"]), meta["compile_seconds"], from_cache=True)


_records_dir: pathlib.Path | None = None
# A `jax.monitoring` event for each record looked up, with outcome="hit" or "miss" and the key
# (tests/compile_stats.py counts them).
RECORD_EVENT = "/meshtrain/compile_cache/gpu_record"


def use_records(directory: pathlib.Path | None) -> None:
    """Keep deviceless compiles' records in `directory` (None: compile every time, keep nothing)."""
    global _records_dir
    _records_dir = None if directory is None else pathlib.Path(directory)


def records_dir() -> pathlib.Path | None:
    """Where deviceless compiles' records are kept now (None: nowhere)."""
    return _records_dir


def records_default() -> pathlib.Path:
    """The records' folder in the per-user cache folder."""
    return cache_dir() / "gpu-aot"


def _versions() -> str:
    out = []
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt"):
        try:
            out.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ",".join(out)


def _targets() -> str:
    files = importlib.resources.files("meshtrain.targets")
    return "".join(sorted(p.read_text() for p in files.iterdir() if p.name.endswith(".txtpb")))


def compile_options_of(lowered) -> tuple | None:
    """The compile options a `jax.stages.Lowered` carries (`jax.jit(..., compiler_options=...)`), or
    None where this JAX keeps them elsewhere (then no record is kept: a key without them could
    return another program's compile)."""
    options = getattr(getattr(lowered, "_lowering", None), "_compiler_options_kvs", None)
    return None if options is None else tuple(sorted((str(k), repr(v)) for k, v in options))


def record_key(lowered, devices: list) -> str | None:
    """The record's key (hex), or None when the compile options cannot be read."""
    options = compile_options_of(lowered)
    if options is None:
        return None
    h = hashlib.sha256()
    for part in (lowered.as_text(), repr(options), os.environ.get("XLA_FLAGS", ""), _targets(), _versions(),
                 devices[0].device_kind, str(len(devices)),
                 repr(sorted({d.process_index for d in devices}))):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def is_attached(device: jax.Device) -> bool:
    """Whether `device` belongs to a backend this process runs (else: a deviceless target's)."""
    try:
        return device in jax.devices(device.platform)
    except RuntimeError:
        return False


def compile(lowered, devices: list) -> Any:
    """`lowered` compiled. For devices this process has: the `jax.stages.Compiled` (JAX's persistent
    cache applies). For a target's devices with records on (`use_records`): a `CompiledRecord`, read
    back when one with the same key exists, else compiled and kept; with records off, compiled into a
    `CompiledRecord` all the same, so that every caller reads the same kind of result."""
    if is_attached(devices[0]):
        return lowered.compile()
    directory = _records_dir
    key = record_key(lowered, devices) if directory is not None else None
    path = directory / f"{key}.rec" if key else None
    if path is not None and path.exists():
        try:
            record = CompiledRecord.from_bytes(path.read_bytes())
            with _suppressed():
                os.utime(path)
            jax.monitoring.record_event(RECORD_EVENT, outcome="hit", key=key)
            return record
        except (ValueError, zlib.error, json.JSONDecodeError, KeyError, UnicodeDecodeError) as error:
            _log.warning("compile cache: recompiling over an unreadable record %s (%s)", path.name, error)
    start = time.perf_counter()
    record = CompiledRecord.of(lowered.compile(), time.perf_counter() - start)
    if path is not None:
        jax.monitoring.record_event(RECORD_EVENT, outcome="miss", key=key)
        _atomic_write(path, record.to_bytes())
    return record
