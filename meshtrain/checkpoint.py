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
* `meta`: JSON: the resolved config (for the record only; a run's config always comes
  from its command line), the seed, and the count of skipped non-finite steps.

When to save, preemption and the non-finite guard are the loop's policy (`run_loop.py`).

Saves are asynchronous by default: the step loop waits only for the device-to-host copy;
orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoints intact and the partial one invisible.

Safety: restoring reads tensorstore arrays and JSON only (no pickle, no imported code);
paths are resolved with `os.path.realpath`, and a step directory that resolves outside
its checkpoint root (a symlink planted in the directory) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from meshtrain import config as config_lib

CHECKPOINT_SUBDIR = "checkpoints"


def checkpoint_root(workdir: str) -> str:
    """`<workdir>/checkpoints`, resolved to an absolute path without symlinks."""
    return os.path.join(os.path.realpath(os.path.expanduser(workdir)), CHECKPOINT_SUBDIR)


@dataclasses.dataclass
class Restored:
    """What a checkpoint gives back to a run."""

    step: int
    state: object  # TrainState in the new run's shardings
    data_state: dict
    meta: dict
    path: str


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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, enable_async_checkpointing=async_save,
            create=not read_only, read_only=read_only, save_interval_steps=1,
            cleanup_tmp_directories=not read_only)  # leftovers of a process killed mid-save
        handlers = {"state": _state_handler(), "data": ocp.JsonCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.root, options=options, item_handlers=handlers)
        self.last_saved: int | None = self.latest_step()

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
        saved = self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta)), force=True)
        if saved:
            self.last_saved = step
        return saved

    def restore(self, abstract_state, step: int | None = None) -> Restored:
        """Reads checkpoint `step` (default: the newest finished one) into `abstract_state`'s shardings.

        Args:
          abstract_state: a pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` of the
            *current* run (e.g. `StateFactory.abstract`); the arrays come back in those shardings.
          step: which checkpoint; None for the newest.
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
        _check_shapes(abstract_state, self._manager.item_metadata(step)["state"], path)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(
                abstract_state)), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return Restored(step=step, state=restored["state"], data_state=dict(restored["data"]),
                        meta=dict(restored["meta"]), path=path)

    def wait(self) -> None:
        """Blocks until the pending asynchronous save is finished."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _state_handler() -> ocp.PyTreeCheckpointHandler:
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
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


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
        try:
            return ckpt.restore(abstract_state)
        except ValueError as error:
            raise config_lib.ConfigError("workdir", config.workdir, f"{error}; resume with the same model.* "
                                         "or use a new workdir") from error
    if not config.checkpoint.restore_from:
        return None
    try:
        root, step = resolve_restore_from(config.checkpoint.restore_from)
        if root == ckpt.root:
            return None
        source = Checkpointer(root, read_only=True, async_save=False)
        try:
            return source.restore(abstract_state, step)
        finally:
            source.close()
    except config_lib.ConfigError:
        raise
    except ValueError as error:
        raise config_lib.ConfigError("checkpoint.restore_from", config.checkpoint.restore_from, str(error)) from error


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
