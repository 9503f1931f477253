"""Throughput, MFU and memory figures, the metrics.jsonl writer, and the terminal progress line.

MFU follows the playbook ("Benchmarking thousands of configurations" and its appendix):
model FLOPs per token = 6 N (forward + backward matmuls with N non-embedding-input
parameters) + 12 L T d_attn (the attention scores and values, causal counted in full as
the playbook does), divided by the peak dense bf16 FLOP/s of the device. Under
`model.matmul_precision='fp8'` the quantised matmuls' share of those FLOPs counts at the device's
FP8 peak (twice bf16's on Hopper): the peak is the blend in which each share takes its own time.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax

from meshtrain import durable, model
from meshtrain.config import ModelConfig

# Peak dense (bf16, fp8) FLOP/s per device, by `device_kind` prefix; fp8 None where the device has no
# FP8 matmul units (its FP8 matmuls run at the bf16 rate). Unknown devices (CPU): MFU is null.
PEAK_FLOPS = {
    "NVIDIA H100": (989e12, 1979e12),
    "NVIDIA H200": (989e12, 1979e12),
    "NVIDIA B200": (2250e12, 4500e12),
    "NVIDIA A100": (312e12, None),
    "TPU v5p": (459e12, None),
    "TPU v5 lite": (197e12, None),
    "TPU v4": (275e12, None),
}
# The weights whose matmuls run in FP8 under matmul_precision='fp8' (fp8.py): attention projections,
# the MLP, the experts and the shared expert; never the embedding, the output head or the router.
FP8_WEIGHTS = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "shared_gate", "shared_up",
                         "shared_down"})


def device_peak_flops(device: jax.Device | None = None, fp8_share: float = 0.0) -> float | None:
    """The peak FLOP/s of `device` (default: the first) for a step with `fp8_share` of its FLOPs in
    FP8 (`blended_peak`), or None when the device is not in the table."""
    kind = (device or jax.devices()[0]).device_kind
    for prefix, (bf16, fp8) in PEAK_FLOPS.items():
        if kind.startswith(prefix):
            return blended_peak(bf16, fp8, fp8_share)
    return None


def blended_peak(bf16: float, fp8: float | None, fp8_share: float) -> float:
    """Peak FLOP/s of work that is `fp8_share` FP8 and the rest bf16: at peak each share takes
    share / its own rate, so the blend is 1 / (share / fp8 + (1 - share) / bf16)."""
    if not fp8 or fp8_share <= 0:
        return bf16
    return 1.0 / (fp8_share / fp8 + (1.0 - fp8_share) / bf16)


def fp8_flops_per_token(cfg: ModelConfig) -> float:
    """The FP8 part of `flops_per_token`: 6 x the parameters of the quantised matmuls a token uses
    (0 unless matmul_precision='fp8'). Attention's scores and values stay in bf16."""
    if cfg.matmul_precision != "fp8":
        return 0.0
    total = 0
    for path, box in model.param_leaves(cfg):
        if path.rsplit("/", 1)[-1] in FP8_WEIGHTS:
            size = math.prod(box.value.shape)
            total += size * cfg.experts_per_token // cfg.num_experts if "expert" in box.names else size
    return 6.0 * total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters a token uses) + `attention_flops_per_token`.

    The input embedding is a gather (no FLOPs); an MoE layer counts only the experts a token is routed to.
    """
    matmul_params = model.num_active_params(cfg) - cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)
    return 6.0 * matmul_params + attention_flops_per_token(cfg, seq_len)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The attention's training FLOPs per token (playbook, "Memory usage in Transformers": 6 x seq_len x the
    width of q.k and of p.v, per head and layer, not halved for the causal mask): 12 x layers x seq_len x
    heads x head_dim where the values are as wide as the keys, 6 x (head_dim + v_head_dim) where not (multi-head
    latent attention)."""
    return 6.0 * cfg.n_layers * seq_len * cfg.n_heads * (cfg.head_dim + (cfg.v_head_dim or cfg.head_dim))


def memory_stats() -> dict[str, float]:
    """Bytes in use / peak on the first local device, when the backend reports them."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}


class MetricsWriter:
    """Appends one JSON object per logged step to `<workdir>/metrics.jsonl` (process 0 only): an
    append-only log (`durable.JsonlLog`) whose torn last line, if a crash left one, is dropped with a
    warning and cut off before the first append."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.rolled_back_path = os.path.join(workdir, "metrics.rolled_back.jsonl")
        self._log = durable.JsonlLog(self.path) if enabled else None

    def truncate_after(self, step: int) -> None:
        """Moves the records of steps after `step` to `metrics.rolled_back.jsonl`: the run went back
        to `step` (a resume from an older checkpoint, a loss-spike rollback), so metrics.jsonl holds
        one trajectory, each step once, and nothing logged is lost. Crash-safe in its order: the moved
        records are appended to the rolled-back log first, then metrics.jsonl is replaced whole; a
        crash in between leaves them in both, and the relaunch moves them again (the rolled-back log
        may then hold a record twice, never lose one)."""
        if not self._log or not os.path.exists(self.path):
            return
        self._log.close()
        with durable.writing(self.path):
            records = durable.read_jsonl(self.path)  # warns once of a torn last line, cut off here
            durable.repair_tail(self.path, warn=False)
        dropped = [r for r in records if r.get("step", 0) > step]
        if dropped:
            rolled_back = durable.JsonlLog(self.rolled_back_path)
            rolled_back.extend(dropped)
            rolled_back.sync()  # on disk before metrics.jsonl loses them
            rolled_back.close()
            durable.write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= step))

    def write(self, record: dict) -> None:
        if self._log:
            self._log.append({k: _jsonable(v) for k, v in record.items()})

    def close(self) -> None:
        if self._log:
            self._log.close()


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan" / "inf": JSON has no literal for them
    return value


class Progress:
    """A live single-line progress display with ETA, only when stdout is a terminal."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.total, self.start = total_steps, start_step
        self.enabled = enabled and sys.stdout.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        width = 30
        filled = int(width * step / max(self.total, 1))
        sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} "
                         f"loss {loss:.4f} eta {eta:6.1f}s")
        sys.stdout.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stdout.write("\r" + " " * 100 + "\r")
            sys.stdout.flush()
