"""Reading compiled HLO text: which collectives move how many elements, in which computation."""

from __future__ import annotations

import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_SHAPE = re.compile(r"(?:f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64)\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def _elements(shapes: str) -> int:
    total = 0
    for dims in _SHAPE.findall(shapes):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n
    return total


def collectives_by_computation(hlo: str) -> dict[str, list[tuple[str, int]]]:
    """computation name ('ENTRY' for the entry) -> [(collective kind, elements of its result)]."""
    out: dict[str, list[tuple[str, int]]] = {}
    name = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            out.setdefault(name, [])
            continue
        match = _OP.search(line)
        if match and name is not None:
            out[name].append((match.group(2), _elements(match.group(1))))
    return out
