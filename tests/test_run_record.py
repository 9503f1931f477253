"""Runs that describe themselves (`meshtrain/run_record.py`): every checkpoint holds its model and
tokenizer as JSON, so reading a run needs its workdir alone; `hf import --workdir` writes a run
(step 0, parameters only) that `sample` reads, `train` continues and `evaluate` scores; many prompts
decode in one batch with stop strings.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from meshtrain import config as config_lib, default_run, evaluate, generate, run_record, sample, train
from meshtrain.cli import load_config_file
from meshtrain.data import tokenizers
from meshtrain.hf import __main__ as hf_cli
from tests import utils

WORDS = ["def", "return", "class", "if", "else", "for", "in", "while", "import", "from", "the", "a", "x", "y",
         "value", "print", "(", ")", ":", "=", "+", "-", "1", "2", "3", "list", "dict", "self", "None", "True"]
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _default(workdir) -> object:
    """The defaults and a workdir: all a command that reads a run is given."""
    config = load_config_file(default_run.PATH)
    config.workdir, config.cpu_devices = str(workdir), 8
    return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run of 2 steps (tensor 2 x data 4, synthetic data) with its full config."""
    workdir = tmp_path_factory.mktemp("run")
    config = utils.config_for(workdir, {"tensor": 2, "data": 4}, **{
        "steps": 2, "log_every": 1, "checkpoint.every": 2, "data.source": "synthetic"})
    train.run(config)
    return workdir, config


def test_checkpoints_hold_the_model_and_tokenizer(trained):
    workdir, config = trained
    found = run_record.read(str(workdir))
    assert found["step"] == 2 and found["tokenizer"] == "bytes" and found["dtype"] == config.model.dtype
    assert found["model"] == {key: config.model[key] for key in run_record.MODEL_KEYS}
    assert found["attention"] == config_lib.attention_impl(config, "cpu")  # attention.impl as the step ran it
    assert found["context"] == config.train.seq_len


def test_sampling_past_the_models_context_is_refused_in_one_line(trained, hf_folder):
    """Prompt + --max_new_tokens past the context the run trained on (or a Hugging Face folder's
    max_position_embeddings): one line naming the flag, the sum and where the context comes from,
    raised before the parameters are read or anything compiles; exactly the context is allowed."""
    workdir, config = trained
    context = config.train.seq_len
    prompt_tokens = len(generate.prompt_rows(tokenizers.load_tokenizer("bytes"), ["def "])[0])
    with pytest.raises(ValueError, match=rf"^--max_new_tokens={100 * context}: the longest prompt \({prompt_tokens} "
                       rf"tokens\) and {100 * context} new ones make {prompt_tokens + 100 * context}, past the "
                       rf"model's context of {context} tokens \(the context the run in .* records\); ask for at "
                       rf"most {context - prompt_tokens}$"):
        sample.sample(_default(workdir), ["def "], 100 * context, generate.Sampling())
    assert len(sample.sample(_default(workdir), ["def "], context - prompt_tokens, generate.Sampling())) == 1
    with open(f"{hf_folder}/config.json") as f:
        positions = json.load(f)["max_position_embeddings"]
    with pytest.raises(ValueError, match=rf"past the model's context of {positions} tokens \(.*config\.json "
                       r"max_position_embeddings\)"):
        sample.sample(_default(hf_folder + "_unused"), ["def"], positions, generate.Sampling(), hf_dir=hf_folder)


def test_the_workdir_alone_samples_what_the_full_config_does(trained):
    """No config file: the defaults plus --config.workdir sample the text the run's own config does."""
    workdir, config = trained
    full = sample.sample(utils.config_for(workdir, {"data": 8}, **{"data.source": "synthetic"}), ["def "], 8,
                         generate.Sampling())
    alone = sample.sample(_default(workdir), ["def "], 8, generate.Sampling())
    assert alone == full and isinstance(alone[0], str)


def test_a_flag_that_contradicts_the_run_is_refused(trained):
    workdir, config = trained
    bad = _default(workdir)
    bad.model.n_layers = config.model.n_layers + 4
    with pytest.raises(config_lib.ConfigError, match=r"config\.model\.n_layers=8: contradicts the run"):
        sample.sample(bad, ["def "], 4, generate.Sampling(), given={"model.n_layers": 8})


def test_many_prompts_in_one_batch_equal_single_calls_with_a_stop_string(trained, tmp_path):
    """8 prompts from a JSON Lines file in one call, stop string ")", against 8 calls of one prompt."""
    workdir, _ = trained
    prompts = ["def ", "class A", "import os", "x = 1", "for i in", "while True", "return (", "print("]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) if i % 2 else json.dumps(p) for i, p in enumerate(prompts)))
    assert sample.read_prompts(str(path)) == prompts
    batched = sample.sample(_default(workdir), prompts, 12, generate.Sampling(), stop=(")",))
    single = [sample.sample(_default(workdir), [p], 12, generate.Sampling(), stop=(")",))[0] for p in prompts]
    assert batched == single
    assert all(")" not in text for text in batched)
    unstopped = sample.sample(_default(workdir), prompts, 12, generate.Sampling())
    assert [generate.cut(t, (")",)) for t in unstopped] == batched


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """A random tiny Llama 3.1 (scaled RoPE) with a word-level tokenizer.json, BOS / EOS and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("hf_run")
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "chat_template": CHAT}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                                      rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16},
                                      bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module")
def imported(hf_folder, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("imported") / "run"
    assert hf_cli.main(["import", hf_folder, "--workdir", str(workdir)]) == 0
    return workdir


def test_an_imported_run_samples_as_its_hugging_face_folder(hf_folder, imported):
    found = run_record.read(str(imported))
    assert found["parameters_only"] and found["step"] == 0 and found["model"]["rope_scaling"] == "llama3"
    assert found["tokenizer"] == "tokenizer" and found["dtype"] == "float32"
    prompts = ["def x ( self )", "class A :", "import"]
    from_run = sample.sample(_default(imported), prompts, 10, generate.Sampling())
    from_folder = sample.sample(_default(imported.parent / "other"), prompts, 10, generate.Sampling(),
                                hf_dir=hf_folder)
    assert from_run == from_folder and any(from_run)
    assert hf_cli.main(["import", hf_folder, "--workdir", str(imported)]) == 2  # holds checkpoints already
    with open(f"{hf_folder}/config.json") as f:
        assert found["context"] == json.load(f)["max_position_embeddings"]


def test_an_imported_run_trains_on_and_evaluates(hf_folder, imported, tmp_path):
    """`train --config.workdir=W` continues the imported run (its first loss that of a run that starts
    from the folder); `evaluate` scores it; the exported parameters are the folder's."""
    out = tmp_path / "export"
    assert hf_cli.main(["export", "--workdir", str(imported), str(out)]) == 0
    from tests.test_hf import _tensors  # the safetensors of a folder, by name

    original, exported = _tensors(hf_folder), _tensors(str(out))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)

    config = _default(imported)
    config.update_from_flattened_dict({"steps": 2, "train.warmup_steps": 1, "log_every": 1, "train.batch_size": 8,
                                       "train.seq_len": 16, "model.dtype": "float32", "checkpoint.every": 2})
    train.run(config, given={"steps": 2})
    losses = [json.loads(line)["loss"] for line in (imported / "metrics.jsonl").read_text().splitlines()]
    fresh = _default(tmp_path / "fresh")
    fresh.update_from_flattened_dict({"steps": 1, "train.warmup_steps": 1, "log_every": 1, "train.batch_size": 8,
                                      "train.seq_len": 16, "model.dtype": "float32", "init.from_hf": hf_folder,
                                      "data.tokenizer": hf_folder})
    train.run(fresh)
    first = json.loads((tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert len(losses) == 2 and np.isfinite(losses).all()
    np.testing.assert_allclose(losses[0], first, rtol=1e-5)

    lm = evaluate.lm_class()(workdir=str(imported), batch_size=4)
    [(logprob, _)] = lm._loglikelihood_tokens([(("ctx", "cont"), lm.tok_encode("def x"), lm.tok_encode(" ( self )"))])
    assert np.isfinite(logprob) and logprob < 0
    assert lm.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>hi<|assistant|>"
