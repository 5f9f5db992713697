"""Any model, not only HuggingFace's, goes out as a safetensors folder and comes back in."""

from __future__ import annotations

import functools

import pytest
import torch

import myelin
from myelin.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def test_a_gpt_saved_with_save_pretrained_starts_a_meta_gpt(tmp_path):
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 9))
    with myelin.Trainer(GPT(CFG), ADAMW, lm_loss, microbatches=2) as trainer:
        trainer.step(x[:, :-1], x[:, 1:])
        want = trainer.state_dict()
        trainer.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no config
    with myelin.init_empty():
        meta = GPT(CFG)
    with myelin.Trainer(meta, ADAMW, lm_loss, microbatches=2, weights=tmp_path) as trainer:
        got = trainer.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_without_safetensors_weights_and_save_pretrained_say_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(myelin.ConfigError, match=r"weights reads .* pip install 'myelin\[hf\]'"):
        myelin.Trainer(GPT(CFG), ADAMW, lm_loss, weights=tmp_path)
    with myelin.Trainer(GPT(CFG), ADAMW, lm_loss) as trainer:
        with pytest.raises(myelin.ConfigError, match=r"save_pretrained reads and writes"):
            trainer.save_pretrained(tmp_path / "out")
