"""The `text_files` TFDS builder: local text files -> an array_record dataset, no TensorFlow.

Each document goes to `validation` when a hash of its text falls in the first
`VALIDATION_PERCENT` percent, otherwise to `train`: the split is deterministic and does not
depend on file order. A small corpus whose hashes give no validation document gives it the
document of smallest hash (with two documents or more); a corpus of one document has no
validation split. The builder config name identifies the file set (`corpus.corpus_name`),
so a changed glob or a changed file builds a new dataset beside the old one. The class is not
registered with TFDS: a prepared dataset also reads back as `tfds:text_files/<config name>`.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import ClassVar

import tensorflow_datasets as tfds
from tensorflow_datasets.core import utils as tfds_utils

from meshtrain import checksums, config as config_lib, durable
from meshtrain.data import corpus

VALIDATION_PERCENT = 5
STATS_FILE = "meshtrain_read_stats.json"
SHARDS_FILE = "meshtrain_shards.json"  # {shard file: [size, crc32]} as prepared


def damaged_shards(data_dir: str) -> list[str]:
    """What is wrong with a prepared dataset's shards against `SHARDS_FILE` ([] if nothing or no record)."""
    path = os.path.join(data_dir, SHARDS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recorded = json.load(f)
    return checksums.mismatches(data_dir, recorded, full_paths=True)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", errors="replace")).digest()[:8], "little")


def split_of(text: str) -> str:
    """'validation' for a fixed ~VALIDATION_PERCENT% of documents (by content hash), else 'train'."""
    return "validation" if _hash(text) % 100 < VALIDATION_PERCENT else "train"


class TextFiles(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Documents of a list of local files (see `corpus.read_documents`), stored as array_record."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Text documents of local files, split by content hash.",
                                               "1.1.0": "Binary and non-UTF-8 files, and JSON lines without a "
                                                        "string text, skipped and counted."}

    @tfds_utils.classproperty
    @classmethod
    def code_path(cls) -> None:
        # No checksums file or resources live beside this builder; locating its code would
        # import `importlib_resources`, which a TFDS install without TensorFlow may lack.
        return None

    def __init__(self, *, files: list[str], name: str, text_field: str = "text", strict: bool = False, **kwargs):
        self._files = list(files)
        self._text_field, self._strict = text_field, strict
        self.read_stats = corpus.ReadStats()
        super().__init__(config=tfds.core.BuilderConfig(name=name), file_format="array_record", **kwargs)

    @property
    def source_files(self) -> list[str]:
        """The text files this corpus is made of."""
        return list(self._files)

    def _log_download_bytes(self) -> None:  # TFDS prints these two lines itself; the run says its own
        pass

    def _log_download_done(self) -> None:
        pass

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Documents of local text files (plain, .jsonl, .gz).",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        hashes = {key: _hash(text) for key, text in corpus.read_documents(self._files, self._text_field,
                                                                           self.read_stats, self._strict)}
        if not hashes:
            unreadable = self.read_stats.unreadable_files
            shown = self._files[0] if len(self._files) == 1 else f"{self._files[0]} and {len(self._files) - 1} more"
            why = f"; {unreadable} unreadable, e.g. {self.read_stats.examples}" if unreadable else ""
            raise config_lib.ConfigError("data.files", shown, f"the files hold no document: empty, or no line with "
                                         f"text{why}")
        validation = {key for key, h in hashes.items() if h % 100 < VALIDATION_PERCENT}
        if not validation and len(hashes) > 1:
            validation = {min(hashes, key=hashes.get)}
        if len(validation) == len(hashes):
            validation = set()
        generators = {"train": self._generate_examples(validation, keep=False)}
        if validation:
            generators["validation"] = self._generate_examples(validation, keep=True)
        return generators

    def _generate_examples(self, validation: set[str], keep: bool):
        for key, text in corpus.read_documents(self._files, self._text_field, corpus.ReadStats()):
            if (key in validation) == keep:
                yield key, {"text": text}

    def write_read_stats(self) -> None:
        """Stores what reading met (non-UTF-8 and unreadable files) beside the dataset, and the
        size and CRC-32 of every shard written (`shard_checksums`), checked before each tokenization."""
        durable.write_json(os.path.join(self.data_dir, STATS_FILE), self.read_stats.__dict__)
        shards = {name: list(checksums.size_and_crc32(os.path.join(self.data_dir, name)))
                  for name in sorted(os.listdir(self.data_dir)) if ".array_record-" in name and durable.TMP_MARK
                  not in name}
        durable.write_json(os.path.join(self.data_dir, SHARDS_FILE), shards)

    def is_complete(self) -> bool:
        """Whether the stats and checksums of `write_read_stats` are beside the prepared dataset (the
        checksums are written last: a crash between TFDS's rename and them leaves them out)."""
        return os.path.exists(os.path.join(self.data_dir, SHARDS_FILE))

    def finish_interrupted(self) -> None:
        """Writes what a crash after TFDS's preparation left out (`is_complete`): the documents are read
        once more for their stats (nothing is tokenized or stored again), the shards checksummed."""
        self.read_stats = corpus.ReadStats()
        for _ in corpus.read_documents(self._files, self._text_field, self.read_stats, self._strict):
            pass
        self.write_read_stats()

    def load_read_stats(self) -> dict:
        path = os.path.join(self.data_dir, STATS_FILE)
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return json.load(f)
