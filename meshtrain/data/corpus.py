"""Where documents come from: a glob of local files, or the embedded default corpus.

The default corpus is real text present on every machine that runs meshtrain: the Python
standard library's own `.py` sources, found through `sysconfig`. It is capped to a fixed
subset (`DEFAULT_CORPUS_BYTES`, files under `DEFAULT_MAX_FILE_BYTES`, chosen by a hash of
the relative path, so the choice is the same on every machine with the same Python) so
that preparing it takes seconds on a laptop CPU.

Files: plain text (one document per file), `.jsonl` (one document per line, the text in
`config.data.text_field`), and either of them gzipped (`.gz`); `config.data.files` may name a
folder (every file under it). What is read is checked, and nothing is silently turned into text:

* a file that is binary (a NUL byte) or not UTF-8 is skipped by name and counted;
* a JSON line that does not parse, lacks the field, or holds anything but a string in it
  (null, a number, an object) is skipped and counted; a `.jsonl` file in which no line has the
  field stops the run with one error naming `data.text_field` and the keys its lines do have;
* an unreadable file is skipped by name and counted.

`data.on_bad_data="error"` turns each skip into that one error instead. The counts are stored
beside the prepared dataset; a training run prints them once and keeps them in the first
record of metrics.jsonl (`read_report`).
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
    non_utf8_files: int = 0  # binary (a NUL byte) or not UTF-8: skipped
    unreadable_files: int = 0
    bad_json_lines: int = 0  # not JSON
    missing_field_lines: int = 0  # JSON without `text_field`
    non_string_lines: int = 0  # `text_field` null, a number, a list or an object
    examples: list[str] = dataclasses.field(default_factory=list)  # a few paths of problem files

    def note(self, path: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(path)

    @property
    def skipped_lines(self) -> int:
        return self.bad_json_lines + self.missing_field_lines + self.non_string_lines


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
    """The sorted files a glob names, or every file under a folder (empty pattern: the default
    corpus). Raises if none match."""
    if not pattern:
        return default_corpus_files()
    path = os.path.expanduser(pattern)
    if os.path.isdir(path):
        files = sorted(os.path.join(d, name) for d, dirs, names in os.walk(path) for name in names
                       if not name.startswith("."))
        if not files:
            raise ConfigError("data.files", pattern, "the folder holds no files")
        return files
    files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
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


def _decode(raw: bytes) -> str | None:
    """The UTF-8 text of a file, or None when it is binary (a NUL byte) or not UTF-8."""
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _skip(stats: ReadStats, counter: str, where: str, why: str, strict: bool) -> None:
    """Counts a skipped file or line; under `data.on_bad_data="error"` raises the one error instead."""
    if strict:
        raise ConfigError("data.on_bad_data", "error", f"{where}: {why} (data.on_bad_data='skip' skips and counts it)")
    setattr(stats, counter, getattr(stats, counter) + 1)
    stats.note(where)


def read_documents(files: list[str], text_field: str, stats: ReadStats, strict: bool = False
                   ) -> Iterator[tuple[str, str]]:
    """Yields (key, text) for every document of every file, updating `stats` (module docstring);
    `strict`: a bad file or line raises ConfigError instead of being skipped."""
    for path in files:
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rb") as f:
                raw = f.read()
        except (OSError, EOFError) as error:
            _skip(stats, "unreadable_files", path, f"unreadable ({error})", strict)
            continue
        text = _decode(raw)
        if text is None:
            _skip(stats, "non_utf8_files", path, "binary or not UTF-8 text", strict)
            continue
        stats.files += 1
        if path.removesuffix(".gz").endswith(".jsonl"):
            yield from _json_lines(path, text, text_field, stats, strict)
        elif text:
            stats.documents += 1
            yield path, text


def _json_lines(path: str, text: str, text_field: str, stats: ReadStats, strict: bool) -> Iterator[tuple[str, str]]:
    """The documents of a JSON Lines file: each line's `text_field`, when it is a string."""
    lines, found, keys = 0, False, set()
    for line_number, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        lines += 1
        where = f"{path}:{line_number + 1}"
        try:
            record = json.loads(line)
        except ValueError:
            _skip(stats, "bad_json_lines", where, "not JSON", strict)
            continue
        if not isinstance(record, dict) or text_field not in record:
            keys.update(record if isinstance(record, dict) else ())
            _skip(stats, "missing_field_lines", where, f"no key {text_field!r}", strict)
            continue
        found = True
        document = record[text_field]
        if not isinstance(document, str):
            _skip(stats, "non_string_lines", where, f"{text_field!r} holds {type(document).__name__}, not text",
                  strict)
            continue
        stats.documents += 1
        yield f"{path}:{line_number}", document
    if lines and not found:
        raise ConfigError("data.text_field", text_field, f"no line of {path} has this key (its {lines} lines have "
                          f"{', '.join(sorted(keys)[:8]) or 'no keys'}): set data.text_field to the field that holds "
                          "the text")


def read_report(stats: dict) -> dict[str, int]:
    """The counts a run logs once and keeps in its first metrics record (from `ReadStats.__dict__`)."""
    if not stats:
        return {}
    lines = sum(int(stats.get(k, 0)) for k in ("bad_json_lines", "missing_field_lines", "non_string_lines"))
    return {"data_files": int(stats.get("files", 0)), "data_documents": int(stats.get("documents", 0)),
            "data_skipped_files": int(stats.get("non_utf8_files", 0)) + int(stats.get("unreadable_files", 0)),
            "data_skipped_lines": lines}
