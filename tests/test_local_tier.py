"""The local checkpoint tier in one process (`meshtrain/local_tier.py`; several processes, a peer's copy
and the fallbacks: tests/test_launch.py): a resume from it is bit-equal, and a step another run left in
the same local folder (a workdir deleted and started again) is never used."""

from __future__ import annotations

import shutil

from meshtrain import local_tier, train
from tests.utils import config_for, losses_of


def test_a_recreated_workdir_does_not_resume_from_the_old_runs_local_steps(tmp_path, compilation_cache):
    local = tmp_path / "local"
    overrides = {"steps": 4, "checkpoint.local_every": 2, "checkpoint.local_dir": str(local)}
    train.run(config_for(tmp_path / "run", **overrides))
    first = losses_of(tmp_path / "run")
    assert local_tier.complete_steps(str(local / "process_0" / "own"), None) == [2]
    shutil.rmtree(tmp_path / "run")  # the same workdir again, from scratch; the host memory kept step 2
    train.run(config_for(tmp_path / "run", **overrides))
    assert losses_of(tmp_path / "run") == first  # steps 1..4 trained again, not resumed from step 2
