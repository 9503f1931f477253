"""The Pallas kernel tests with the kernels compiled by Triton on this machine's GPU, as JSON.

`python bench/gpu/kernel_tests.py [--out FILE] [-k EXPR] [--seconds S] [--log FILE]`

Runs `tests/test_pallas_rms_norm.py`, `tests/test_pallas_cross_entropy.py` and
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
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the quick kernels first: a run stopped at its time limit has tested them
FILES = ("tests/test_pallas_rms_norm.py", "tests/test_pallas_cross_entropy.py", "tests/test_pallas_flash_attention.py")


def gpu_visible() -> bool:
    """Whether JAX (in a child process: this one must not start a backend) sees a GPU."""
    probe = "import jax; print(any(d.platform == 'gpu' for d in jax.devices()))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env("cuda"), timeout=300)
    return out.returncode == 0 and out.stdout.strip().endswith("True")


def _env(platform: str) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep carried wheels
    env = dict(os.environ, JAX_PLATFORMS=platform, PYTHONPATH=path)
    env["MESHTRAIN_PALLAS"] = "compiled" if platform == "cuda" else "interpret"
    return env


def run(select: str = "", seconds: float = 0.0, log: pathlib.Path | None = None) -> dict:
    """The kernel tests in one pytest process, its verbose output streamed to `log` (each test's name
    is written when it starts, its outcome when it ends); after `seconds` (0: no limit) the process is
    stopped and the tests that finished are the result, the one running named as unfinished."""
    platform = "cuda" if gpu_visible() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.xml"
        log = log or pathlib.Path(tmp) / "pytest.log"
        cmd = [sys.executable, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider", "-p", "bench.gpu._report_now",
               "-o", "addopts=", "--durations=10",
               f"--junitxml={report}", *FILES] + (["-k", select] if select else [])
        start = time.perf_counter()
        with open(log, "w") as stream:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(platform), stdout=stream, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=seconds or None)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
        text = log.read_text(errors="replace")
        results = _read_junit(report) if report.exists() else _read_verbose(text)
    failed = {k: v for k, v in results.items() if v != "passed" and not v.startswith("skipped")}
    return {"bench": "gpu_kernel_tests", "platform": platform,
            "mode": "compiled" if platform == "cuda" else "interpret", "tests": len(results),
            "passed": sum(v == "passed" for v in results.values()), "failed": failed,
            "skipped": {k: v for k, v in results.items() if v.startswith("skipped")},
            "seconds": round(time.perf_counter() - start, 1),
            "pytest_exit": f"stopped after {seconds:.0f} s" if code is None else code,
            "unfinished": _unfinished(text) if code is None else "",
            "tail": text[-2000:] if code != 0 else ""}


def _read_verbose(text: str) -> dict[str, str]:
    """{test: outcome} from pytest -v's lines `path::test[params] PASSED [ 5%]` (a run stopped early)."""
    out = {}
    for match in re.finditer(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.MULTILINE):
        out[match.group(1)] = match.group(2).lower() if match.group(2) in ("PASSED", "SKIPPED") else match.group(2)
    return out


def _unfinished(text: str) -> str:
    """The test pytest -v had started and not finished when the run was stopped."""
    last = text.rstrip("\n").rsplit("\n", 1)[-1]
    return last.split(" ")[0] if "::" in last and not re.search(r" (PASSED|FAILED|ERROR|SKIPPED)", last) else ""


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
    result = run(args.select, max(args.seconds, 0.0), pathlib.Path(args.log) if args.log else None)
    print(f"Pallas kernel tests, {result['mode']} on {result['platform']}: {result['passed']} of {result['tests']} "
          f"passed in {result['seconds']} s" + (f"; stopped while running {result['unfinished']}"
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
