"""Tokenizers: bytes by default (no files needed), a Hugging Face tokenizer.json or a
sentencepiece model by path.

Every tokenizer exposes `vocab_size`, `bos_id`, `eos_id`, `pad_id`, `name` (a stable id for
caches) and `encode(text) -> np.ndarray[int32]` without special tokens; documents are framed
as BOS + tokens + EOS by the pipeline. `model.vocab_size` must be at least `vocab_size`; it
is usually padded up so that it divides the mesh (`padded_vocab_size`).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from meshtrain.config import ConfigError
from meshtrain.data import packing


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: PAD=0, BOS=1, EOS=2, byte b -> b + 3."""

    pad_id, bos_id, eos_id = packing.PAD_ID, packing.BOS_ID, packing.EOS_ID
    offset = 3
    vocab_size = 256 + offset
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        raw = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
        return raw.astype(np.int32) + self.offset

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        raw = (ids[ids >= self.offset] - self.offset).astype(np.uint8).tobytes()
        return raw.decode("utf-8", errors="replace")


def _file_id(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


class HuggingFaceTokenizer:
    """A `tokenizer.json` read with the `tokenizers` package. Beside it, a Hugging Face folder's
    `tokenizer_config.json` names the BOS and EOS tokens and holds the chat template (or
    `chat_template.jinja` does); without it they are found by their usual spellings."""

    _BOS = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
    _EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
    _PAD = ("<pad>", "[PAD]", "<|finetune_right_pad_id|>")

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError as error:
            raise ConfigError("data.tokenizer", path, "reading a tokenizer.json needs the 'tokenizers' "
                             "package (pip install tokenizers)") from error
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as error:  # noqa: BLE001 - the tokenizers package raises a bare Exception
            raise ConfigError("data.tokenizer", path, f"the file is not a readable tokenizer.json (damaged or "
                             f"of another format): {' '.join(str(error).split())}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        settings = _folder_settings(os.path.dirname(path))
        self.bos_id = self._named(settings, "bos_token", self._BOS)
        self.eos_id = self._named(settings, "eos_token", self._EOS)
        pad = self._named(settings, "pad_token", self._PAD)
        self.pad_id = packing.PAD_ID if pad is None else pad
        self.chat_template: str | None = settings.get("chat_template") if isinstance(
            settings.get("chat_template"), str) else None
        self.name = f"hf-{_file_id(path)}"

    def _named(self, settings: dict, key: str, candidates) -> int | None:
        """The id of the folder's `key` token (None where it says null), else of a usual spelling."""
        if key in settings:
            token = settings[key]
            token = token.get("content") if isinstance(token, dict) else token
            return None if token is None else self._tok.token_to_id(token)
        return self._find(candidates)

    def _find(self, candidates) -> int | None:
        for token in candidates:
            index = self._tok.token_to_id(token)
            if index is not None:
                return index
        return None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def token(self, index: int | None) -> str:
        return "" if index is None else self._tok.id_to_token(index)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the folder's chat template writes it (Jinja, sandboxed as transformers
        renders it); raises ValueError when the tokenizer has none."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json chat_template, or "
                             "chat_template.jinja)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.token(self.bos_id), eos_token=self.token(self.eos_id))


def _folder_settings(folder: str) -> dict:
    """`tokenizer_config.json` of a Hugging Face folder (plus `chat_template.jinja`), or {}."""
    settings: dict = {}
    config = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config) as f:
            settings = json.load(f)
    template = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(template):
        with open(template) as f:
            settings["chat_template"] = f.read()
    return settings


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool, **special) -> str:
    """A Hugging Face chat template rendered as `transformers` renders it: Jinja in an immutable
    sandbox, blocks trimmed, `raise_exception` and `strftime_now` available."""
    import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **special)


class SentencePieceTokenizer:
    """A sentencepiece `.model` file read with the `sentencepiece` package."""

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError as error:
            raise ConfigError("data.tokenizer", path, "reading a sentencepiece model needs the "
                             "'sentencepiece' package (pip install sentencepiece)") from error
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as error:  # noqa: BLE001 - sentencepiece raises RuntimeError or OSError
            raise ConfigError("data.tokenizer", path, f"the file is not a readable sentencepiece model (damaged "
                             f"or of another format): {' '.join(str(error).split())}") from None
        self.vocab_size = int(self._sp.get_piece_size())
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else packing.PAD_ID
        self.name = f"sp-{_file_id(path)}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


def folder_tokenizer(folder: str) -> str | None:
    """The `tokenizer.json` of a Hugging Face folder, or None."""
    path = os.path.join(folder, "tokenizer.json")
    return path if os.path.isfile(path) else None


def load_tokenizer(spec: str):
    """`"bytes"`, a path to a `tokenizer.json` (or a Hugging Face folder holding one), or a path to a
    sentencepiece `.model` file."""
    if spec == "bytes":
        return ByteTokenizer()
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        spec = os.path.join(spec, "tokenizer.json")
    if not os.path.isfile(spec):
        raise ConfigError("data.tokenizer", spec, "must be 'bytes', a Hugging Face folder with a tokenizer.json, "
                         "or the path of an existing tokenizer.json or sentencepiece .model file")
    if spec.endswith(".json"):
        return HuggingFaceTokenizer(spec)
    if spec.endswith(".model"):
        return SentencePieceTokenizer(spec)
    raise ConfigError("data.tokenizer", spec, "a tokenizer file must end in .json (Hugging Face) or "
                     ".model (sentencepiece)")


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that holds `vocab_size` ids (so the vocab divides the mesh)."""
    return -(-int(vocab_size) // int(multiple)) * int(multiple)
