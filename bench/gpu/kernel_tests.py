"""The Pallas kernel tests with the kernels compiled by Triton on this machine's GPU, as JSON.

`python bench/gpu/kernel_tests.py [--out FILE] [-k EXPR] [--seconds S] [--log FILE]`

Runs `tests/test_cudnn_attention.py` (cuDNN's attention against the einsum one),
`tests/test_pallas_rms_norm.py`, `tests/test_pallas_cross_entropy.py` and
`tests/test_pallas_flash_attention.py` with `MESHTRAIN_PALLAS=compiled` (the kernels compiled, not
interpreted) on JAX's GPU backend: each kernel and its backward against the pure-jnp reference, in
float32 (1e-5) and bf16, the tolerances of the CPU suite. On a machine without a GPU it runs them in
interpret mode instead (the CPU suite's own run). pytest's verbose output streams to `--log`; after
`--seconds` it is stopped and the tests that finished are reported, with the one it was running.
Prints a table and one JSON line (also written to `--out`); exits 1 when a test fails or the run was
stopped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

STARTED = time.monotonic()  # --seconds counts from here: the part's limit began with this process
ROOT = pathlib.Path(__file__).resolve().parents[2]
# the quick kernels first: a run stopped at its time limit has tested them
FILES = ("tests/test_cudnn_attention.py", "tests/test_pallas_rms_norm.py", "tests/test_pallas_cross_entropy.py",
         "tests/test_pallas_flash_attention.py")


def gpu_visible(timeout: float = 120.0) -> bool:
    """Whether JAX (in a child process: this one must not start a backend) sees a GPU."""
    probe = "import jax; print(any(d.platform == 'gpu' for d in jax.devices()))"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env("cuda"),
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0 and out.stdout.strip().endswith("True")


def _env(platform: str) -> dict:
    # the checkout, bench/gpu (the `_report_now` plugin), and what was there (carried wheels)
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "bench" / "gpu"), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, JAX_PLATFORMS=platform, PYTHONPATH=path)
    env["MESHTRAIN_PALLAS"] = "compiled" if platform == "cuda" else "interpret"
    return env


def workers(platform: str) -> int:
    """pytest-xdist workers for the compiled run: each test spends most of its time compiling (Triton
    and XLA, on the host's cores), so on a GPU machine four processes share the GPU, each allocating
    what it needs (no preallocation); serial on CPU, or without pytest-xdist."""
    if platform != "cuda" or importlib.util.find_spec("xdist") is None:
        return 0
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def run(select: str = "", seconds: float = 0.0, log: pathlib.Path | None = None,
        deadline: float | None = None) -> dict:
    """The kernel tests (`workers` processes), pytest's verbose output streamed to `log` (serially each
    test's name is written when it starts, its outcome when it ends); after `seconds` (0: no limit)
    the run is stopped and the tests that finished are the result (serially, the one running named
    as unfinished); `deadline` (`time.monotonic()`), where given, counts `seconds` from the caller's
    start instead. A SIGTERM (the runbook's `timeout`) stops pytest's whole process group first."""
    deadline = deadline if deadline is not None else (time.monotonic() + seconds if seconds else None)
    platform = "cuda" if gpu_visible(min(120.0, max(5.0, deadline - time.monotonic())) if deadline else 120.0) \
        else "cpu"
    n = workers(platform)
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.xml"
        log = log or pathlib.Path(tmp) / "pytest.log"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "_report_now",
               "-o", "addopts=", "--durations=10", f"--junitxml={report}", *FILES]
        cmd += (["-k", select] if select else []) + (["-n", str(n)] if n else [])
        env = dict(_env(platform), XLA_PYTHON_CLIENT_PREALLOCATE="false") if n else _env(platform)
        start = time.perf_counter()
        with open(log, "w") as stream:
            # a session of its own: stopping it stops xdist's workers too, which would hold the GPU
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT,
                                    start_new_session=True)

            def stop(*_):
                os.killpg(proc.pid, signal.SIGKILL)
                sys.exit(143)
            previous = signal.signal(signal.SIGTERM, stop)
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()) if deadline else None)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
            finally:
                signal.signal(signal.SIGTERM, previous)
        text = log.read_text(errors="replace")
        results = _read_junit(report) if report.exists() else _read_verbose(text)
    failed = {k: v for k, v in results.items() if v != "passed" and not v.startswith("skipped")}
    return {"bench": "gpu_kernel_tests", "platform": platform, "workers": n,
            "mode": "compiled" if platform == "cuda" else "interpret", "tests": len(results),
            "passed": sum(v == "passed" for v in results.values()), "failed": failed,
            "skipped": {k: v for k, v in results.items() if v.startswith("skipped")},
            "seconds": round(time.perf_counter() - start, 1),
            "pytest_exit": f"stopped after {seconds:.0f} s" if code is None else code,
            "unfinished": _unfinished(text) if code is None else [],
            "tail": text[-2000:] if code != 0 else ""}


def _read_verbose(text: str) -> dict[str, str]:
    """{test: outcome} from pytest -v's lines (a run stopped early): `path::test[params] PASSED [ 5%]`,
    or under xdist `[gw0] [  5%] PASSED path::test[params]`."""
    out = {}
    serial = r"^(?P<test>\S+::\S+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
    parallel = r"^\[gw\d+\] (?:\[ *\d+%\] )?(?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<test>\S+::\S+)"
    for pattern in (serial, parallel):
        for match in re.finditer(pattern, text, re.MULTILINE):
            outcome = {"XFAIL": "SKIPPED", "XPASS": "PASSED"}.get(match.group("outcome"), match.group("outcome"))
            out[match.group("test")] = outcome.lower() if outcome in ("PASSED", "SKIPPED") else outcome
    return out


def _unfinished(text: str) -> list[str]:
    """The tests pytest -v had started and not finished when the run was stopped (a started test's
    line is its name alone until its outcome is written)."""
    done = _read_verbose(text)
    return [m.group(1) for m in re.finditer(r"^(\S+::\S+) *$", text, re.MULTILINE) if m.group(1) not in done]


def _read_junit(path: pathlib.Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            out[name] = (problem.get("message") or "failed")[:500]
        else:
            skipped = case.find("skipped")
            out[name] = "passed" if skipped is None else f"skipped: {skipped.get('message') or ''}"[:300]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    parser.add_argument("-k", dest="select", default="", help="pytest -k expression (a subset of the tests)")
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: the tests of the default block sizes")
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("RUNBOOK_PART_SECONDS", 0)) - 10,
                        help="stop pytest after this long and report the tests that finished (default: the "
                             "runbook part's limit less 10 s; <= 0: no limit)")
    parser.add_argument("--log", default="", help="pytest's verbose output, streamed (default: a temporary file)")
    args = parser.parse_args()
    if args.quick:
        args.select = args.select or "default_blocks"
    seconds = max(args.seconds, 0.0)
    result = run(args.select, seconds, pathlib.Path(args.log) if args.log else None,
                 STARTED + seconds if seconds else None)
    print(f"Pallas kernel tests, {result['mode']} on {result['platform']}: {result['passed']} of {result['tests']} "
          f"passed in {result['seconds']} s" + (f"; stopped while running {', '.join(result['unfinished'])}"
                                                if result["unfinished"] else ""))
    for name, message in result["failed"].items():
        print(f"  FAILED {name}: {message.splitlines()[0] if message else ''}")
    for name, reason in result["skipped"].items():
        print(f"  SKIPPED {name}: {reason}")
    line = json.dumps(result)
    print(line)
    if args.out:
        pathlib.Path(args.out).write_text(line + "\n")
    sys.exit(0 if result["pytest_exit"] == 0 and result["tests"] else 1)


if __name__ == "__main__":
    main()
