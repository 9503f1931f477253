"""Input pipeline throughput: rows/s and tokens/s, to compare with the model's consumption.

    python bench/data_pipeline.py [--source text_files] [--batches 200] [--seq_len 128] [--batch_size 16]

Measures (1) the host row rate of the source alone (read + pack, one thread) and (2) the
end-to-end rate of `data.make_iterator` on the default mesh of 8 fake CPU devices: grain
reading threads, prefetch and global-array assembly, consumed as fast as possible. A step is
input-bound only if it consumes rows faster than (2). Prints the figures and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

from meshtrain import config as config_lib, data
from meshtrain.data import packing
from meshtrain.run import Run
from meshtrain.validate import validate


def make_config(args) -> config_lib.ml_collections.ConfigDict:
    c = config_lib.default_config()
    c.data.source, c.train.batch_size, c.train.seq_len = args.source, args.batch_size, args.seq_len
    c.data.data_dir = args.data_dir or os.path.join(tempfile.gettempdir(), "meshtrain_bench_tfds")
    return c


def host_rows_per_sec(config, rows: int) -> float:
    source = data._rows(config, "train")
    start = time.perf_counter()
    for i in range(rows):
        tokens, doc_ids = source[i]
        packing.row_fields(tokens, doc_ids, False)
    return rows / (time.perf_counter() - start)


def pipeline_rows_per_sec(config, batches: int) -> tuple[float, float]:
    config.mesh.data = 8
    it = data.make_iterator(Run.resolve(config, jax.devices()[:8]))
    jax.block_until_ready(next(it))  # warm-up: threads started, first rows read
    start, waited = time.perf_counter(), it.wait_seconds
    for _ in range(batches):
        jax.block_until_ready(next(it))
    elapsed = time.perf_counter() - start
    per_batch_wait = (it.wait_seconds - waited) / batches
    it.close()
    return batches * config.train.batch_size / elapsed, per_batch_wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="text_files", choices=("text_files", "synthetic"))
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--data_dir", default="")
    args = parser.parse_args()
    config = make_config(args)
    validate(config, 8)
    start = time.perf_counter()
    data._rows(config, "train")  # prepares the dataset if missing
    prepare_s = time.perf_counter() - start
    host = host_rows_per_sec(config, args.batches * args.batch_size)
    rows_s, wait_s = pipeline_rows_per_sec(config, args.batches)
    result = {"source": args.source, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "cpu_count": os.cpu_count(), "prepare_or_open_s": round(prepare_s, 3),
              "host_rows_per_sec": round(host, 1), "host_tokens_per_sec": round(host * args.seq_len),
              "pipeline_rows_per_sec": round(rows_s, 1), "pipeline_tokens_per_sec": round(rows_s * args.seq_len),
              "pipeline_batches_per_sec": round(rows_s / args.batch_size, 1),
              "wait_per_batch_ms_when_consumed_flat_out": round(1000 * wait_s, 3)}
    print(f"source {args.source}: batch {args.batch_size} x seq_len {args.seq_len} on {os.cpu_count()} CPUs")
    print(f"  prepare/open:             {prepare_s:8.2f} s")
    print(f"  host rows (1 thread):     {host:10,.0f} rows/s  {host * args.seq_len:12,.0f} tokens/s")
    print(f"  iterator (global arrays): {rows_s:10,.0f} rows/s  {rows_s * args.seq_len:12,.0f} tokens/s  "
          f"({rows_s / args.batch_size:,.1f} batches/s)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
