"""`python -m meshtrain.data.prepare --config configs/tiny.py`: build the dataset ahead of training.

Builds the TFDS dataset of `config.data.source` (array_record), tokenizes both splits into
the token cache, and prints the size: documents, tokens and rows of `train.seq_len`, plus
the files that were not UTF-8 or not readable. Training does the same on first use.
"""

from __future__ import annotations

import json
import sys

from absl import app
from ml_collections import config_flags

from meshtrain import cli, data as data_lib, durable

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)


def prepare(config) -> dict:
    """Validates the data keys of `config`, prepares its dataset and returns the summary."""
    data_lib.validate_config(config, {})
    if config.data.source == "synthetic":
        return {"source": "synthetic", "note": "nothing to prepare: rows are generated on the fly"}
    from meshtrain.data import sources

    return {"source": config.data.source, **sources.prepare(config)}


def main(argv) -> None:
    del argv
    try:
        summary = prepare(_CONFIG.value)
    except ValueError as error:  # a bad config or bad input: one clear line, no traceback
        sys.exit(f"error: {error}")
    except durable.WriteError as error:  # a full disk, a read-only folder: one line, exit code 4
        print(f"error: {error}", file=sys.stderr)
        sys.exit(4)
    for split, sizes in summary.get("splits", {}).items():
        print(f"{split:>10}: {sizes['documents']:,} documents, {sizes['tokens']:,} tokens, "
              f"{sizes['rows']:,} rows of {_CONFIG.value.train.seq_len} tokens, unigram entropy "
              f"{sizes['unigram_entropy_nats']:.3f} nats/token")
    stats = summary.get("read_stats") or {}
    if stats:
        print(f"     files: {stats['files']:,} read, {stats['non_utf8_files']} not UTF-8 (decoded with "
              f"replacement), {stats['unreadable_files']} unreadable (skipped), {stats['bad_json_lines']} bad "
              f"JSON lines (skipped){'; e.g. ' + ', '.join(stats['examples']) if stats['examples'] else ''}")
    print(json.dumps(summary))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
