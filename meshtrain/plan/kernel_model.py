"""What a GPU-compiled step runs and what it costs, kernel by kernel: the kernel model.

Playbook, "Profiling GPU compute and communication". The compiled module's text (`compiled.as_text()`,
read by `plan.hlo`) lists every kernel it launches: fusions, GEMMs (Triton GEMM fusions, cuBLAS calls)
and their operand types, cuDNN's fused attention, the Pallas kernels as Triton calls. `kernels` turns
them into launches with the bytes each moves and the FLOPs it computes, counted as often as the loops
and conditionals around them run them; `KernelTimes` prices each launch (the larger of its FLOPs at an
efficiency and its bytes at a share of HBM bandwidth, plus a launch cost), which is how
`meshtrain.aot`, the pipeline's cost model and the benchmarks model a step's time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Callable

import numpy as np

from meshtrain.parallel import slot_program
from meshtrain.plan.hlo import (
    _ARRAY,
    _BRANCHES,
    _DTYPE_BYTES,
    _INSTRUCTION,
    _TRIP,
    KINDS,
    _by_size,
    _computations,
    _inferred_trips,
    _multiplicities,
    _nbytes,
    _operand_name,
    _top_level_args,
)

# --------------------------------------------------------------------------------------------
# What a GPU-compiled module runs: Pallas kernels as Triton calls, GEMMs and their precision.
# --------------------------------------------------------------------------------------------

_TRITON_TARGET = "__gpu$xla.gpu.triton"
_TRITON_CALL = f'custom_call_target="{_TRITON_TARGET}"'
_KERNEL_NAME = re.compile(r'\bname\s*=\s*\\?"([\w.\-]+)\\?"')
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_F8 = re.compile(r"^\(?f8e\w+\[")


def triton_kernels(hlo: str) -> collections.Counter:
    """Pallas kernel name -> how many Triton custom calls of it the compiled module holds (a kernel
    lowered in interpret mode is a loop of ordinary ops instead, and is not counted)."""
    found: collections.Counter = collections.Counter()
    for line in hlo.splitlines():
        if _TRITON_CALL in line:
            name = _KERNEL_NAME.search(line)
            found[name.group(1) if name else "unnamed"] += 1
    return found


def cudnn_attention_calls(hlo: str) -> collections.Counter:
    """cuDNN fused-attention custom call target (`__cudnn$fmhaSoftmax`, its backward, the bias
    variants; + PACKED for its packed call, rows of several documents) -> how many the compiled module
    holds."""
    found: collections.Counter = collections.Counter()
    for line in hlo.splitlines():
        if (t := _CUSTOM_TARGET.search(line)) and t.group(1).startswith("__cudnn$fmha"):
            packed = (seg := _MAX_SEGMENTS.search(line)) and int(seg.group(1)) > 1
            found[t.group(1) + (PACKED if packed else "")] += 1
    return found


PACKED = " packed"  # `cudnn_attention_calls`' suffix for cuDNN's packed (THD) calls


@dataclasses.dataclass(frozen=True)
class GemmCount:
    total: float  # GEMMs: dots (GEMM fusions) and cuBLAS / cuBLASLt calls (per instruction, or as executed)
    fp8: float  # those whose two operands are FP8 (f8e4m3fn / f8e5m2): a tensor-core FP8 GEMM
    operands: tuple[tuple[str, float], ...] = ()  # ("f8e4m3fn x f8e5m2", n): element types, sorted, per GEMM

    def of_types(self, a: str, b: str) -> float:
        """GEMMs multiplying element types `a` and `b` (either order)."""
        return dict(self.operands).get(" x ".join(sorted((a, b))), 0)


def _element_type(shape: str) -> str:
    m = re.match(r"\(?(\w+)\[", shape)
    return m.group(1) if m else "?"


def gemms(hlo: str, executed: bool = False, branch_weights=None) -> GemmCount:
    """The GEMMs of a compiled GPU module: every `dot` left (each inside a Triton GEMM fusion after
    XLA:GPU's passes) and every cuBLAS(Lt) custom call, and which of them multiply FP8 operands.
    `executed`: each counted as often as it runs per call (loop bodies times their trip counts,
    conditional branches by `branch_weights`, see `_multiplicities`), else once per instruction.

    A dot of values dequantised to bf16 is a bf16 GEMM however its inputs were stored; only a dot
    whose operands are f8 typed (or cuBLASLt's `$f8` call) runs on the FP8 tensor cores."""
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, entry, branch_weights) if executed else None
    kinds: collections.Counter = collections.Counter()
    for name, lines in comps.items():
        runs = mult.get(name, 0) if mult is not None else 1
        if not runs:
            continue
        types = {}
        for line in lines:
            if m := _INSTRUCTION.match(line):
                types[m.group(1)] = m.group(2)
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            opcode, cublas = m.group(3), None
            if opcode == "custom-call" and (t := _CUSTOM_TARGET.search(line)) and t.group(1).startswith("__cublas"):
                cublas = t.group(1)
            if opcode != "dot" and cublas is None:
                continue
            operands = [op.strip().split()[-1].lstrip("%") for op in _top_level_args(m.group(4))[:2]]
            pair = sorted(_element_type(types.get(op, "")) for op in operands)
            if cublas is not None and "f8" in cublas and not all(t.startswith("f8") for t in pair):
                pair = ["f8?", "f8?"]  # an FP8 call whose operands this module's text does not type
            kinds[" x ".join(pair)] += runs
    fp8 = sum(n for k, n in kinds.items() if all(t.startswith("f8") for t in k.split(" x ")))
    return GemmCount(sum(kinds.values()), fp8, tuple(sorted(kinds.items())))


def f8_conversions(hlo: str) -> int:
    """`convert` instructions whose operand is an FP8 value: a quantised tensor dequantised (to bf16
    or float32) before its GEMM, which then runs in the wider type and keeps a wider copy."""
    comps, _ = _computations(hlo)
    found = 0
    for lines in comps.values():
        types = {m.group(1): m.group(2) for line in lines if (m := _INSTRUCTION.match(line))}
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m and m.group(3) == "convert":
                operand = _top_level_args(m.group(4))[0].strip().split()[-1].lstrip("%")
                found += _F8.match(types.get(operand, "")) is not None
    return found


# --------------------------------------------------------------------------------------------
# What a GPU-compiled module costs, kernel by kernel. Playbook, "Profiling GPU compute and
# communication" (kernel launch overhead) and "Diving in the GPUs - fusing, threading, mixing" (a
# kernel bound by HBM traffic; attention's scores written to and read from HBM, which Flash Attention
# keeps on chip): what a profile shows, read from the compiled module without a GPU.
# --------------------------------------------------------------------------------------------

# instructions that launch nothing (views, tuples, control flow whose bodies are read instead)
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
              "replica-id", "opt-barrier", "add-dependency", "domain", "while", "conditional", "call",
              "fusion-done"}  # an asynchronous fusion (newer XLA:GPU) launches at its start
# collectives move bytes over links, not through a kernel's HBM roofline: the cost model prices transfers
_COLLECTIVE = re.compile(r"^(?:(?:" + "|".join(KINDS) + r"|async|send|recv)(?:-start|-update|-done)?"
                         r"|copy-start|copy-done)$")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CUBLAS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled GPU module: what one launch moves through HBM and computes, and how
    many times it runs per call of the module."""

    name: str
    opcode: str  # "fusion", or the custom call's target, or the unfused instruction's opcode
    bytes: float  # read and written by one launch
    flops: float  # of its dots (GEMMs) in one launch, or an attention kernel's; elementwise work is not counted
    runs: float
    # the share of the bf16 peak its FLOPs run at: a measured kernel's (`MEASURED_EFFICIENCY`);
    # 0 for GEMMs, which `KernelTimes.flop_efficiency` prices (float32 ones at `TF32_EFFICIENCY`)
    efficiency: float = 0.0
    tf32: bool = False  # a GEMM of float32 operands: Hopper runs it as TF32 (`TF32_EFFICIENCY`)
    attention: bool = False  # a cuDNN fused-attention call or a Pallas flash attention kernel
    packed: bool = False  # cuDNN's packed (THD) attention call: rows of several documents, each causal
    fp8: bool = False  # a GEMM of two FP8 operands: Hopper's FP8 tensor cores (`FP8_EFFICIENCY` of their peak)


@dataclasses.dataclass(frozen=True)
class KernelTimes:
    """A GPU kernel's seconds from what it moves and computes (`Kernel`): the larger of its
    GEMM FLOPs at `flop_efficiency` of the bf16 peak and its HBM bytes at `hbm_efficiency` of the
    bandwidth, plus `launch` seconds per launch (what a kernel costs beyond its work: launch, the
    ramp of its first wave, its tail).

    The defaults were fitted (least squares in log time) to the 15 branch times of
    `bench/gpu/pipeline_branches.py` measured on one H200 (JAX 0.11.2: d_model 512 at 128 and 2,048
    tokens, llama3_8b's layer at 4,096, two layers a stage, each branch compiled for the H200 without
    it); on the held-out four-layer stages of the same shapes they give 0.78 to 1.15 of the measured
    times, where the whole-branch roofline of `from_compiler` gives 0.03 to 0.26."""

    flop_efficiency: float = 0.85
    hbm_efficiency: float = 0.65
    launch: float = 1.3e-6

    def seconds(self, kernels, gpu) -> float:
        """The kernels run one after another (one stream), each `runs` times."""
        return sum(k.runs * (max(k.flops / self.flop_rate(k, gpu),
                                 k.bytes / (gpu.hbm_bandwidth * self.hbm_efficiency)) + self.launch)
                   for k in kernels)

    def flop_rate(self, kernel: Kernel, gpu) -> float:
        """FLOP/s at which `kernel`'s FLOPs run on `gpu`: a GEMM of two FP8 operands at `FP8_EFFICIENCY` of
        the FP8 peak (where the GPU has FP8 tensor cores), the others at `rate` of the bf16 peak."""
        if kernel.fp8 and not kernel.efficiency and gpu.peak_fp8_flops:
            return gpu.peak_fp8_flops * FP8_EFFICIENCY
        return gpu.peak_flops * self.rate(kernel)

    def rate(self, kernel: Kernel) -> float:
        """The share of the bf16 peak at which `kernel`'s FLOPs run (FP8 GEMMs aside: `flop_rate`)."""
        if kernel.efficiency:
            return kernel.efficiency
        return min(self.flop_efficiency, TF32_EFFICIENCY) if kernel.tf32 else self.flop_efficiency


KERNEL_TIMES = KernelTimes()


def module_seconds(gpu, times: KernelTimes = KERNEL_TIMES) -> Callable[[str], float]:
    """A compiled module's text -> its seconds on `gpu`, kernel by kernel (`kernels`, `times`): what
    `parallel.cost.BranchCosts.from_gpu_compile` prices each pipeline branch with."""
    return lambda text: times.seconds(kernels(text, price=lambda ks: times.seconds(ks, gpu)), gpu)

# A float32 GEMM runs as TF32 on Hopper (XLA:GPU's default precision; TF32's dense peak is half the
# bf16 one): the share of the bf16 peak at which the two float32 GEMMs of the head's backward (the
# logits' float32 gradient against bf16 operands, [16384, 2048] x [2048, 128256]) ran in the profiled
# step of `bench/gpu/mfu.py` on one H200 (2026-11-27): 58 ms for 17.2 TFLOP.
TF32_EFFICIENCY = 0.30

# A GEMM of two FP8 operands (e4m3 / e5m2, float32 accumulation) on Hopper's FP8 tensor cores: the share of
# the FP8 peak (`hardware.Gpu.peak_fp8_flops`, twice the bf16 one) it runs at. NOT measured here yet (no GPU
# has run meshtrain's FP8 step): a published cuBLASLt micro-benchmark (TN layout, bf16 output, float32
# accumulation, 8192 x 8192 x 8192, 500 iterations on 16 H100 SXM GPUs, 2026-05-24) measured 1,599 to 1,630
# TFLOP/s, 1,611 on average: 0.81 of 1,979. The bf16 GEMMs' `KernelTimes.flop_efficiency` (0.85) was fitted
# to measured steps; this one is a kernel alone at a large square shape. The GPU runbook's `mfu` part
# measures the FP8 step beside the bf16 one, from which this figure is to be set.
FP8_EFFICIENCY = 0.81

# Attention kernels and the fused head + loss, priced by their FLOPs (the compiled module's text gives
# their shapes, not what they compute): the share of the bf16 peak each reached, by head_dim (64: up to
# 64; 128: above; the loss kernels' figure is the same in both), on one
# H200 (JAX 0.11.2, CUDA 13, 2026-11-27). Head dim 64: in the step of `bench/gpu/mfu.py`'s model
# (batch 4 x 4,096, 32 heads, 8 K/V heads), device time per call from its two-step profile (`--profile`):
# cuDNN forward 0.716 ms (its backward 2.144 ms with its three helper kernels), with the document mask
# as a bias 1.267 / 3.52 ms; the Pallas forward 1.640 ms, dq 1.332 ms, dk/dv 2.096 ms (the kernels that
# skip the causal mask below the diagonal, with 128 x 128 forward tiles; the 64 x 64 ones that replaced
# them were not profiled in the step: alone they take 0.978 ms a forward, the former 1.127, so the figure
# here is an upper bound). Head dim 128: `bench/kernels.py` at 1 x 8,192 (calls queued back to back):
# cuDNN forward 1.188 ms, forward + backward 3.978 ms; with the bias 2.117 / 9.005 ms (those two timed
# with a host round trip per call, so a little under the device's speed); Pallas with its default
# tiles 1.391 / 5.573 ms (dq and dk/dv not timed apart: both at the backward's share).
# The fused head + loss's forward (`pallas_kernels.cross_entropy`, [16384, 2048] x [2048, 128256], in the
# same step's profile): 17.7 ms a call (its Pallas backward, 692 ms with atomic adds, is now XLA GEMMs).
# FLOPs as counted here (`_attention_flops`): forward 4·B·H·T·S·D, halved when causal; cuDNN's backward
# 2.5 forwards; the Pallas dq kernel 1.5 forwards (it recomputes the scores), dk/dv 2 forwards; the
# loss kernel 2·N·D·V.
MEASURED_EFFICIENCY: dict[str, tuple[float, float]] = {  # kernel -> (head_dim <= 64, head_dim > 64)
    "cudnn_forward": (0.388, 0.468),
    "cudnn_backward": (0.324, 0.498),
    "cudnn_bias_forward": (0.219, 0.263),
    "cudnn_bias_backward": (0.197, 0.202),
    "flash_attention_forward": (0.169, 0.400),
    "flash_attention_dq": (0.313, 0.465),
    "flash_attention_dkdv": (0.265, 0.465),
    "cross_entropy_forward": (0.491, 0.491),
}
_PALLAS_FLASH = {"flash_attention_forward": 1.0, "flash_attention_dq": 1.5, "flash_attention_dkdv": 2.0}
_PALLAS_LOSS = {"cross_entropy_forward": 2.0}  # x N·D·V
# The MoE's grouped matmul kernels (`pallas_kernels.grouped_matmul`), priced by the rows their name says
# they are expected to compute (the routed rows, each expert's rounded up to whole tiles: a kernel skips
# the tiles no expert holds) at the share of the bf16 peak of their tiles. NOT measured on these kernels:
# no GPU has run them here yet. The figures are what a Pallas-Triton grouped matmul of the same structure
# (rows sorted by group, one group's weights a tile, float32 accumulation) reached on an H100 in public
# autotuning records (tokamax's `data/autotuning/nvidia_h100_80gb_hbm3/pallas_triton_ragged_dot.json`):
# 128 x 256 tiles with 8 warps, 1.48 ms for [8192, 4096] x [8, 4096, 14336] (Mixtral's expert, 0.656 of
# the peak), its weight gradient 0.557 at Qwen3-30B-A3B's expert ([131072, 2048] x [131072, 768]); 128 x
# 128 tiles with 4 warps, 0.42 to 0.43 forward at K 7168 and 0.47 to 0.51 for the weight gradient.
# `bench/gpu/moe_step.py` times the kernels on a GPU; its figures are to replace these.
GROUPED_EFFICIENCY: dict[tuple[str, int], float] = {  # (kernel, warps) -> share of the bf16 peak
    ("grouped_matmul", 4): 0.42, ("grouped_matmul_dx", 4): 0.42, ("grouped_matmul_dw", 4): 0.50,
    ("grouped_matmul", 8): 0.65, ("grouped_matmul_dx", 8): 0.65, ("grouped_matmul_dw", 8): 0.56,
}
_GROUPED = re.compile(r"^(grouped_(?:matmul(?:_dx|_dw)?|swiglu(?:_dx)?|dual_dx))_m(\d+)w(\d+)_rows(\d+)$")
# the fused kernels (`grouped_swiglu`): the products they run, and the kernel whose share of the peak they take
_GROUPED_FUSED = {"grouped_swiglu": (2, "grouped_matmul"), "grouped_swiglu_dx": (1, "grouped_matmul_dx"),
                  "grouped_dual_dx": (2, "grouped_matmul_dx")}
_FMHA_SHAPE = re.compile(r'"intermediate_tensor_shape"\s*:\s*\{[^}]*?"dimensions"\s*:\s*\[([^\]]*)\]')
_MASK_TYPE = re.compile(r'"mask_type"\s*:\s*"(\w+)"')
_MAX_SEGMENTS = re.compile(r'"max_seg_per_batch"\s*:\s*"?(\d+)')


def _attention_flops(batch: int, heads: int, length_q: int, length_kv: int, head_dim: int, causal: bool) -> float:
    """A forward attention's matmul FLOPs: scores and output, 2·T·S·D each per head; half when causal."""
    return 4.0 * batch * heads * length_q * length_kv * head_dim * (0.5 if causal else 1.0)


def _measured_kernel(target: str, rest: str, operand_shapes: list[str]) -> tuple[float, float]:
    """(FLOPs, efficiency) of a cuDNN fused-attention call, a Pallas flash kernel or a Pallas loss kernel,
    or (0, 0) for any other custom call. cuDNN's backend config gives its [B, H, T, S] scores' shape and
    its mask; the Pallas flash kernels take q [B, T, H, D] and k [B, S, K, D] first, and count as causal
    when T == S (the model's attention; ring attention's off-diagonal blocks are full, and priced as
    half); the loss kernels take h [N, D] and w [D, V] first."""
    if target.startswith("__cudnn$fmha"):
        shape, q = _FMHA_SHAPE.search(rest), _dims(operand_shapes[0]) if operand_shapes else []
        if not shape or not q:
            return 0.0, 0.0
        b, h, t, s_ = (int(d.strip().strip('"')) for d in shape.group(1).split(","))
        mask = _MASK_TYPE.search(rest)
        flops = _attention_flops(b, h, t, s_, q[-1], bool(mask and "CAUSAL" in mask.group(1)))
        backward = "Backward" in target
        kind = "cudnn_" + ("bias_" if "Bias" in target else "") + ("backward" if backward else "forward")
        return flops * (2.5 if backward else 1.0), MEASURED_EFFICIENCY[kind][q[-1] > 64]
    name = _KERNEL_NAME.search(rest)
    if target == _TRITON_TARGET and name and name.group(1) in _PALLAS_FLASH and len(operand_shapes) >= 2:
        q, k = _dims(operand_shapes[0]), _dims(operand_shapes[1])
        v = _dims(operand_shapes[2]) if len(operand_shapes) > 2 else k
        if len(q) != 4 or len(k) != 4 or len(v) != 4:
            return 0.0, 0.0
        # the scores over the query / key width, the output over the values' (narrower under latent attention)
        flops = _attention_flops(q[0], q[2], q[1], k[1], (q[3] + v[3]) / 2, q[1] == k[1])
        return flops * _PALLAS_FLASH[name.group(1)], MEASURED_EFFICIENCY[name.group(1)][q[3] > 64]
    if target == _TRITON_TARGET and name and name.group(1) in _PALLAS_LOSS and len(operand_shapes) >= 2:
        h, w = _dims(operand_shapes[0]), _dims(operand_shapes[1])
        if len(h) != 2 or len(w) != 2:
            return 0.0, 0.0
        return _PALLAS_LOSS[name.group(1)] * h[0] * h[1] * w[1], MEASURED_EFFICIENCY[name.group(1)][0]
    return 0.0, 0.0


def grouped_matmul_price(name: re.Match, operands: list[list[int]], result: list[int]) -> tuple[float, float]:
    """(FLOPs, efficiency) of a grouped matmul kernel named as `_GROUPED` matches: 2 x rows x (the width
    it contracts) x (the width it writes), times the products it runs (`_GROUPED_FUSED`): x [M, K] ->
    [M, N] for the products and input gradients (operands: group, owned, x, w, ...), x [M, K] and dy [M, N]
    for the weight gradient (first, count, size, x, dy)."""
    kernel, warps, rows = name.group(1), int(name.group(3)), int(name.group(4))
    products, kernel = _GROUPED_FUSED.get(kernel, (1, kernel))
    efficiency = GROUPED_EFFICIENCY.get((kernel, warps), GROUPED_EFFICIENCY[(kernel, 4)])
    if kernel == "grouped_matmul_dw":
        if len(operands) >= 5 and len(operands[3]) == 2 and len(operands[4]) == 2:
            return 2.0 * rows * operands[3][1] * operands[4][1], efficiency
    elif len(operands) >= 3 and len(operands[2]) == 2 and len(result) == 2:
        return products * 2.0 * rows * operands[2][1] * result[1], efficiency
    return 0.0, 0.0


def _grouped_bytes(name: re.Match, operands: list[str], out_bytes: int) -> float:
    """HBM bytes of a grouped matmul kernel: of its row operands only the expected rows (the tiles no
    expert holds are skipped), its weights whole, its output whole (those tiles are written as zeros)."""
    rows, total = int(name.group(4)), float(out_bytes)
    for shape in operands:
        dims = _dims(shape)
        if len(dims) == 2:  # x [M, K] or dy [M, N]: the rows it reads
            total += _nbytes(shape) * min(1.0, rows / max(dims[0], 1))
        else:
            total += _nbytes(shape)
    return total


def kernels(hlo: str, branch_weights=None, price=None,
            attention_branch: str = "longest", lockstep=None, slot_shares=None) -> list[Kernel]:
    """The kernels a GPU-compiled module launches (its optimized HLO, `compiled.as_text()`): each
    fusion, custom call and unfused instruction of the computations that run, with the bytes it reads
    and writes and its GEMM FLOPs, and how many times it runs per call: loop bodies times their trip
    counts (inferred from the condition where XLA left none, `_inferred_trips`). A conditional runs one
    branch per call: with `branch_weights` (for conditionals of that many branches) each branch counts
    that share of the calls; otherwise only the branch that `price` (kernels -> seconds) makes longest,
    or without `price` the one of the most launches (a lock-step tick lasts as long as its slowest
    stage's branch). A conditional each of whose branches is itself an attention call
    (`attention.cudnn_attention`'s choice, `attention.DOCUMENT_BRANCHES`: cuDNN's causal call, its packed
    call, the document-masked fallback past `attention.max_documents`) counts its packed call where it has
    one (rows of documents), else its longest branch; `attention_branch="shortest"` prices it by its
    cheapest branch: the step of a batch whose rows are one document each;
    a pipeline tick's switch (its stages' attention nested in their layer loops) keeps its longest. A fusion
    reads of a parameter only what its (dynamic-)slices take (a layer of a
    scanned stack), and updates an operand in place when its root is a dynamic-update-slice (writing
    only the update).

    `lockstep` = (rows [n, p] of branch indices, branches), or {branches: rows} for a pipeline run as
    several loops whose switches differ in size (`slot_program.segment_rows`): a pipeline's slot switch
    (a conditional of that many branches) as its loop runs it, row by row (`Layout.lockstep_rows`: a
    tick, stage s taking branch rows[i, s]), each row lasting as long as its slowest stage's branch
    (`price`): each such conditional counts each branch for the share of rows it is the slowest in.
    Without it the longest branch counts for every row, a backward in every tick of a table whose ticks
    alternate forwards and backwards. `slot_shares` ({branches: rows} of the same shapes, `Layout.slot_shares`):
    the share of its scanned slots stage s runs at that row (uneven stages), by which its branch prices the
    conditionals that skip its empty slots (named `slot_program.EMPTY_SLOT_SCOPE`): the costlier branch for
    that share of the calls, the other for the rest; a row lasts as long as its slowest (branch, share).
    Without it such a conditional counts its costlier branch every call (the fullest stage's)."""
    comps, entry = _computations(hlo)
    parsed = {name: [m for line in lines if (m := _INSTRUCTION.match(line))] for name, lines in comps.items()}
    branch_weights, lockstep, slot_shares = _by_size(branch_weights), _by_size(lockstep), _by_size(slot_shares)
    cost = (lambda ks: price(ks)) if price else (lambda ks: sum(k.runs for k in ks))

    @functools.cache
    def own(name: str) -> tuple[Kernel, ...]:  # the computation's own launches, once each
        shapes = {m.group(1): m.group(2) for m in parsed[name]}
        return tuple(kernel for m in parsed[name] if (kernel := _kernel(m, shapes, parsed)) is not None)

    def walk(name: str, factor: float, share: float | None = None) -> list[Kernel]:
        """The launches of computation `name` run `factor` times; `share`: of a pipeline stage's slots, the
        share that run (its empty-slot conditionals' weight), None outside a lock-step branch."""
        out = [dataclasses.replace(k, runs=factor) for k in own(name)]
        for m in parsed[name]:
            opcode, rest = m.group(3), m.group(4)
            if opcode == "while":
                trips = int(t.group(1)) if (t := _TRIP.search(rest)) else \
                    _inferred_trips(comps, comps[name], m.string) or 1
                for key in ("body", "condition"):
                    if (c := re.search(rf"\b{key}=%?([\w.\-]+)", rest)) and c.group(1) in parsed:
                        out += walk(c.group(1), factor * trips, share)
            elif opcode == "conditional":
                found = _BRANCHES.search(rest)
                names = [n.strip().lstrip("%") for n in found.group(1).split(",")] if found else \
                    re.findall(r"\b(?:true|false)_computation=%?([\w.\-]+)", rest)
                names = [n for n in names if n in parsed]
                if share is not None and len(names) == 2 and _skips_slots(rest):
                    costs = [cost(walk(b, 1.0)) for b in names]
                    run = int(np.argmax(costs))
                    for index, branch in enumerate(names):
                        out += walk(branch, factor * (share if index == run else 1.0 - share))
                elif len(names) in branch_weights:
                    for branch, weight in zip(names, branch_weights[len(names)], strict=True):
                        out += walk(branch, factor * weight, share)
                elif len(names) in lockstep:
                    rows = lockstep[len(names)]
                    shares = slot_shares.get(len(names), np.ones(rows.shape))
                    pairs = sorted({(int(b), float(q)) for b, q in zip(rows.ravel(), shares.ravel(), strict=True)})
                    costs = {(b, q): cost(walk(names[b], 1.0, q)) for b, q in pairs}
                    for (index, q), weight in _slowest_shares(rows, costs, shares).items():
                        out += walk(names[index], factor * weight, q)
                elif names:
                    walked = [walk(branch, factor, share) for branch in names]
                    attention_choice = len(names) > 1 and all(  # every branch itself an attention call
                        any(k.attention for k in own(branch)) for branch in names)
                    packed = [w for b, w in zip(names, walked, strict=True) if any(k.packed for k in own(b))]
                    if attention_choice and attention_branch != "shortest" and packed:
                        out += packed[0]  # rows of documents: cuDNN's packed call, not the fallback past its limit
                    else:
                        out += (min if attention_branch == "shortest" and attention_choice else max)(walked, key=cost)
            elif opcode == "call" and (t := re.search(r"\bto_apply=%?([\w.\-]+)", rest)) and t.group(1) in parsed:
                out += walk(t.group(1), factor, share)
        return out

    return walk(entry, 1.0)


def _slowest_shares(rows, costs: dict[tuple[int, float], float], shares) -> dict[tuple[int, float], float]:
    """{(branch, slot share): share of the rows in which it is the slowest stage's} (rows [n, p] of branch
    indices, shares [n, p] of the share of its slots each stage runs)."""
    slowest = collections.Counter(max(zip(row, share, strict=True), key=lambda bq: costs[bq])
                                  for row, share in zip(rows.tolist(), shares.tolist(), strict=True))
    return {(int(b), float(q)): n / len(rows) for (b, q), n in slowest.items()}


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _skips_slots(rest: str) -> bool:
    """Whether a conditional is an uneven stage's skip of its empty slots: its op_name in the scope
    `slot_program.EMPTY_SLOT_SCOPE` and not inside a branch there (a conditional of the slot's layer)."""
    op = _OP_NAME.search(rest)
    scopes = op.group(1).split("/") if op else []
    if slot_program.EMPTY_SLOT_SCOPE not in scopes:
        return False
    inner = scopes[len(scopes) - scopes[::-1].index(slot_program.EMPTY_SLOT_SCOPE):]
    return not any(scope.startswith("branch_") for scope in inner)


def _kernel(m, shapes: dict[str, str], parsed) -> Kernel | None:
    """The launch of instruction `m` (one run), or None for an instruction that launches nothing here."""
    opcode, rest = m.group(3), m.group(4)
    if opcode in _NO_KERNEL or _COLLECTIVE.match(opcode):
        return None
    args = [_operand_name(a) for a in _top_level_args(rest)]
    operand_bytes = [_nbytes(shapes.get(a, "")) for a in args]
    out_bytes, flops, efficiency, tf32, fp8 = _nbytes(m.group(2)), 0.0, 0.0, False, False
    callee = re.search(r"\bcalls=%?([\w.\-]+)", rest) if opcode in ("fusion", "fusion-start") else None
    if callee and callee.group(1) in parsed:
        if opcode == "fusion-start":  # ((operands), result, context): the result is the fused root's
            root = next(r for r in parsed[callee.group(1)] if r.string.lstrip().startswith("ROOT"))
            out_bytes, opcode = _nbytes(root.group(2)), "fusion"
        moved = _fusion_bytes(parsed[callee.group(1)], operand_bytes, out_bytes)
        flops = _dot_flops(parsed, callee.group(1))
        tf32 = flops > 0 and _float32_dots(parsed, callee.group(1))
        fp8 = flops > 0 and _fp8_dots(parsed, callee.group(1))
    else:
        target = _CUSTOM_TARGET.search(rest) if opcode == "custom-call" else None
        if target and target.group(1).startswith("__cublas"):  # (result, workspace): the scratch is no traffic
            first = _ARRAY.search(m.group(2))
            out_bytes = _nbytes(first.group(0)) if first else 0
        moved = out_bytes + sum(operand_bytes)
        types = [_element_type(shapes.get(a, "")) for a in args[:2]]
        if opcode == "dot":
            flops = _one_dot_flops(m, shapes)
            tf32 = bool(types) and types[0] == "f32"
            fp8 = len(types) == 2 and all(t.startswith("f8") for t in types)
        elif target and target.group(1).startswith("__cublas") and (c := _CUBLAS_CONTRACTING.search(rest)):
            lhs = _dims(shapes.get(args[0], "")) if args else []
            dims = [int(d.strip().strip('"')) for d in c.group(1).split(",") if d.strip()]
            if lhs and all(d < len(lhs) for d in dims):
                flops = 2.0 * math.prod(_dims(m.group(2))) * math.prod(lhs[d] for d in dims)
                tf32 = bool(types) and types[0] == "f32"
                fp8 = "f8" in target.group(1) or (len(types) == 2 and all(t.startswith("f8") for t in types))
        elif target:
            operands = [shapes.get(a, "") for a in args]
            flops, efficiency = _measured_kernel(target.group(1), rest, operands)
            if (named := _KERNEL_NAME.search(rest)) and (grouped := _GROUPED.match(named.group(1))):
                flops, efficiency = grouped_matmul_price(grouped, [_dims(o) for o in operands], _dims(m.group(2)))
                moved = _grouped_bytes(grouped, operands, out_bytes)
    if opcode == "custom-call" and (t := _CUSTOM_TARGET.search(rest)):
        opcode = t.group(1)
    name = _KERNEL_NAME.search(rest)
    attention = opcode.startswith("__cudnn$fmha") or (
        opcode == _TRITON_TARGET and name is not None and name.group(1) in _PALLAS_FLASH)
    packed = attention and bool((seg := _MAX_SEGMENTS.search(rest)) and int(seg.group(1)) > 1)
    return Kernel(m.group(1), opcode, float(moved), float(flops), 1.0, efficiency, tf32, attention, packed, fp8)


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _one_dot_flops(m, shapes: dict[str, str]) -> float:
    """2 x (result elements) x (contracted size) of a `dot` instruction."""
    lhs = _dims(shapes.get(_operand_name(_top_level_args(m.group(4))[0]), ""))
    c = _CONTRACTING.search(m.group(4))
    k = math.prod(lhs[int(d)] for d in c.group(1).split(",") if d) if c and lhs else 1
    return 2.0 * math.prod(_dims(m.group(2))) * k


def _dot_flops(parsed, name: str) -> float:
    """The dot FLOPs of a fused computation (nested fusions included)."""
    shapes = {m.group(1): m.group(2) for m in parsed[name]}
    total = 0.0
    for m in parsed[name]:
        if m.group(3) == "dot":
            total += _one_dot_flops(m, shapes)
        elif m.group(3) == "fusion" and (callee := re.search(r"\bcalls=%?([\w.\-]+)", m.group(4))) \
                and callee.group(1) in parsed:
            total += _dot_flops(parsed, callee.group(1))
    return total


def _fp8_dots(parsed, name: str) -> bool:
    """Whether a fused computation's dots (nested fusions included) multiply two FP8 operands."""
    shapes = {m.group(1): m.group(2) for m in parsed[name]}
    for m in parsed[name]:
        if m.group(3) == "dot":
            types = [_element_type(shapes.get(_operand_name(a), "")) for a in _top_level_args(m.group(4))[:2]]
            if len(types) == 2 and all(t.startswith("f8") for t in types):
                return True
        elif m.group(3) == "fusion" and (callee := re.search(r"\bcalls=%?([\w.\-]+)", m.group(4))) \
                and callee.group(1) in parsed and _fp8_dots(parsed, callee.group(1)):
            return True
    return False


def _float32_dots(parsed, name: str) -> bool:
    """Whether a fused computation's dots (nested fusions included) take float32 operands (TF32)."""
    shapes = {m.group(1): m.group(2) for m in parsed[name]}
    for m in parsed[name]:
        if m.group(3) == "dot":
            args = _top_level_args(m.group(4))
            if args and _element_type(shapes.get(_operand_name(args[0]), "")) == "f32":
                return True
        elif m.group(3) == "fusion" and (callee := re.search(r"\bcalls=%?([\w.\-]+)", m.group(4))) \
                and callee.group(1) in parsed and _float32_dots(parsed, callee.group(1)):
            return True
    return False


_READS = ("dynamic-slice", "slice", "gather")  # ops that read part of their first operand
_LAYOUT = re.compile(r"\]\{([\d,]+)")  # an array's layout: its dimensions minor to major
SECTOR = 32  # bytes: the least a GPU reads from HBM
_WINDOWED = (*_READS, "dynamic-update-slice", "scatter")


def _elements(shape: str) -> int:
    m = _ARRAY.search(shape)
    return math.prod(int(d) for d in m.group(2).split(",") if d) if m else 0


def _fusion_bytes(body, operand_bytes: list[int], out_bytes: int) -> int:
    """HBM bytes of one fusion launch: each parameter whole, or, where its only users (seen through
    bitcasts and dtype converts) are (dynamic-)slices, gathers and the root dynamic-update-slice or
    scatter that updates it in place, only the elements the slices and gathers take (a converted stack's
    one layer; the target logit of each row of the logits) at the parameter's width;
    then the result, or only the update written in place (a scatter: its updates read and the
    rows they add to read and written, as XLA:GPU emits a scatter into its operand's buffer: a pipeline
    tick's embedding-gradient rows, `pipeline_tables._TableWork.add_embedding_grads`). XLA:GPU's loop
    and reduction emitters compute each output element from the input elements it needs, so a slice
    of a converted parameter reads the slice alone."""
    users: dict[str, list[tuple[str, int, str, str]]] = collections.defaultdict(list)
    shapes, params, root = {}, {}, None
    for m in body:
        shapes[m.group(1)] = m.group(2)
        if m.group(3) == "parameter":
            params[int(re.match(r"\s*(\d+)", m.group(4)).group(1))] = m.group(1)
        for i, arg in enumerate(_top_level_args(m.group(4))):
            users[_operand_name(arg)].append((m.group(3), i, m.group(2), m.group(1)))
        if m.string.lstrip().startswith("ROOT"):
            root = m
    lines = {m.group(1): m for m in body}

    def uses_of(name: str, converted: bool = False) -> list[tuple[str, int, str, bool, str, str]]:
        """Its users, through bitcasts (the same bytes, another shape) and converts (the same
        elements, another width: only a read may follow one): (opcode, operand index, result shape,
        converted, user, the value it reads)."""
        out = []
        for op, i, shape, user in users.get(name, []):
            if op in ("bitcast", "convert"):
                out += uses_of(user, converted or op == "convert")
            else:
                out.append((op, i, shape, converted, user, name))
        return out

    def read(name: str, op: str, shape: str, user: str, operand: str) -> int:
        """Bytes a slice or gather of parameter `name` reads: its elements at the parameter's width; a
        gather's rows in whole 32-byte sectors (a column of a row-major table, or a row of a column-major
        one as the embedding's gathered table lies, costs a sector an element)."""
        width = _DTYPE_BYTES.get(_element_type(shapes.get(name, "")), 0)
        elements = _elements(shape)
        sizes = re.search(r"slice_sizes=\{([\d,]*)\}", lines[user].group(4)) if op == "gather" else None
        layout = _LAYOUT.search(shapes.get(operand, ""))
        if not sizes or not layout:
            return width * elements
        minor = int(layout.group(1).split(",")[0])
        run = int(sizes.group(1).split(",")[minor]) * width  # bytes of one contiguous run
        return elements // max(run // width, 1) * -(-run // SECTOR) * SECTOR
    total = 0
    for index, name in params.items():
        uses = uses_of(name)
        if uses and all(op in _WINDOWED and i == 0 and (op in _READS or not converted)
                        for op, i, _, converted, _, _ in uses):
            # read through its slices and gathers; updated in place (a window read, changed and written
            # back, as `pipeline_tables._add_chunk` adds a chunk's gradients: the window, not the whole);
            # at most once whole (a gather of each token's rows for its k experts re-reads rows from cache)
            reads = sum(read(name, op, shape, user, operand) for op, _, shape, _, user, operand in uses
                        if op in _READS)
            total += min(reads, operand_bytes[index]) if index < len(operand_bytes) else reads
        else:
            total += operand_bytes[index] if index < len(operand_bytes) else 0
    if root is not None and root.group(3) == "dynamic-update-slice":
        total += _nbytes(shapes.get(_operand_name(_top_level_args(root.group(4))[1]), ""))
    elif root is not None and root.group(3) == "scatter":
        total += 2 * _nbytes(shapes.get(_operand_name(_top_level_args(root.group(4))[2]), ""))
    else:
        total += out_bytes
    return total
