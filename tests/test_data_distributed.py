"""Two real processes (jax.distributed on 127.0.0.1, 4 fake CPU devices each) read disjoint rows
whose union is exactly what one process reads."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess

NAMES = ("data", "stage", "fsdp", "expert", "sequence", "tensor")
MESHES = {"dp8": (4, 1, 2, 1, 1, 1), "dp4_seq2": (2, 1, 2, 1, 2, 1)}
STEPS, BATCH, SEQ = 3, 8, 16
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_for(source, data_dir):
    from meshtrain import config as config_lib

    c = config_lib.default_config()
    c.seed, c.train.batch_size, c.train.seq_len = 11, BATCH, SEQ
    c.data.source, c.data.data_dir = source, data_dir
    return c


def batch_sharding(mesh_name: str) -> jax.sharding.NamedSharding:
    """Rows over the batch axes, length over `sequence` (`Run.batch_sharding`) on the named mesh."""
    from meshtrain.sharding_rules import Rules

    mesh = jax.make_mesh(MESHES[mesh_name], NAMES, axis_types=(jax.sharding.AxisType.Auto,) * 6)
    return jax.sharding.NamedSharding(mesh, Rules.for_mesh(mesh).spec(("batch", "length")))


def worker(process_id: int, port: int, source: str, data_dir: str, mesh_name: str, out: str) -> None:
    """One process: joins the job, reads STEPS batches, saves the shards it holds with their indices."""
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    from meshtrain import data

    it = data.iterator(config_for(source, data_dir), batch_sharding(mesh_name))
    shards = []
    for step in range(STEPS):
        batch = next(it)
        for name, array in batch.items():
            for shard in array.addressable_shards:
                rows, cols = (s.indices(n)[:2] for s, n in zip(shard.index, array.shape, strict=True))
                shards.append({"step": step, "field": name, "rows": rows, "cols": cols,
                               "value": np.asarray(shard.data).tolist()})
    state = it.state()
    it.close()
    with open(out, "w") as f:
        json.dump({"shards": shards, "state": state, "local_devices": jax.local_device_count()}, f)
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("source,mesh_name", [("synthetic", "dp8"), ("text_files", "dp4_seq2")])
def test_two_processes_read_disjoint_rows_whose_union_is_one_process(tmp_path, source, mesh_name):
    from meshtrain import data

    data_dir = str(tmp_path / "tfds")
    config = config_for(source, data_dir)
    single_it = data.iterator(config, batch_sharding(mesh_name))  # also prepares the dataset first
    single = [{k: np.asarray(v) for k, v in next(single_it).items()} for _ in range(STEPS)]
    single_it.close()

    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    outs = [str(tmp_path / f"proc{i}.json") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), source, data_dir, mesh_name, outs[i]],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0].decode()[-3000:] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log

    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    assert all(r["local_devices"] == 4 for r in results)
    assert results[0]["state"] == results[1]["state"] and results[0]["state"]["next_row"] == STEPS * BATCH
    rows_of = [{(s["step"], r) for s in res["shards"] for r in range(*s["rows"])} for res in results]
    assert not rows_of[0] & rows_of[1]  # disjoint rows
    assert rows_of[0] | rows_of[1] == {(step, r) for step in range(STEPS) for r in range(BATCH)}
    covered = {}
    for res in results:
        for s in res["shards"]:
            want = single[s["step"]][s["field"]][slice(*s["rows"]), slice(*s["cols"])]
            np.testing.assert_array_equal(np.asarray(s["value"], want.dtype), want)
            covered.setdefault((s["step"], s["field"]), np.zeros((BATCH, SEQ), bool))[
                slice(*s["rows"]), slice(*s["cols"])] = True
    assert len(covered) == STEPS * 5 and all(mask.all() for mask in covered.values())  # union = everything


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])
