"""Hugging Face checkpoint files: `config.json` and safetensors, read lazily and written streamed.

The safetensors format is an 8-byte header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw little-endian bytes: tensors are opened as read-only memory maps
(each device reads only its own block) and written one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


class HFFormatError(ValueError):
    """A Hugging Face checkpoint that cannot be imported; the message names the key or tensor."""


def read_config(hf_dir: str) -> dict:
    """The folder's `config.json` as a dict."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise HFFormatError(f"{hf_dir}: no config.json")
    with open(path) as fh:
        return json.load(fh)


class SafetensorsStore:
    """The tensors of a checkpoint folder, opened lazily as read-only memory maps."""

    def __init__(self, hf_dir: str):
        index_path, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
        if os.path.exists(index_path):
            with open(index_path) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        elif os.path.exists(single):
            files = [SINGLE_FILE]
        else:
            raise HFFormatError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")
        self.entries: dict[str, tuple[str, dict]] = {}
        for file in files:
            for name, entry in read_header(os.path.join(hf_dir, file))[0].items():
                self.entries[name] = (os.path.join(hf_dir, file), entry)
        self._maps: dict[str, tuple[np.memmap, int]] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._entry(name)["dtype"]
        if code not in ST_DTYPES:
            raise HFFormatError(f"tensor {name!r}: dtype {code} is not supported (supported: {sorted(ST_DTYPES)})")
        return ST_DTYPES[code]

    def __call__(self, name: str) -> np.ndarray:
        """The tensor as a lazy view of the memory map (reads happen on slicing)."""
        path, entry = self.entries[name]
        if path not in self._maps:
            self._maps[path] = (np.memmap(path, dtype=np.uint8, mode="r"), read_header(path)[1])
        data, base = self._maps[path]
        start, end = entry["data_offsets"]
        return data[base + start:base + end].view(self.dtype(name)).reshape(self.shape(name))

    def _entry(self, name: str) -> dict:
        if name not in self.entries:
            raise HFFormatError(f"tensor {name!r} is missing from the checkpoint")
        return self.entries[name][1]


def read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def write_safetensors(path: str, tensors: list[tuple[str, tuple[int, ...], str]],
                       blocks: Iterator[np.ndarray]) -> None:
    """Writes the header from shapes first, then streams each tensor's bytes from `blocks`."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, code in tensors:
        nbytes = math.prod(shape) * ST_DTYPES[code].itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for (name, shape, code), block in zip(tensors, blocks, strict=True):
            block = np.ascontiguousarray(block, dtype=ST_DTYPES[code])
            assert block.shape == tuple(shape), (name, block.shape, shape)
            fh.write(block.tobytes())
