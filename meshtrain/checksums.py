"""File checksums for what meshtrain writes and reads back: checkpoints (`checkpoint.py`) and
prepared dataset shards (`data/text_files.py`). CRC-32 (zlib): fast, in the standard library,
and enough to catch truncation and flipped bytes; not a defence against deliberate tampering."""

from __future__ import annotations

import os
import zlib


def crc32(path: str) -> int:
    """CRC-32 of a file's bytes, read in 4 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def size_and_crc32(path: str) -> tuple[int, int]:
    return os.path.getsize(path), crc32(path)


def mismatches(root: str, recorded: dict, full_paths: bool = False) -> list[str]:
    """What differs between the files under `root` and `recorded` {relative path: [size, crc32]}
    (missing, resized, changed bytes), one line per file naming it (relative, or full)."""
    problems = []
    for rel, (size, crc) in sorted(recorded.items()):
        path = os.path.join(root, rel)
        name = path if full_paths else rel
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{name} has {os.path.getsize(path)} bytes, {size} were written (truncated or appended)")
        elif crc32(path) != crc:
            problems.append(f"{name} does not match its CRC-32 (its bytes changed since they were written)")
    return problems
