"""Mixture of experts: the layer against a per-token dense reference (values and gradients),
capacity slots and router losses on hand-made routings, validation, parameter count.

The whole-model tests (equal losses across expert-parallel meshes, the compiled exchange)
are in tests/test_moe_train.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from meshtrain import mesh as mesh_lib, model as model_lib, moe
from meshtrain.config import ConfigError, ModelConfig
from meshtrain.sharding_rules import Rules
from meshtrain.validate import validate
from tests import utils

E, K, B, T, D, F = 8, 2, 8, 16, 16, 32
CFG = ModelConfig(vocab_size=16, d_model=D, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, mlp_dim=F,
                  num_experts=E, experts_per_token=K, capacity_factor=E / K)  # C = T: nothing dropped

MESHES = [{}, {"data": 2, "expert": 4}, {"expert": 2, "tensor": 2, "sequence": 2}]


def _mesh(sizes: dict) -> jax.sharding.Mesh:
    return utils.mesh_of(**sizes)


def _inputs(seed: int = 0):
    kx, kp, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (B, T, D), jnp.float32)
    params = nn.unbox(moe.MoeMlp(CFG, _rules({})).init(kp, x)["params"])
    # a router with large weights spreads the tokens over all experts
    params["router"] = params["router"] * 50.0
    return params, x, jax.random.normal(kc, (B, T, D), jnp.float32)


def _rules(sizes: dict) -> Rules:
    return Rules(tuple((a, sizes.get(a, 1)) for a in mesh_lib.MESH_ORDER))


def _layer_vjp(cfg: ModelConfig, sizes: dict, params, x, cot):
    """(y, stats, grads wrt (params, x)) of MoeMlp on the mesh `sizes`."""
    mesh = _mesh(sizes)
    layer = moe.MoeMlp(cfg, Rules.for_mesh(mesh, model=cfg))

    def f(params, x):
        y, stats = layer.apply({"params": params}, x)
        return jnp.sum(y * cot), (y, stats)

    with jax.set_mesh(mesh):
        (_, (y, stats)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
    return y, stats, grads


def _reference_vjp(params, x, cot, keep=None, norm_topk=True):
    """The per-token reference; `keep` [B, T, k] zeroes dropped choices."""
    def f(params, x):
        if keep is None:
            y = moe.moe_reference(x, params["router"], params["w_gate"], params["w_up"], params["w_down"], K,
                                  norm_topk)
        else:
            y = _masked_reference(params, x, keep)
        return jnp.sum(y * cot), y
    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads


def _assert_equal(y, grads, y_ref, g_ref):
    """The layer's output and its gradients (every parameter's, the input's) equal the reference's (1e-5)."""
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    for name in g_ref[0]:
        np.testing.assert_allclose(grads[0][name], g_ref[0][name], atol=1e-5, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(grads[1], g_ref[1], atol=1e-5, rtol=1e-5)


def _masked_reference(params, x, keep):
    _, _, weights, experts = moe.route(x, params["router"], K)
    out = 0.0
    for j in range(K):  # loop over the chosen experts of every token
        e = experts[..., j]
        hidden = (nn.silu(jnp.einsum("btd,btdf->btf", x, params["w_gate"][e]))
                  * jnp.einsum("btd,btdf->btf", x, params["w_up"][e]))
        out = out + (weights[..., j] * keep[..., j])[..., None] * jnp.einsum("btf,btfd->btd", hidden,
                                                                             params["w_down"][e])
    return out


# the dispatches: capacity; dropless with ragged_dot; dropless with the grouped matmul kernel (interpret mode
# on the CPU, its region manual over every axis), whole or in two chunks of each device's tokens
DISPATCHES = {"capacity": {}, "dropless": dict(moe_dropless=True),
              "dropless-kernel": dict(moe_dropless=True, moe_matmul="pallas"),
              "dropless-kernel-chunks2": dict(moe_dropless=True, moe_matmul="pallas", moe_chunks=2)}


@pytest.mark.parametrize("dispatch", list(DISPATCHES))
@pytest.mark.parametrize("sizes", MESHES + [{"fsdp": 2, "expert": 2, "tensor": 2}],
                         ids=lambda s: "x".join(f"{a}{n}" for a, n in s.items()) or "1dev")
def test_layer_equals_per_token_reference(sizes, dispatch):
    params, x, cot = _inputs()
    y_ref, g_ref = _reference_vjp(params, x, cot)
    y, stats, grads = _layer_vjp(dataclasses.replace(CFG, **DISPATCHES[dispatch]), sizes, params, x, cot)
    _assert_equal(y, grads, y_ref, g_ref)
    assert float(stats["dropped"]) == 0.0


@pytest.mark.parametrize("dispatch", ["capacity", "dropless-kernel"])
@pytest.mark.parametrize("moe_fsdp", ["experts", "weights"])
def test_experts_over_fsdp_or_gathered_equal_reference(moe_fsdp, dispatch):
    """Under `fsdp` the experts either rest whole on its devices, the tokens travelling over fsdp x expert
    (one expert a device here), or every expert's model dimension is ZeRO's, gathered where used."""
    params, x, cot = _inputs()
    cfg = dataclasses.replace(CFG, moe_fsdp=moe_fsdp, **DISPATCHES[dispatch])
    sizes = {"fsdp": 4, "expert": 2}
    assert Rules.for_mesh(_mesh(sizes), model=cfg).split_axes("expert") == (
        ("expert", "fsdp") if moe_fsdp == "experts" else ("expert",))
    y_ref, g_ref = _reference_vjp(params, x, cot)
    y, stats, grads = _layer_vjp(cfg, sizes, params, x, cot)
    _assert_equal(y, grads, y_ref, g_ref)
    assert float(stats["dropped"]) == 0.0


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_unnormalised_top_k_weights_equal_reference(dispatch):
    """`model.moe_norm_topk=False` (Qwen1.5/2-MoE, OLMoE; Qwen3-MoE without norm_topk_prob): each token's k
    outputs weighted by their softmax probabilities over all experts, as they are."""
    params, x, cot = _inputs()
    params["router"] = params["router"] / 25.0  # a softer router: the k chosen probabilities sum well below 1
    y_ref, g_ref = _reference_vjp(params, x, cot, norm_topk=False)
    cfg = dataclasses.replace(CFG, moe_norm_topk=False, **DISPATCHES[dispatch])
    y, _, grads = _layer_vjp(cfg, {"data": 2, "expert": 4}, params, x, cot)
    _assert_equal(y, grads, y_ref, g_ref)
    y_normalised, _ = _reference_vjp(params, x, cot)
    differ = np.abs(np.asarray(y_ref) - np.asarray(y_normalised)).max()
    assert differ > 0.1 * np.abs(np.asarray(y_normalised)).max()  # the choice matters here


@pytest.mark.parametrize("moe_fsdp, dropless, sizes, over", [
    ("auto", True, {"fsdp": 4, "expert": 2}, ("expert", "fsdp")),
    ("auto", False, {"fsdp": 4, "expert": 2}, ("expert",)),  # capacity dispatch keeps ZeRO's split
    ("auto", True, {"fsdp": 8, "expert": 2}, ("expert",)),  # 8 experts do not split 16 ways
    ("auto", True, {"data": 8}, ()),
    ("experts", False, {"fsdp": 8}, ("fsdp",)),
    ("weights", True, {"fsdp": 8}, ()),
])
def test_experts_over_fsdp_resolution(moe_fsdp, dropless, sizes, over):
    cfg = dataclasses.replace(CFG, moe_fsdp=moe_fsdp, moe_dropless=dropless)
    rules = Rules.for_sizes(tuple((a, sizes.get(a, 1)) for a in mesh_lib.MESH_ORDER), model=cfg)
    assert rules.split_axes("expert") == over
    # an expert weight's model dimension is ZeRO's only over the axes its expert dimension leaves
    entries = rules.spec(("expert", "embed", "mlp"))
    assert set(over) | {a for e in entries[1:2] if e for a in ((e,) if isinstance(e, str) else e)} == {
        a for a in ("fsdp", "expert") if sizes.get(a, 1) > 1}


def test_capacity_drops_overflow_and_counts_it():
    params, x, cot = _inputs(1)
    cfg = dataclasses.replace(CFG, capacity_factor=1.0)  # C = T * k / E = 4 slots per expert per row
    _, _, _, experts = moe.route(x, params["router"], K)
    slot = moe.capacity_slots(experts, E, moe.capacity(cfg, T))
    keep = (slot < E * moe.capacity(cfg, T)).astype(jnp.float32)
    assert 0 < float(1 - keep.mean()) < 0.5  # this routing does overflow
    y_ref, g_ref = _reference_vjp(params, x, cot, keep)
    y, stats, grads = _layer_vjp(cfg, {"data": 2, "expert": 4}, params, x, cot)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(grads[1], g_ref[1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(stats["dropped"]), float(1 - keep.mean()), rtol=1e-6)


def test_skewed_router_drops_under_capacity_and_not_dropless():
    """Every token prefers experts 0 and 1: capacity (factor 1) drops most choices, dropless keeps all
    and equals the per-token reference under expert parallelism (values and gradients)."""
    params, x, cot = _inputs(2)
    x = x.at[..., 0].set(5.0)  # a constant feature the router reads ...
    params["router"] = params["router"].at[0, :2].set(10.0).at[0, 2:].set(-10.0)  # ... towards experts 0, 1
    _, _, _, experts = moe.route(x, params["router"], K)
    assert set(np.unique(np.asarray(experts)).tolist()) == {0, 1}
    capped = dataclasses.replace(CFG, capacity_factor=1.0)
    _, stats, _ = _layer_vjp(capped, {"data": 2, "expert": 4}, params, x, cot)
    assert float(stats["dropped"]) > 0.5
    y_ref, g_ref = _reference_vjp(params, x, cot)
    y, stats, grads = _layer_vjp(dataclasses.replace(capped, moe_dropless=True), {"data": 2, "expert": 4},
                                 params, x, cot)
    assert float(stats["dropped"]) == 0.0
    _assert_equal(y, grads, y_ref, g_ref)


def _accepted(experts: np.ndarray, groups: int, ep: int, num_experts: int, capacity: int) -> np.ndarray:
    """keep [B, T, k]: which assignments the dropless exchange delivers, by its rule written out: rows
    [B] lie one a device, `groups` data groups of `ep` expert-axis devices (row r: group r // ep, device
    r % ep); a device takes up to `capacity` rows, its experts in order, each expert's rows source by
    source, each source's in its own order (token, then choice)."""
    b, t, k = experts.shape
    keep = np.zeros(experts.shape, bool)
    e_l = num_experts // ep
    for g in range(groups):
        for j in range(ep):
            taken = 0
            for e in range(j * e_l, (j + 1) * e_l):
                for s in range(ep):
                    row = g * ep + s
                    for tok, choice in zip(*np.nonzero(experts[row] == e), strict=True):
                        if taken < capacity:
                            keep[row, tok, choice] = True
                            taken += 1
    return keep


@pytest.mark.parametrize("kernel", [False, True], ids=["ragged_dot", "kernel"])
def test_exchange_capacity_drops_past_it_and_counts_them(kernel):
    """Every token prefers experts 0 and 1, which live on the first device of each expert group: with
    the exchange's capacity at 1.5x the balanced load that device drops what passes it (its experts in
    order, sources in order), the output is the per-token reference without those choices and the
    dropped fraction counts them; with the worst case (factor 0) nothing is dropped."""
    params, x, cot = _inputs(2)
    x = x.at[..., 0].set(5.0)
    params["router"] = params["router"].at[0, :2].set(10.0).at[0, 2:].set(-10.0)
    _, _, _, experts = moe.route(x, params["router"], K)
    sizes = {"data": 2, "expert": 4}
    routed = (B // 8) * T * K
    cfg = dataclasses.replace(CFG, moe_dropless=True, moe_exchange_factor=1.5,
                              moe_matmul="pallas" if kernel else "ragged_dot")
    keep = _accepted(np.asarray(experts), 2, 4, E, math.ceil(1.5 * routed))
    assert 0.3 < 1 - keep.mean() < 0.9  # this routing overflows the first device
    y_ref, g_ref = _reference_vjp(params, x, cot, jnp.asarray(keep, jnp.float32))
    y, stats, grads = _layer_vjp(cfg, sizes, params, x, cot)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(grads[1], g_ref[1], atol=1e-5, rtol=1e-5)
    for name in ("w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(grads[0][name], g_ref[0][name], atol=1e-5, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(float(stats["dropped"]), float(1 - keep.mean()), rtol=1e-6)
    _, stats, _ = _layer_vjp(dataclasses.replace(cfg, moe_exchange_factor=0.0), sizes, params, x, cot)
    assert float(stats["dropped"]) == 0.0


def _simulate_ragged_all_to_all(operands, outputs, tables):
    """`jax.lax.ragged_all_to_all` over a list of devices, as its documentation spells it out: sender
    s's slice i goes to device i // (K / n), at the offset s names for it there, `recv_sizes` rows."""
    n = len(operands)
    per = len(tables[0][0]) // n
    results = [np.array(o) for o in outputs]
    for s, (in_off, send, out_off, _) in enumerate(tables):
        for i in range(len(in_off)):
            j, slot = divmod(i, per)
            assert send[i] == tables[j][3][s * per + slot]  # send sizes == all_to_all(recv sizes)
            results[j][out_off[i]:out_off[i] + send[i]] = operands[s][in_off[i]:in_off[i] + send[i]]
    return results


@pytest.mark.parametrize("capacity", [10**6, 40], ids=["worst-case", "overflowing"])
def test_ragged_exchange_tables_deliver_the_accepted_rows(capacity):
    """The tables `ExchangePlan` gives `jax.lax.ragged_all_to_all` (the GPU exchange, which XLA:CPU cannot
    run), replayed as its documentation defines the collective: every accepted row lands in its
    expert's group of the receiver's grouped layout (sources in order, padding between groups to whole
    tiles), and the return trip brings each one back to its sorted place at the sender, dropped rows 0."""
    from meshtrain import moe_dropless

    ep, e, tile = 4, 8, 4
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 9, size=(ep, e)).astype(np.int32)
    counts[:, 0] += 12  # expert 0 (device 0) is popular
    capacity = min(capacity, int(counts.sum()))
    plans = [moe_dropless.ExchangePlan.of(jnp.asarray(counts), jnp.int32(me), capacity, tile) for me in range(ep)]
    # each sender's rows sorted by expert, named (source, expert, rank) by a unique number
    sent = [np.concatenate([[1000 * s + 100 * x + r + 1 for r in range(counts[s, x])] for x in range(e)])
            .astype(np.float32) for s in range(ep)]
    grouped = _simulate_ragged_all_to_all(sent, [np.zeros(plans[0].rows, np.float32)] * ep,
                                          [[np.asarray(a) for a in p.dispatch()] for p in plans])
    e_l = e // ep
    for j in range(ep):
        taken, start, layout = 0, 0, plans[j].layout()
        for slot in range(e_l):
            x = j * e_l + slot
            want = []
            for s in range(ep):
                rows = [1000 * s + 100 * x + r + 1 for r in range(counts[s, x])]
                room = max(0, min(len(rows), capacity - taken))
                want += rows[:room]
                taken += room
            assert int(layout.starts[slot]) == start and int(layout.sizes[slot]) == len(want)
            np.testing.assert_array_equal(grouped[j][start:start + len(want)], want)
            start += -(-len(want) // tile) * tile
        assert not np.any(grouped[j][start:])  # nothing past the groups
    home = _simulate_ragged_all_to_all(grouped, [np.zeros(len(r), np.float32) for r in sent],
                                       [[np.asarray(a) for a in p.back()] for p in plans])
    # ... which is also the dispatch's gradient (`moe_dropless._ragged_dispatch`): each grouped row's
    # cotangent home into a zero buffer, the rows not delivered 0
    for s in range(ep):
        delivered = np.isin(sent[s], np.concatenate(grouped))
        np.testing.assert_array_equal(home[s], np.where(delivered, sent[s], 0))
        assert float(plans[s].dropped()) == float((~delivered).sum())
    # the combine's gradient (`moe_dropless._ragged_home`): the dispatch's tables carry the gradient of each
    # row home back to its row of the layout, written over the layout's own buffer (here rows of -1): the
    # rows no expert owns keep it, which the grouped kernels mask
    held = [np.full(plans[0].rows, -1.0, np.float32)] * ep
    back = _simulate_ragged_all_to_all(home, held, [[np.asarray(a) for a in p.dispatch()] for p in plans])
    for j in range(ep):
        owned = np.asarray(plans[j].layout().valid_rows())
        np.testing.assert_array_equal(back[j][owned], grouped[j][owned])
        assert np.all(back[j][~owned] == -1)
    overflows = bool((counts.sum(0).reshape(ep, e_l).sum(1) > capacity).any())  # some device is sent more
    assert overflows == (capacity == 40)
    assert overflows == any(float(p.dropped()) > 0 for p in plans)


def test_capacity_slots_hand_made():
    # one row, 3 tokens, E = 3, k = 2, C = 2: first choices fill the queues before second choices
    experts = jnp.array([[[0, 1], [0, 2], [0, 1]]])
    slot = moe.capacity_slots(experts, 3, 2)
    # token 2's first choice is expert 0's third: dropped (slot E*C = 6)
    np.testing.assert_array_equal(slot, [[[0, 2], [1, 4], [6, 3]]])
    assert moe.capacity(dataclasses.replace(CFG, capacity_factor=1.25), 128) == math.ceil(1.25 * 128 * K / E)
    assert moe.capacity(dataclasses.replace(CFG, capacity_factor=100.0), 128) == 128


@pytest.mark.parametrize("k, balance", [(1, 2 * (0.75 * 0.65 + 0.25 * 0.35)), (2, 1.0)])
def test_router_losses_equal_their_formulas(k, balance):
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    offsets = np.array([1.0, 2.0, 0.0, -1.0])  # logsumexp(log p + c) = c
    logits = jnp.asarray(np.log(probs) + offsets[:, None], jnp.float32)
    _, p, weights, experts = moe.route(logits, jnp.eye(2), k)  # logits = x @ I
    np.testing.assert_allclose(p, probs, rtol=1e-6)
    np.testing.assert_allclose(jnp.sum(weights, -1), 1.0, rtol=1e-6)
    sums = moe.router_sums(logits, p, experts)
    # top-1 sends tokens 0, 1, 3 to expert 0 and token 2 to expert 1: f = (3/4, 1/4), P = (0.65, 0.35)
    np.testing.assert_allclose(moe.load_balancing_loss(sums), balance, rtol=1e-6)
    np.testing.assert_allclose(moe.z_loss(sums), (1 + 4 + 0 + 1) / 4, rtol=1e-6)


def test_layer_statistics_are_global_on_a_mesh():
    params, x, cot = _inputs(2)
    logits, p, _, experts = moe.route(x, params["router"], K)
    sums = moe.router_sums(logits, p, experts)
    _, stats, _ = _layer_vjp(CFG, {"data": 2, "expert": 4}, params, x, cot)
    np.testing.assert_allclose(stats["balance"], moe.load_balancing_loss(sums), rtol=1e-5)
    np.testing.assert_allclose(stats["z"], moe.z_loss(sums), rtol=1e-5)


def _moe_config(**overrides):
    c = utils.load_config_file("tiny_moe")
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


@pytest.mark.parametrize("key, value, mesh, match", [
    ("model.num_experts", 6, {"expert": 4, "data": 2}, "divisible by mesh.expert=4"),
    ("model.experts_per_token", 9, {}, "between 1 and model.num_experts=8"),
    ("model.moe_every", 3, {}, "divide model.n_layers=4"),
    ("model.capacity_factor", 0.0, {}, "must be > 0"),
    ("model.moe_mlp_dim", 12, {"tensor": 8, "expert": 1}, "divisible by mesh.tensor=8"),
    ("model.moe_fsdp", "sometimes", {}, "must be one of"),
])
def test_validation_names_key_value_and_rule(key, value, mesh, match):
    c = _moe_config(**{key: value})
    for axis, size in mesh.items():
        c.mesh[axis] = size
    with pytest.raises(ConfigError, match=match) as err:
        validate(c, 8)
    assert f"config.{key}={value!r}" in str(err.value)


def test_experts_over_fsdp_must_divide():
    c = _moe_config(**{"model.moe_fsdp": "experts"})
    c.mesh.expert, c.mesh.fsdp, c.mesh.data = 4, 2, 1
    c.model.num_experts = 4
    with pytest.raises(ConfigError, match="mesh.expert x mesh.fsdp=4 x 2") as err:
        validate(c, 8)
    assert "config.model.num_experts=4" in str(err.value)


@pytest.mark.parametrize("expert", [1, 2, 4, 8])
def test_tiny_moe_valid_on_every_expert_size(expert):
    c = _moe_config()
    c.mesh.expert, c.mesh.data = expert, -1
    assert validate(c, 8)["expert"] == expert


@pytest.mark.parametrize("shared", [False, True])
def test_num_params_is_exact(shared):
    c = _moe_config(**{"model.shared_expert": shared})
    cfg = ModelConfig.from_config(c)
    model = model_lib.Transformer(cfg, _rules({}))
    batch = model_lib.dummy_batch(1, 8)
    with jax.set_mesh(_mesh({})):
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"], batch["positions"],
                                                   batch["segment_ids"]))["params"]
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes)))
    assert model_lib.num_params(cfg) == count


@pytest.mark.parametrize("dropless", [False, True])
def test_padding_takes_no_capacity_and_stays_out_of_the_statistics(dropless):
    """The last 5 tokens of every row are padding, which the router would send to expert 0 and 1:
    they take no capacity (the real tokens' outputs, gradients and dropped count do not depend on
    what the padding holds), their outputs are 0, and balance / z / dropped are those of the real
    tokens alone. Under expert parallelism (data=2 x expert=4)."""
    params, x, cot = _inputs(3)
    cfg = dataclasses.replace(CFG, capacity_factor=1.0, moe_dropless=dropless)
    valid = jnp.broadcast_to(jnp.arange(T) < T - 5, (B, T))
    skew = x.at[..., 0].set(jnp.where(valid, x[..., 0], 8.0))  # padding that would crowd experts 0, 1
    params["router"] = params["router"].at[0, :2].add(5.0)
    mesh = _mesh({"data": 2, "expert": 4})
    layer = moe.MoeMlp(cfg, Rules.for_mesh(mesh))

    def run(x):
        def f(params):
            y, stats = layer.apply({"params": params}, x, valid)
            return jnp.sum(y * cot), (y, stats)
        with jax.set_mesh(mesh):
            (_, (y, stats)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
        return y, stats, grads

    y, stats, grads = run(x)
    y_skew, stats_skew, grads_skew = run(skew)
    real = np.asarray(valid)
    np.testing.assert_array_equal(np.asarray(y)[~real], 0.0)
    np.testing.assert_allclose(np.asarray(y_skew)[real], np.asarray(y)[real], rtol=1e-6, atol=1e-6)
    for name in ("w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(grads_skew[name], grads[name], rtol=1e-5, atol=1e-6, err_msg=name)
    logits, p, _, experts = moe.route(x, params["router"], K)
    sums = moe.router_sums(logits[real], p[real], experts[real])  # the real tokens alone
    for s in (stats, stats_skew):
        np.testing.assert_allclose(s["balance"], moe.load_balancing_loss(sums), rtol=1e-5)
        np.testing.assert_allclose(s["z"], moe.z_loss(sums), rtol=1e-5)
        np.testing.assert_allclose(s["dropped"], stats["dropped"], rtol=1e-6)
    slot = moe.capacity_slots(experts, E, moe.capacity(cfg, T), valid)
    dropped_real = float(np.sum((np.asarray(slot) == E * moe.capacity(cfg, T)) & real[..., None]))
    want = 0.0 if dropless else dropped_real / (real.sum() * K)
    assert dropless or want > 0  # capacity does drop real tokens here
    np.testing.assert_allclose(float(stats["dropped"]), want, rtol=1e-6)
