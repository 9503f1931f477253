"""Real-data sources: the text_files TFDS builder, tokenizers, the default corpus and bad input."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece
import tokenizers as hf_tokenizers

from meshtrain import config as config_lib, data
from meshtrain.data import corpus, sources, text_files, tokenizers
from meshtrain.validate import validate
from tests.utils import batch_sharding, mesh_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mesh8():
    return mesh_of(data=8)


def text_config(tmp_path, files="", seq_len=32, batch_size=8):
    c = config_lib.default_config()
    c.data.source, c.data.files, c.data.data_dir = "text_files", files, str(tmp_path / "tfds")
    c.train.seq_len, c.train.batch_size = seq_len, batch_size
    return c


def write_corpus(root):
    """Train-split documents in three formats, one non-UTF-8 file and one broken .gz file."""
    root.mkdir(parents=True, exist_ok=True)
    docs = [f"document {i}: " + "lorem ipsum dolor " * (3 + i) for i in range(40)]
    docs = [d for d in docs if text_files.split_of(d) == "train"]
    held_out = next(t for t in (f"held out {i}" for i in range(1000)) if text_files.split_of(t) == "validation")
    (root / "long.txt").write_text("L" + "x" * 500 + "Z")
    (root / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:20]) + "\nnot json\n")
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"text": d}) for d in docs[20:]))
    (root / "held_out.txt").write_text(held_out)
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (root / "broken.txt.gz").write_bytes(b"this is not gzip")
    return docs


def test_text_files_builder_reads_all_formats_and_counts_bad_input(tmp_path):
    docs = write_corpus(tmp_path / "corpus")
    config = text_config(tmp_path, files=str(tmp_path / "corpus" / "*"))
    validate(config, 8)
    summary = sources.prepare(config, progress=False)
    stats = summary["read_stats"]
    # read: long.txt, a.jsonl, b.jsonl.gz, held_out.txt; skipped: latin1.txt (not UTF-8), broken.txt.gz
    assert stats["files"] == 4 and stats["unreadable_files"] == 1 and stats["non_utf8_files"] == 1
    assert stats["bad_json_lines"] == 1
    train = summary["splits"]["train"]
    tok = tokenizers.ByteTokenizer()
    texts = [*docs, "L" + "x" * 500 + "Z", "held out"]
    assert train["documents"] + summary["splits"]["validation"]["documents"] == len(texts)
    result = sources.builder(config)
    tokens, starts = sources.token_cache(result, "train", config)
    stored = {tok.decode(tokens[starts[i]:starts[i + 1]]) for i in range(len(starts) - 1)}
    assert set(docs) | {"L" + "x" * 500 + "Z"} <= stored  # nothing dropped, the long document whole
    assert train["tokens"] == int(starts[-1]) and train["rows"] == (train["tokens"] - 1) // 32


def test_long_document_is_split_across_rows(tmp_path):
    write_corpus(tmp_path / "corpus")
    config = text_config(tmp_path, files=str(tmp_path / "corpus" / "long.txt"), seq_len=32, batch_size=8)
    rows = sources.open_rows(config, "train")
    assert rows.num_windows == (502 + 2 - 1) // 32  # BOS + 502 bytes + EOS
    it = data.iterator(config, batch_sharding(mesh8()))
    batches = [np.asarray(next(it)["inputs"]) for _ in range(2)]
    it.close()
    text = "".join(tokenizers.ByteTokenizer().decode(r) for r in np.concatenate(batches)[: rows.num_windows])
    assert sorted(text) == sorted(("L" + "x" * 500 + "Z")[: len(text)])  # all rows come from it
    with pytest.raises(ValueError, match="one document has no validation split"):
        data.iterator(config, batch_sharding(mesh8()), split="validation")


def test_unigram_entropy():
    np.testing.assert_allclose(sources.unigram_entropy(np.array([3, 3, 4, 4, 5, 5, 6, 6])), np.log(4), rtol=1e-6)
    assert sources.unigram_entropy(np.array([7, 7, 7])) == 0.0


def test_empty_glob_is_a_config_error(tmp_path):
    config = text_config(tmp_path, files=str(tmp_path / "nothing" / "*.txt"))
    with pytest.raises(config_lib.ConfigError, match="data.files.*matches no files"):
        validate(config, 8)


def test_unknown_source_and_small_vocab_are_config_errors(tmp_path):
    config = text_config(tmp_path)
    config.data.source = "parquet"
    with pytest.raises(config_lib.ConfigError, match="data.source='parquet'"):
        validate(config, 8)
    config = text_config(tmp_path)
    config.model.vocab_size = 256
    with pytest.raises(config_lib.ConfigError, match=r"model.vocab_size=256.*data.tokenizer='bytes'.*\(259\)"):
        validate(config, 8)


def test_tokenizer_errors_name_the_key(tmp_path, monkeypatch):
    config = text_config(tmp_path)
    config.data.tokenizer = str(tmp_path / "missing.json")
    with pytest.raises(config_lib.ConfigError, match="data.tokenizer"):
        validate(config, 8)
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the package were not installed
    with pytest.raises(config_lib.ConfigError, match="'tokenizers' package"):
        tokenizers.load_tokenizer(str(path))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    (tmp_path / "sp.model").write_bytes(b"")
    with pytest.raises(config_lib.ConfigError, match="'sentencepiece' package"):
        tokenizers.load_tokenizer(str(tmp_path / "sp.model"))


@pytest.mark.parametrize("name, content, what", [("tokenizer.json", b'{"model": ', "tokenizer.json"),
                                                   ("tokenizer.json", b'{"x": 1}', "tokenizer.json"),
                                                   ("sp.model", b"not a model", "sentencepiece model")])
def test_a_damaged_tokenizer_file_is_one_config_error_naming_it(tmp_path, name, content, what):
    """Before anything is written: `validate` reads the tokenizer and names the key and the file."""
    path = tmp_path / name
    path.write_bytes(content)
    config = text_config(tmp_path)
    config.data.tokenizer = str(path)
    with pytest.raises(config_lib.ConfigError, match=f"config.data.tokenizer='{path}': the file is not a readable "
                                                     f"{what}") as error:
        validate(config, 8)
    assert "\n" not in str(error.value)


def test_tfds_name_not_prepared_names_the_directory(tmp_path):
    config = text_config(tmp_path)
    for name in ("mnist", "no_such_dataset_here"):
        config.data.source = f"tfds:{name}"
        with pytest.raises(config_lib.ConfigError, match=str(tmp_path / "tfds")):
            validate(config, 8)


def test_prepared_text_files_reads_back_through_tfds_name(tmp_path):
    write_corpus(tmp_path / "corpus")
    config = text_config(tmp_path, files=str(tmp_path / "corpus" / "*.jsonl*"))
    validate(config, 8)
    direct = data.iterator(config, batch_sharding(mesh8()))
    want = np.asarray(next(direct)["inputs"])
    direct.close()
    config.data.source = f"tfds:text_files/{sources.builder(config).builder_config.name}"
    validate(config, 8)
    named = data.iterator(config, batch_sharding(mesh8()))
    np.testing.assert_array_equal(np.asarray(next(named)["inputs"]), want)
    named.close()


def test_default_corpus_is_capped_stdlib_source(tmp_path):
    files = corpus.default_corpus_files()
    assert files == sorted(files) and all(f.endswith(".py") and "site-packages" not in f for f in files)
    assert sum(os.path.getsize(f) for f in files) <= corpus.DEFAULT_CORPUS_BYTES
    config = text_config(tmp_path, seq_len=128)
    it = data.iterator(config, batch_sharding(mesh8()), split="validation")
    batch = {k: np.asarray(v) for k, v in next(it).items()}
    it.close()
    text = "".join(tokenizers.ByteTokenizer().decode(r) for r in batch["inputs"])
    assert any(word in text for word in ("def ", "import ", "return ", "self."))
    assert batch["loss_mask"].mean() > 0.95  # packed: almost no target is masked


@pytest.mark.slow
def test_prepare_command_prints_sizes(tmp_path):
    write_corpus(tmp_path / "corpus")
    config_file = tmp_path / "cfg.py"
    config_file.write_text("from meshtrain import config\n\ndef get_config():\n    c = config.default_config()\n"
                           "    c.data.source = 'text_files'\n    return c\n")
    command = [sys.executable, "-m", "meshtrain.data.prepare", f"--config={config_file}",
               f"--config.data.files={tmp_path / 'corpus' / '*.jsonl*'}",
               f"--config.data.data_dir={tmp_path / 'tfds'}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["splits"]["train"]["documents"] > 0 and "rows of 128 tokens" in out.stdout
    assert 0.0 < summary["splits"]["train"]["unigram_entropy_nats"] < np.log(259)
    bad = subprocess.run([*command[:-2], "--config.data.files=/no/such/dir/*"], check=False, capture_output=True,
                         text=True, timeout=120, cwd=REPO, env=env)
    assert bad.returncode != 0 and "config.data.files='/no/such/dir/*': the glob matches no files" in bad.stderr


TEXT = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n", "import os\nprint(os.getcwd())\n"] * 20


def test_tokenizer_json_encodes_and_decodes(tmp_path):
    """A tiny BPE `tokenizer.json` built here: ids within its vocabulary, BOS / EOS found, round trip."""
    tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf_tokenizers.decoders.ByteLevel()
    trainer = hf_tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = tokenizers.load_tokenizer(str(path))
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 2, 3)
    ids = loaded.encode(TEXT[0])
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < loaded.vocab_size
    assert len(ids) < len(TEXT[0])  # merges learned from the text
    assert loaded.decode(ids) == TEXT[0]


def test_sentencepiece_model_encodes_and_decodes(tmp_path):
    """A tiny sentencepiece model trained here: ids within its vocabulary, BOS / EOS / PAD, round trip."""
    prefix = tmp_path / "sp"
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_prefix=str(prefix), vocab_size=64,
                                             model_type="bpe", pad_id=3, character_coverage=1.0,
                                             normalization_rule_name="identity", remove_extra_whitespaces=False,
                                             minloglevel=2)
    loaded = tokenizers.load_tokenizer(f"{prefix}.model")
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 2, 3)
    assert loaded.vocab_size == 64 and loaded.name.startswith("sp-")
    ids = loaded.encode("def add(a, b):")
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < 64
    assert loaded.decode(ids) == "def add(a, b):"


# ---- damaged data: one clear error naming the file, never a silent read or a hang ---------------


def _prepared(tmp_path):
    write_corpus(tmp_path / "corpus")
    config = text_config(tmp_path, files=str(tmp_path / "corpus" / "*.jsonl*"))
    result = sources.builder(config)
    shard = next(os.path.join(result.data_dir, n) for n in sorted(os.listdir(result.data_dir))
                 if "-train.array_record-" in n)
    return config, str(result.data_dir), shard


def _tokenize_train(config):
    return sources.token_cache(sources.builder(config), "train", config)


def _truncate_file(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "truncated-unrecorded"])
def test_damaged_shard_is_named_before_tokenizing(tmp_path, damage):
    """A truncated or altered array_record shard is caught by the checksums recorded at preparation,
    and (for a dataset prepared elsewhere, with no record) by the empty records it reads back."""
    config, directory, shard = _prepared(tmp_path)
    if damage == "flipped":
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 3] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    else:
        _truncate_file(shard)
    if damage == "truncated-unrecorded":
        os.remove(os.path.join(directory, text_files.SHARDS_FILE))
    match = {"truncated": "bytes, .* were written", "flipped": "does not match its CRC-32",
             "truncated-unrecorded": "reads back empty"}[damage]
    with pytest.raises(config_lib.ConfigError, match=f"config.data.source=.*{match}") as error:
        _tokenize_train(config)
    assert os.path.basename(shard) in str(error.value)


def test_missing_dataset_info_is_named(tmp_path):
    config, directory, _ = _prepared(tmp_path)
    os.remove(os.path.join(directory, "dataset_info.json"))
    with pytest.raises(config_lib.ConfigError, match="no dataset_info.json: the prepared dataset is incomplete"):
        sources.builder(config)
    config.data.source = "tfds:text_files/" + os.path.basename(os.path.dirname(directory))
    with pytest.raises(config_lib.ConfigError, match="no dataset_info.json"):
        validate(config, 8)


def test_damaged_token_cache_is_rebuilt(tmp_path, caplog):
    """The token cache is derived data: a truncated one is rebuilt from the shards, to the same tokens."""
    config, directory, _ = _prepared(tmp_path)
    tokens, starts = (np.array(a) for a in _tokenize_train(config))
    cache = next(os.path.join(directory, sources.CACHE_DIR, n) for n in os.listdir(os.path.join(
        directory, sources.CACHE_DIR)) if n.endswith(".train.tokens.npy"))
    _truncate_file(cache)
    with caplog.at_level("WARNING", logger="meshtrain"):
        again, again_starts = _tokenize_train(config)
    assert "is damaged" in caplog.text and "rebuilding" in caplog.text
    np.testing.assert_array_equal(np.asarray(again), tokens)
    np.testing.assert_array_equal(again_starts, starts)


def test_broken_line_in_a_large_jsonl_is_counted_not_fatal(tmp_path):
    """One broken line in the middle of 20,000: the other documents are read, the prepare report
    counts the line and names it."""
    root = tmp_path / "big"
    root.mkdir()
    lines = [json.dumps({"text": f"document number {i} " * 3}) for i in range(20_000)]
    lines[10_000] = '{"text": "cut off in the midd'
    (root / "big.jsonl").write_text("\n".join(lines) + "\n")
    config = text_config(tmp_path, files=str(root / "big.jsonl"), seq_len=64)
    summary = sources.prepare(config, progress=False)
    stats = summary["read_stats"]
    assert stats["bad_json_lines"] == 1 and stats["documents"] == 19_999
    assert any("big.jsonl:10001" in e for e in stats["examples"])
    assert sum(s["documents"] for s in summary["splits"].values()) == 19_999
