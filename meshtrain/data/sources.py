"""Real-data sources: TFDS datasets (and local Hugging Face datasets) -> token stream -> packed, shuffled rows.

The layout is Megatron-LM's GPT dataset (Shoeybi et al. 2019, the codebase the playbook's
"Tensor Parallelism" section builds on): the documents of a split are tokenized once into one
flat token array plus document offsets (cached beside the TFDS dataset), laid end to end in
an order shuffled from the seed, and cut into windows of `seq_len + 1` tokens every `seq_len` tokens. A
document longer than
`seq_len` spans several windows (split, never dropped); the tail shorter than one window is
left out of each epoch. grain shuffles the windows, reseeded every epoch, so global row `i`
is `windows[shuffle_epoch(i)]`: a pure function of (seed, i), which is what makes resume
exact on any topology.
"""

from __future__ import annotations

import array
import contextlib
import functools
import logging
import os
import shutil
import time

import grain
import numpy as np
import tensorflow_datasets as tfds
import tqdm

from meshtrain import config as config_lib, durable
from meshtrain.data import corpus, hf_source, text_files, tokenizers
from meshtrain.data.text_files import TextFiles

_SPLIT_IDS = {"train": 0, "validation": 1}
CACHE_DIR = "meshtrain_tokens"
_FLUSH_TOKENS = 1 << 22  # tokens held in memory while tokenizing (8-16 MiB)
log = logging.getLogger("meshtrain")


@functools.lru_cache(maxsize=8)
def tokenizer_for(spec: str):
    """The tokenizer named by `config.data.tokenizer` (loaded once per process)."""
    return tokenizers.load_tokenizer(spec)


DEFAULT_SUBDIR = "datasets"  # under the workdir, when neither data.data_dir nor $TFDS_DATA_DIR is set


def _prepared(config) -> bool:
    """Whether the text_files / hf: dataset of `config` is prepared (nothing to write but token caches)."""
    try:
        builder(config, prepare_if_missing=False)
    except config_lib.ConfigError:
        return False
    return True


def data_dir(config) -> str:
    """Where datasets are prepared and read: `config.data.data_dir`, else `$TFDS_DATA_DIR`, else
    `<workdir>/datasets` (the run's own folder, never a hidden one of the home directory)."""
    chosen = config.data.data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.join(config.workdir or ".",
                                                                                      DEFAULT_SUBDIR)
    return os.path.expanduser(chosen)


@contextlib.contextmanager
def quiet_tfds():
    """TensorFlow Datasets' own log lines (absl's "Using custom data configuration", "Downloading and
    preparing dataset ...") and progress bars off while it builds or reads: the run says what it
    prepares in its own lines."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    tfds.disable_progress_bar()
    try:
        yield
    finally:
        absl_logger.setLevel(level)


def text_files_builder(config) -> TextFiles:
    files = corpus.expand_files(config.data.files)
    name = corpus.corpus_name(config.data.files, files, config.data.text_field)
    with quiet_tfds():
        return TextFiles(files=files, name=name, text_field=config.data.text_field,
                         strict=config.data.on_bad_data == "error", data_dir=data_dir(config))


def read_report(config) -> tuple[dict[str, int], list[str]]:
    """(counts, a few of the skipped files or lines) of what reading the text files met, as the run logs
    it once and keeps it in its first metrics record; ({}, []) for other sources."""
    if config.data.source != "text_files":
        return {}, []
    stats = builder(config).load_read_stats()
    return corpus.read_report(stats), list(stats.get("examples", []))


def builder(config, prepare_if_missing: bool = True):
    """The TFDS builder of `config.data.source`, prepared (text_files) or checked (tfds:<name>)."""
    with quiet_tfds():
        return _builder(config, prepare_if_missing)


def _builder(config, prepare_if_missing: bool):
    source = config.data.source
    if source == "text_files":
        result = text_files_builder(config)
        remove_stale_incomplete(os.path.dirname(str(result.data_dir)))  # a killed preparation's, at any start
        if not result.is_prepared():
            if not prepare_if_missing:
                raise config_lib.ConfigError("data.source", source, f"not prepared in {result.data_dir}")
            log.info("data: preparing %d file(s) into %s (once; later runs read it)", len(result.source_files),
                     result.data_dir)
            start = time.monotonic()
            try:
                result.download_and_prepare()
                result.write_read_stats()
                log.info("data: prepared in %.1f s", time.monotonic() - start)
            except (OSError, RuntimeError) as error:  # another process sharing data_dir may have finished first
                result = text_files_builder(config)
                if not result.is_prepared():
                    wrapped = durable.as_write_error(data_dir(config), error)
                    if wrapped is None:
                        raise
                    raise wrapped from error
        if not result.is_complete():
            log.info("data: %s was prepared without its checksums (a run that stopped before them, or an older "
                     "meshtrain): writing them", result.data_dir)
            try:
                result.finish_interrupted()
            except durable.WriteError as error:  # a read-only shared folder: usable, unchecked
                log.warning("data: %s: its shards stay unchecked (%s)", result.data_dir, error)
        _require_dataset_info(source, str(result.data_dir))
        report = corpus.read_report(result.load_read_stats())
        skipped = report.get("data_skipped_files") or report.get("data_skipped_lines")
        if config.data.on_bad_data == "error" and skipped:
            raise config_lib.ConfigError("data.on_bad_data", "error", f"the dataset prepared in {result.data_dir} "
                                         f"skipped {report['data_skipped_files']} file(s) and "
                                         f"{report['data_skipped_lines']} line(s); delete it to prepare it again "
                                         "and meet the first one as an error")
        return result
    if source.startswith(hf_source.PREFIX):
        result = hf_source.HFDataset(source, config.data.text_field, data_dir(config))
        if not result.is_prepared():
            if not prepare_if_missing:
                raise config_lib.ConfigError("data.source", source, f"not prepared in {result.data_dir}")
            with durable.writing(result.data_dir):
                result.prepare()
        return result
    name = source.removeprefix("tfds:")
    directory = data_dir(config)
    _require_dataset_info(source, os.path.join(directory, *name.split("/")))
    try:
        result = tfds.builder(name, data_dir=directory)
    except tfds.core.registered.DatasetNotFoundError as error:
        raise config_lib.ConfigError("data.source", source, f"no TFDS dataset {name!r} is registered or prepared "
                                     f"in config.data.data_dir={directory!r}") from error
    if not result.is_prepared():
        raise config_lib.ConfigError("data.source", source, f"the dataset is not prepared; searched "
                                     f"{result.data_dir} (config.data.data_dir={directory!r}); "
                                     "build it with tfds first")
    return result


def _require_dataset_info(source: str, dataset_dir: str) -> None:
    """A prepared TFDS folder without its dataset_info.json (the split list lives there): one clear
    error instead of a dataset that reads back with no splits."""
    if not os.path.isdir(dataset_dir):
        return
    versions = [os.path.join(dataset_dir, v) for v in sorted(os.listdir(dataset_dir))
                if v[:1].isdigit() and os.path.isdir(os.path.join(dataset_dir, v))]
    folders = versions or [dataset_dir]
    for folder in folders:
        shards = [n for n in os.listdir(folder) if ".array_record-" in n or ".tfrecord-" in n]
        if shards and not os.path.exists(os.path.join(folder, "dataset_info.json")):
            raise config_lib.ConfigError("data.source", source, f"{folder} holds {len(shards)} shard(s) but no "
                                         "dataset_info.json: the prepared dataset is incomplete or damaged; "
                                         "prepare it again")


def _damaged(source: str, problems: list[str], directory: str) -> config_lib.ConfigError:
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    return config_lib.ConfigError("data.source", source, f"damaged data: {shown}. Prepare it again (delete "
                                  f"{directory} and run python -m meshtrain.prepare with the same config)")


def _tfds_split(result, split: str) -> str:
    splits = set(result.info.splits.keys())
    if split in splits:
        return split
    if split == "validation" and "test" in splits:
        return "test"
    raise ValueError(f"split={split!r}: dataset {result.name} ({result.data_dir}) has only the splits "
                     f"{sorted(splits)}; a text_files corpus of one document has no validation split")


def _document_tokens(text, tokenizer) -> np.ndarray:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    framed = [tokenizer.encode(str(text))]
    if tokenizer.bos_id is not None:
        framed.insert(0, np.asarray([tokenizer.bos_id], np.int32))
    if tokenizer.eos_id is not None:
        framed.append(np.asarray([tokenizer.eos_id], np.int32))
    return np.concatenate(framed)


def token_cache(result, split: str, config, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, doc_starts) of a split: built once, then memory-mapped from the cache directory."""
    tokenizer = tokenizer_for(config.data.tokenizer)
    tfds_split = _tfds_split(result, split)
    directory = os.path.join(result.data_dir, CACHE_DIR)
    stem = os.path.join(directory, f"{tokenizer.name}.{config.data.text_field}.{tfds_split}")
    cached = _load_cache(stem)
    if cached is not None:
        return cached
    problems = text_files.damaged_shards(str(result.data_dir))
    if problems:
        raise _damaged(config.data.source, problems, str(result.data_dir))
    with quiet_tfds():
        source = result.as_data_source(split=tfds_split)
    field = config.data.text_field
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    with durable.writing(directory):  # a full disk or a read-only folder: one line naming it
        _remove_stale_temporaries(directory)
        os.makedirs(directory, exist_ok=True)
        raw = f"{stem}.tokens.{os.getpid()}.tmp.raw"
        try:
            starts = _tokenize_to(raw, source, field, tokenizer, dtype, result, tfds_split, config, progress)
            tmp = f"{stem}.tokens.npy.{os.getpid()}.tmp.npy"
            tokens = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(int(starts[-1]),))
            written = np.memmap(raw, dtype=dtype, mode="r") if starts[-1] else np.zeros(0, dtype)
            for lo in range(0, tokens.size, _FLUSH_TOKENS):  # copied a chunk at a time: memory stays flat
                tokens[lo:lo + _FLUSH_TOKENS] = written[lo:lo + _FLUSH_TOKENS]
            tokens.flush()
            del tokens, written
        finally:
            if os.path.exists(raw):
                os.remove(raw)
        os.replace(tmp, stem + ".tokens.npy")
        tmp = f"{stem}.starts.npy.{os.getpid()}.tmp.npy"  # starts last: marks the cache complete
        np.save(tmp, starts)
        os.replace(tmp, stem + ".starts.npy")
    return np.load(stem + ".tokens.npy", mmap_mode="r"), np.load(stem + ".starts.npy")


_STALE_S = 600  # a temporary file untouched this long, of a process not alive here, is a dead writer's


def _remove_stale_temporaries(directory: str) -> None:
    """Removes the temporary files of token caches whose writer died (a crash leaves `*.<pid>.tmp.*`)."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        parts = name.split(".")
        if "tmp" not in parts or not parts[parts.index("tmp") - 1].isdigit():
            continue
        pid, path = int(parts[parts.index("tmp") - 1]), os.path.join(directory, name)
        with contextlib.suppress(OSError):  # a writer on another host of a shared folder: still being written
            if pid == os.getpid() or _alive(pid) or time.time() - os.path.getmtime(path) < _STALE_S:
                continue
        with contextlib.suppress(OSError):
            os.remove(path)


def remove_stale_incomplete(folder: str) -> None:
    """Removes TFDS's `incomplete.*` folders of preparations that died (a kill leaves them): those whose
    newest file is older than `_STALE_S` (a live preparation, here or on another host, writes on)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not name.startswith("incomplete.") or not os.path.isdir(path):
            continue
        with contextlib.suppress(OSError):
            newest = max([os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs]
                         + [os.path.getmtime(path)])
            if time.time() - newest >= _STALE_S:
                log.info("data: removing %s (a preparation that did not finish)", path)
                shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tokenize_to(raw: str, source, field: str, tokenizer, dtype, result, tfds_split: str, config,
                 progress: bool) -> np.ndarray:
    """Tokenizes every document of `source` into the flat file `raw`; returns the document offsets."""
    lengths = array.array("q")  # 8 bytes a document: the tokens themselves go to disk as they come
    with open(raw, "wb") as out:
        pending, pending_size = [], 0
        for i in tqdm.trange(len(source), desc=f"tokenizing {tfds_split}", disable=not progress):
            example = source[i]
            if field not in example:
                raise ValueError(f"config.data.text_field={field!r}: the examples of {result.name} have fields "
                                 f"{sorted(example)}")
            if example[field] is None:  # array_record gives a truncated or damaged record back empty
                shards = sorted(n for n in os.listdir(result.data_dir) if f"-{tfds_split}." in n)
                what = (f"record {i} of split {tfds_split!r} reads back empty from {', '.join(shards)} (truncated, "
                        "damaged)")
                raise _damaged(config.data.source, [what], str(result.data_dir))
            pending.append(_document_tokens(example[field], tokenizer).astype(dtype))
            lengths.append(len(pending[-1]))
            pending_size += len(pending[-1])
            if pending_size >= _FLUSH_TOKENS:
                out.write(np.concatenate(pending).tobytes())
                pending, pending_size = [], 0
        if pending:
            out.write(np.concatenate(pending).tobytes())
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.frombuffer(lengths, np.int64), out=starts[1:])
    return starts


def _load_cache(stem: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The token cache if it is complete and consistent; None (rebuilt from the shards, nothing is
    lost: it is derived data) when it is missing, unreadable or its offsets do not fit its tokens."""
    if not os.path.exists(stem + ".starts.npy"):
        return None
    try:
        tokens, starts = np.load(stem + ".tokens.npy", mmap_mode="r"), np.load(stem + ".starts.npy")
        if starts.ndim == 1 and len(starts) and starts[0] == 0 and int(starts[-1]) == tokens.size \
                and np.all(np.diff(starts) >= 0):
            return tokens, starts
        problem = f"its {len(starts) - 1} document offsets end at {int(starts[-1]) if len(starts) else 0}, " \
                  f"its tokens number {tokens.size}"
    except (OSError, ValueError, EOFError) as error:
        problem = f"unreadable ({error})"
    log.warning("token cache %s.* is damaged (%s): rebuilding it from the dataset", stem, problem)
    return None


class PackedRows:
    """Global row i -> (tokens, doc_ids) of a window of `seq_len + 1` tokens of the shuffled stream."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, seed: int, split: str,
                 name: str = "dataset"):
        self.tokens, self.doc_starts, self.seq_len = tokens, np.asarray(doc_starts, np.int64), int(seq_len)
        num_docs = len(self.doc_starts) - 1
        seeds = np.random.SeedSequence([int(seed), _SPLIT_IDS[split]]).generate_state(2)
        self.order = np.random.default_rng(seeds[0]).permutation(num_docs)  # stream position -> document
        lengths = np.diff(self.doc_starts)[self.order]
        self.stream_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        total = int(self.stream_starts[-1])
        self.num_windows = (total - 1) // self.seq_len if total > 0 else 0
        if self.num_windows < 1:
            raise ValueError(f"{name} split {split!r}: {num_docs} documents, {total} tokens: fewer than "
                             f"train.seq_len+1={self.seq_len + 1}, so not one row can be made")
        self._windows = grain.MapDataset.range(self.num_windows).shuffle(seed=int(seeds[1] % 2**31)).repeat(None)

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        start = int(self._windows[int(row)]) * self.seq_len
        stop = start + self.seq_len + 1
        first = int(np.searchsorted(self.stream_starts, start, side="right")) - 1
        last = int(np.searchsorted(self.stream_starts, stop, side="left"))
        tokens, doc_ids = [], []
        for position in range(first, last):
            lo = max(start, self.stream_starts[position]) - self.stream_starts[position]
            hi = min(stop, self.stream_starts[position + 1]) - self.stream_starts[position]
            offset = self.doc_starts[self.order[position]]
            tokens.append(np.asarray(self.tokens[offset + lo:offset + hi], np.int32))
            doc_ids.append(np.full(hi - lo, position + 1, np.int32))
        return np.concatenate(tokens), np.concatenate(doc_ids)


def open_rows(config, split: str) -> PackedRows:
    """The packed rows of `split` of `config.data.source`, preparing a text_files dataset if missing."""
    result = builder(config)
    tokens, starts = token_cache(result, split, config)
    return PackedRows(tokens, starts, config.train.seq_len, config.seed, split, name=result.name)


def prepare(config, progress: bool = True) -> dict:
    """Builds the dataset and its token caches; returns the sizes (documents, tokens, rows) per split."""
    result = builder(config)
    summary = {"data_dir": str(result.data_dir), "splits": {}}
    if isinstance(result, TextFiles):
        summary["read_stats"] = result.load_read_stats()
    for split in _SPLIT_IDS:
        if split == "validation" and not set(result.info.splits.keys()) & {"validation", "test"}:
            continue
        tokens, starts = token_cache(result, split, config, progress=progress)
        summary["splits"][split] = {"documents": len(starts) - 1, "tokens": int(starts[-1]),
                                    "rows": max(0, (int(starts[-1]) - 1) // config.train.seq_len),
                                    "unigram_entropy_nats": unigram_entropy(tokens)}
    return summary


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(np.asarray(tokens, np.int64))
    p = counts[counts > 0] / max(1, counts.sum())
    return float(-(p * np.log(p)).sum())


def validate_config(config) -> None:
    """Tokenizer, vocabulary, file glob and dataset rules of real-data sources. Raises ConfigError."""
    tokenizer = tokenizer_for(config.data.tokenizer)
    if config.model.vocab_size < tokenizer.vocab_size:
        raise config_lib.ConfigError(
            "model.vocab_size", config.model.vocab_size,
            f"must be >= the vocabulary of config.data.tokenizer={config.data.tokenizer!r} ({tokenizer.vocab_size})")
    source = config.data.source
    if source == "text_files" or source.startswith(hf_source.PREFIX):
        if source == "text_files":
            corpus.expand_files(config.data.files)
        else:
            hf_source.resolve(source)
        folder = data_dir(config)
        if (problem := durable.unwritable(folder)) and not _prepared(config):
            key, value = ("data.data_dir", config.data.data_dir) if config.data.data_dir else \
                ("workdir", config.workdir)
            raise config_lib.ConfigError(key, value, f"the data folder {folder} {problem}: the dataset is not "
                                         "prepared there yet and cannot be; set config.data.data_dir to a folder "
                                         "this user can write (or prepare it there once with a user who can)")
        return
    if source == "tfds:":
        raise config_lib.ConfigError("data.source", source, "'tfds:' must be followed by a dataset name")
    builder(config, prepare_if_missing=False)
