"""Where documents come from: a glob of local files, or the embedded default corpus.

The default corpus is real text present on every machine that runs meshtrain: the Python
standard library's own `.py` sources, found through `sysconfig`. It is capped to a fixed
subset (`DEFAULT_CORPUS_BYTES`, files under `DEFAULT_MAX_FILE_BYTES`, chosen by a hash of
the relative path, so the choice is the same on every machine with the same Python) so
that preparing it takes seconds on a laptop CPU.

Files: plain text (one document per file), `.jsonl` (one document per line, the text in
`config.data.text_field`), and either of them gzipped (`.gz`). Bytes that are not UTF-8
are decoded with replacement characters and counted; unreadable files are counted and
skipped. Both counts are reported by `prepare`.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator

from meshtrain.config import ConfigError

DEFAULT_CORPUS_BYTES = 4 * 2**20
DEFAULT_MAX_FILE_BYTES = 128 * 2**10
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass
class ReadStats:
    """What reading the files met: reported, never silently dropped."""

    files: int = 0
    documents: int = 0
    non_utf8_files: int = 0
    unreadable_files: int = 0
    bad_json_lines: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)  # a few paths of problem files

    def note(self, path: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(path)


def default_corpus_files() -> list[str]:
    """The capped, machine-independent subset of the standard library's `.py` files."""
    return list(_default_corpus())


@functools.cache  # walked once per process: the planner validates a config per candidate mesh
def _default_corpus() -> tuple[str, ...]:
    root = sysconfig.get_paths()["stdlib"]
    candidates = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in files:
            path = os.path.join(directory, name)
            if name.endswith(".py") and os.path.getsize(path) <= DEFAULT_MAX_FILE_BYTES:
                candidates.append(os.path.relpath(path, root))
    candidates.sort(key=lambda rel: hashlib.sha1(rel.encode()).hexdigest())
    chosen, total = [], 0
    for rel in candidates:
        size = os.path.getsize(os.path.join(root, rel))
        if total + size > DEFAULT_CORPUS_BYTES:
            continue
        chosen.append(os.path.join(root, rel))
        total += size
    return tuple(sorted(chosen))


def expand_files(pattern: str) -> list[str]:
    """The sorted files a glob names (empty pattern: the default corpus). Raises if none match."""
    if not pattern:
        return default_corpus_files()
    files = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError("data.files", pattern, "the glob matches no files")
    return files


def corpus_name(pattern: str, files: list[str], text_field: str) -> str:
    """A stable name for the dataset built from `files` (changes when a file changes)."""
    digest = hashlib.sha256(text_field.encode())
    for path in files:
        stat = os.stat(path)
        digest.update(f"{path}\0{stat.st_size}\0{int(stat.st_mtime)}\0".encode())
    prefix = "stdlib" if not pattern else "files"
    return f"{prefix}_{digest.hexdigest()[:12]}"


def _decode(raw: bytes, path: str, stats: ReadStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.non_utf8_files += 1
        stats.note(path)
        return raw.decode("utf-8", errors="replace")


def read_documents(files: list[str], text_field: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    """Yields (key, text) for every document of every file, updating `stats`."""
    for path in files:
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rb") as f:
                raw = f.read()
        except (OSError, EOFError):
            stats.unreadable_files += 1
            stats.note(path)
            continue
        stats.files += 1
        text = _decode(raw, path, stats)
        inner = path.removesuffix(".gz")
        if inner.endswith(".jsonl"):
            for line_number, line in enumerate(text.splitlines()):
                if not line.strip():
                    continue
                try:
                    document = json.loads(line)[text_field]
                except (ValueError, KeyError, TypeError):
                    stats.bad_json_lines += 1
                    stats.note(f"{path}:{line_number + 1}")
                    continue
                stats.documents += 1
                yield f"{path}:{line_number}", str(document)
        elif text:
            stats.documents += 1
            yield path, text
