"""`config.data.source='hf:<path>'`: a local Hugging Face dataset read through `datasets`.

`<path>` is a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`, or a glob
of data files `datasets` reads: parquet, JSON / JSON Lines (also gzipped), arrow, CSV. Nothing
is fetched from the Hub. Documents are the `config.data.text_field` column.

Preparing streams the documents a record batch at a time (pyarrow for parquet and arrow,
`load_dataset(..., streaming=True)` for JSON and CSV), so memory stays flat however large the
data is, and writes them once, in the dataset's
order, into one array_record file per split under `<data_dir>/meshtrain_hf/<name>/`. From there
the documents take the path of every other source: `sources.token_cache` tokenises them into the
same token cache and `sources.PackedRows` packs, masks and shuffles them, so determinism and
exact resume hold unchanged. A `DatasetDict` keeps its own `train` and `validation` (or `test`)
splits; any other dataset is split by content hash as `text_files` is (`text_files.split_of`).
The name identifies the files (paths, sizes, modification times) and the text field, so a
changed file prepares a new dataset beside the old one; the shards' sizes and CRC-32s are
recorded and checked before each tokenisation, as for `text_files`.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import types
from collections.abc import Iterator

import grain
from array_record.python import array_record_module

from meshtrain import checksums
from meshtrain.config import ConfigError
from meshtrain.data import text_files

PREFIX = "hf:"
SUBDIR = "meshtrain_hf"
INFO_FILE = "meshtrain_hf.json"
KINDS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow", ".csv": "csv"}
log = logging.getLogger("meshtrain")


def _kind(path: str) -> str | None:
    name = path.removesuffix(".gz")
    return next((kind for suffix, kind in KINDS.items() if name.endswith(suffix)), None)


def _arrow_files(folder: str) -> list[str]:
    """The data files of one `Dataset.save_to_disk` folder, in the order its state.json lists them."""
    with open(os.path.join(folder, "state.json")) as f:
        state = json.load(f)
    return [os.path.join(folder, entry["filename"]) for entry in state["_data_files"]]


def resolve(source: str) -> tuple[str, dict[str, list[str]] | list[str]]:
    """(`datasets` builder, the files) of `hf:<path>`: {split: files} for a DatasetDict folder (its
    own splits), else one list of files (split by content hash). Raises ConfigError."""
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError("data.source", source, "reading Hugging Face datasets needs the datasets package: "
                          "pip install 'meshtrain[data]'")
    path = os.path.expanduser(source.removeprefix(PREFIX))
    if not path:
        raise ConfigError("data.source", source, "'hf:' must be followed by a save_to_disk folder or a glob of "
                          "parquet / JSON / arrow / CSV files")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            with open(os.path.join(path, "dataset_dict.json")) as f:
                names = json.load(f)["splits"]
            if "train" not in names:
                raise ConfigError("data.source", source, f"the DatasetDict has the splits {names}, none named 'train'")
            splits = {"train": _arrow_files(os.path.join(path, "train"))}
            held_out = next((n for n in ("validation", "test") if n in names), None)
            if held_out:
                splits["validation"] = _arrow_files(os.path.join(path, held_out))
            return "arrow", splits
        if os.path.exists(os.path.join(path, "state.json")):
            return "arrow", _arrow_files(path)
        raise ConfigError("data.source", source, f"{path} is a folder but not one written by save_to_disk (no "
                          "state.json or dataset_dict.json); name its data files by a glob, e.g. hf:DIR/*.parquet")
    files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError("data.source", source, "matches no file and no save_to_disk folder")
    kinds = {_kind(p) for p in files}
    if None in kinds or len(kinds) > 1:
        shown = ", ".join(os.path.basename(p) for p in files[:4])
        raise ConfigError("data.source", source, f"the glob matches {shown}{' ...' if len(files) > 4 else ''}: files "
                          f"of one kind are needed, one of {sorted(set(KINDS))} (optionally .gz for JSON)")
    return kinds.pop(), files


def dataset_name(source: str, text_field: str) -> str:
    """A stable name for the prepared dataset (changes when a file or the field changes)."""
    kind, files = resolve(source)
    digest = hashlib.sha256(f"{kind}\0{text_field}\0".encode())
    for split, paths in (files.items() if isinstance(files, dict) else [("all", files)]):
        for path in paths:
            stat = os.stat(path)
            digest.update(f"{split}\0{os.path.realpath(path)}\0{stat.st_size}\0{int(stat.st_mtime)}\0".encode())
    return f"hf_{digest.hexdigest()[:12]}"


def _stream(kind: str, files: list[str], text_field: str, source: str) -> Iterator[str]:
    """The text of every example, streamed (never the whole dataset in memory).

    Parquet and arrow files are read with pyarrow, a record batch at a time, without pre-buffering
    or reader threads: `datasets`' streaming reader of this version keeps memory in proportion to
    the data it has read, this way stays flat (docs/data.md).
    JSON and CSV stream through `datasets`.
    """
    if kind in ("parquet", "arrow"):
        batches = _parquet_batches(files, text_field) if kind == "parquet" else _arrow_batches(files)
        for path, batch in batches:
            if text_field not in batch.schema.names:
                raise ConfigError("data.text_field", text_field, f"the examples of {source} ({path}) have the "
                                  f"fields {sorted(batch.schema.names)}")
            for text in batch.column(text_field).to_pylist():
                if text is not None:
                    yield str(text)
        return
    import datasets

    stream = datasets.load_dataset(kind, data_files=files, split="train", streaming=True)
    for index, example in enumerate(stream):
        if text_field not in example:
            raise ConfigError("data.text_field", text_field, f"the examples of {source} have the fields "
                              f"{sorted(example)}")
        text = example[text_field]
        if text is None:
            log.warning("%s: example %d has no %r (None): skipped", source, index, text_field)
            continue
        yield str(text)


def _parquet_batches(files: list[str], text_field: str):
    import pyarrow.parquet as pq

    for path in files:
        reader = pq.ParquetFile(path, pre_buffer=False)
        columns = [text_field] if text_field in reader.schema_arrow.names else None  # else: the error names them
        for batch in reader.iter_batches(batch_size=256, columns=columns, use_threads=False):
            yield path, batch


def _arrow_batches(files: list[str]):
    import pyarrow as pa

    for path in files:
        source = pa.memory_map(path)
        try:
            reader = pa.ipc.open_stream(source)  # what save_to_disk writes
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield path, reader.get_batch(i)
            continue
        for batch in reader:
            yield path, batch


class HFDataset:
    """A prepared `hf:` dataset: one array_record file of UTF-8 documents per split.

    Offers what `sources.token_cache` reads of a TFDS builder: `name`, `data_dir`,
    `info.splits` and `as_data_source(split)`.
    """

    def __init__(self, source: str, text_field: str, root: str):
        self.source, self.text_field = source, text_field
        self.name = dataset_name(source, text_field)
        self.data_dir = os.path.join(root, SUBDIR, self.name)
        self.info = types.SimpleNamespace(splits=self._read_info().get("splits", {}))

    def _read_info(self) -> dict:
        path = os.path.join(self.data_dir, INFO_FILE)
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return json.load(f)

    def is_prepared(self) -> bool:
        return bool(self.info.splits)

    def prepare(self, progress: bool = False) -> None:
        """Streams the documents into array_record files, written aside and renamed into place (a
        process sharing `data_dir` that finishes first wins; ours is then discarded)."""
        kind, files = resolve(self.source)
        tmp = f"{self.data_dir}.tmp.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        writers = {split: array_record_module.ArrayRecordWriter(os.path.join(tmp, f"{split}.array_record"),
                                                                "group_size:1") for split in ("train", "validation")}
        counts = dict.fromkeys(writers, 0)
        try:
            parts = files.items() if isinstance(files, dict) else [(None, files)]
            for split, paths in parts:
                for text in _stream(kind, paths, self.text_field, self.source):
                    target = split or text_files.split_of(text)
                    writers[target].write(text.encode("utf-8"))
                    counts[target] += 1
                    if progress and sum(counts.values()) % 100_000 == 0:
                        log.info("%s: %d documents read", self.source, sum(counts.values()))
        except BaseException:
            for writer in writers.values():
                writer.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for writer in writers.values():
            writer.close()
        if not counts["train"]:
            shutil.rmtree(tmp)
            raise ConfigError("data.source", self.source, f"holds no document with a {self.text_field!r} field "
                              "in its train split")
        splits = {split: n for split, n in counts.items() if n}
        for split in set(counts) - set(splits):
            os.remove(os.path.join(tmp, f"{split}.array_record"))
        shards = {name: list(checksums.size_and_crc32(os.path.join(tmp, name))) for name in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, text_files.SHARDS_FILE), "w") as f:
            json.dump(shards, f)
        with open(os.path.join(tmp, INFO_FILE), "w") as f:  # written last: marks the folder complete
            json.dump({"source": self.source, "text_field": self.text_field, "kind": kind, "splits": splits}, f)
        os.makedirs(os.path.dirname(self.data_dir), exist_ok=True)
        try:
            os.rename(tmp, self.data_dir)
        except OSError:  # prepared meanwhile by another process
            shutil.rmtree(tmp, ignore_errors=True)
        self.info.splits = self._read_info().get("splits", {})
        if not self.info.splits:
            raise ConfigError("data.source", self.source, f"{self.data_dir} exists without {INFO_FILE} (an "
                              "interrupted copy?): delete it and prepare again")

    def as_data_source(self, split: str):
        return _Documents(os.path.join(self.data_dir, f"{split}.array_record"), self.text_field)


class _Documents:
    """Random access to one split's documents, each as {text_field: bytes}."""

    def __init__(self, path: str, field: str):
        self._records, self._field = grain.sources.ArrayRecordDataSource([path]), field

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict:
        return {self._field: self._records[index]}
