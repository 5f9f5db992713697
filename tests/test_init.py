"""Meta-device models materialised stage by stage get the eager model's weights."""

from __future__ import annotations

import functools

import pytest
import torch

import myelin
from myelin.init import is_meta, materialize
from myelin.models import GPT, GPTConfig, lm_loss
from myelin.partition import cross_stage_ties, layers_of, stage_module

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, d_model=16)


def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def test_init_empty_allocates_nothing():
    with myelin.init_empty():
        model = GPT(GPTConfig(n_layer=48, d_model=1024, n_head=16))
    assert is_meta(model)
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_each_stage_of_a_meta_gpt_materialises_to_the_eager_weights(stages):
    eager = GPT(CFG)
    with myelin.init_empty():
        meta = GPT(CFG)
    for s in range(stages):
        want = stage_module(eager, stages, s, partition=None if stages > 1 else [5])
        got = stage_module(meta, stages, s, partition=None if stages > 1 else [5])
        materialize(got, meta, list(got), got.first_layer)
        for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
            assert torch.equal(a, b), name


def test_hf_gpt2_meta_stages_match_eager_with_init_layers_and_stay_tied():
    eager = hf_gpt2()
    myelin.init_layers(eager, layers_of(eager))
    with myelin.init_empty():
        meta = hf_gpt2()
    whole = stage_module(meta, 1, 0, partition=[4])
    materialize(whole, meta, list(whole), 0)
    assert whole[0].wte.weight is whole[3].lm_head.weight  # the tie survives
    for s in range(2):
        with myelin.init_empty():
            meta = hf_gpt2()
        got = stage_module(meta, 2, s)
        materialize(got, meta, list(got), got.first_layer)
        want = stage_module(eager, 2, s)
        for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
            if name != "1.lm_head.weight":  # the last stage's copy of the tie is taken from stage 0
                assert torch.equal(a, b), name


def test_tied_embedding_is_found_across_stages():
    model = hf_gpt2()
    ties = cross_stage_ties(model, 2)
    assert ties == {(0, 1): {id(model.transformer.wte.weight)}}
    assert cross_stage_ties(model, 1) == {}
    assert cross_stage_ties(GPT(CFG), 2) == {}


def test_trainer_materialises_a_meta_model_in_one_process():
    eager = GPT(CFG)
    with myelin.init_empty():
        meta = GPT(CFG)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, 32, (4, 9))
    with myelin.Trainer(eager, adamw, lm_loss, microbatches=2) as a:
        la = a.step(x[:, :-1], x[:, 1:])
    with myelin.Trainer(meta, adamw, lm_loss, microbatches=2) as b:
        lb = b.step(x[:, :-1], x[:, 1:])
        assert not is_meta(b.module)
    assert la == lb
