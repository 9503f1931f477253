"""Global batches from random-access rows: grain reading, prefetch, exact resume.

Playbook, "Data Parallelism" and "Revisit global batch size": each data-parallel rank
consumes its own slice of the global batch (gbs = mbs x grad_acc x dp). Here the slice
belongs to a *process*: a process reads only the rows its devices hold under the batch
sharding (`Run.batch_sharding`: rows over the batch axes, length over `sequence`), and
`jax.make_array_from_process_local_data` joins the slices into one global array.

Row `s * batch_size + i` of the run is global row `start_row + s * batch_size + i` of
the source, whatever the process count or data-parallel size. The iterator's state is
that index (JSON), so a run resumed on another topology sees the rows an uninterrupted
run would have seen next.
"""

from __future__ import annotations

import queue
import threading
import time

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from meshtrain.data import packing


class _Failure:
    """An exception raised by the reading thread, re-raised by `__next__` in the consumer."""

    def __init__(self, error: Exception):
        self.error = error


def local_block(sharding: NamedSharding, global_shape: tuple[int, int]) -> tuple[slice, slice]:
    """The (rows, columns) block of the global batch that this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    blocks = []
    for dim, size in enumerate(global_shape):
        spans = {idx[dim].indices(size)[:2] for idx in index_map.values()}
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        covered = sum(e - s for s, e in spans)
        if covered != hi - lo:  # the process's slices must tile one contiguous block
            raise ValueError(f"batch sharding {sharding.spec}: this process's devices hold non-contiguous "
                             f"slices {sorted(spans)} of dimension {dim}; order the mesh devices by process")
        blocks.append(slice(lo, hi))
    return blocks[0], blocks[1]


class DataIterator:
    """Iterates global batches; `state()` is the global row index of the next batch.

    Attributes:
      wait_seconds: cumulative seconds the consumer spent blocked in `__next__` (input time).
    """

    def __init__(self, rows, sharding: NamedSharding, *, batch_size: int, seq_len: int, start_row: int = 0,
                 permutation: np.ndarray | None = None, cross_document_attention: bool = False,
                 prefetch: int = 2, num_threads: int = 2, state_info: dict | None = None):
        self.sharding = sharding
        self.batch_size, self.seq_len = int(batch_size), int(seq_len)
        self.global_shape = (self.batch_size, self.seq_len)
        self._rows_block, self._cols_block = local_block(self.sharding, self.global_shape)
        self._next_row = int(start_row)
        self._state_info = dict(state_info or {})
        self.wait_seconds = 0.0
        self._permutation = _check_permutation(permutation, self.seq_len)
        local_rows = self._rows_block.stop - self._rows_block.start
        first = self._rows_block.start

        def global_row(j: int) -> int:
            step, i = divmod(int(j), local_rows)
            return int(start_row) + step * self.batch_size + first + i

        def read(j: int) -> dict[str, np.ndarray]:
            tokens, doc_ids = rows[global_row(j)]
            return packing.row_fields(tokens, doc_ids, cross_document_attention)

        options = grain.ReadOptions(num_threads=max(1, num_threads), prefetch_buffer_size=2 * local_rows)
        dataset = grain.MapDataset.range(0, 2**62).map(read).to_iter_dataset(options).batch(local_rows)
        self._local_batches = iter(dataset)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(prefetch)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="meshtrain-data", daemon=True)
        self._thread.start()

    def _to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        out = {}
        for name in packing.FIELDS:
            field = local[name]
            if self._permutation is not None:
                field = field[:, self._permutation]
            field = np.ascontiguousarray(field[:, self._cols_block])
            out[name] = jax.make_array_from_process_local_data(self.sharding, field, self.global_shape)
        return out

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._to_global(next(self._local_batches))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except Exception as error:  # noqa: BLE001 - handed to the consumer, raised by __next__
            self._put_final(_Failure(error))

    def _put_final(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._stop.is_set():
            raise StopIteration
        start = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds += time.perf_counter() - start
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        self._next_row += self.batch_size
        return item

    def input_seconds(self) -> float:
        """Cumulative seconds the consumer has waited for batches."""
        return self.wait_seconds

    def state(self) -> dict:
        """JSON-serialisable position: `next_row` is the global row index of the next batch."""
        return {"next_row": self._next_row, **self._state_info}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _check_permutation(permutation, seq_len: int) -> np.ndarray | None:
    if permutation is None:
        return None
    perm = np.asarray(permutation)
    if perm.shape != (seq_len,) or not np.array_equal(np.sort(perm), np.arange(seq_len)):
        raise ValueError(f"permutation of shape {perm.shape}: must be a permutation of range(train.seq_len="
                         f"{seq_len})")
    return perm


