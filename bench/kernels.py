"""Benchmark of the Pallas kernels.

On GPU: TFLOP/s, % of the GPU's bf16 peak and compiled temp memory of the Pallas
flash attention kernel against XLA attention and cuDNN (`jax.nn.dot_product_attention`),
causal, bf16, forward and forward + backward: first at the GPU runbook's shape
(`bench/gpu/mfu.py`: batch 4 x 4,096, 32 query heads, 8 K/V heads of 64), then at
Llama-3-8B heads (32 query heads, 8 K/V heads, head_dim 128) for each of `--lengths`.
`cudnn+docs` is meshtrain's `attention.impl=cudnn` on rows of 4 documents (cuDNN's packed
call on a Hopper; `cudnn+docs fallback` the document-masked fallback past `attention.max_documents`:
the Pallas flash kernel from head dim 128, else cuDNN with the mask as a bias; the causal-only call
is `cudnn`). A call's time is the GPU's
throughput: `--iters` calls queued back to back, one host round trip for all, best of 3
(a round trip per call adds ~0.3 ms, a third of a 1-ms kernel).

On CPU: the kernels run in interpret mode, so only correctness against the
references is reported, plus the compiled temp memory of a loss + gradient step
with and without the fused cross-entropy (32k vocabulary). Prints a table and
one JSON line; exits 1 when a kernel differs from its reference by more than the
kernel tests' float32 tolerance (`TOLERANCE`) or the fused loss's step holds as
many temporary bytes as the float32 logits it never writes.

`--sweep` (GPU only) times the flash kernel alone at the runbook's shape (or 1 x
`--sweep-length` tokens at Llama-3-8B heads) for each tile size and Triton launch parameter
(`FlashBlockSizes`: warps, pipeline stages): the forward's, then the backward's under the
default forward; the best of each is printed with the default's.

    python bench/kernels.py [--lengths 1024,2048] [--iters 10] [--out FILE]
    python bench/kernels.py --sweep [--sweep-length 8192] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.pallas_kernels import (
    FlashBlockSizes,
    flash_attention,
    flash_attention_reference,
    fused_cross_entropy,
    fused_cross_entropy_reference,
    rms_norm,
    rms_norm_reference,
)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
RUNBOOK_SHAPE = (4, 4096, 32, 8, 64)  # batch, length, heads, K/V heads, head_dim: bench/gpu/mfu.py's model


def _attention_impls():
    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def cudnn_docs(q, k, v, max_documents=32):
        """meshtrain's cudnn attention on rows of 4 documents: the packed call on a Hopper (max_documents 0:
        the document-masked fallback, the Pallas flash kernel from head dim 128, else a bias)."""
        from meshtrain.attention import cudnn_attention

        b, t = q.shape[:2]
        segments = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) * 4 // t + 1, (b, t))
        return cudnn_attention(q, k, v, segments, max_documents=max_documents)

    return {
        "pallas_flash": lambda q, k, v: flash_attention(q, k, v, causal=True),
        "xla": xla,
        "cudnn": cudnn,
        "cudnn+docs": cudnn_docs,
        "cudnn+docs fallback": functools.partial(cudnn_docs, max_documents=0),
    }


def _time_queued(fn, args, calls: int = 20) -> float:
    """Seconds a call, from `calls` calls queued back to back (one host round trip in all)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _attention_flops(batch: int, length: int, heads: int, head_dim: int, backward: bool) -> float:
    # Two matmuls of 2*L*L*D flops per head, half of them kept by the causal mask;
    # the backward pass does 2.5x the forward's matmul work.
    fwd = batch * 4 * heads * length * length * head_dim / 2
    return fwd * (3.5 if backward else 1.0)


def bench_attention_gpu(lengths: list[int], iters: int, on_row=None) -> list[dict]:
    """Each implementation's rows (`on_row(rows)` after each: a run stopped at its time limit keeps them)."""
    from meshtrain import metrics

    peak = metrics.device_peak_flops(jax.devices()[0])
    rows = []
    shapes = [RUNBOOK_SHAPE] + [(1, length, HEADS, KV_HEADS, HEAD_DIM) for length in lengths]
    for batch, length, heads, kv_heads, head_dim in shapes:
        ks = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(ks[0], (batch, length, heads, head_dim), jnp.bfloat16)
        k = jax.random.normal(ks[1], (batch, length, kv_heads, head_dim), jnp.bfloat16)
        v = jax.random.normal(ks[2], (batch, length, kv_heads, head_dim), jnp.bfloat16)
        for name, impl in _attention_impls().items():
            for backward in (False, True):
                fn = impl
                if backward:
                    fn = jax.grad(
                        lambda q, k, v, f=impl: jnp.sum(f(q, k, v).astype(jnp.float32)),
                        argnums=(0, 1, 2),
                    )
                row = {
                    "shape": f"{batch}x{length}x{heads}/{kv_heads}x{head_dim}",
                    "length": length,
                    "impl": name,
                    "pass": "fwd+bwd" if backward else "fwd",
                }
                try:
                    compiled = jax.jit(fn).lower(q, k, v).compile()
                    mem = compiled.memory_analysis()
                    row["temp_mib"] = round(mem.temp_size_in_bytes / 2**20, 1) if mem else None
                    seconds = _time_queued(compiled, (q, k, v), iters)
                    row["ms"] = round(seconds * 1e3, 3)
                    flops = _attention_flops(batch, length, heads, head_dim, backward)
                    row["tflops"] = round(flops / seconds / 1e12, 1)
                    row["peak_share"] = round(flops / seconds / peak, 3) if peak else None
                except (
                    jax.errors.JaxRuntimeError,
                    RuntimeError,
                    ValueError,
                    NotImplementedError,
                ) as e:
                    # out of memory (XLA at long L), or cuDNN unavailable for this shape or GPU
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                print(json.dumps(row), flush=True)
    return rows


SWEEP_FORWARD = [  # (block_q, block_kv, num_warps, num_stages)
    (bq, bk, warps, stages)
    for bq, bk in ((64, 64), (64, 128), (128, 64), (128, 128))
    for warps in (4, 8)
    for stages in (2, 3)
]
SWEEP_BACKWARD = [  # (block_q_bwd, block_kv_bwd, num_warps_bwd, num_stages_bwd)
    (bq, bk, warps, stages)
    for bq, bk in ((32, 64), (64, 64), (64, 128), (128, 64), (128, 128))
    for warps in (4, 8)
    for stages in (1, 2)
]


def sweep_flash(on_row=None, shape=RUNBOOK_SHAPE, forward=None, backward=None) -> dict:
    """The flash kernel's forward and forward + backward at the runbook's shape for each entry of
    `SWEEP_FORWARD` / `SWEEP_BACKWARD` (the backward's under the default forward), as TFLOP/s and
    share of the GPU's bf16 peak; the default (`FlashBlockSizes.default`) first in each list."""
    from meshtrain import metrics

    peak = metrics.device_peak_flops(jax.devices()[0])
    batch, length, heads, kv_heads, head_dim = shape
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (batch, length, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(ks[1], (batch, length, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(ks[2], (batch, length, kv_heads, head_dim), jnp.bfloat16)
    default = FlashBlockSizes.default(head_dim, jnp.bfloat16)
    result = {"shape": f"{batch}x{length}x{heads}/{kv_heads}x{head_dim}", "forward": [], "backward": []}
    d_warps, d_stages = default.launch_params(head_dim, backward=False)
    d_warps_bwd, d_stages_bwd = default.launch_params(head_dim, backward=True)
    cases = [("forward", (default.block_q, default.block_kv, d_warps, d_stages))]
    forward = SWEEP_FORWARD if forward is None else forward
    cases += [("forward", c) for c in forward]
    cases += [("backward", (default.block_q_bwd, default.block_kv_bwd, d_warps_bwd, d_stages_bwd))]
    cases += [("backward", c) for c in (SWEEP_BACKWARD if backward is None else backward)]
    for n, (which, (bq, bk, warps, stages)) in enumerate(cases):
        backward = which == "backward"
        if backward:
            blocks = FlashBlockSizes(block_q_bwd=bq, block_kv_bwd=bk, num_warps_bwd=warps, num_stages_bwd=stages)
        else:
            blocks = FlashBlockSizes(block_q=bq, block_kv=bk, num_warps=warps, num_stages=stages)
        fn = lambda q, k, v, blocks=blocks: flash_attention(q, k, v, causal=True, block_sizes=blocks)
        if backward:
            fn = jax.grad(lambda q, k, v, f=fn: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
        row = {"block_q": bq, "block_kv": bk, "num_warps": warps, "num_stages": stages,
               "default": n in (0, len(forward) + 1)}
        try:
            seconds = _time_queued(jax.jit(fn).lower(q, k, v).compile(), (q, k, v))
            flops = _attention_flops(batch, length, heads, head_dim, backward)
            row["ms"] = round(seconds * 1e3, 3)
            row["tflops"] = round(flops / seconds / 1e12, 1)
            row["peak_share"] = round(flops / seconds / peak, 3) if peak else None
        except (jax.errors.JaxRuntimeError, RuntimeError, ValueError) as e:  # e.g. out of shared memory
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        result[which].append(row)
        print(which, json.dumps(row), flush=True)
        if on_row is not None:
            on_row(result)
    for which in ("forward", "backward"):
        timed = [r for r in result[which] if "ms" in r]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            result[f"best_{which}"] = best
            base = next((r for r in timed if r["default"]), None)
            print(f"{which}: best {best}  default {base}", flush=True)
    return result


# the kernel tests' float32 tolerance (tests/test_pallas_*.py), the same in interpret mode and compiled
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _within(a, b) -> bool:
    return bool(np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **TOLERANCE))


def correctness() -> dict:
    ks = jax.random.split(jax.random.key(1), 6)
    q = jax.random.normal(ks[0], (1, 256, 8, 64))
    k = jax.random.normal(ks[1], (1, 256, 2, 64))
    v = jax.random.normal(ks[2], (1, 256, 2, 64))
    attn = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, causal=True)))
    grads = jax.grad(attn(flash_attention), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(attn(flash_attention_reference), argnums=(0, 1, 2))(q, k, v)
    x = jax.random.normal(ks[3], (64, 96))
    w = 1.0 + 0.1 * jax.random.normal(ks[4], (96,))
    h = jax.random.normal(ks[5], (256, 64))
    w_out = 0.1 * jax.random.normal(ks[0], (64, 1000))
    labels = jax.random.randint(ks[1], (256,), 0, 1000)
    mask = jnp.ones((256,))
    pairs = {
        "flash_out": [(flash_attention(q, k, v), flash_attention_reference(q, k, v))],
        "flash_grad": list(zip(grads, ref_grads, strict=True)),
        "rms_norm": [(rms_norm(x, w, eps=1e-6), rms_norm_reference(x, w, eps=1e-6))],
        "cross_entropy_per_token": [(fused_cross_entropy(h, w_out, labels, mask) / 256,
                                     fused_cross_entropy_reference(h, w_out, labels, mask) / 256)],
    }
    out = {f"{name}_max_err": max(_max_err(a, b) for a, b in got) for name, got in pairs.items()}
    out["failed"] = [name for name, got in pairs.items() if not all(_within(a, b) for a, b in got)]
    return out


def loss_memory(tokens: int = 2048, d_model: int = 256, vocab: int = 32768) -> dict:
    """Compiled temp bytes of loss + gradient, fused vs full fp32 logits."""
    args = (
        jax.ShapeDtypeStruct((tokens, d_model), jnp.float32),
        jax.ShapeDtypeStruct((d_model, vocab), jnp.float32),
        jax.ShapeDtypeStruct((tokens,), jnp.int32),
        jax.ShapeDtypeStruct((tokens,), jnp.float32),
    )
    out = {
        "tokens": tokens,
        "vocab": vocab,
        "logits_fp32_mib": tokens * vocab * 4 / 2**20,
    }
    for name, fn in (
        ("fused", fused_cross_entropy),
        ("reference", fused_cross_entropy_reference),
    ):
        step = jax.grad(fn, argnums=(0, 1))
        mem = jax.jit(step).lower(*args).compile().memory_analysis()
        out[f"{name}_temp_mib"] = round(mem.temp_size_in_bytes / 2**20, 1) if mem else None
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768",
                        help="lengths timed after the runbook's shape ('' for none)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="", help="also write the JSON line here")
    parser.add_argument("--sweep", action="store_true",
                        help="GPU only: the flash kernel's tile sizes and launch parameters at the runbook's shape")
    parser.add_argument("--sweep-length", type=int, default=0,
                        help="--sweep at 1 x LENGTH tokens, 32/8 heads of 128 (default: the runbook's shape)")
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke run: on a GPU the 1024 and 2048 lengths, 2 iterations")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.iters = "1024,2048", 2
    backend = jax.default_backend()
    result = {"backend": backend, "device": jax.devices()[0].device_kind}
    if args.sweep:
        if backend != "gpu":
            print("bench/kernels.py --sweep: not a GPU (the sweep times compiled Triton kernels)", file=sys.stderr)
            return 2
        def keep_sweep(sweep):
            if args.out:
                pathlib.Path(args.out).write_text(json.dumps({**result, "sweep": sweep, "partial": True}) + "\n")
        shape = (1, args.sweep_length, HEADS, KV_HEADS, HEAD_DIM) if args.sweep_length else RUNBOOK_SHAPE
        result["sweep"] = sweep_flash(keep_sweep, shape=shape)
        line = json.dumps(result)
        print(line)
        if args.out:
            pathlib.Path(args.out).write_text(line + "\n")
        return 0
    if backend == "gpu":  # the timings first: a run stopped at its time limit has printed them
        lengths = [int(n) for n in args.lengths.split(",") if n]
        def keep(rows):  # the rows so far, under --out, until the whole result replaces them
            if args.out:
                pathlib.Path(args.out).write_text(json.dumps({**result, "attention": rows, "partial": True}) + "\n")
        result["attention"] = bench_attention_gpu(lengths, args.iters, keep)
    else:
        print("not a GPU: attention timings skipped (interpret mode measures nothing useful)")
    result["correctness"] = correctness()
    print("correctness:", result["correctness"], flush=True)
    result["loss_memory"] = memory = loss_memory()
    print("loss step memory:", memory, flush=True)
    failed = list(result["correctness"]["failed"])
    if memory["fused_temp_mib"] is not None and memory["fused_temp_mib"] >= memory["logits_fp32_mib"]:
        failed.append("fused_loss_memory")
    result["failed"] = failed
    line = json.dumps(result)
    print(line)
    if args.out:
        pathlib.Path(args.out).write_text(line + "\n")
    if failed:
        print(f"outside the tolerance {TOLERANCE} or the memory bound: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
