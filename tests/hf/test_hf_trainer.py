"""A HuggingFace causal LM in one process: HF's inputs and labels, HF's loss and numerics,
and handed back as it came (state_dict, save_pretrained, weights=)."""

from __future__ import annotations

import functools
import json

import hf_families as fam
import pytest
import torch
import transformers as tf

import myelin
from myelin.checkpoint import CheckpointError

ADAMW = functools.partial(torch.optim.AdamW, lr=fam.LR)


def _train(model, steps=fam.STEPS, masked=True, **kw):
    with myelin.Trainer(model, ADAMW, microbatches=fam.MICROBATCHES, **kw) as trainer:
        losses = []
        for step in range(steps):
            ids, mask, labels = fam.batch(step)
            losses.append(trainer.step((ids, mask) if masked else ids, labels))
        return losses, trainer.state_dict()


@pytest.mark.parametrize("family", sorted(fam.FAMILIES))
def test_one_stage_trains_exactly_as_plain_hf_with_gradient_accumulation(family):
    losses, state = _train(fam.build(family))
    reference = fam.build(family)
    assert losses == fam.train_plain(reference)
    assert fam.max_diff(state, reference.state_dict()) == 0.0


def test_input_ids_alone_train_as_hf_without_a_mask():
    losses, state = _train(fam.build("mistral"), masked=False)
    reference = fam.build("mistral")
    assert losses == fam.train_plain(reference, masked=False)
    assert fam.max_diff(state, reference.state_dict()) == 0.0


def test_the_step_loss_is_hfs_loss_of_the_whole_batch_however_it_is_cut():
    ids, mask, labels = fam.batch(0)
    model = fam.build("llama")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    for microbatches in (1, 2, 4):
        with myelin.Trainer(fam.build("llama"), ADAMW, microbatches=microbatches) as trainer:
            got = trainer.eval_step((ids, mask), labels)
            if microbatches == 1:
                assert got == want
            assert got == pytest.approx(want, rel=1e-6)  # else summed in another order
            assert trainer.step((ids, mask), labels) == pytest.approx(want, rel=1e-6)


def test_labels_of_minus_100_are_not_learned_from():
    ids, mask, labels = fam.batch(0)
    ignored = labels.clone()
    ignored[:, 6:] = -100
    changed = labels.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % fam.VOCAB  # only where ignored
    changed = changed.masked_fill(ignored == -100, -100)
    with myelin.Trainer(fam.build("qwen2"), ADAMW, microbatches=2) as trainer:
        assert trainer.eval_step((ids, mask), ignored) == trainer.eval_step((ids, mask), changed)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_gradient_checkpointing_switched_on_before_wrapping_changes_nothing():
    model = fam.build("llama")
    model.gradient_checkpointing_enable()
    losses, state = _train(model)
    reference = fam.build("llama")
    assert losses == fam.train_plain(reference)
    assert fam.max_diff(state, reference.state_dict()) == 0.0
    assert all(block.gradient_checkpointing for block in model.model.layers)


def test_a_compiled_model_compiles_each_block_and_trains_the_same():
    model = fam.build("llama")
    losses, state = _train(torch.compile(model, backend="aot_eager"))
    reference = fam.build("llama")
    assert losses == fam.train_plain(reference)  # aot_eager keeps eager numerics
    assert fam.max_diff(state, reference.state_dict()) == 0.0
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.model.layers)


@pytest.mark.slow
def test_a_model_compiled_with_inductor_trains_within_rounding():
    model = fam.build("gpt_neox")
    losses, state = _train(torch.compile(model))
    reference = fam.build("gpt_neox")
    assert losses == pytest.approx(fam.train_plain(reference), rel=1e-6)
    assert fam.max_diff(state, reference.state_dict()) < 1e-4


@pytest.mark.parametrize("family", ["llama_tied", "gpt_neox"])
def test_state_dict_and_save_pretrained_hand_back_a_plain_hf_model(family, tmp_path):
    model = fam.build(family)
    with myelin.Trainer(model, ADAMW, microbatches=2) as trainer:
        ids, mask, labels = fam.batch(0)
        trainer.step((ids, mask), labels)
        state = trainer.state_dict()
        trainer.save_pretrained(tmp_path)
    fresh = fam.build(family)
    fresh.load_state_dict(state, strict=True)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    assert fam.max_diff(loaded.state_dict(), state) == 0.0
    tied = family == "llama_tied"
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == tied
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


@pytest.mark.parametrize("family", ["gemma", "gpt_neox"])
def test_a_meta_model_starts_from_a_save_pretrained_folder(tmp_path, family):
    """Gemma's folder sharded; GPT-NeoX's holds its head as `embed_out` (as Pythia's do),
    which transformers renames on load: `weights=` follows it, as from_pretrained does."""
    fam.build(family).save_pretrained(tmp_path, max_shard_size="20KB")
    if family == "gpt_neox":
        names = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert "embed_out.weight" in names["weight_map"]
        assert "lm_head.weight" not in names["weight_map"]
    with myelin.init_empty():
        model = tf.AutoModelForCausalLM.from_config(fam.config(family))
    losses, state = _train(model, weights=tmp_path)
    reference = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert losses == fam.train_plain(reference)
    assert fam.max_diff(state, reference.state_dict()) == 0.0


def test_a_folder_that_does_not_match_is_named(tmp_path):
    with pytest.raises(myelin.ConfigError, match="neither model.safetensors nor"):
        myelin.Trainer(fam.build("llama"), ADAMW, weights=tmp_path)
    fam.build("qwen2").save_pretrained(tmp_path)  # same names, other shapes
    other = fam.config("llama")
    other.intermediate_size = 40
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight: the folder has \(48, 32\)"):
        myelin.Trainer(tf.LlamaForCausalLM(other), ADAMW, weights=tmp_path)


def test_a_model_other_than_hf_needs_its_loss():
    with pytest.raises(
        myelin.ConfigError, match="loss_fn=None: a Sequential needs a callable loss_fn"
    ):
        myelin.Trainer(torch.nn.Sequential(torch.nn.Linear(2, 2)), ADAMW)
