"""The GPU runbook's install on a machine without a package index, built on CPU.

A Python 3.12 environment stands in for a GPU machine's: JAX 0.11.2 and what GPU images carry beside it
(the list `bench/gpu/offline_wheels.sh` names), installed from the index. That script fills a wheel folder
(index reachable), then `bench/gpu/install.sh` installs meshtrain from the folder with every index refused
(PIP_NO_INDEX=1), keeping the machine's JAX, and the main job trains. Needs a package index to build the
stand-in (`-m network`: its own leg of .ci/run) and pyenv's Python 3.12 (fails in one line without it).
"""

import json
import os
import pathlib
import subprocess

import pytest

from tests.utils import ROOT

# What a GPU image holds beside its JAX (bench/gpu/offline_wheels.sh's list), setuptools to build meshtrain.
MACHINE = ["jax==0.11.2", "jaxlib==0.11.2", "flax==0.12.12", "optax==0.2.8", "orbax-checkpoint==0.12.8",
           "chex==0.1.92", "numpy", "absl-py", "etils", "protobuf", "pyarrow", "psutil", "requests", "tqdm",
           "wrapt", "pyyaml", "cloudpickle", "packaging", "matplotlib", "setuptools"]


def python312() -> str:
    """pyenv's Python 3.12 (as .ci/run finds it), or python3.12 on PATH."""
    root = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv"))
    found = sorted(root.glob("versions/3.12*/bin/python"))
    candidates = [str(found[-1])] if found else []
    candidates += [p for p in ("python3.12",) if subprocess.run(["which", p], capture_output=True).returncode == 0]
    for candidate in candidates:
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    pytest.fail("no Python 3.12 here ($PYENV_ROOT/versions/3.12* or python3.12 on PATH): the offline install "
                "test needs one", pytrace=False)


def run(command, **kwargs):
    out = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.network
def test_runbook_installs_from_a_wheel_folder_and_keeps_the_machines_jax(tmp_path):
    machine = tmp_path / "machine"
    run([python312(), "-m", "venv", str(machine)], timeout=120)
    python = str(machine / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *MACHINE], timeout=900)
    wheels = tmp_path / "wheels"
    run(["bash", "bench/gpu/offline_wheels.sh", str(wheels), "3.12"], cwd=ROOT, timeout=300)

    offline = {**os.environ, "PYTHON": python, "WHEELS": str(wheels), "PIP_NO_INDEX": "1",
               "PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_FIND_LINKS": ""}
    install = run(["bash", "bench/gpu/install.sh"], cwd=ROOT, env=offline, timeout=300)
    assert "JAX 0.11.2 found in range: kept" in install.stdout, install.stdout
    versions = run([python, "-c", "import jax, jaxlib, flax; print(jax.__version__, jaxlib.__version__, "
                    "flax.__version__)"]).stdout.split()
    assert versions == ["0.11.2", "0.11.2", "0.12.12"]  # nothing of the machine's replaced

    workdir = tmp_path / "run"
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    env.pop("TFDS_DATA_DIR", None)
    env.pop("PYTHONPATH", None)  # meshtrain from the install, not from the checkout's path
    env.pop("XLA_FLAGS", None)  # conftest's flags are for this process's jaxlib; 0.11 aborts on one of them
    train = run([python, "-m", "meshtrain.train", "--config", str(ROOT / "configs" / "tiny.py"),
                 "--config.steps=10", "--config.log_every=5", f"--config.workdir={workdir}"],
                cwd=tmp_path, env=env, timeout=600)
    assert "step 10 |" in train.stdout + train.stderr
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
