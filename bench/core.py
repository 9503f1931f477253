"""Core benchmarks (issue: core): meshtrain's step vs a minimal plain-JAX step, and scan compile time.

1. tokens/s of the tiny and a ~50M-parameter model on 1 CPU device, meshtrain's jitted step vs a
   plain-JAX train step of the same model written here (no mesh, no rules, no flax): the ratio must
   be >= 0.95.
2. compile time of the same model with 2 vs 32 layers: scanned layers keep the ratio <= 1.5.

Prints a table and one JSON line. Run: `python bench/core.py [--quick]`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from meshtrain import (  # noqa: E402
    config as config_lib,
    model as model_lib,
    optimizer as optimizer_lib,
    train_step as train_step_lib,
)
from meshtrain.run import Run  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)


def model_config(name: str):
    c = config_lib.default_config()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = 1
    c.data.source = "synthetic"
    c.remat.policy = "none"
    c.train.zero_stage = 0
    c.model.dtype = "float32"
    c.model.vocab_size = 264
    if name == "tiny":
        c.model.update(d_model=64, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=8, mlp_dim=192)
        c.train.update(batch_size=16, seq_len=128)
    else:  # ~50M parameters
        c.model.update(vocab_size=16384, d_model=512, n_layers=10, n_heads=8, n_kv_heads=4, head_dim=64,
                       mlp_dim=2048)
        c.train.update(batch_size=4, seq_len=256)
    return c


# ------------------------------- the plain-JAX reference ---------------------------------------

def plain_init(cfg, key):
    d, h, k, dh, f, v, n = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim,
                            cfg.vocab_size, cfg.n_layers)
    keys = iter(jax.random.split(key, 16))

    def w(*shape):
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)
    return {"emb": w(v, d), "head": w(d, v), "norm": jnp.ones(d),
            "layers": {"wq": w(n, d, h, dh), "wk": w(n, d, k, dh), "wv": w(n, d, k, dh), "wo": w(n, h, dh, d),
                       "wg": w(n, d, f), "wu": w(n, d, f), "wd": w(n, f, d),
                       "n1": jnp.ones((n, d)), "n2": jnp.ones((n, d))}}


def plain_loss(p, batch, cfg):
    def norm(x, s):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * s

    def rope(x, pos):
        dh = x.shape[-1]
        inv = 1.0 / (10000.0 ** (jnp.arange(0, dh, 2) / dh))
        ang = pos[..., None] * inv
        ang = jnp.concatenate([ang, ang], -1)[:, :, None]
        rot = jnp.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
        return x * jnp.cos(ang) + rot * jnp.sin(ang)

    tok, pos, seg = batch["inputs"], batch["positions"].astype(jnp.float32), batch["segment_ids"]
    b, t = tok.shape
    mask = (jnp.arange(t)[:, None] >= jnp.arange(t)[None]) & (seg[:, :, None] == seg[:, None])

    def layer(x, lp):
        y = norm(x, lp["n1"])
        q = rope(jnp.einsum("btd,dhk->bthk", y, lp["wq"]), pos)
        k = rope(jnp.einsum("btd,dhk->bthk", y, lp["wk"]), pos)
        v = jnp.einsum("btd,dhk->bthk", y, lp["wv"])
        kv = k.shape[2]
        q = q.reshape(b, t, kv, -1, q.shape[-1])
        s = jnp.einsum("btkgd,bskd->bkgts", q, k) / jnp.sqrt(q.shape[-1])
        s = jnp.where(mask[:, None, None], s, -1e30)
        o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, -1), v).reshape(b, t, -1, q.shape[-1])
        x = x + jnp.einsum("bthk,hkd->btd", o, lp["wo"])
        y = norm(x, lp["n2"])
        x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(y @ lp["wg"]) * (y @ lp["wu"]), lp["wd"])
        return x, None

    x, _ = jax.lax.scan(layer, p["emb"][tok], p["layers"])
    logits = norm(x, p["norm"]) @ p["head"]
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    return jnp.sum(ce * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])


def plain_step_fn(config):
    cfg = config_lib.ModelConfig.from_config(config)
    # The same optimizer as meshtrain's config: global-norm clipping, then AdamW with its schedule.
    t = config.train
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                     optax.adamw(optimizer_lib.learning_rate_schedule(config), b1=t.b1, b2=t.b2, eps=t.eps,
                                 weight_decay=t.weight_decay))

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # donated, like meshtrain's step
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(plain_loss)(params, batch, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = plain_init(cfg, jax.random.key(0))
    return step, params, tx.init(params)


# ---------------------------------------- timing -----------------------------------------------

def make_batch(config):
    b, t, v = config.train.batch_size, config.train.seq_len, config.model.vocab_size
    rng = np.random.default_rng(0)
    tok = rng.integers(0, v, (b, t + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:]),
            "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
            "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), jnp.float32)}


def time_steps(fn, steps: int) -> float:
    jax.block_until_ready(fn())  # compile + warm-up, finished before the clock starts
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def seconds_per_step(name: str, impl: str, steps: int, recopy: bool = True) -> float:
    """Best-of-3 seconds per step of one implementation, timed in this process.

    `recopy` copies the freshly created state once before timing (both implementations). On this
    VM the buffers one large initialisation program writes can land on memory that stays slower to
    stream: an elementwise pass over meshtrain's 56M-parameter state measured 0.030 s on the
    buffers `StateFactory.create` returned and 0.020 s on a copy of them; the step is donated, so
    it keeps whatever buffers it started with. The copy puts both implementations on equal memory.
    """
    config = model_config(name)
    batch = make_batch(config)
    if impl == "meshtrain":
        run = Run.resolve(config, jax.devices()[:1])
        mesh = run.mesh
        factory, step_fn = train_step_lib.build(run)
        holder = {"state": factory.create(0)}
        if recopy:
            holder["state"] = jax.tree.map(jnp.copy, holder["state"])

        def step():
            holder["state"], metrics = step_fn(holder["state"], batch)
            return metrics["loss"]
    else:
        mesh = None
        plain, params, opt = plain_step_fn(config)
        holder = {"p": params, "o": opt}
        if recopy:
            holder = jax.tree.map(jnp.copy, holder)

        def step():
            holder["p"], holder["o"], loss = plain(holder["p"], holder["o"], batch)
            return loss
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return min(time_steps(step, steps) for _ in range(3))


def throughput(name: str, steps: int, rounds: int = 2, recopy: bool = True) -> dict:
    """tokens/s of both implementations, each timed in fresh processes, alternating.

    One process per measurement: on this CPU host the speed of a step depends on which large
    buffers were allocated first (two states in one process measured up to 15% apart depending
    on their creation order), so neither implementation shares a process with the other.
    """
    config = model_config(name)
    tokens = config.train.batch_size * config.train.seq_len
    results = {}
    for round_ in range(rounds):
        for impl in ("meshtrain", "plain") if round_ % 2 == 0 else ("plain", "meshtrain"):
            out = subprocess.run([sys.executable, __file__, "--one", impl, "--model", name, "--steps", str(steps)]
                                 + ([] if recopy else ["--no-recopy"]),
                                 check=True, capture_output=True, text=True).stdout
            seconds = json.loads(out.strip().splitlines()[-1])["seconds_per_step"]
            print(f"  {name} {impl}: {seconds:.4f} s/step", flush=True)
            results[impl] = min(results.get(impl, 1e9), seconds)
    n_params = model_lib.num_params(config_lib.ModelConfig.from_config(config))
    return {"model": name, "params": n_params, "meshtrain_tokens_per_s": tokens / results["meshtrain"],
            "plain_tokens_per_s": tokens / results["plain"], "ratio": results["plain"] / results["meshtrain"]}


def compile_seconds(layers: int) -> float:
    config = model_config("tiny")
    config.model.n_layers = layers
    run = Run.resolve(config, jax.devices()[:1])
    factory, step_fn = train_step_lib.build(run)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in make_batch(config).items()}
    with jax.set_mesh(run.mesh):
        t0 = time.perf_counter()
        step_fn.lower(factory.abstract, batch).compile()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke run: the tiny model only, one timing process each, 3 steps")
    parser.add_argument("--one", choices=("meshtrain", "plain"), help=argparse.SUPPRESS)  # one timing process
    parser.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--no-recopy", action="store_true",
                        help="time each state on the buffers its initialiser returned (see seconds_per_step)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps({"seconds_per_step": seconds_per_step(args.model, args.one, args.steps,
                                                                   not args.no_recopy)}))
        return
    recopy = not args.no_recopy
    rows = [throughput("tiny", 3 if args.quick else 30, rounds=1 if args.quick else 2, recopy=recopy)]
    if not args.quick:
        rows.append(throughput("50m", 5, recopy=recopy))
    for r in rows:
        print(f"{r['model']:>5} ({r['params'] / 1e6:.1f}M params): meshtrain {r['meshtrain_tokens_per_s']:.0f} tok/s, "
              f"plain JAX {r['plain_tokens_per_s']:.0f} tok/s, ratio {r['ratio']:.3f}")
    c2, c32 = compile_seconds(2), compile_seconds(32)
    print(f"compile: 2 layers {c2:.2f} s, 32 layers {c32:.2f} s, ratio {c32 / c2:.2f}")
    print(json.dumps({"bench": "core", "recopy": recopy, "throughput": rows, "compile_s": {"2": c2, "32": c32},
                      "compile_ratio": c32 / c2}))


if __name__ == "__main__":
    main()
