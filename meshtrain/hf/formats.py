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
            path = os.path.join(hf_dir, file)
            header, base = read_header(path)
            size = os.path.getsize(path)
            for name, entry in header.items():
                start, end = _offsets(path, name, entry)
                if base + end > size:
                    raise HFFormatError(f"{path}: damaged (truncated?): tensor {name!r} ends at byte {base + end} of "
                                        f"a {size}-byte file")
                self.entries[name] = (path, entry)
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
        return self.raw(name).view(self.dtype(name)).reshape(self.shape(name))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, a lazy view of the memory map."""
        path, entry = self.entries[name]
        if path not in self._maps:
            self._maps[path] = (np.memmap(path, dtype=np.uint8, mode="r"), read_header(path)[1])
        data, base = self._maps[path]
        start, end = entry["data_offsets"]
        return data[base + start:base + end]

    def _entry(self, name: str) -> dict:
        if name not in self.entries:
            raise HFFormatError(f"tensor {name!r} is missing from the checkpoint")
        return self.entries[name][1]


def read_header(path: str) -> tuple[dict, int]:
    """A safetensors file's header ({tensor: {dtype, shape, data_offsets}}) and where its data starts;
    HFFormatError naming the file when it is not one (truncated, overwritten, another format)."""
    total = os.path.getsize(path)
    with open(path, "rb") as fh:
        first = fh.read(8)
        size = struct.unpack("<Q", first)[0] if len(first) == 8 else -1
        if not 2 <= size <= total - 8:
            raise HFFormatError(f"{path}: damaged or not a safetensors file (its header length, {size}, does not "
                                f"fit its {total} bytes)")
        try:
            header = json.loads(fh.read(size))
        except ValueError as error:  # JSON or UTF-8
            raise HFFormatError(f"{path}: damaged or not a safetensors file (its header is not JSON: "
                                f"{error})") from None
    if not isinstance(header, dict):
        raise HFFormatError(f"{path}: damaged or not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + size


def _offsets(path: str, name: str, entry) -> tuple[int, int]:
    """A header entry's data offsets, checked against its shape and dtype."""
    try:
        start, end = (int(x) for x in entry["data_offsets"])
        count = math.prod(int(n) for n in entry["shape"])
        itemsize = ST_DTYPES[entry["dtype"]].itemsize if entry["dtype"] in ST_DTYPES else None
    except (KeyError, TypeError, ValueError):
        raise HFFormatError(f"{path}: damaged header entry for tensor {name!r}: {entry!r}") from None
    if not 0 <= start <= end or (itemsize is not None and end - start != count * itemsize):
        raise HFFormatError(f"{path}: damaged header entry for tensor {name!r}: offsets {start}..{end} do not "
                            f"hold its shape {entry['shape']} of {entry['dtype']}")
    return start, end


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


# FP8 block-scaled checkpoints (DeepSeek-V3's release format): each quantised weight is e4m3 with a float32
# `<name>_scale_inv` of one entry per block of `weight_block_size` (rows x columns); its value is the product.
FP8_CODE, SCALE_SUFFIX = "F8_E4M3", "_scale_inv"


def fp8_block(hf_config: dict) -> tuple[int, int] | None:
    """The (rows, columns) block of a config.json's FP8 block-scaled quantisation, None without one; other
    quantisations are refused with their key."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
    block = quant.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2):
        raise HFFormatError(f"config.json quantization_config={quant!r}: only FP8 (e4m3) weights with "
                            "weight_block_size [rows, columns] scales are read (DeepSeek-V3's release format)")
    return int(block[0]), int(block[1])


class Dequantised:
    """An FP8 weight and its block scales, read as float32: slicing reads only the rows / columns asked for."""

    def __init__(self, weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]):
        self.weight, self.scale, self.block, self.shape = weight, scale, block, weight.shape

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        rows, cols = (slice(*s.indices(n)) for s, n in zip(index, self.shape, strict=True))
        values = np.asarray(self.weight[rows, cols]).astype(np.float32)
        r = np.arange(rows.start, rows.stop, rows.step) // self.block[0]
        c = np.arange(cols.start, cols.stop, cols.step) // self.block[1]
        return values * np.asarray(self.scale, np.float32)[np.ix_(r, c)]


class DequantisingStore:
    """A SafetensorsStore whose FP8 block-scaled weights read as float32 (their scales read with them and
    left out of the tensor names): `fp8_block` of the config.json gives the block."""

    def __init__(self, store: SafetensorsStore, block: tuple[int, int]):
        self.store, self.block = store, block
        entries = store.entries
        self.scaled = {name for name, (_, entry) in entries.items()
                       if entry["dtype"] == FP8_CODE and name + SCALE_SUFFIX in entries}
        unscaled = sorted(n for n, (_, e) in entries.items() if e["dtype"] == FP8_CODE and n not in self.scaled)
        if unscaled:
            raise HFFormatError(f"tensor {unscaled[0]!r} is FP8 without its {unscaled[0] + SCALE_SUFFIX!r}")
        for name in self.scaled:
            want = tuple(math.ceil(n / b) for n, b in zip(store.shape(name), block, strict=True))
            if store.shape(name + SCALE_SUFFIX) != want:
                raise HFFormatError(f"tensor {name + SCALE_SUFFIX!r} has shape {store.shape(name + SCALE_SUFFIX)}; "
                                    f"{name!r} in blocks of {block} needs {want}")
        self.entries = {n: e for n, e in entries.items() if not (n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)]
                                                                  in self.scaled)}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.store.shape(name)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name in self.scaled else self.store.dtype(name)

    def __call__(self, name: str):
        if name in self.scaled:
            weight = self.store.raw(name).view(ml_dtypes.float8_e4m3fn).reshape(self.shape(name))
            return Dequantised(weight, self.store(name + SCALE_SUFFIX), self.block)
        return self.store(name)
