"""`python -m meshtrain.launch --processes N -- <train args>`: N local processes, one job.

For tests and single-node use: each process runs `python -m meshtrain.train <train args>`
with `--coordinator_address=127.0.0.1:<free port> --num_processes=N --process_id=i`, and
the processes join one JAX job through `jax.distributed.initialize` (gloo collectives on
CPU). On clusters start the train module once per host yourself (or let SLURM / the cloud
launcher do it: `jax.distributed` detects them). Playbook, "5D parallelism in a nutshell":
the multi-process job sees one global mesh; nothing else in meshtrain changes.

The launcher is a supervisor only: it forwards SIGTERM / SIGINT to every process (a
preemption of the whole job: they save at a common step and exit 0), and when one process
fails it stops the others (SIGTERM, then SIGKILL after `--grace_s`) and exits with that
process's code, so a dead peer never leaves the job hanging. (Without the launcher, the
survivors of a dead process fail when a collective errors, or at the latest after
`jax.distributed`'s heartbeat timeout, 100 s by default.)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(processes: int, port: int, train_args: list[str]) -> list[list[str]]:
    """The command line of each process."""
    if processes < 1:
        raise ValueError(f"processes={processes!r}: must be >= 1")
    return [[sys.executable, "-m", "meshtrain.train", *train_args, f"--coordinator_address=127.0.0.1:{port}",
             f"--num_processes={processes}", f"--process_id={i}"] for i in range(processes)]


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def launch(processes: int, train_args: list[str], port: int | None = None, grace_s: float = 5.0,
           env: dict | None = None) -> int:
    """Runs the N processes to completion; returns 0, or the exit code of the first that failed."""
    cmds = commands(processes, port or free_port(), train_args)
    procs = [subprocess.Popen(cmd, env=env) for cmd in cmds]

    def forward(signum, frame):
        del frame
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                print(f"launch: process {index} exited with {code}; stopping the others", file=sys.stderr)
                _stop(procs, grace_s)
                return code if code > 0 else 128 - code  # killed by a signal: 128 + its number
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        _stop(procs, grace_s)
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, train_args = argv[:split], argv[split + 1:]
    else:
        own, train_args = argv, []
    parser = argparse.ArgumentParser(prog="python -m meshtrain.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, required=True, help="number of local processes")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    parser.add_argument("--grace_s", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(own)
    if args.processes < 1:
        parser.error(f"--processes={args.processes}: must be >= 1")
    return launch(args.processes, train_args, port=args.port or None, grace_s=args.grace_s, env=dict(os.environ))


if __name__ == "__main__":
    sys.exit(main())
