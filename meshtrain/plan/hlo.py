"""Reading a compiled step's HLO: which collectives run, how often, over which mesh axes, moving what.

Playbook, appendix A0 ("Parallel Programming Crash Course") and A3: a ring all-reduce of K
bytes over n devices sends 2(n-1)/n K from each device, an all-gather (n-1)/n of its result,
a reduce-scatter (n-1)/n of its input, an all-to-all (n-1)/n of its buffer, a point-to-point
permute its whole buffer. `compiled.as_text()` lists every collective once per computation:
a collective inside a `while` body runs `known_trip_count` times, so each computation is
weighted by the product of the trip counts of the loops around it.

Replica groups come in three spellings: explicit (`{{0,1},{2,3}}`), iota
(`[4,2]<=[2,2,2]T(2,1,0)`) and mesh (`mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0))
{'axis_1'}`). Each is turned into groups of partition ids, the partition ids into mesh
coordinates, and the coordinates that vary inside a group name the collective's mesh axes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import numpy as np

from meshtrain.plan.comm import attribute

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                   r"(?:\s*\{([^}]*)\})?")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


# one instruction of a computation: (name, result shapes, opcode, the rest of the line)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_COMMENT = re.compile(r"/\*.*?\*/")


def _top_level_args(text: str) -> list[str]:
    """The comma-separated arguments of a call up to its closing parenthesis."""
    depth, args, start = 0, [], 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                args.append(text[start:i])
                return [a for a in args if a.strip()]
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(text[start:i])
            start = i + 1
    return [a for a in args if a.strip()]


def _operand_name(arg: str) -> str:
    """The instruction an operand names (`f32[8] %x`, `%x`, `/*index=5*/%x` -> `x`)."""
    return _COMMENT.sub("", arg).strip().split()[-1].lstrip("%")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: kind, result bytes, groups of partition ids, runs per step."""

    kind: str
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]
    count: float  # an average where a conditional branch holds it
    pairs: tuple[tuple[int, int], ...] = ()


def _nbytes(shapes: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shapes):
        total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        ids = ids.transpose(perm)
    return ids.reshape(dims)


def _groups(line: str, num_partitions: int) -> tuple[tuple[int, ...], ...]:
    if m := _MESH.search(line):
        axes = [(name.strip().strip("'"), int(size)) for name, size in
                (part.split("=") for part in m.group(1).split(",") if part.strip())]
        shape = [size for _, size in axes]
        if m.group(2):
            perm = [int(p) for p in m.group(3).split(",")] if m.group(3) else None
            ids = _iota(shape, [int(d) for d in m.group(2).split(",")], perm)
        else:
            ids = np.arange(math.prod(shape)).reshape(shape)
        chosen = {a.strip().strip("'") for a in (m.group(4) or "").split(",") if a.strip()}
        if not m.group(4):  # no axis list: one group of all devices
            chosen = {name for name, _ in axes}
        keep = [i for i, (name, _) in enumerate(axes) if name in chosen]
        rest = [i for i in range(len(axes)) if i not in keep]
        moved = ids.transpose(rest + keep).reshape(-1, math.prod(shape[i] for i in keep) if keep else 1)
        return tuple(tuple(int(x) for x in row) for row in moved)
    if m := _IOTA.search(line):
        perm = [int(p) for p in m.group(3).split(",")] if m.group(3) else None
        ids = _iota([int(d) for d in m.group(1).split(",")], [int(d) for d in m.group(2).split(",")], perm)
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(ids.shape[0], -1))
    if (m := _EXPLICIT.search(line)) and m.group(1):
        return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    return (tuple(range(num_partitions)),)  # empty replica_groups: everyone


def _computations(hlo: str):
    """name -> list of instruction lines, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        if name is None:
            m = _HEADER.match(line)
            if m and "=" not in line.split("(")[0]:
                name = m.group(2)
                comps[name] = []
                if m.group(1):
                    entry = name
            continue
        if line.startswith("}"):
            name = None
            continue
        comps[name].append(line)
    return comps, entry


def _by_size(weights) -> dict[int, object]:
    """Per-switch-size conditional weights or lock-step rows, {branches: value}, from such a mapping, from
    one tuple of weights (its length), or from one (rows, branches) pair; {} for None."""
    if weights is None:
        return {}
    if isinstance(weights, dict):
        return weights
    if len(weights) == 2 and isinstance(weights[0], np.ndarray):
        return {int(weights[1]): weights[0]}
    return {len(weights): tuple(weights)}


def _multiplicities(comps: dict[str, list[str]], entry: str, branch_weights=None) -> dict[str, float]:
    """How many times each computation runs per call of the entry (while bodies x trip count).

    A conditional runs one branch per call, which the text cannot tell: each branch counts as
    running every call, unless `branch_weights` gives, for conditionals with that many branches,
    the share of calls that take each branch (a slot-table tick's switch: `Layout.branch_share`, one
    tuple a switch size: `_by_size`).
    """
    branch_weights = _by_size(branch_weights)
    mult: dict[str, float] = collections.defaultdict(float)
    mult[entry] = 1
    order, seen = [entry], {entry}
    edges: dict[str, list[tuple[str, int]]] = {}
    for name, lines in comps.items():
        out = []
        for line in lines:
            trip = 1
            if " while(" in line and (t := _TRIP.search(line)):
                trip = int(t.group(1))
            out += [(c, trip) for c in _CALLEE.findall(line) if c in comps]
            if b := _BRANCHES.search(line):
                branches = [c.strip().lstrip("%") for c in b.group(1).split(",")]
                weights = branch_weights.get(len(branches), (1.0,) * len(branches))
                out += [(c, w) for c, w in zip(branches, weights, strict=True) if c in comps]
        edges[name] = out
    # computations form a DAG; visit callers before callees (Kahn order from the entry).
    indegree: dict[str, int] = collections.defaultdict(int)
    stack = [entry]
    while stack:
        node = stack.pop()
        for callee, _ in edges.get(node, []):
            indegree[callee] += 1
            if callee not in seen:
                seen.add(callee)
                stack.append(callee)
    ready, order = [entry], []
    while ready:
        node = ready.pop()
        order.append(node)
        for callee, trip in edges.get(node, []):
            mult[callee] += mult[node] * trip
            indegree[callee] -= 1
            if indegree[callee] == 0:
                ready.append(callee)
    return mult


def _inferred_trips(comps: dict[str, list[str]], caller: list[str], line: str) -> int | None:
    """The trips of the `while` on `line` (in the computation of lines `caller`) that XLA left without
    `known_trip_count` (XLA:GPU so leaves the gradient-accumulation loop): its condition compares
    element i of the loop's tuple below a constant n (`compare(get-tuple-element(param, i), constant(n)),
    direction=LT`, directly or as a fusion's root), its body adds 1 to element i (directly or in a
    fusion) and its init tuple's element i is a constant c (through copies): n - c. None otherwise."""
    cond, body_name, head = (re.search(r"\bcondition=%?([\w.\-]+)", line), re.search(r"\bbody=%?([\w.\-]+)", line),
                             _INSTRUCTION.match(line))
    if not cond or not body_name or not head or cond.group(1) not in comps or body_name.group(1) not in comps:
        return None
    condition = comps[cond.group(1)]
    compared = _through_fusion(comps, _root(condition))  # (the compare, its operands as the condition's names)
    if compared is None or compared[0].group(3) != "compare" or "direction=LT" not in compared[0].group(4) \
            or len(compared[1]) != 2:
        return None
    counter, limit_name = compared[1]
    limit = _constant(comps, condition, limit_name, compared[2])
    element = _defined(condition, counter)
    index = re.search(r"\bindex=(\d+)", element.group(4)) if element and element.group(3) == "get-tuple-element" \
        else None
    init = _defined(caller, _operand_name(_top_level_args(head.group(4))[0]))
    if limit is None or index is None or init is None or init.group(3) != "tuple":
        return None
    i = int(index.group(1))
    inits = _top_level_args(init.group(4))
    start = _constant(comps, caller, _operand_name(inits[i])) if i < len(inits) else None
    if start is None or limit <= start or not _adds_one(comps, comps[body_name.group(1)], i):
        return None
    return limit - start


def _root(lines: list[str]):
    return next((m for text in lines if text.lstrip().startswith("ROOT") and (m := _INSTRUCTION.match(text))), None)


def _defined(lines: list[str], name: str):
    return next((m for text in lines if (m := _INSTRUCTION.match(text)) and m.group(1) == name), None)


def _through_fusion(comps: dict[str, list[str]], m):
    """(instruction, its operands named in m's computation, the fused computation or None): `m` itself,
    or, when `m` is a fusion, its fused root with each parameter replaced by the fusion's operand."""
    if m is None:
        return None
    operands = [_operand_name(a) for a in _top_level_args(m.group(4))]
    callee = re.search(r"\bcalls=%?([\w.\-]+)", m.group(4)) if m.group(3) == "fusion" else None
    if not callee or callee.group(1) not in comps:
        return m, operands, None
    fused = comps[callee.group(1)]
    root = _root(fused)
    if root is None:
        return None
    params = {p.group(1): int(re.match(r"\s*(\d+)", p.group(4)).group(1)) for text in fused
              if (p := _INSTRUCTION.match(text)) and p.group(3) == "parameter"}
    named = []
    for name in (_operand_name(a) for a in _top_level_args(root.group(4))):
        named.append(operands[params[name]] if name in params and params[name] < len(operands) else name)
    return root, named, fused


def _constant(comps, lines: list[str], name: str, fused: list[str] | None = None) -> int | None:
    """The integer constant `name` holds (through copies, bitcasts, converts), looked up in `fused` first."""
    m = (_defined(fused, name) if fused else None) or _defined(lines, name)
    while m is not None and m.group(3) in ("copy", "bitcast", "convert"):
        m = _defined(lines, _operand_name(_top_level_args(m.group(4))[0]))
    value = re.match(r"\s*(-?\d+)\)", m.group(4)) if m is not None and m.group(3) == "constant" else None
    return int(value.group(1)) if value else None


def _adds_one(comps, body: list[str], i: int) -> bool:
    """Whether the loop body's result element `i` is its parameter's element `i` plus the constant 1."""
    root = _root(body)
    elements = [_operand_name(a) for a in _top_level_args(root.group(4))] if root and root.group(3) == "tuple" else []
    if i >= len(elements):
        return False
    added = _through_fusion(comps, _defined(body, elements[i]))
    if added is None or added[0].group(3) != "add" or len(added[1]) != 2:
        return False
    for counter, one in (added[1], added[1][::-1]):
        element = _defined(body, counter)
        while element is not None and element.group(3) in ("copy", "bitcast"):
            element = _defined(body, _operand_name(_top_level_args(element.group(4))[0]))
        same = element is not None and element.group(3) == "get-tuple-element" and \
            re.search(rf"\bindex={i}\b", element.group(4)) is not None
        if same and _constant(comps, body, one, added[2]) == 1:
            return True
    return False


def collectives(hlo: str, num_partitions: int,
                branch_weights: tuple[float, ...] | None = None) -> list[Collective]:
    """Every collective in the compiled module with the number of times it runs per step
    (conditional branches: see `_multiplicities`)."""
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, entry, branch_weights)
    found = []
    for name, lines in comps.items():
        if not mult.get(name):
            continue
        defined = {i.group(1): i.group(2) for line in lines if (i := _INSTRUCTION.match(line))}
        for line in lines:
            m = _OP.match(line)
            if not m:
                continue
            kind, shapes = m.group(2), m.group(1)
            if kind == "ragged-all-to-all":  # what it can move: the smaller of its operand and its output
                operand = _top_level_args(line[m.end():])[0] if _top_level_args(line[m.end():]) else ""
                shapes = _ragged_moved(defined.get(_operand_name(operand), "") + ", " + shapes)
            elif m.group(3) and shapes.startswith("("):  # async start: ((operands), result[, ctx]); keep the result
                shapes = _async_result(shapes, kind)
            pairs = ()
            if kind == "collective-permute" and (p := _PAIRS.search(line)):
                pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", p.group(1)))
            found.append(Collective(kind, _nbytes(shapes), _groups(line, num_partitions), mult[name], pairs))
    return found


def _ragged_moved(shapes: str) -> str:
    """The bytes a ragged all-to-all can move, from its operand's shape followed by its own result
    (`operand, result` or, started asynchronously, `operand, ((operand, output, ...), result)`): at most its
    operand (all a device can send) and at most its output (all it can receive), so on average over the
    devices at most the smaller of the two; the rows it does move are known only at run time."""
    arrays = _ARRAY.findall(shapes)
    if len(arrays) < 2:
        return shapes
    sized = [(_DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d), f"{t}[{dims}]")
             for t, dims in (arrays[0], arrays[-1])]
    return min(sized)[1]


def _async_result(shapes: str, kind: str) -> str:
    """The result part of an async-start tuple `((in...), out, ...)`: the second top-level element."""
    depth, parts, start = 0, [], 1
    for i, ch in enumerate(shapes):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            parts.append(shapes[start:i])
            start = i + 1
    return parts[1] if len(parts) > 1 else shapes


def group_axes(group: tuple[int, ...], mesh_shape: dict[str, int]) -> dict[str, int]:
    """The mesh axes along which the partitions of `group` differ (mesh order) -> how many values each takes."""
    names = list(mesh_shape)
    coords = np.array(np.unravel_index(np.array(group), tuple(mesh_shape.values()))).T  # [n, axes]
    extents = {names[i]: len(set(coords[:, i])) for i in range(len(names))}
    return {a: n for a, n in extents.items() if n > 1}


def bytes_by_axis(found: list[Collective], mesh_shape: dict[str, int]) -> dict[str, float]:
    """Bytes each device sends per step, attributed to mesh axes (see `attribute`)."""
    total: dict[str, float] = collections.defaultdict(float)
    n_dev = math.prod(mesh_shape.values())
    for c in found:
        if c.kind == "collective-permute":
            moving = [(s, t) for s, t in c.pairs if s != t]
            if not moving:
                continue
            axes = sorted({a for s, t in moving for a in group_axes((s, t), mesh_shape)},
                          key=list(mesh_shape).index)
            share = c.result_bytes * len(moving) / n_dev * c.count
            for axis in axes:  # a permute along several axes at once is rare; split it evenly
                total[axis] += share / len(axes)
            continue
        group = c.groups[0]
        if len(group) <= 1:
            continue
        full = c.result_bytes * len(group) if c.kind == "reduce-scatter" else c.result_bytes
        for axis, nbytes in attribute(c.kind, full, group_axes(group, mesh_shape)).items():
            total[axis] += nbytes * c.count
    return dict(total)


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_START = re.compile(r"\s(" + "|".join(KINDS) + r")-start\(|\sasync-start\(")
_DONE = re.compile(r"\s(?:" + "|".join(KINDS) + r"|async)-done\(\s*%?([\w.\-]+)")
_COMPUTE = re.compile(r"\s(?:fusion|custom-call|dot|convolution)\(")


@dataclasses.dataclass(frozen=True)
class AsyncPair:
    """An asynchronous collective in a scheduled module: its kind, where, and the compute between."""

    kind: str
    computation: str
    compute_between: int  # fusions / GEMM custom-calls / dots scheduled between its start and done

    @property
    def overlapped(self) -> bool:
        return self.compute_between > 0


_CALLS = re.compile(r"\s(?:conditional|while|call)\(")
_CALLED = re.compile(r"\b(?:calls|body|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")


def _computing(comps: dict[str, list[str]]):
    """Whether a computation (or one it calls: a conditional's branches, a loop's body) holds compute."""
    @functools.cache
    def computing(name: str) -> bool:
        for line in comps.get(name, []):
            if _COMPUTE.search(line):
                return True
            if _CALLS.search(line) and computing_call(line, computing):
                return True
        return False
    return computing


def async_overlap(hlo: str) -> list[AsyncPair]:
    """Every asynchronous start/done pair of a scheduled module (GPU compiles; CPU has none) with
    the compute instructions the scheduler placed between them: the overlap the latency-hiding
    scheduler achieved (playbook, "Data Parallelism": overlap gradient reduction with backward). A
    conditional, loop or call counts as compute when a computation it runs holds some (a pipeline
    tick's `lax.switch` over the stage's forward and backward)."""
    comps, _ = _computations(hlo)
    computing = _computing(comps)
    pairs = []
    for comp, lines in comps.items():
        open_: dict[str, list] = {}  # start name -> [kind, compute count]
        for line in lines:
            if (done := _DONE.search(line)) and done.group(1) in open_:
                kind, between = open_.pop(done.group(1))
                pairs.append(AsyncPair(kind, comp, between))
                continue
            if (start := _START.search(line)) and (name := _NAME.match(line)):
                kind = start.group(1) or _async_kind(line, comps)
                open_[name.group(1)] = [kind, 0]
                continue
            if _COMPUTE.search(line) or (_CALLS.search(line) and computing_call(line, computing)):
                for entry in open_.values():
                    entry[1] += 1
    return pairs


def overlap_runs(hlo: str, branch_weights=None) -> dict[str, tuple[float, float]]:
    """{kind: (runs, runs with compute beside)} of the module's asynchronous pairs (`async_overlap`),
    each counted as often as it runs per call (`_multiplicities`: loop trips, conditional branches by
    `branch_weights`): the overlap a step gets, where `async_overlap` counts instructions (a loop's
    body compiled twice counts twice there, and its pairs that run once a tick count once)."""
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, entry, branch_weights)
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for pair in async_overlap(hlo):
        runs = mult.get(pair.computation, 0.0)
        out[pair.kind][0] += runs
        out[pair.kind][1] += runs if pair.overlapped else 0.0
    return {kind: (runs, overlapped) for kind, (runs, overlapped) in out.items()}


def computing_call(line: str, computing) -> bool:
    """Whether a conditional / loop / call `line` runs a computation that holds compute."""
    for m in _CALLED.finditer(line):
        names = [m.group(1)] if m.group(1) else [n.strip().lstrip("%") for n in m.group(2).split(",")]
        if any(computing(n) for n in names):
            return True
    return False


def _async_kind(line: str, comps: dict[str, list[str]]) -> str:
    """The collective an `async-start` wraps (reduce-scatter, all-to-all on XLA:GPU), by its callee."""
    callee = _CALLEE.search(line)
    for body in comps.get(callee.group(1), []) if callee else []:
        if m := _OP.match(body):
            return m.group(2)
    return "async"
