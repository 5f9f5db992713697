"""Any model, not only HuggingFace's, goes out as a safetensors folder and comes back in."""

from __future__ import annotations

import functools

import pytest
import torch

import myelin
from myelin.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpt_saved_with_save_pretrained_starts_a_meta_gpt(tmp_path, precision):
    """Under bf16 the folder holds the fp32 masters, as state_dict() does, not the rounded
    weights the stage computes with."""
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 9))
    with myelin.Trainer(GPT(CFG), ADAMW, lm_loss, microbatches=2, precision=precision) as trainer:
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


_LOAD_PEAK = """
import sys, torch
from safetensors.torch import save_file
from myelin import pretrained

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

folder = sys.argv[1]
weights = {"a": torch.randn(2048, 4096), "b": torch.randn(2048, 4096).bfloat16()}  # 32 + 16 MB
save_file(weights, folder + "/model.safetensors")
module = torch.nn.Module()
module.a = torch.nn.Parameter(torch.zeros(2048, 4096))
module.b = torch.nn.Parameter(torch.zeros(2048, 4096))  # fp32: read through a bf16 buffer
before = peak()
pretrained.load(module, {"a": ["a"], "b": ["b"]}, folder)
grew = peak() - before
assert torch.equal(module.a, weights["a"]) and torch.equal(module.b, weights["b"].float())
print(grew)
"""


def test_loading_reads_into_the_stage_without_mapping_or_copying_the_file(tmp_path):
    """Reading a stage's tensors from a folder adds no more than one converted tensor to the
    rank's peak memory: not the file's pages (a mapping counts them while it is open), not a
    copy of each tensor (before: 49 MiB for these 48 MiB of weights; now 16 MiB, the bf16
    buffer of the tensor stored in another dtype)."""
    pytest.importorskip("safetensors")
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _LOAD_PEAK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    grew = int(out.stdout.split()[-1])
    assert grew < 24 << 20, f"loading raised the peak by {grew / 2**20:.0f} MiB"


def test_tensors_of_dtypes_outside_the_direct_table_are_read_by_safetensors(tmp_path):
    """A float8 tensor: safetensors reads it, as before the direct reads (which cover the
    common dtypes only); the others still go straight into the parameters."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from myelin import pretrained

    stored = torch.randn(4, 8).to(torch.float8_e4m3fn)
    bias = torch.arange(4, dtype=torch.float32)
    save_file({"w": stored, "b": bias}, str(tmp_path / "model.safetensors"))
    module = torch.nn.Linear(8, 4)
    assert pretrained.load(module, {"weight": ["w"], "bias": ["b"]}, tmp_path) == [
        "model.safetensors"
    ]
    assert torch.equal(module.weight.detach(), stored.to(torch.float32))
    assert torch.equal(module.bias.detach(), bias)


def test_a_save_into_a_folder_of_another_layouts_save_leaves_only_its_own_weights(tmp_path):
    """An earlier 2-stage save's shards and index stayed beside a 1-stage save's file, and
    `weights=` (the index first) read the old weights; and the other way round."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from myelin.pretrained import _drop_stale

    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 9))
    old = {"stale": torch.zeros(1)}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_file(old, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"stale": "x"}}')
    with myelin.Trainer(GPT(CFG), ADAMW, lm_loss, microbatches=2) as trainer:
        trainer.step(x[:, :-1], x[:, 1:])
        want = trainer.state_dict()
        trainer.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with myelin.init_empty():
        meta = GPT(CFG)
    with myelin.Trainer(meta, ADAMW, lm_loss, microbatches=2, weights=tmp_path) as trainer:
        got = trainer.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # a 2-stage save after it: the single file goes, the shards and index it wrote stay
    written = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    for name in written:
        save_file(old, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    _drop_stale(tmp_path, written)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*written, "model.safetensors.index.json"]
    )
