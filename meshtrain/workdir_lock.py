"""One run per workdir: an exclusive lock held for the life of a training run.

Two runs writing one workdir interleave their metrics and replace each other's checkpoints, and
both report success. `WorkdirLock` takes an exclusive `flock` on `<workdir>/.meshtrain.lock.<process>`
(one file per process of a multi-process run) and writes who holds it (host, pid, start time) into
the file. The operating system releases the lock when the process ends, however it ends, so a
SIGKILLed run never blocks its relaunch; a second run on a busy workdir stops before anything is
compiled or written, with one line naming the holder. Commands that only read a workdir (`sample`,
`evaluate`, `report`) take no lock.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket

from meshtrain import config as config_lib


class WorkdirLock:
    """The lock of one process of the run in `workdir` (`with WorkdirLock(workdir, process): ...`)."""

    def __init__(self, workdir: str, process: int = 0):
        self.path = os.path.join(os.path.expanduser(workdir), f".meshtrain.lock.{int(process)}")
        self._file = None

    def acquire(self) -> WorkdirLock:
        """Takes the lock; raises ConfigError naming the workdir and its holder when another run has it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 (held open for the life of the run)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _describe(handle.read())
            handle.close()
            raise config_lib.ConfigError("workdir", os.path.dirname(self.path),
                                         f"is in use by another run ({holder}; lock {self.path}): wait for it, "
                                         "stop it, or use another workdir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),  # read as "holder unknown" if torn
                                 "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}))
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
