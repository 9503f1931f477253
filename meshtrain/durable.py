"""Writes a crash cannot tear: whole files by rename, append-only logs whose torn tail is repaired.

Every file meshtrain writes is one of two kinds (docs/checkpoints.md, "What a crash leaves"):

* **whole files** (a run's exported model, sample and evaluation outputs, the token cache, data
  checksums): written under a temporary name in the same folder, flushed to disk and renamed over
  the target (`write_atomic`, `atomic_path`). A crash leaves the old file or the new one, never half
  of either; the temporary file it may leave (`*.tmp.<host>.<pid>`) is ignored by every reader.
* **append-only logs** (`metrics.jsonl`, `metrics.rolled_back.jsonl`): one JSON object a line,
  appended and flushed a line at a time (`JsonlLog`). A crash or a full disk during an append leaves
  at worst a torn last line; readers (`read_jsonl`) drop it with one warning, and the next append
  cuts it off first. A bad line anywhere else is not a crash's doing: `CorruptFileError` names the
  file and the line.

Checkpoints are orbax's (a temporary folder renamed when complete, `checkpoint.py`); the workdir
lock's holder record is rewritten in place and read as "holder unknown" when torn (`workdir_lock.py`).
A write that fails (a full disk, a read-only mount) raises `WriteError`: one line naming the file
and what to do, exit code 4 from `python -m meshtrain.train`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
from collections.abc import Iterator

log = logging.getLogger("meshtrain")

TMP_MARK = ".tmp"  # temporary files are `<name>.tmp.<host>.<pid>`: readers skip them, a later write replaces them


class CorruptFileError(ValueError):
    """A file meshtrain wrote holds something no crash leaves (a bad line before the last): the message
    names the file, the line and what to do."""


class WriteError(OSError):
    """A write failed for a reason outside the run (disk full, read-only, no permission): one line."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def describe_os_error(path: str, error: OSError) -> str:
    """One line for an OSError writing `path`: what happened and what to do."""
    what = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.EFBIG: "the file size limit is exceeded"}.get(
                error.errno, error.strerror or str(error))
    return (f"cannot write {path}: {what}; free space or fix the folder's permissions (or choose another "
            "folder), then run the same command: it resumes from the newest finished checkpoint")


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)
_MESSAGES = {os.strerror(code): code for code in WRITE_ERRNOS}


def as_write_error(path: str, error: BaseException) -> WriteError | None:
    """`error` as a `WriteError` naming `path` when it is a failed write: an OSError, or a library's
    wrapper whose message carries the system's (TFDS's and array_record's RuntimeError: "... No space
    left on device ..."); None otherwise."""
    if isinstance(error, WriteError):
        return error
    if isinstance(error, OSError):
        return WriteError(error.errno, describe_os_error(path, error)) if error.errno in WRITE_ERRNOS else None
    for message, code in _MESSAGES.items():
        if message in str(error):
            return WriteError(code, describe_os_error(path, OSError(code, message)))
    return None


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Turns a failed write of the block (`as_write_error`: a full disk, a read-only folder, no
    permission) into a `WriteError` naming `path`; other errors (a read's) pass unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        wrapped = as_write_error(path, error)
        if wrapped is None or wrapped is error:
            raise
        raise wrapped from error


def unwritable(folder: str) -> str | None:
    """Why files cannot be created in `folder` (created first if missing), or None when they can: it
    is a file, or it (or its nearest existing parent) is read-only or not this user's to write."""
    path = os.path.abspath(os.path.expanduser(folder))
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"cannot be created: {probe} is a file, not a folder" if probe != path else "is a file, not a folder"
    if os.access(probe, os.W_OK | os.X_OK):
        return None
    where = "" if probe == path else f" (its parent {probe} cannot be written to create it)"
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        return f"is on a read-only file system{where}"
    return f"cannot be written by this user (uid {os.getuid()}){where}"


# What a run keeps in its workdir, by kind (`train.run` checks them before anything reads or writes).
WORKDIR_FILES = ("metrics.jsonl", "metrics.rolled_back.jsonl", "goodput.jsonl", ".meshtrain.run_id")
WORKDIR_FOLDERS = ("checkpoints", "tb", "datasets", "profile", "tokenizer")


def wrong_kind(workdir: str) -> str | None:
    """The first entry of a run's workdir of the wrong kind (a folder where the run keeps a file, or a file
    where it keeps a folder), in words, or None."""
    root = os.path.abspath(os.path.expanduser(workdir))
    for name in WORKDIR_FILES:
        if os.path.isdir(os.path.join(root, name)):
            return f"{os.path.join(root, name)} is a folder where the run keeps a file"
    for name in WORKDIR_FOLDERS:
        path = os.path.join(root, name)
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{path} is a file where the run keeps a folder"
    return None


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every file system syncs a folder
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary path beside `path` to write (any way: numpy, a library) that replaces `path` when the
    block ends without an error; on an error the temporary file is removed and `path` is unchanged."""
    folder = os.path.dirname(path)
    tmp = f"{path}{TMP_MARK}.{socket.gethostname()}.{os.getpid()}"  # unique across hosts sharing the folder
    with writing(path):
        if folder:
            os.makedirs(folder, exist_ok=True)
        try:
            yield tmp
            _fsync(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        fsync_dir(folder)


def write_atomic(path: str, data: str | bytes) -> None:
    """Writes `data` to `path` all at once: the old file or the new one, whatever happens (`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)


def write_json(path: str, obj, **dump_kwargs) -> None:
    """`obj` as JSON at `path`, all at once (`write_atomic`)."""
    write_atomic(path, json.dumps(obj, **dump_kwargs))


def read_jsonl(path: str, warn: bool = True) -> list[dict]:
    """The records of an append-only JSON-lines log (`JsonlLog`), in file order.

    Accepts: blank lines (skipped) and a torn last line (no newline at its end, or not JSON: what a
    crash or a full disk during an append leaves), dropped with one warning. Any other line that is
    not a JSON object raises `CorruptFileError` naming the file and the line. `warn`: False checks
    the file without the warning (a reader that warns comes later)."""
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: b"" unless the last append was torn
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        record = _parse(raw)
        if record is None:
            if number == len(lines) and not tail.strip():  # the last line: what a crash tears
                if warn:
                    _warn_torn(path, number)
                continue
            raise CorruptFileError(f"{path}:{number}: not a JSON object ({raw[:60]!r}); a crash tears only the "
                                   "last line: the file was changed by hand or damaged: fix or delete that line")
        records.append(record)
    if tail.strip():
        record = _parse(tail)
        if record is None:
            if warn:
                _warn_torn(path, len(lines) + 1)
        else:
            records.append(record)  # complete but for its newline
    return records


def _parse(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _warn_torn(path: str, number: int | None = None) -> None:
    where = f"{path}:{number}" if number else path
    log.warning("%s: a torn last line (a crash or a full disk during its write) is dropped", where)


def repair_tail(path: str, warn: bool = True) -> None:
    """Cuts a torn last line off an append-only log (after its last newline), so the next append starts
    a line of its own (`warn`: with one warning); a log without one is unchanged."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return
    if not size:
        return
    with open(path, "rb+") as fh:
        ends_line = _read_at(fh, size - 1, 1) == b"\n"
        end = size - 1 if ends_line else size  # the last line: [start, end)
        start = _line_start(fh, end)
        last = _read_at(fh, start, end - start)
        if not last.strip():
            return
        if _parse(last) is not None:  # whole; if it lost only its newline, it gets one
            if not ends_line:
                fh.seek(size)
                fh.write(b"\n")
            return
        if warn:  # torn (a bad last line ending in a newline is read as torn too: `read_jsonl`)
            _warn_torn(path)
        fh.truncate(start)


def _read_at(fh, offset: int, length: int) -> bytes:
    fh.seek(offset)
    return fh.read(length)


def _line_start(fh, end: int) -> int:
    """The offset after the last newline before `end` (0 when none)."""
    back = 1 << 16
    while True:
        lo = max(0, end - back)
        cut = _read_at(fh, lo, end - lo).rfind(b"\n")
        if cut >= 0:
            return lo + cut + 1
        if lo == 0:
            return 0
        back *= 2


class JsonlLog:
    """An append-only JSON-lines file: each `append` writes one line and flushes it. The first append
    of a process cuts a torn last line left by a crash (`repair_tail`)."""

    def __init__(self, path: str):
        self.path = path
        self._file = None

    def append(self, record: dict) -> None:
        self.extend([record])

    def extend(self, records: list[dict]) -> None:
        """Appends `records`, one line each, in one write."""
        if not records:
            return
        with writing(self.path):
            if self._file is None:
                folder = os.path.dirname(self.path)
                if folder:
                    os.makedirs(folder, exist_ok=True)
                repair_tail(self.path)
                self._file = open(self.path, "a")  # noqa: SIM115 (held open between appends)
            self._file.write("".join(json.dumps(r) + "\n" for r in records))
            self._file.flush()

    def sync(self) -> None:
        """Forces the appended lines to disk (before a step that relies on them surviving a power loss)."""
        if self._file is not None:
            with writing(self.path):
                os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # a failed flush was reported by the append that failed
                self._file.close()
            self._file = None
