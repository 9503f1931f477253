"""lm-eval-harness evaluation (meshtrain/evaluate.py) on the tasks of local JSONL files in tests/lm_eval:
multiple choice (loglikelihood), perplexity (loglikelihood_rolling) and greedy completion (generate_until),
each checked against the model computed another way."""

from __future__ import annotations

import contextlib
import json
import math

import datasets
import jax
import lm_eval
import lm_eval.api.registry
import lm_eval.tasks
import numpy as np
import pytest

from meshtrain import eval_tasks, evaluate, generate, model as model_lib, sample, train
from meshtrain.data import corpus, tokenizers
from meshtrain.run import Run
from tests import utils

pytestmark = pytest.mark.usefixtures("compilation_cache")
TASKS = utils.ROOT / "tests" / "lm_eval"
STEPS, SEQ_LEN = 6, 32


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A float32 tiny model trained on Python sources (a DatasetDict read through `hf:`) whose validation
    split is the perplexity task's text; evaluated once, at the end, over exactly that text."""
    root = tmp_path_factory.mktemp("evaluate")
    train_docs = [open(p, encoding="utf-8").read() for p in corpus.default_corpus_files()[:40]]
    text = _rows("text.jsonl")[0]["text"]
    assert len(text.encode()) == 8 * SEQ_LEN  # 8 windows: one eval batch of 8 rows predicts every byte once
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train_docs}),
                          "validation": datasets.Dataset.from_dict({"text": [text]})}).save_to_disk(str(root / "data"))
    workdir = root / "run"
    config = utils.config_for(workdir, {"data": 2, "tensor": 2, "fsdp": 2}, **{
        "data.source": f"hf:{root / 'data'}", "data.data_dir": str(root / "prepared"), "steps": STEPS,
        "train.seq_len": SEQ_LEN, "eval_every": STEPS, "eval_batches": 1, "checkpoint.every": STEPS,
        "eval_tasks": "meshtrain_choices", "eval_tasks_include_path": str(TASKS)})
    with contextlib.chdir(utils.ROOT):  # the task YAMLs name their JSONL files from there
        train.run(config)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluated = next(r for r in records if "eval_loss" in r)
    resolved = Run.resolve(config, utils.devices_for(config))
    return resolved, sample.load_params(resolved), evaluated


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch):
    monkeypatch.chdir(utils.ROOT)


def _lm(trained, batch_size: int):
    resolved, params, _ = trained
    return evaluate.lm_class()(model_config=resolved.model, params=params, batch_size=batch_size, max_length=SEQ_LEN,
                               tokenizer=tokenizers.load_tokenizer(resolved.config.data.tokenizer))


def _samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_registered_with_lm_eval():
    assert lm_eval.api.registry.get_model("meshtrain") is evaluate.lm_class()


def test_multiple_choice_accuracy_equals_model_logits_at_batch_sizes_1_and_8(trained):
    """By hand, from `model.logits`; then through lm-eval at batch sizes 1 and 8, and in the training
    loop (`eval_tasks`, the train batch size) on the final step's parameters."""
    resolved, params, evaluated = trained
    tokenizer = tokenizers.load_tokenizer(resolved.config.data.tokenizer)
    by_hand = []
    for item in _rows("choices.jsonl"):
        scores = []
        for choice in item["choices"]:
            # lm-eval moves the context's trailing whitespace to the continuation; the context gets BOS
            context = item["context"].rstrip()
            continuation = item["context"][len(context):] + choice
            ids = [tokenizer.bos_id, *tokenizer.encode(context), *tokenizer.encode(continuation)]
            ids = ids[-(SEQ_LEN + 1):]  # max_length tokens of input: a long context is cut on the left
            rows = np.asarray([ids[:-1]] * 4)  # the batch splits over data x fsdp
            logits = np.asarray(model_lib.logits(resolved.model, params, rows))[0]
            logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
            n = len(tokenizer.encode(continuation))
            scores.append(sum(logprobs[len(ids) - 1 - n + k, ids[len(ids) - n + k]] for k in range(n)))
        by_hand.append((scores, int(np.argmax(scores)) == item["answer"]))
    runs = {}
    for batch_size in (1, 8):
        results = eval_tasks.run_tasks(_lm(trained, batch_size), ["meshtrain_choices"], include_path=str(TASKS),
                                     log_samples=True)
        runs[batch_size] = results
        samples = _samples(results, "meshtrain_choices")
        assert len(samples) == len(by_hand)
        for sample_, (scores, _) in zip(samples, by_hand, strict=True):
            got = [resp[0][0] for resp in sample_["resps"]]
            np.testing.assert_allclose(got, scores, rtol=1e-5, atol=1e-5)
        acc = results["results"]["meshtrain_choices"]["acc,none"]
        assert acc == pytest.approx(np.mean([correct for _, correct in by_hand]), abs=1e-12)
    assert evaluated["lm_eval/meshtrain_choices/acc"] == pytest.approx(np.mean([c for _, c in by_hand]), abs=1e-12)
    one, eight = (_samples(runs[b], "meshtrain_choices") for b in (1, 8))
    for a, b in zip(one, eight, strict=True):
        np.testing.assert_allclose([r[0][0] for r in a["resps"]], [r[0][0] for r in b["resps"]], rtol=1e-5, atol=1e-5)
        assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]


def test_simple_evaluate_by_name_loads_the_run(trained):
    """`lm_eval.simple_evaluate(model="meshtrain", model_args="config=...,workdir=...,<key>=<value>")`: the
    run's newest checkpoint on the config's mesh, with the same accuracy as in the training loop."""
    resolved, _, evaluated = trained
    c = resolved.config
    args = {"config": "configs/tiny.py", "workdir": c.workdir, "model.n_layers": c.model.n_layers,
            "model.dtype": c.model.dtype, "train.seq_len": c.train.seq_len, "train.batch_size": c.train.batch_size,
            **{f"mesh.{axis}": c.mesh[axis] for axis in utils.AXES}}
    manager = lm_eval.tasks.TaskManager(include_path=str(TASKS))
    results = lm_eval.simple_evaluate(model="meshtrain", model_args=",".join(f"{k}={v}" for k, v in args.items()),
                                      tasks=["meshtrain_choices"], batch_size=8, torch_random_seed=None,
                                      bootstrap_iters=0, task_manager=manager)
    assert results["results"]["meshtrain_choices"]["acc,none"] == evaluated["lm_eval/meshtrain_choices/acc"]


def test_perplexity_task_equals_eval_loss(trained):
    """The rolling windows of `train.seq_len` bytes are the eval rows of the same text: the task's
    bits per byte (the byte tokenizer: one token a byte) is the run's eval loss in bits."""
    eval_loss = trained[2]["eval_loss"]
    results = eval_tasks.run_tasks(_lm(trained, 8), ["meshtrain_text"], include_path=str(TASKS))
    metrics = results["results"]["meshtrain_text"]
    assert metrics["bits_per_byte,none"] * math.log(2) == pytest.approx(eval_loss, rel=1e-5)
    assert math.log(metrics["byte_perplexity,none"]) == pytest.approx(eval_loss, rel=1e-5)


def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(trained):
    resolved, params, _ = trained
    tokenizer = tokenizers.load_tokenizer(resolved.config.data.tokenizer)
    results = eval_tasks.run_tasks(_lm(trained, 8), ["meshtrain_prompts"], include_path=str(TASKS), log_samples=True)
    for sample_, item in zip(_samples(results, "meshtrain_prompts"), _rows("prompts.jsonl"), strict=True):
        ids = [tokenizer.bos_id, *tokenizer.encode(item["prompt"])]
        new = generate.generate(resolved.model, params, [ids], 16, eos_id=tokenizer.eos_id,
                                vocab_limit=tokenizer.vocab_size)[0]
        want = tokenizer.decode([t for t in new if t != tokenizer.eos_id]).split("\n")[0]
        assert sample_["resps"][0][0] == want
    assert 0 <= results["results"]["meshtrain_prompts"]["exact_match,none"] <= 1


def test_unknown_task_is_a_config_error(trained):
    with pytest.raises(evaluate.config_lib.ConfigError, match="no_such_task") as error:
        eval_tasks.run_tasks(_lm(trained, 8), ["no_such_task"], include_path=str(TASKS))
    assert error.value.key == "tasks"
