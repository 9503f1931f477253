"""The fast checkpoint tier: each process's shards in host-local storage, and a copy of its peer's.

Every `checkpoint.local_every` steps each process writes the shards of the train state its devices
hold (their bytes as the devices hold them, one file) with the step's data position to
`checkpoint.local_dir` (default: host memory, `/dev/shm`), and a copy of the previous process's shards
in a ring (process p keeps p - 1's, sent device to device by one `ppermute` a leaf). The persistent
tier (`meshtrain.checkpoint`, `checkpoint.every`) stays as it is, less often.

On a restart the processes share which steps each holds complete, its own and its peer copy; the
newest step that every process can rebuild (its own copy, or the one its successor keeps) wins over
the persistent tier's newest when it is not older. A process that lost its own copy (a replaced
host) takes it back from its successor, the `ppermute` run the other way. A step missing anywhere
falls back to the previous complete one, then to the persistent tier; a step whose device or process
count differs is not used. Restored bytes are the saved bytes: a resume is bit-equal.

Writes keep the crash-consistency rules of the persistent tier: each step is written into a hidden
temporary folder (`data.bin`, then `meta.json` with the data's sha256 and size), each file and the
folder fsynced, then renamed into place; a step whose checksum does not match is not complete. The
two newest steps of each kind are kept. The device-to-host copy and the exchange block the step
loop; the files are written in a background thread, one save at a time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import threading

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain import durable, faults

log = logging.getLogger("meshtrain")

DATA, META = "data.bin", "meta.json"
RUN_ID_FILE = ".meshtrain.run_id"
KEEP = 2
MAX_STEPS = 8  # steps a process reports to its peers (the newest)


def default_root(workdir: str) -> str:
    """Host memory where the host has it (/dev/shm), else the temporary folder: one folder per workdir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    digest = hashlib.sha1(os.path.realpath(os.path.expanduser(workdir)).encode()).hexdigest()[:12]
    return os.path.join(base, f"meshtrain-local-{os.getuid()}", digest)


def _local_devices() -> list:
    return sorted(jax.local_devices(), key=lambda d: d.id)


@functools.cache
def _ring(shift: int):
    return ring(tuple(jax.devices()), shift)


def ring(devices: tuple, shift: int):
    """(jitted function, its sharding): rows [processes x devices a process, ...] -> the rows of the
    process `shift` before in the ring, on the same devices (a `ppermute` over the processes)."""
    processes = len({d.process_index for d in devices})
    ordered = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(processes, -1)
    mesh = Mesh(ordered, ("p", "l"))
    spec = PartitionSpec(("p", "l"))
    pairs = [(i, (i + shift) % processes) for i in range(processes)]
    body = jax.shard_map(lambda x: jax.lax.ppermute(x, "p", pairs), mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(body), NamedSharding(mesh, spec)


def _exchange(shift: int, shards: list[jax.Array]) -> list[jax.Array]:
    """One leaf's local shards (one a device, ascending id) sent `shift` processes on in the ring: the
    shards the process `shift` before held, on the same devices. Runs under the ring's own mesh (the
    step's is the context mesh); a scalar travels as one element."""
    ring, sharding = _ring(shift)
    shape = shards[0].shape
    rows = [s if s.ndim else jax.device_put(np.asarray(s).reshape(1), s.device) for s in shards]
    with jax.set_mesh(sharding.mesh):
        out = ring(jax.make_array_from_single_device_arrays(
            (jax.device_count() * rows[0].shape[0], *rows[0].shape[1:]), sharding, rows))
    by_device = {s.device: s.data for s in out.addressable_shards}
    return [by_device[d] if shape else jax.device_put(np.asarray(by_device[d]).reshape(()), d)
            for d in _local_devices()]


def _shards(leaf: jax.Array) -> list[jax.Array]:
    by_device = {s.device: s.data for s in leaf.addressable_shards}
    return [by_device[d] for d in _local_devices()]


class LocalTier:
    """One process's side of the local tier (module docstring)."""

    def __init__(self, root: str, every: int, abstract_state, run_id: str, injection: faults.Injection = faults.NONE):
        """`abstract_state`: what a step holds (its leaves' shapes, dtypes and shardings are part of the
        layout a step must match to be used); `run_id`: the workdir's (`run_id`): a step of another run
        that had the same folder is never used."""
        self.every, self.injection = int(every), injection
        self._digest = _digest(abstract_state)
        self.run_id = run_id
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.root = os.path.join(root, f"process_{self.process}")
        self.own, self.peer = os.path.join(self.root, "own"), os.path.join(self.root, "peer")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _layout(self) -> dict:
        return {"devices": jax.device_count(), "processes": self.processes, "state": self._digest,
                "run": self.run_id}

    # -- saving ---------------------------------------------------------------------------------------

    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        """Copies this process's shards to the host (and its peer's from its peer), then writes both in
        the background; the previous save's writes finish first."""
        self.wait()
        leaves = jax.tree.leaves(state)
        own = _host_bytes([_shards(leaf) for leaf in leaves])
        peer = None
        if self.processes > 1:
            peer = _host_bytes([_exchange(1, _shards(leaf)) for leaf in leaves])
        record = {"step": step, "data_state": data_state, "meta": meta, "layout": self._layout()}

        def write():
            try:
                _write_step(self.own, step, own, record, lambda: self.injection.at("local", step))
                if peer is not None:
                    _write_step(self.peer, step, peer, {**record, "of": (self.process - 1) % self.processes})
            except BaseException as error:  # noqa: BLE001 - reported by the next save or `wait`
                self._error = error

        self._thread = threading.Thread(target=write, name="meshtrain-local-save", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the pending writes are on disk; a write that failed is logged (the tier is a cache: the
        persistent tier still holds the run)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            log.warning("local checkpoint tier: a save failed (%s); the persistent tier still holds the run",
                        self._error)
            self._error = None

    # -- restoring ------------------------------------------------------------------------------------

    def agreed_step(self, persistent: int | None) -> tuple[int | None, int | None]:
        """(the newest step every process can rebuild from this tier or None, the persistent tier's newest
        step every process sees or None), decided once for all (collective: every process calls it)
        from each process's complete steps and its view of the persistent tier (`persistent`)."""
        own, peer = complete_steps(self.own, self._layout()), complete_steps(self.peer, self._layout())
        if self.processes == 1:
            return (own[-1] if own else None), persistent
        from jax.experimental import multihost_utils

        mine = np.full((3, MAX_STEPS), -1, np.int64)
        mine[0, :len(own[-MAX_STEPS:])] = own[-MAX_STEPS:]
        mine[1, :len(peer[-MAX_STEPS:])] = peer[-MAX_STEPS:]
        mine[2, 0] = -1 if persistent is None else persistent
        every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 3, MAX_STEPS]
        seen = int(every[:, 2, 0].min())  # a file system that lags on one process: the oldest view
        candidates = sorted({int(s) for s in every[:, 0].ravel() if s >= 0}, reverse=True)
        for step in candidates:
            if all(step in every[p, 0] or step in every[(p + 1) % self.processes, 1] for p in range(self.processes)):
                return step, (seen if seen >= 0 else None)
        return None, (seen if seen >= 0 else None)

    def forget_after(self, step: int) -> None:
        """Removes this process's steps after `step` (the run went back to it: a rollback, or a restart
        from an older step), so the newest steps kept are this trajectory's."""
        self.wait()
        for folder in (self.own, self.peer):
            for old in _step_names(folder):
                if old > step:
                    shutil.rmtree(os.path.join(folder, str(old)), ignore_errors=True)

    def restore(self, step: int, abstract_state) -> tuple[object, dict, dict, bool]:
        """(state in the run's shardings, data state, meta, whether this process took its shards from its
        successor's copy) of the agreed `step`; collective when several processes run."""
        leaves, treedef = jax.tree.flatten(abstract_state)
        own = read_step(self.own, step, self._layout())
        rows, record, from_peer = (_split(own[0], leaves), own[1], False) if own else (None, None, True)
        if self.processes > 1:
            from jax.experimental import multihost_utils

            kept = read_step(self.peer, step, self._layout())  # the previous process's shards
            # the step's record (the same on every process) from whichever process has one
            mine = (own or kept or (b"", {}))[1]
            encoded = json.dumps(mine).encode() if mine else b""
            width = int(np.max(multihost_utils.process_allgather(np.array([len(encoded)]))))
            buffer = np.zeros(width, np.uint8)
            buffer[:len(encoded)] = np.frombuffer(encoded, np.uint8)
            records = np.asarray(multihost_utils.process_allgather(buffer)).reshape(self.processes, width)
            record = record or next(json.loads(bytes(r).rstrip(b"\0")) for r in records if r.any())
            lost = np.asarray(multihost_utils.process_allgather(np.array([own is None])))
            if lost.any():  # each process sends the copy it keeps back to the process it copies
                sent = _split(kept[0], leaves) if kept else [
                    [np.zeros(_shard_shape(leaf), leaf.dtype) for _ in _local_devices()] for leaf in leaves]
                returned = [_exchange(-1, [jax.device_put(x, d) for x, d in
                                           zip(leaf_rows, _local_devices(), strict=True)]) for leaf_rows in sent]
                rows = rows if own else returned
        if rows is None:
            raise ValueError(f"local checkpoint tier: step {step} of process {self.process} is gone")
        state = jax.tree.unflatten(treedef, _assemble(leaves, rows))
        return state, record["data_state"], record["meta"], from_peer


def kept_record(folder: str, step: int) -> dict | None:
    try:
        with open(os.path.join(folder, str(step), META)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _shard_shape(leaf) -> tuple[int, ...]:
    return leaf.sharding.shard_shape(leaf.shape)


def _host_bytes(per_leaf: list[list[jax.Array]]) -> bytes:
    """The shards' bytes, leaf by leaf and device by device (ascending id)."""
    return b"".join(np.ascontiguousarray(np.asarray(s)).tobytes() for shards in per_leaf for s in shards)


def _split(data: bytes, leaves) -> list[list[np.ndarray]]:
    """`_host_bytes`'s layout read back: per leaf, per local device, the shard."""
    out, offset = [], 0
    for leaf in leaves:
        shape, dtype = _shard_shape(leaf), np.dtype(leaf.dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        rows = []
        for _ in _local_devices():
            rows.append(np.frombuffer(data, dtype, count=int(np.prod(shape)), offset=offset).reshape(shape))
            offset += size
        out.append(rows)
    if offset != len(data):
        raise ValueError(f"local checkpoint tier: {len(data)} bytes where the state takes {offset}")
    return out


def _assemble(leaves, rows_per_leaf) -> list[jax.Array]:
    arrays = []
    for leaf, rows in zip(leaves, rows_per_leaf, strict=True):
        pieces = [r if isinstance(r, jax.Array) else jax.device_put(r, d)
                  for r, d in zip(rows, _local_devices(), strict=True)]
        arrays.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces))
    return arrays


# -- files ----------------------------------------------------------------------------------------------

def _write_step(folder: str, step: int, data: bytes, record: dict, before_commit=lambda: None) -> None:
    """`folder/<step>/` written whole: a hidden temporary folder, each file fsynced, renamed; then the
    steps older than the KEEP newest removed."""
    os.makedirs(folder, exist_ok=True)
    final, tmp = os.path.join(folder, str(step)), os.path.join(folder, f".{step}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, DATA), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    before_commit()
    meta = {**record, "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(tmp, META), "w") as f:
        f.write(json.dumps(meta))  # one write
        f.flush()
        os.fsync(f.fileno())
    durable.fsync_dir(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    durable.fsync_dir(folder)
    for old in _step_names(folder)[:-KEEP]:
        shutil.rmtree(os.path.join(folder, str(old)), ignore_errors=True)
    for name in os.listdir(folder):  # a killed save's temporary folder
        if name.startswith(".") and ".tmp-" in name and name != os.path.basename(tmp):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _step_names(folder: str) -> list[int]:
    """The step folders under `folder`, complete or not, ascending."""
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit()) if os.path.isdir(folder) else []


def _digest(abstract_state) -> str:
    """What must match for a step's bytes to mean the same state: each leaf's shape, dtype and sharding."""
    parts = [(tuple(leaf.shape), str(leaf.dtype), str(getattr(leaf.sharding, "spec", leaf.sharding)),
              str(dict(getattr(getattr(leaf.sharding, "mesh", None), "shape", {}))))
             for leaf in jax.tree.leaves(abstract_state)]
    return hashlib.sha1(repr(parts).encode()).hexdigest()


def run_id(workdir: str) -> str:
    """The workdir's run id (`<workdir>/.meshtrain.run_id`, written once, by rename, by process 0; the
    others wait for it): a local-tier step of a run that had this folder before is never used."""
    path = os.path.join(os.path.expanduser(workdir), RUN_ID_FILE)
    if jax.process_index() == 0 and not os.path.exists(path):
        durable.write_atomic(path, os.urandom(8).hex())
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("meshtrain local tier run id")
    with open(path) as f:
        return f.read().strip()


def complete_steps(folder: str, layout: dict | None) -> list[int]:
    """The steps under `folder` whose data matches its checksum (and, given `layout`, written on the same
    devices and processes), ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        if name.isdigit() and read_step(folder, int(name), layout, check_only=True):
            steps.append(int(name))
    return sorted(steps)


def read_step(folder: str, step: int, layout: dict | None, check_only: bool = False):
    """(data bytes, record) of a complete step, or None (missing, torn, damaged, another layout)."""
    record = kept_record(folder, step)
    if record is None or (layout is not None and record.get("layout") != layout):
        return None
    try:
        with open(os.path.join(folder, str(step), DATA), "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) != record.get("nbytes") or hashlib.sha256(data).hexdigest() != record.get("sha256"):
        log.warning("local checkpoint tier: %s is damaged (its checksum does not match); not used",
                    os.path.join(folder, str(step)))
        return None
    return True if check_only else (data, record)
