"""`data.source='hf:<folder or glob>'` (data/hf_source.py): local Hugging Face datasets through `datasets`."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from meshtrain import config as config_lib, train
from meshtrain.data import hf_source, sources, text_files
from tests import utils

pytestmark = pytest.mark.usefixtures("compilation_cache")

WORDS = ["def", "return", "self", "import", "value", "for", "in", "range", "if", "else", "print", "(", ")", ":"]


def _documents(count: int = 90) -> list[str]:
    """Python-looking documents of varied length, deterministic; a few fall in the validation split."""
    rng = np.random.default_rng(7)
    docs = [f"# document {i}\n" + " ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) for i in range(count)]
    assert {text_files.split_of(d) for d in docs} == {"train", "validation"}
    return docs


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The same documents as JSONL (text_files and hf:), parquet and a save_to_disk folder, plus a
    DatasetDict with its own validation split."""
    root = tmp_path_factory.mktemp("hf")
    docs = _documents()
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    table = datasets.Dataset.from_dict({"n": list(range(len(docs))), "text": docs})
    table.to_parquet(str(root / "docs.parquet"))
    table.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": table.select(range(60)), "test": table.select(range(60, 90))}).save_to_disk(
        str(root / "split"))
    return root, docs


def _config(root, workdir, source: str, **overrides):
    return utils.config_for(workdir, {"data": 8}, **{
        "data.source": source, "data.data_dir": str(root / "prepared"), "model.dtype": "bfloat16", "steps": 4,
        "checkpoint.every": 0, **overrides})


def _split_documents(config, split: str) -> list[tuple[int, ...]]:
    tokens, starts = sources.token_cache(sources.builder(config), split, config)
    return sorted(tuple(tokens[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True))


def test_parquet_and_save_to_disk_train_to_the_losses_of_jsonl(written, tmp_path):
    """hf: JSONL, parquet and a save_to_disk folder give the same documents in the same order, so the
    same batches and the same losses, bit for bit (bf16, the default dtype); text_files reads the same
    JSONL into the same documents per split (in its own order)."""
    root, docs = written
    losses = {}
    for name in ("docs.jsonl", "docs.parquet", "saved"):
        config = _config(root, tmp_path / name, f"hf:{root / name}")
        train.run(config)
        losses[name] = utils.losses_of(tmp_path / name)
        for split in ("train", "validation"):
            want = sorted(tuple(sources._document_tokens(d, sources.tokenizer_for(config.data.tokenizer)))
                          for d in docs if text_files.split_of(d) == split)
            assert _split_documents(config, split) == want
    assert len(losses["docs.jsonl"]) == 4 and all(np.isfinite(list(losses["docs.jsonl"].values())))
    assert losses["docs.parquet"] == losses["docs.jsonl"] and losses["saved"] == losses["docs.jsonl"]
    as_files = _config(root, tmp_path / "files", "text_files", **{"data.files": str(root / "docs.jsonl")})
    for split in ("train", "validation"):
        assert _split_documents(as_files, split) == _split_documents(config, split)


def test_dataset_dict_keeps_its_own_splits(written):
    root, docs = written
    config = _config(root, "/unused", f"hf:{root / 'split'}")
    tokenizer = sources.tokenizer_for(config.data.tokenizer)
    for split, part in (("train", docs[:60]), ("validation", docs[60:])):  # its "test" split is held out
        assert _split_documents(config, split) == sorted(tuple(sources._document_tokens(d, tokenizer)) for d in part)


def test_prepared_once_then_read_from_the_cache(written):
    root, _ = written
    config = _config(root, "/unused", f"hf:{root / 'docs.parquet'}")
    first = sources.builder(config)
    assert first.is_prepared()
    stamp = (root / "prepared" / hf_source.SUBDIR / first.name / hf_source.INFO_FILE).stat().st_mtime_ns
    again = sources.builder(config)
    assert again.data_dir == first.data_dir
    assert (root / "prepared" / hf_source.SUBDIR / first.name / hf_source.INFO_FILE).stat().st_mtime_ns == stamp


@pytest.mark.parametrize("source,key,match", [
    ("hf:", "data.source", "must be followed by"),
    ("hf:{root}/nothing*.parquet", "data.source", "matches no file"),
    ("hf:{root}/docs.*", "data.source", "files of one kind"),
    ("hf:{root}", "data.source", "not one written by save_to_disk"),
])
def test_bad_hf_source_is_a_config_error(written, source, key, match):
    root, _ = written
    config = _config(root, "/unused", source.format(root=root))
    with pytest.raises(config_lib.ConfigError, match=match) as error:
        sources.validate_config(config)
    assert error.value.key == key


def test_missing_text_field_names_the_key_and_the_fields(written):
    root, _ = written
    config = _config(root, "/unused", f"hf:{root / 'docs.parquet'}", **{"data.text_field": "content"})
    with pytest.raises(config_lib.ConfigError, match=r"data.text_field='content'.*\['n', 'text'\]") as error:
        sources.builder(config)
    assert error.value.key == "data.text_field"
    assert not list((root / "prepared" / hf_source.SUBDIR).glob("*.tmp.*"))  # nothing half-written left
