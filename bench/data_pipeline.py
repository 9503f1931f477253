"""Input pipeline throughput: rows/s and tokens/s, to compare with the model's consumption.

    python bench/data_pipeline.py [--source text_files] [--batches 200] [--seq_len 128] [--batch_size 16]
    python bench/data_pipeline.py --hf_rss [--hf_mib 16,128]

Measures (1) the host row rate of the source alone (read + pack, one thread) and (2) the
end-to-end rate of `data.make_iterator` on the default mesh of 8 fake CPU devices: grain
reading threads, prefetch and global-array assembly, consumed as fast as possible. A step is
input-bound only if it consumes rows faster than (2). Prints the figures and one JSON line.

`--hf_rss` measures instead the memory of preparing an `hf:` dataset (a parquet file of random
Python-like documents, `--hf_mib` MiB of text each): each size is prepared (streamed to array_record,
tokenized to the token cache) in a fresh process that samples its resident set every 20 ms. Flat
memory means the growth over the process's baseline does not grow with the data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
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


def _rss_mib() -> float:
    """The anonymous part of the resident set (MiB): the process's own memory, without the pages of
    memory-mapped files (the token cache is read and written through mmap; the kernel drops those
    pages under pressure)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def write_parquet(path: str, mib: int) -> int:
    """Random Python-like documents of about 4 KiB, `mib` MiB in all, written a row group at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = np.array(["def", "return", "self", "import", "value", "for", "in", "range(n):", "if", "else:", "print(x)",
                      "items", "append", "class", "None", "True", "=", "+", "\n    "])
    rng, written, docs = np.random.default_rng(0), 0, 0
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        while written < mib * 2**20:
            batch = [" ".join(rng.choice(words, size=700)) for _ in range(256)]
            writer.write_table(pa.table({"text": batch}))
            written += sum(len(d) for d in batch)
            docs += len(batch)
    return docs


def hf_rss_child(glob_pattern: str, data_dir: str) -> None:
    """Prepares `hf:<glob_pattern>` (both splits' token caches) and prints its memory as JSON."""
    import datasets  # noqa: F401  (imported before the baseline: its import is not the data's memory)

    from meshtrain.data import sources

    config = config_lib.default_config()
    config.data.source, config.data.data_dir = f"hf:{glob_pattern}", data_dir
    base, peak, done = _rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(0.02)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    result = sources.builder(config)
    tokens = sum(int(sources.token_cache(result, split, config)[1][-1]) for split in ("train", "validation"))
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    print(json.dumps({"base_mib": round(base, 1), "peak_mib": round(max(peak[0], _rss_mib()), 1),
                      "tokens": tokens, "seconds": round(seconds, 2)}))


def hf_rss(args) -> None:
    window = 2 * args.batch_size * (args.seq_len + 1) * 4  # the default prefetch (2 batches) of int32 tokens
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mib in [int(m) for m in args.hf_mib.split(",")]:
            folder = os.path.join(tmp, f"mib{mib}")
            os.makedirs(folder)
            docs = write_parquet(os.path.join(folder, "part-0.parquet"), mib)
            child = subprocess.run([sys.executable, __file__, "--hf_rss_child", os.path.join(folder, "*.parquet"),
                                    "--data_dir", os.path.join(tmp, f"prepared{mib}")], capture_output=True, text=True,
                                   check=True)
            measured = json.loads(child.stdout.strip().splitlines()[-1])
            rows.append({"text_mib": mib, "documents": docs, "x_prefetch_window": round(mib * 2**20 / window),
                         **measured, "growth_mib": round(measured["peak_mib"] - measured["base_mib"], 1)})
    print(f"{'text MiB':>9} {'documents':>10} {'x prefetch':>11} {'tokens':>12} {'base MiB':>9} {'peak MiB':>9} "
          f"{'growth MiB':>11} {'seconds':>8}")
    for r in rows:
        print(f"{r['text_mib']:>9} {r['documents']:>10,} {r['x_prefetch_window']:>11,} {r['tokens']:>12,} "
              f"{r['base_mib']:>9} {r['peak_mib']:>9} {r['growth_mib']:>11} {r['seconds']:>8}")
    print(json.dumps({"bench": "hf_prepare_rss", "prefetch_window_bytes": window, "sizes": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf_rss", action="store_true", help="memory of preparing hf: datasets of growing size")
    parser.add_argument("--hf_mib", default="16,128", help="text sizes (MiB) for --hf_rss")
    parser.add_argument("--hf_rss_child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--source", default="text_files", choices=("text_files", "synthetic"))
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--data_dir", default="")
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: 20 batches")
    args = parser.parse_args()
    if args.quick:
        args.batches = 20
    if args.hf_rss_child:
        return hf_rss_child(args.hf_rss_child, args.data_dir)
    if args.hf_rss:
        return hf_rss(args)
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
