"""Checkpoint storage: save the train state, restore it onto any mesh, exactly.

Playbook, "ZeRO (Zero Redundancy Optimizer)" and "5D parallelism in a nutshell": the train
state rests sharded over the mesh (optimizer state, gradients and parameters split over
the data-parallel ranks), so a checkpoint is written shard by shard by every process
(orbax over tensorstore) and read back into whatever shardings the *new* run asks for. A checkpoint saved on
`fsdp=8` restores onto `data=2, fsdp=2, tensor=2` or onto 4 devices because the restore
target is the new run's abstract state (`jax.ShapeDtypeStruct`s carrying the new
`NamedSharding`s), never the saved layout.

Layout of `<workdir>/checkpoints/<step>/` (one orbax `CheckpointManager`, one handler per item):

* `state`: the `TrainState` arrays (step, params, optimizer state), orbax's PyTree handler
  (tensorstore, OCDBT); the run has no other random state: initialisation and the data
  order derive from `config.seed`, stored in `meta`.
* `data`: the data iterator position, JSON (`DataIterator.state()`).
* `meta`: JSON: the run's model and tokenizer (`run_record.record`: what the commands that read
  the run adopt), the resolved config (for the record), the seed, and the count of skipped
  non-finite steps. A parameters-only checkpoint (`python -m meshtrain.hf import --workdir`) says
  so (`parameters_only`): its `state` holds the parameters alone, and a run resuming from it starts
  its optimizer state afresh.

When to save is the loop's policy (`run_checkpoints.py`); preemption and the non-finite guard are `run_guards.py`.

Saves are asynchronous by default: the step loop waits only for the device-to-host copy;
orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoints intact and the partial one invisible.

Content check. Orbax makes a save atomic but does not check what it reads back. Before a save is
committed (renamed into place), each process writes `<step>/checksums/process_<i>.json`: the size
and CRC-32 of every file it wrote (its `ocdbt.process_<i>` shards and array metadata; process 0
also the shared metadata and JSON items). A restore first checks every file against them, so a
truncated or missing file, a flipped byte or a garbled metadata file is caught before any array
is read (`CheckpointDamaged`, naming the step, the file and what is wrong). Resuming then falls
back to the newest intact checkpoint and moves the damaged one aside to `<root>.damaged/<step>`
(nothing is deleted, and the keep policy never counts it); `checkpoint.restore_from` naming a
damaged step stops with that error. A checkpoint without checksums (a synchronous save killed
between its commit and its checksums) is restored unverified, with a warning; orbax's own errors
on reading it count as damage too.

State a run may start afresh (`RESTARTABLE`): the FP8 amax histories. A checkpoint without them
(written before they were part of the train state, or by a bf16 run) or with another history length
restores everything else exactly and the histories start empty, as a new run's do; a bf16 run leaves
an FP8 run's histories unread. So `model.matmul_precision` may change between a run and its resume.

Safety: restoring reads tensorstore arrays and JSON only (no pickle, no imported code);
paths are resolved with `os.path.realpath`, and a step directory that resolves outside
its checkpoint root (a symlink planted in the directory) is refused.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from meshtrain import checksums, config as config_lib, durable

CHECKPOINT_SUBDIR = "checkpoints"
CHECKSUMS_SUBDIR = "checksums"
log = logging.getLogger("meshtrain")


class _OrbaxNoise(logging.Filter):
    """Drops orbax's warning that the checksums folder is an item it was not asked to restore, and the
    tracebacks its save threads log when a write fails: the run reports that failure once, in one line
    (`CheckpointSaveError`), and stops."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if f'Item "{CHECKSUMS_SUBDIR}" was found in the checkpoint' in message:
            return False
        failed = "raised an exception" in message or "Failed to" in message or record.exc_info
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname and failed)


logging.getLogger("absl").addFilter(_OrbaxNoise())


def quiet_failed_save_threads() -> None:
    """After a failed asynchronous save, tensorstore's writes still in flight call back into an event loop
    orbax has closed, and each prints "RuntimeError: Event loop is closed" with its traceback (through
    `sys.excepthook` or `sys.unraisablehook`). The commands that train install this once: those
    tracebacks are dropped, every other exception is printed as before; the failure itself is
    reported once (`CheckpointSaveError`)."""
    previous, previous_unraisable = sys.excepthook, sys.unraisablehook

    def closed_loop(value) -> bool:
        return type(value) is RuntimeError and str(value) == "Event loop is closed"

    def hook(kind, value, tb):
        if not closed_loop(value):
            previous(kind, value, tb)

    def unraisable(info):
        if not closed_loop(info.exc_value):
            previous_unraisable(info)

    sys.excepthook, sys.unraisablehook = hook, unraisable


class CheckpointDamaged(Exception):
    """A checkpoint whose files do not match their checksums, or that orbax cannot read."""

    def __init__(self, step: int, path: str, problems: list[str]):
        self.step, self.path, self.problems = step, path, problems
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        super().__init__(f"checkpoint step {step} at {path!r} is damaged: {shown}")


class CheckpointSaveError(RuntimeError):
    """A save that could not be written (a full disk, a lost mount): the run stops."""

    def __init__(self, step: int | None, root: str, error: BaseException, newest: int | None):
        self.step, self.newest = step, newest
        detail = " ".join(str(error).split())
        detail = re.sub(r" ?\[tensorstore_spec='.*?'\]", "", detail)  # a kilobyte of driver settings
        code = re.search(r"os_error_code='(\d+)'", detail)
        if len(detail) > 400:
            detail = f"{detail[:220]} ... {detail[-160:]}"
        if code and os.strerror(int(code.group(1))) not in detail:  # the reason, whatever was cut
            detail = f"{detail}; {os.strerror(int(code.group(1)))}"
        kept = f"the newest finished checkpoint, step {newest}, is intact" if newest is not None else \
            "no checkpoint was finished before it"
        super().__init__(f"checkpoint save of step {step} in {root!r} failed ({type(error).__name__}: {detail}); "
                         f"{kept} and nothing of the failed save looks finished; free space (or fix the "
                         f"directory) and relaunch to resume")


def _owner(rel: str) -> int:
    """The process that wrote a checkpoint file: its `ocdbt.process_<i>` shards and array metadata
    are its own; the shared metadata and JSON items are process 0's."""
    m = re.search(r"(?:ocdbt\.process_|array_metadatas/process_)(\d+)", rel.replace(os.sep, "/"))
    return int(m.group(1)) if m else 0


_TEMPORARY = re.compile(r"\.orbax-checkpoint-tmp[^/\\]*")

# written or rewritten by orbax as it commits the step, after the checksums
_REWRITTEN_AT_COMMIT = ("commit_success.txt", "_CHECKPOINT_METADATA")


def write_checksums(step_dir: str, process: int) -> dict:
    """Writes `<step_dir>/checksums/process_<process>.json`: {relative path: [size, crc32]} of the
    files this process wrote (not orbax's commit records, which it writes as it commits)."""
    entries = {}
    for dirpath, dirnames, files in os.walk(step_dir):
        dirnames[:] = [d for d in dirnames if d != CHECKSUMS_SUBDIR]
        for name in files:
            full = os.path.join(dirpath, name)
            # a path as it will be once committed: orbax may write an item in a temporary directory too
            rel = _TEMPORARY.sub("", os.path.relpath(full, step_dir))
            if name in _REWRITTEN_AT_COMMIT or _owner(rel) != process:
                continue
            entries[rel] = list(checksums.size_and_crc32(full))
    durable.write_json(os.path.join(step_dir, CHECKSUMS_SUBDIR, f"process_{process}.json"), {"crc32": entries})
    return entries


def verify_checksums(step_dir: str) -> list[str] | None:
    """What is wrong with the files of `step_dir` against its checksums ([] if nothing), or None
    when it has no checksums."""
    manifests = sorted(glob.glob(os.path.join(step_dir, CHECKSUMS_SUBDIR, "process_*.json")))
    if not manifests:
        return None
    problems = [f"files of process {owner} have no checksum file (checksums/process_{owner}.json)"
                for owner in sorted(_writers(step_dir) - {_manifest_process(m) for m in manifests})]
    for manifest in manifests:
        try:
            with open(manifest) as f:
                entries = json.load(f)["crc32"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            problems.append(f"checksum file {os.path.relpath(manifest, step_dir)} is unreadable ({error})")
            continue
        problems += checksums.mismatches(step_dir, entries)
    return problems


def _manifest_process(manifest: str) -> int:
    return int(re.search(r"process_(\d+)\.json$", manifest).group(1))


def _writers(step_dir: str) -> set[int]:
    """The processes whose shards a step holds (`ocdbt.process_<i>` directories)."""
    found = set()
    for _, dirnames, _ in os.walk(step_dir):
        found |= {int(m.group(1)) for d in dirnames if (m := re.fullmatch(r"ocdbt\.process_(\d+)", d))}
    return found


def checkpoint_root(workdir: str) -> str:
    """`<workdir>/checkpoints`, resolved to an absolute path without symlinks."""
    return os.path.join(os.path.realpath(os.path.expanduser(workdir)), CHECKPOINT_SUBDIR)


class Unverified(ValueError):
    """A checkpoint without checksums, which the run does not trust (`checkpoint.trust_unverified`)."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path
        super().__init__(f"checkpoint step {step} at {path} has no checksums (a save stopped between its commit and "
                         "its checksums): nothing shows whether its files are intact; set "
                         "config.checkpoint.trust_unverified=True to restore it anyway (a non-finite loss right "
                         "after will name it)")


@dataclasses.dataclass
class Restored:
    """What a checkpoint gives back to a run."""

    step: int
    state: object  # TrainState in the new run's shardings; None when only parameters were read
    data_state: dict
    meta: dict
    path: str
    params: object = None  # the parameters alone (`restore_params`; a parameters-only checkpoint)

    @property
    def parameters_only(self) -> bool:
        return self.state is None


class Checkpointer:
    """One orbax `CheckpointManager` over a checkpoint root, with the three items above.

    Args:
      root: the checkpoint root (`checkpoint_root(workdir)` or another run's root).
      keep: number of finished checkpoints kept (`checkpoint.keep`, >= 1).
      async_save: write in a background thread (`checkpoint.async_save`).
      read_only: open another run's checkpoints for restoring only (`checkpoint.restore_from`).
    """

    def __init__(self, root: str, *, keep: int = 2, async_save: bool = True, read_only: bool = False):
        if keep < 1:
            raise ValueError(f"keep={keep!r}: must be >= 1 (a run must always have a finished checkpoint)")
        self.root = os.path.realpath(os.path.expanduser(root))
        if read_only and not os.path.isdir(self.root):
            raise ValueError(f"checkpoint directory {self.root!r}: does not exist")
        self._async, self._saving, self.save_error = async_save, None, None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, enable_async_checkpointing=async_save,
            create=not read_only, read_only=read_only, save_interval_steps=1,
            cleanup_tmp_directories=not read_only,  # leftovers of a process killed mid-save
            # checksums go into the step's temporary directory, before orbax commits it by renaming
            async_options=ocp.AsyncOptions(post_finalization_callback=self._checksum_pending) if async_save else None)
        # called on every process with the step once its own writes of that step are finished, before
        # the barrier that precedes the commit (fault injection: `faults`)
        self.on_written: Callable[[int], None] | None = None
        handlers = {"state": _state_handler(self._written), "data": ocp.JsonCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.root, options=options, item_handlers=handlers)
        self.last_saved: int | None = self.latest_step()

    def _written(self) -> None:
        if self.on_written is not None:
            self.on_written(self._saving)

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step (unfinished saves are not listed), or None."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def step_path(self, step: int) -> str:
        """The step's directory; refuses one that resolves outside the root."""
        path = os.path.join(self.root, str(int(step)))
        if os.path.dirname(os.path.realpath(path)) != self.root:
            raise ValueError(f"checkpoint step directory {path!r} resolves to {os.path.realpath(path)!r}, "
                             f"outside the checkpoint root {self.root!r}: refusing to read it")
        return path

    def save(self, step: int, state, data_state: dict, meta: dict) -> bool:
        """Starts saving `state` at `step` (returns once the arrays are copied to the host)."""
        if self.last_saved is not None and step <= self.last_saved:
            return False
        self.wait()  # the previous save (its error surfaces here; its checksums name its own step)
        self._saving = step
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta)), force=True)
            if saved and not self._async:  # committed already: checksum it in place
                self._checksum_pending()
        except Exception as error:  # noqa: BLE001 (tensorstore, OS and orbax errors alike)
            raise self._failed(step, error) from error
        if saved:
            self.last_saved = step
        return saved

    def check(self) -> None:
        """Raises CheckpointSaveError at once when the save in flight has failed (the run calls this
        after every step: it stops at the step after a failed write, not at the next save)."""
        if self._saving is None or not self._async:
            return
        try:
            self._manager.check_for_errors()
        except Exception as error:  # noqa: BLE001
            raise self._failed(self._saving, error) from error

    def _failed(self, step: int | None, error: BaseException) -> CheckpointSaveError:
        self.save_error = CheckpointSaveError(step, self.root, error, self.latest_step())
        return self.save_error

    def _checksum_pending(self) -> None:
        """The checksums of the save in flight, in its directory (temporary until orbax commits it)."""
        step = self._saving
        candidates = [d for d in glob.glob(os.path.join(self.root, f"{step}.orbax-checkpoint-tmp*")) + [
            os.path.join(self.root, str(step))] if os.path.isdir(d)]
        if step is None or not candidates:
            log.warning("checkpoint step %s: no directory to checksum; it will restore unverified", step)
            return
        write_checksums(candidates[0], jax.process_index())

    def verify(self, step: int) -> list[str] | None:
        """Problems of checkpoint `step` against its checksums ([]: intact; None: no checksums)."""
        return verify_checksums(self.step_path(step))

    def set_aside(self, step: int) -> str:
        """Moves a damaged checkpoint to `<root>.damaged/<step>[.n]` (process 0; every process waits):
        out of the run's checkpoints and its keep policy, nothing deleted. Returns the new path."""
        target = os.path.join(self.root + ".damaged", str(step))
        n = 0
        while os.path.exists(target if n == 0 else f"{target}.{n}"):
            n += 1
        target = target if n == 0 else f"{target}.{n}"
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.move(self.step_path(step), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"meshtrain: checkpoint {step} set aside")
        self.last_saved = self.latest_step()
        return target

    def restore(self, abstract_state, step: int | None = None, *, trust_unverified: bool = True) -> Restored:
        """Reads checkpoint `step` (default: the newest finished one) into `abstract_state`'s shardings.

        Args:
          abstract_state: a pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` of the
            *current* run (e.g. `StateFactory.abstract`); the arrays come back in those shardings.
          step: which checkpoint; None for the newest.
          trust_unverified: restore a checkpoint that has no checksums (with a warning); else
            `Unverified` is raised.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise ValueError(f"checkpoint directory {self.root!r}: holds no finished checkpoint")
            step = steps[-1]
        if step not in steps:
            raise ValueError(f"checkpoint step={step!r}: not a finished checkpoint in {self.root!r} "
                             f"(finished: {steps})")
        path = self.step_path(step)
        problems = self.verify(step)
        if problems:
            raise CheckpointDamaged(step, path, problems)
        if problems is None:
            if not trust_unverified:
                raise Unverified(step, path)
            log.warning("checkpoint step %d at %s has no checksums: restoring it unverified", step, path)
        try:
            metadata = self._manager.item_metadata(step)["state"]
        except Exception as error:  # noqa: BLE001 (orbax raises many kinds on unreadable metadata)
            raise CheckpointDamaged(step, path, [f"orbax cannot read its metadata ({type(error).__name__}: "
                                                 f"{error})"]) from error
        target, fresh = _restore_target(abstract_state, metadata, path)
        _check_shapes(target, metadata, path)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(
                    target), partial_restore=target is not abstract_state), data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore()))
        except Exception as error:  # noqa: BLE001
            raise CheckpointDamaged(step, path, [f"orbax cannot read it ({type(error).__name__}: {error})"]) from error
        state = restored["state"]
        if target is not abstract_state:
            state = dataclasses.replace(abstract_state, **state, **{name: jax.tree.map(_zeros, part)
                                                                  for name, part in fresh.items()})
        return Restored(step=step, state=state, data_state=dict(restored["data"]),
                        meta=dict(restored["meta"]), path=path)

    def meta(self, step: int) -> dict:
        """Checkpoint `step`'s meta JSON, read as a file (nothing else of the checkpoint).

        Raises CheckpointDamaged when the file is missing or not JSON (a damaged step, like a bad checksum).
        """
        path = os.path.join(self.step_path(step), "meta", "metadata")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as error:
            raise CheckpointDamaged(step, self.step_path(step), [f"meta/metadata unreadable ({error})"]) from error

    def restore_params(self, abstract_params, step: int | None = None) -> Restored:
        """Only the parameters of checkpoint `step` (default: the newest), in `abstract_params`' shardings:
        what sampling and scoring read, and all a parameters-only checkpoint holds (`hf import`)."""
        steps = self.all_steps()
        step = steps[-1] if step is None and steps else step
        if step not in steps:
            raise ValueError(f"checkpoint directory {self.root!r}: no finished checkpoint {step!r} (finished: {steps})")
        path = self.step_path(step)
        problems = self.verify(step)
        if problems:
            raise CheckpointDamaged(step, path, problems)
        try:
            metadata = self._manager.item_metadata(step)["state"]
        except Exception as error:  # noqa: BLE001
            raise CheckpointDamaged(step, path, [f"orbax cannot read its metadata ({type(error).__name__}: "
                                                 f"{error})"]) from error
        target = {"params": abstract_params}
        _check_shapes(target, metadata, path)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(
                    target), partial_restore=True), meta=ocp.args.JsonRestore()))
        except Exception as error:  # noqa: BLE001
            raise CheckpointDamaged(step, path, [f"orbax cannot read it ({type(error).__name__}: {error})"]) from error
        return Restored(step=step, state=None, data_state={}, meta=dict(restored["meta"]), path=path,
                        params=restored["state"]["params"])

    def wait(self) -> None:
        """Blocks until the pending asynchronous save is finished; raises CheckpointSaveError if it failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001
            raise self._failed(self._saving, error) from error

    def close(self) -> None:
        """Waits for the pending save; its failure is raised unless one was reported already."""
        reported = self.save_error
        try:
            self.wait()
        except CheckpointSaveError:
            if reported is None:
                raise
        finally:
            try:
                self._manager.close()
            except Exception as error:  # noqa: BLE001
                log.warning("closing the checkpoint manager: %s", error)


def _state_handler(written: Callable[[], None]) -> ocp.PyTreeCheckpointHandler:
    """The arrays' handler. On CPU, orbax's replica-parallel saving (each replica writes a slice of
    a replicated array) compiles one slicing program per shard and replica, seconds per first save
    for nothing (the devices share one host memory), so it is off there; elsewhere orbax decides."""
    from orbax.checkpoint import type_handlers

    replica_parallel = False if jax.default_backend() == "cpu" else None
    array_handler = type_handlers.ArrayHandler(use_replica_parallel=replica_parallel)
    registry = type_handlers.create_type_handler_registry(
        (int, type_handlers.ScalarHandler()), (float, type_handlers.ScalarHandler()),
        (np.number, type_handlers.ScalarHandler()), (np.ndarray, type_handlers.NumpyHandler()),
        (jax.Array, array_handler))
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    handler.async_save = _checksummed(handler.async_save, written)
    return handler


def _checksummed(async_save, written: Callable[[], None]):
    """`async_save` of the arrays' handler that, on a process other than the primary, writes that
    process's checksums once its own writes finish, before the barrier that precedes the commit
    (orbax runs the manager's post-finalization callback on the primary alone, which checksums its
    own files there); then, on every process, calls `written`. An instance attribute, not a subclass:
    orbax pairs save arguments with the handler's exact class."""

    async def save(directory, *args, **kwargs):
        from orbax.checkpoint._src.futures import future

        futures = await async_save(directory, *args, **kwargs)
        process = jax.process_index()
        step_dir = os.path.dirname(os.fspath(getattr(directory, "path", directory)))

        def done():
            if process != 0:
                write_checksums(step_dir, process)
            written()

        return [future.ChainedFuture(list(futures or []), cb=done)]

    return save


# Parts of the train state a run may start afresh when its checkpoint holds them in another form:
# the FP8 amax histories (absent from a checkpoint written before they existed, or by a bf16 run; of
# another length when `model.fp8_history` changed). Empty histories are what a new run starts with.
RESTARTABLE = ("fp8",)


def _restore_target(abstract_state, metadata, path: str):
    """(what to read, {field: abstract part to start as zeros}). The whole `abstract_state` when the
    checkpoint holds every part in the run's form; else a dict of its fields without the restartable
    parts the checkpoint lacks or holds in another form (read with orbax's partial restore)."""
    if not dataclasses.is_dataclass(abstract_state):
        return abstract_state, {}
    saved = dict(metadata.items()) if hasattr(metadata, "items") else {}
    fresh = {}
    for name in RESTARTABLE:
        want = getattr(abstract_state, name, None)
        if want is None:
            continue
        want_shapes = {_key(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(want)}
        have_shapes = {_key(k): tuple(getattr(v, "shape", ()) or ())
                       for k, v in jax.tree_util.tree_leaves_with_path(saved.get(name, {}))}
        if name in saved and want_shapes == have_shapes:
            continue
        fresh[name] = want
        if have_shapes and not want_shapes:
            log.warning("checkpoint %s: its %s state (%d arrays) is left unread: the run keeps none", path, name,
                        len(have_shapes))
        elif want_shapes:
            log.warning("checkpoint %s: its %s state (%d arrays) does not fit the run's (%d arrays): the run "
                        "starts it afresh", path, name, len(have_shapes), len(want_shapes))
    if not fresh:
        return abstract_state, {}
    return {f.name: getattr(abstract_state, f.name) for f in dataclasses.fields(abstract_state)
            if f.name not in fresh}, fresh


def _zeros(leaf: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros in `leaf`'s shape, dtype and sharding (every process builds its own shards)."""
    return jax.make_array_from_callback(leaf.shape, leaf.sharding,
                                        lambda index: np.zeros(leaf.shape, leaf.dtype)[index])


def _check_shapes(abstract_state, metadata, path: str) -> None:
    """A clear error when the checkpoint's arrays are not the shapes the run's model expects."""
    want = {_key(k): v for k, v in jax.tree_util.tree_leaves_with_path(abstract_state)}
    have = {_key(k): v for k, v in jax.tree_util.tree_leaves_with_path(metadata)}
    for key, target in want.items():
        got = have.get(key)
        if got is None:
            raise ValueError(f"checkpoint {path!r}: has no array {key}; it was written by a different model "
                             f"or optimizer (keys differ)")
        shape = tuple(getattr(got, "shape", ()) or ())
        if shape != tuple(target.shape):
            raise ValueError(f"checkpoint {path!r}: array {key} has shape {shape}, the run's config expects "
                             f"{tuple(target.shape)}; model.* must match the run that wrote it")


def _key(path) -> str:
    """A key path as "a/b/0/c", the same for attribute, dict and sequence keys."""
    return "/".join(str(getattr(e, "name", getattr(e, "key", getattr(e, "idx", e)))) for e in path)


def resolve_restore_from(path: str) -> tuple[str, int | None]:
    """`checkpoint.restore_from` -> (checkpoint root, step or None for the newest).

    Accepts another run's workdir, its `checkpoints/` root, or one step directory inside it.
    """
    real = os.path.realpath(os.path.expanduser(path))
    if not os.path.isdir(real):
        raise ValueError(f"config.checkpoint.restore_from={path!r}: no such directory ({real!r})")
    if os.path.isdir(os.path.join(real, CHECKPOINT_SUBDIR)):
        return os.path.join(real, CHECKPOINT_SUBDIR), None
    name = os.path.basename(real)
    if name.isdigit():
        return os.path.dirname(real), int(name)
    return real, None


def resume(config: ml_collections.ConfigDict, ckpt: Checkpointer, abstract_state) -> Restored | None:
    """The run's own newest checkpoint; else `checkpoint.restore_from`'s; else None (fresh start).

    Raises ConfigError (naming `workdir` or `checkpoint.restore_from`) when the checkpoint does
    not fit the run's model, or the path is unusable.
    """
    if ckpt.latest_step() is not None:
        damaged = []
        for step in reversed(ckpt.all_steps()):
            try:
                if ckpt.meta(step).get("parameters_only"):  # `hf import --workdir`: parameters, step 0
                    return ckpt.restore_params(abstract_state.params, step)
                return ckpt.restore(abstract_state, step, trust_unverified=bool(config.checkpoint.trust_unverified))
            except Unverified as error:
                raise config_lib.ConfigError("checkpoint.trust_unverified", False, str(error)) from error
            except CheckpointDamaged as error:
                moved = ckpt.set_aside(step)
                damaged.append(f"step {step} ({'; '.join(error.problems[:2])})")
                log.warning("%s; moved to %s; falling back to the previous checkpoint", error, moved)
            except ValueError as error:
                raise config_lib.ConfigError("workdir", config.workdir, f"{error}; resume with the same model.* "
                                             "or use a new workdir") from error
        raise config_lib.ConfigError("workdir", config.workdir, f"every checkpoint is damaged: {', '.join(damaged)}; "
                                     f"they were moved to {ckpt.root}.damaged/ (nothing deleted): restore one by "
                                     "hand, start a new workdir, or set config.checkpoint.restart_from_scratch=True "
                                     "to train this one from step 0")
    set_aside = _set_aside_steps(ckpt.root)
    if set_aside and not config.checkpoint.restart_from_scratch:
        raise config_lib.ConfigError("workdir", config.workdir, f"holds no intact checkpoint: its checkpoints of "
                                     f"steps {set_aside} were damaged and moved to {ckpt.root}.damaged/; restore one "
                                     "by hand, start a new workdir, or set config.checkpoint.restart_from_scratch=True "
                                     "to train this one from step 0 on purpose")
    if set_aside:
        log.warning("config.checkpoint.restart_from_scratch: training %s from step 0; the damaged checkpoints "
                    "stay in %s.damaged/", config.workdir, ckpt.root)
    if not config.checkpoint.restore_from:
        return None
    try:
        root, step = resolve_restore_from(config.checkpoint.restore_from)
        if root == ckpt.root:
            return None
        source = Checkpointer(root, read_only=True, async_save=False)
        try:
            if step is not None:  # a named step: its damage is an error
                return source.restore(abstract_state, step)
            for newest in reversed(source.all_steps()):  # a run: its newest intact checkpoint
                try:
                    return source.restore(abstract_state, newest)
                except CheckpointDamaged as error:
                    log.warning("%s; trying the previous one (%s is read only: nothing moved)", error, root)
            raise ValueError(f"checkpoint directory {root!r}: holds no intact checkpoint")
        finally:
            source.close()
    except config_lib.ConfigError:
        raise
    except (ValueError, CheckpointDamaged) as error:
        raise config_lib.ConfigError("checkpoint.restore_from", config.checkpoint.restore_from, str(error)) from error


def _set_aside_steps(root: str) -> list[int]:
    """The steps of the damaged checkpoints `set_aside` moved to `<root>.damaged/`."""
    damaged = root + ".damaged"
    if not os.path.isdir(damaged):
        return []
    return sorted({int(name.split(".")[0]) for name in os.listdir(damaged) if name.split(".")[0].isdigit()})


def validate_config(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """The checkpoint rules (gathered by `meshtrain.validate`). Raises ConfigError."""
    del sizes
    if config.checkpoint.restore_from:
        path = os.path.realpath(os.path.expanduser(config.checkpoint.restore_from))
        if not os.path.isdir(path):
            raise config_lib.ConfigError("checkpoint.restore_from", config.checkpoint.restore_from,
                                         f"must be a run's workdir, its checkpoints/ directory or one step "
                                         f"directory; {path!r} is not a directory")


def config_record(config: ml_collections.ConfigDict) -> dict:
    """The resolved config as plain JSON (a record: it is never executed or read back as a config)."""
    return json.loads(config.to_json_best_effort())
