"""The Pallas kernel tests with the kernels compiled by Triton on this machine's GPU, as JSON.

`python bench/gpu/kernel_tests.py [--out FILE] [-k EXPR]`

Runs `tests/test_pallas_flash_attention.py`, `tests/test_pallas_rms_norm.py` and
`tests/test_pallas_cross_entropy.py` with `MESHTRAIN_PALLAS=compiled` (the kernels compiled, not
interpreted) on JAX's GPU backend: each kernel and its backward against the pure-jnp reference, in
float32 (1e-5) and bf16, the tolerances of the CPU suite. On a machine without a GPU it runs them in
interpret mode instead (the CPU suite's own run). Prints a table and one JSON line (also written to
`--out`); exits 1 when a test fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILES = ("tests/test_pallas_flash_attention.py", "tests/test_pallas_rms_norm.py", "tests/test_pallas_cross_entropy.py")


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


def run(select: str = "") -> dict:
    platform = "cuda" if gpu_visible() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={report}", *FILES] + (["-k", select] if select else [])
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(platform), capture_output=True, text=True)
        results = _read_junit(report) if report.exists() else {}
    failed = {k: v for k, v in results.items() if v != "passed" and v != "skipped"}
    return {"bench": "gpu_kernel_tests", "platform": platform,
            "mode": "compiled" if platform == "cuda" else "interpret", "tests": len(results),
            "passed": sum(v == "passed" for v in results.values()), "failed": failed,
            "pytest_exit": proc.returncode, "tail": (proc.stdout + proc.stderr)[-2000:] if proc.returncode else ""}


def _read_junit(path: pathlib.Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            out[name] = (problem.get("message") or "failed")[:500]
        else:
            out[name] = "skipped" if case.find("skipped") is not None else "passed"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    parser.add_argument("-k", dest="select", default="", help="pytest -k expression (a subset of the tests)")
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: the tests of the default block sizes")
    args = parser.parse_args()
    if args.quick:
        args.select = args.select or "default_blocks"
    result = run(args.select)
    print(f"Pallas kernel tests, {result['mode']} on {result['platform']}: {result['passed']} of {result['tests']} "
          "passed")
    for name, message in result["failed"].items():
        print(f"  FAILED {name}: {message.splitlines()[0] if message else ''}")
    line = json.dumps(result)
    print(line)
    if args.out:
        pathlib.Path(args.out).write_text(line + "\n")
    sys.exit(0 if result["pytest_exit"] == 0 and result["tests"] else 1)


if __name__ == "__main__":
    main()
