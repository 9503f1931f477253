"""Model-level properties: document masking with packed rows, tied heads, no retrace."""

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain import mesh as mesh_lib, model as model_lib, train_step as train_step_lib
from meshtrain.config import ModelConfig
from meshtrain.sharding_rules import Rules
from tests.utils import resolve, run_steps, synthetic_batches, tiny_config


def _model_and_params(**overrides):
    config = tiny_config(**overrides)
    mesh = mesh_lib.make_mesh(config, jax.devices()[:1])
    model = model_lib.Transformer(ModelConfig.from_config(config), Rules.for_mesh(mesh))
    batch = model_lib.dummy_batch(1, 8)
    with jax.set_mesh(mesh):
        params = jax.jit(model.init)(jax.random.key(0), batch["inputs"], batch["positions"],
                                     batch["segment_ids"])["params"]
    return model, jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params,
                               is_leaf=lambda x: hasattr(x, "names")), mesh


def _loss(model, params, mesh, tokens, positions, segments, mask):
    batch = {"inputs": tokens[None, :-1], "targets": tokens[None, 1:], "positions": positions[None],
             "segment_ids": segments[None], "loss_mask": mask[None]}
    with jax.set_mesh(mesh):
        loss_sum, _ = jax.jit(lambda p, b: model.apply({"params": p}, b, method=model.loss))(params, batch)
    return float(loss_sum)


def test_packed_row_loss_equals_sum_of_documents():
    """Attention never crosses documents and RoPE restarts per document (float32, 1e-5)."""
    model, params, mesh = _model_and_params()
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(3, 264, 21), rng.integers(3, 264, 12)  # 20 and 11 targets
    packed = np.concatenate([doc_a, doc_b]).astype(np.int32)  # row of 33 tokens -> 32 inputs
    segments = np.array([1] * 21 + [2] * 11, np.int32)
    positions = np.concatenate([np.arange(21), np.arange(11)]).astype(np.int32)
    mask = np.ones(32, np.float32)
    mask[20] = 0.0  # the last token of doc a has no target inside its document
    packed_loss = _loss(model, params, mesh, jnp.asarray(packed), positions, segments, mask)
    separate = sum(_loss(model, params, mesh, jnp.asarray(doc.astype(np.int32)), np.arange(len(doc) - 1),
                         np.ones(len(doc) - 1, np.int32), np.ones(len(doc) - 1, np.float32))
                   for doc in (doc_a, doc_b))
    np.testing.assert_allclose(packed_loss, separate, rtol=1e-5)


def test_layers_cast_beforehand_give_the_same_loss_and_gradients():
    """`model.in_compute_dtype` (the pipeline executor's cast of the matmul weights, once a step): the
    same bf16 forward and the same gradients, rounded as the cast inside the model rounds them; the norm
    scales (and a router) stay float32."""
    model, params, mesh = _model_and_params(**{"model.dtype": "bfloat16", "model.attention_bias": True})
    cast = model_lib.in_compute_dtype(params["layers"], jnp.bfloat16)
    kinds = {jax.tree_util.keystr(path): leaf.dtype for path, leaf in jax.tree_util.tree_leaves_with_path(cast)}
    assert {k for k, d in kinds.items() if d == jnp.float32} == {k for k in kinds if "scale" in k}
    assert any("bq" in k for k in kinds) and all(kinds[k] == jnp.bfloat16 for k in kinds if "scale" not in k)
    rng = np.random.default_rng(0)
    batch = {"inputs": jnp.asarray(rng.integers(3, 264, (2, 16)), jnp.int32),
             "positions": jnp.tile(jnp.arange(16), (2, 1)), "segment_ids": jnp.ones((2, 16), jnp.int32),
             "loss_mask": jnp.ones((2, 16), jnp.float32)}
    batch["targets"] = jnp.roll(batch["inputs"], -1, axis=1)

    def loss(layers, rest):
        return model.apply({"params": {**rest, "layers": layers}}, batch, method=model.loss)[0]
    rest = {k: v for k, v in params.items() if k != "layers"}
    with jax.set_mesh(mesh):
        value, grads = jax.jit(jax.value_and_grad(loss))(params["layers"], rest)
        value_cast, grads_cast = jax.jit(jax.value_and_grad(loss))(cast, rest)
    assert float(value) == float(value_cast)
    for g, g_cast in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_cast), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g_cast.astype(jnp.float32)))


def test_tied_embeddings_have_no_head():
    model, params, _ = _model_and_params(**{"model.tie_embeddings": True})
    assert "head" not in params
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == model_lib.num_params(model.cfg)


def test_num_params_matches_initialised_model():
    model, params, _ = _model_and_params()
    assert sum(x.size for x in jax.tree.leaves(params)) == model_lib.num_params(model.cfg)


def test_step_compiles_once():
    """The jitted step is traced once for all steps (no config branching, stable shapes)."""
    config = tiny_config({"data": 2})
    batches = synthetic_batches(config, 3)
    run = resolve(config)
    factory, step_fn = train_step_lib.build(run)
    mesh = run.mesh
    state = factory.create(0)
    with jax.set_mesh(mesh):
        for batch in batches:
            state, _ = step_fn(state, batch)
    assert step_fn._cache_size() == 1


def test_bf16_compute_trains_close_to_float32():
    """bf16 compute with float32 master weights follows the float32 run (playbook, mixed precision)."""
    config32 = tiny_config()
    batches = synthetic_batches(config32, 2)
    loss32, _, _ = run_steps(config32, batches)
    loss16, _, _ = run_steps(tiny_config(**{"model.dtype": "bfloat16"}), batches)
    np.testing.assert_allclose(loss16, loss32, rtol=2e-2)


def test_flops_per_token_counts_active_experts_only():
    """MFU's FLOPs: 6 x matmul parameters a token uses; a top-2 of 8 MoE uses 2 expert MLPs per layer."""
    from meshtrain.metrics import flops_per_token

    dense = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128)
    moe = ModelConfig(**{**dense.__dict__, "num_experts": 8, "experts_per_token": 2})
    attention = 2 * 12 * 64 * 4 * 16
    layer_attn, mlp, norms = 64 * 4 * 16 * 2 + 2 * 64 * 2 * 16, 3 * 64 * 128, 2 * 64
    head = 64 * 256
    assert flops_per_token(dense, 64) == 6 * (2 * (layer_attn + mlp + norms) + 64 + head) + attention
    router = 64 * 8
    assert flops_per_token(moe, 64) == 6 * (2 * (layer_attn + 2 * mlp + router + norms) + 64 + head) + attention
