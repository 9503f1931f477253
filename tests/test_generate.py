"""Sampling with a KV cache (`meshtrain.generate`): the logits every token was picked from equal the
full forward pass over the whole sequence, on one device and tensor-parallel beside data and
fsdp; greedy and seeded sampling give the same tokens on both meshes."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from meshtrain import config as config_lib, generate, model as model_lib, sample, tensorboard, train, train_step
from tests import utils

PROMPTS = [[1, 70, 72, 75, 80, 3], [1, 90], [1, 40, 41, 42]]  # left-padded to 6
NEW = 8
MESHES = {"one device": {}, "tensor2-data2-fsdp2": {"tensor": 2, "data": 2, "fsdp": 2}}


@functools.cache
def _params(mesh_name: str, dtype: str = "float32"):
    """(model config, parameters on the mesh): one device's initial parameters, placed on the mesh."""
    def build(mesh):
        run = utils.resolve(utils.tiny_config(mesh, **{"model.dtype": dtype}))
        return run, train_step.build(run)[0]
    _, single = build({})
    params = single.create(0).params
    run, factory = build(MESHES[mesh_name])
    return run.model, jax.device_put(params, jax.tree.map(lambda a: a.sharding, factory.abstract.params))


def _full(cfg, params, tokens: list[int]) -> np.ndarray:
    """The full forward's logits [L, V] of one sequence, on one device (model.logits)."""
    host = jax.tree.map(np.asarray, params)
    return np.asarray(model_lib.logits(cfg, jax.device_put(host, jax.devices()[0]), np.array([tokens])))[0]


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_cached_decode_equals_the_full_forward(mesh_name):
    cfg, params = _params(mesh_name)
    new, logits = generate.generate(cfg, params, PROMPTS, NEW, return_logits=True)
    assert logits.shape == (len(PROMPTS), NEW, cfg.vocab_size)
    for row, prompt in enumerate(PROMPTS):
        assert len(new[row]) == NEW
        full = _full(cfg, params, prompt + new[row])
        np.testing.assert_allclose(logits[row], full[len(prompt) - 1:len(prompt) - 1 + NEW], rtol=1e-5, atol=1e-5)
        assert new[row] == list(np.argmax(full[len(prompt) - 1:-1], axis=-1))  # greedy


def test_same_tokens_on_every_mesh():
    sampling = generate.Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=3)
    results = {}
    for name in MESHES:
        cfg, params = _params(name)
        results[name] = (generate.generate(cfg, params, PROMPTS, NEW),
                         generate.generate(cfg, params, PROMPTS, NEW, sampling))
    greedy, sampled = zip(*results.values(), strict=True)
    assert greedy[0] == greedy[1] and sampled[0] == sampled[1]
    assert sampled[0] != greedy[0]  # sampling is not greedy here
    cfg, params = _params("one device")
    other_seed = generate.generate(cfg, params, PROMPTS, NEW, generate.Sampling(0.9, 50, 0.95, seed=4))
    assert other_seed != sampled[0]


def test_pick_restricts_to_top_k_and_top_p():
    logits = jax.numpy.log(jax.numpy.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = [jax.random.key(i) for i in range(200)]
    def picks(sampling):
        return {int(generate.pick(logits, k, sampling)[0]) for k in keys}
    assert picks(generate.Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert picks(generate.Sampling(temperature=1.0, top_k=2)) == {0, 1}
    assert picks(generate.Sampling(temperature=1.0, top_p=0.8)) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    assert picks(generate.Sampling(temperature=1.0, top_p=0.81)) == {0, 1, 2}
    assert picks(generate.Sampling(temperature=0.0)) == {0}


def test_eos_ends_a_row_and_padding_ids_are_never_picked():
    cfg, params = _params("one device")
    new, logits = generate.generate(cfg, params, PROMPTS, NEW, return_logits=True)
    eos = new[0][2]
    ended = generate.generate(cfg, params, PROMPTS, NEW, eos_id=eos)
    assert ended[0] == new[0][:3]
    limit = 100
    hot = generate.Sampling(temperature=2.0, seed=1)
    limited = generate.generate(cfg, params, PROMPTS, NEW, hot, vocab_limit=limit)
    assert max(max(row) for row in limited) < limit
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            generate.Sampling(**bad)


def test_cached_decode_in_default_dtype():
    """bf16 compute: the cached decode's logits stay within bf16 rounding of the bf16 full forward."""
    cfg, params = _params("tensor2-data2-fsdp2", "bfloat16")
    new, logits = generate.generate(cfg, params, PROMPTS, NEW, return_logits=True)
    assert np.isfinite(logits).all()
    for row, prompt in enumerate(PROMPTS):
        full = _full(cfg, params, prompt + new[row])
        np.testing.assert_allclose(logits[row], full[len(prompt) - 1:len(prompt) - 1 + NEW], rtol=0, atol=2**-6)


def test_sample_command_refuses_what_it_cannot_run(tmp_path):
    """One ConfigError naming the key: a pipeline mesh, a workdir with no checkpoint."""
    staged = utils.tiny_config({"stage": 2, "data": 4}, workdir=str(tmp_path))
    with pytest.raises(config_lib.ConfigError, match=r"config\.mesh\.stage=2"):
        sample.sample(staged, ["def "], 4, generate.Sampling())
    empty = utils.tiny_config({"data": 8}, workdir=str(tmp_path / "none"))
    with pytest.raises(config_lib.ConfigError, match=r"config\.workdir=.*no checkpoint"):
        sample.sample(empty, ["def "], 4, generate.Sampling())


def test_sample_continues_a_prompt_from_a_trained_run(tmp_path):
    """`sample_every`: the text sampled inside the training loop at step 2 (metrics.jsonl, TensorBoard
    text) is what `meshtrain.sample` prints from step 2's checkpoint, on another mesh, with the same
    prompt, settings and seed; a step that samples is logged though `log_every` skips it."""
    config = utils.config_for(tmp_path, {"data": 8}, **{
        "steps": 3, "log_every": 3, "checkpoint.every": 2, "data.source": "synthetic",
        "sample_every": 2, "sample_max_new_tokens": 8, "sample_temperature": 0.8, "sample_top_k": 40})
    train.run(config)
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == [1, 2, 3] and "sample" in records[2] and "sample" not in records[3]
    assert tensorboard.read_texts(str(tmp_path / "tb"))["sample/text_summary"] == [(2, records[2]["sample"])]

    later = utils.config_for(tmp_path, {"tensor": 2, "data": 4}, **{
        "data.source": "synthetic", "checkpoint.restore_from": str(tmp_path / "checkpoints" / "2")})
    [text] = sample.sample(later, ["def "], 8, generate.Sampling(temperature=0.8, top_k=40, seed=config.seed))
    assert text == records[2]["sample"]
    assert isinstance(text, str) and len(text.encode()) <= 8 * 4
