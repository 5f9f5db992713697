"""`myelin train --model llama` and `--model config.json`: HuggingFace models on the
default job's byte-level data, handed back as model.pt and a save_pretrained folder."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from myelin import train_model
from myelin.errors import ConfigError
from myelin.train import TrainConfig, main
from tests.test_train import QUICK, parse, run_train


def test_llama_trains_in_two_stages_and_comes_back_as_hf(tmp_path):
    out_dir = tmp_path / "run"
    argv = [*QUICK, "--model=llama", "--steps=8", "--eval-every=4", f"--out={out_dir}"]
    code, out, err = run_train(argv, tmp_path)
    assert code == 0, err[-5000:]
    assert "myelin train: LlamaForCausalLM 2 layers x 64" in out and "sample (" in out
    config = json.loads((out_dir / "config.json").read_text())
    assert config["model"] == "llama" and config["stages"] == 2
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0], vals  # steps 0, 4 and 8
    model = train_model.build(TrainConfig(**config))
    assert isinstance(model, tf.LlamaForCausalLM) and model.config.vocab_size == 256
    model.load_state_dict(torch.load(out_dir / "model.pt", weights_only=True), strict=True)
    again = tf.AutoModelForCausalLM.from_pretrained(out_dir / "hf")
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(idx).logits, model(idx).logits)


def test_a_config_file_names_the_model(tmp_path, monkeypatch, capsys):
    config = tf.Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config.save_pretrained(tmp_path / "qwen")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    argv = [*QUICK, "--stages=1", "--steps=2", "--sample-tokens=5", "--out=run"]
    assert main(parse(*argv, f"--model={tmp_path / 'qwen'}")) == 0
    assert "myelin train: Qwen2ForCausalLM 2 layers x 32" in capsys.readouterr().out
    model = tf.Qwen2ForCausalLM(config)
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    assert tf.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").config.vocab_size == 300


def test_config_files_that_do_not_fit_are_named(tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(ConfigError, match=r"model='nope' must be one of gpt, llama or a Hug"):
        TrainConfig(model="nope")
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    with pytest.raises(ConfigError, match=r"vocab_size=100 must be at least 256"):
        TrainConfig(model=str(path))
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "num_hidden_layers": 1}))
    with pytest.raises(ConfigError, match=r"stages=4 exceeds the model's 3 layers \(embedding, 1 "):
        TrainConfig(model=str(path), stages=4)
    path.write_text(json.dumps({"vocab_size": 256}))
    with pytest.raises(ConfigError, match=r"has no 'model_type'"):
        TrainConfig(model=str(path))
