"""A HuggingFace causal LM cut into stages runs its own forward: found by structure, chained
stage by stage in one process it gives the whole model's logits, bit for bit."""

from __future__ import annotations

import hf_families as fam
import pytest
import torch
import transformers as tf

import myelin
from myelin import PartitionError, hf
from myelin.partition import layers_of, stage_module


@pytest.mark.parametrize("family", sorted(fam.FAMILIES))
def test_blocks_embeddings_and_head_are_found_from_structure(family):
    model = fam.build(family)
    found = hf.find(model)
    assert len(found.blocks) == 4
    assert all(b is m for b, m in zip(found.blocks, found.blocks))
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert any(m is embedding for m in found.before.values())
    assert any(m is head for m in found.after.values())
    assert not any(p for m in found.everywhere.values() for p in m.parameters())
    layers = layers_of(model)
    assert len(layers) == 6
    # every parameter belongs to exactly one layer, ties aside
    held = {id(p) for layer in layers for p in layer.parameters()}
    assert held == {id(p) for p in model.parameters()}


def test_router_auxiliary_losses_are_refused_not_dropped():
    """An MoE model whose loss adds its routers' load-balancing loss: each stage holds only
    its own routers' logits, so myelin says so rather than train without it."""
    cfg = tf.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        output_router_logits=True,
    )
    model = tf.MixtralForCausalLM(cfg)
    with pytest.raises(PartitionError, match="output_router_logits=True.*= False"):
        myelin.split(model, 2)
    model.config.output_router_logits = False
    whole = stage_module(model, 1, 0)  # cut while off, then switched on
    model.config.output_router_logits = True
    with pytest.raises(PartitionError, match="returned an aux_loss"):
        whole(torch.randint(0, 32, (2, 6)))


def _chain(model, stages, partition, inputs):
    """Run stage after stage in this process, as the pipeline would, and return the logits."""
    out = inputs
    for s in range(stages):
        module = stage_module(model, stages, s, partition)
        out = module(*(out if isinstance(out, tuple) else (out,)))
    return out


@pytest.mark.parametrize("family", sorted(fam.FAMILIES))
def test_stages_chained_give_the_whole_models_logits(family):
    model = fam.build(family).eval()
    ids, mask, _ = fam.batch(0)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        for stages, partition in [(2, None), (3, [1, 4, 1]), (6, None), (2, [5, 1])]:
            got = _chain(model, stages, partition, (ids, mask))
            assert torch.equal(got, want), (family, stages, partition)
        got = _chain(model, 3, [2, 2, 2], (ids,))  # no mask
        assert torch.equal(got, model(input_ids=ids).logits)


def test_a_stage_passes_the_hidden_state_and_the_inputs_on():
    model = fam.build("llama")
    ids, mask, _ = fam.batch(0)
    hidden, *rest = stage_module(model, 2, 0)(ids, mask)
    assert hidden.shape == (*ids.shape, 32) and hidden.dtype == torch.float32
    assert rest[0] is ids and rest[1] is mask
    assert stage_module(model, 2, 1)(hidden, ids, mask).shape == (*ids.shape, fam.VOCAB)


def test_the_model_is_left_as_it_was_after_a_stage_ran():
    model = fam.build("gpt2")
    before = dict(model.named_modules())
    ids, _, _ = fam.batch(0)
    stage_module(model, 3, 1)(torch.zeros(*ids.shape, 32), ids)
    assert dict(model.named_modules()) == before


def test_eval_step_puts_the_whole_hf_model_back_in_train_mode():
    """An HF stage's eval() reaches modules outside its layers (GPT-2's embedding dropout,
    which no block holds); after eval_step they train again, as before it."""
    cfg = tf.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                        embd_pdrop=0.5)  # fmt: skip
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg).train()
    before = [m.training for m in model.modules()]
    ids = torch.randint(0, 64, (2, 8))
    with myelin.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.0), microbatches=1) as t:
        t.eval_step(ids, ids)
        assert [m.training for m in model.modules()] == before
        assert model.transformer.drop.training


def test_an_encoder_decoder_model_is_refused_with_what_to_do():
    model = tf.T5ForConditionalGeneration(
        tf.T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    )
    with pytest.raises(PartitionError, match="encoder-decoder.*pass its layers by hand"):
        myelin.split(model, 2)


def test_a_masked_lm_and_an_encoder_without_is_decoder_are_refused():
    """Their loss is not a causal one, or their attention sees later tokens: myelin would
    count the loss over the wrong tokens (BertForMaskedLM trained at twice HF's loss)."""
    kw = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=32)  # fmt: skip
    with pytest.raises(PartitionError, match="not a causal LM .*ForMaskedLM"):
        myelin.split(tf.BertForMaskedLM(tf.BertConfig(**kw)), 2)
    with pytest.raises(PartitionError, match="is_decoder=False"):
        myelin.split(tf.BertLMHeadModel(tf.BertConfig(**kw)), 2)


def test_a_model_without_block_classes_or_head_is_refused_naming_what_is_missing():
    base = tf.LlamaModel(fam.config("llama"))  # no LM head
    with pytest.raises(PartitionError, match=r"no LM head.*get_output_embeddings.*by hand"):
        myelin.split(base, 2)
    model = fam.build("llama")
    model._no_split_modules = ["SomethingElse"]
    with pytest.raises(PartitionError, match=r"ModuleList of \['SomethingElse'\].*found none"):
        myelin.split(model, 2)
    model._no_split_modules = None
    with pytest.raises(PartitionError, match="_no_split_modules"):
        myelin.split(model, 2)


def test_modules_go_where_the_forward_runs_them_not_where_they_are_registered():
    # OPT registers its final norm and output projection before its blocks, runs them after.
    model = fam.build("opt")
    found = hf.find(model)
    decoder = "model.decoder."
    assert sorted(found.before) == [
        decoder + n for n in ("embed_positions", "embed_tokens", "project_in")
    ]
    assert sorted(found.after) == ["lm_head", decoder + "final_layer_norm", decoder + "project_out"]
    ids, mask, _ = fam.batch(0)
    out = (ids, mask)
    for s in range(3):  # the middle stage stands in for project_in, a Linear 16 -> 32
        out = stage_module(model, 3, s)(*(out if isinstance(out, tuple) else (out,)))
    assert torch.equal(out, model(input_ids=ids, attention_mask=mask).logits)


class _Odd(torch.nn.Module):
    """A model whose norm runs before and after its blocks: no stage can hold it."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.embed, self.norm = torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.head, self.twice = torch.nn.Linear(4, 8), twice

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        x = self.embed(input_ids)
        x = self.norm(x) if self.twice else x
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def test_a_module_the_forward_runs_on_both_sides_of_the_blocks_is_named():
    from myelin.hf import probe, shape

    odd = _Odd(twice=False)
    beside, registered = shape._beside(odd, "layers")
    assert beside == {"embed": odd.embed, "norm": odd.norm, "head": odd.head}
    probed = probe.probe(odd, "layers", odd.layers, beside)
    assert probed.sides == {"embed": "before", "norm": "after", "head": "after"}
    assert not probed.block_tuple  # a Linear returns the hidden state alone
    before, after, _ = shape._around(odd, beside, registered, probed)
    assert list(before) == ["embed"] and sorted(after) == ["head", "norm"]
    odd = _Odd(twice=True)
    beside, registered = shape._beside(odd, "layers")
    probed = probe.probe(odd, "layers", odd.layers, beside)
    with pytest.raises(
        PartitionError, match=r"uses norm, which holds weights, among its blocks or on both sides"
    ):
        shape._around(odd, beside, registered, probed)


@pytest.mark.parametrize(
    ("config", "tuple_blocks"),
    [
        (
            tf.FalconConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4
            ),
            True,
        ),
        (tf.BloomConfig(vocab_size=64, hidden_size=32, n_layer=4, n_head=4), True),
        (fam.config("llama"), False),
    ],
    ids=["falcon", "bloom", "llama"],
)
def test_a_stage_of_the_head_alone_runs_for_blocks_that_return_tuples(config, tuple_blocks):
    """Falcon's and Bloom's blocks return (hidden, ...) and the model takes outputs[0]: a
    stage's stand-in for the last block must too (it gave row 0 of the batch: IndexError)."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    assert hf.find(model).block_tuple == tuple_blocks
    ids, mask, _ = fam.batch(0)
    out = (ids, mask)
    for s in range(3):  # [embeddings], [4 blocks], [head]
        module = stage_module(model, 3, s, partition=[1, 4, 1])
        out = module(*(out if isinstance(out, tuple) else (out,)))
    assert torch.equal(out, model(input_ids=ids, attention_mask=mask).logits)


def test_stage_inputs_that_are_not_token_ids_are_named():
    model = fam.build("llama")
    with pytest.raises(myelin.MyelinError, match=r"takes input_ids.*got float32\[2, 3\]"):
        stage_module(model, 2, 0)(torch.zeros(2, 3))
    with pytest.raises(myelin.MyelinError, match=r"takes \(hidden, input_ids, ...\)"):
        stage_module(model, 2, 1)(torch.zeros(2, 3, dtype=torch.long))


def test_a_meta_model_materialises_each_stage_and_its_rotary_tables():
    eager = fam.build("llama")
    myelin.init_layers(eager, layers_of(eager))
    with myelin.init_empty():
        meta = tf.LlamaForCausalLM(fam.config("llama"))
    ids, mask, _ = fam.batch(0)
    out = (ids, mask)
    for s in range(2):
        module = stage_module(meta, 2, s)
        myelin.init.materialize(module, meta, list(module), module.first_layer)
        out = module(*(out if isinstance(out, tuple) else (out,)))
    assert torch.equal(out, eager(input_ids=ids, attention_mask=mask).logits)


def _dropout_logits(model, stages, ids):
    """The logits of one forward of `model` split into `stages` HF stages, each run on its
    own layers' random streams, as a pipeline's ranks run them."""
    from myelin.placement import layer_modules
    from myelin.runtime.rng import LayerStreams

    args = (ids,)
    for s in range(stages):
        stage = stage_module(model, stages, s)
        streams = LayerStreams(1234, 0, layer_modules(stage), torch.device("cpu"))
        with streams.scope():
            out = stage(*args)
        streams.close()
        args = out if isinstance(out, tuple) else (out,)
    return args[0]


def test_dropout_in_an_hf_model_draws_the_same_masks_at_every_split():
    """GPT-2's embedding dropout runs on every stage's forward (on zeros where a later
    stage stands in for the embeddings); it must not advance the stream of that stage's
    first block, so every block draws the masks it draws in one process."""
    cfg = tf.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                        embd_pdrop=0.3, resid_pdrop=0.3, attn_pdrop=0.3)  # fmt: skip
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 64, (2, 8))
    one = _dropout_logits(model, 1, ids)
    assert not torch.equal(one, model.eval()(ids).logits)  # dropout did draw
    model.train()
    for stages in (2, 3, 6):
        assert torch.equal(_dropout_logits(model, stages, ids), one), stages


def test_blocks_that_take_the_embeddings_too_are_refused_past_stage_zero():
    """Zamba's hybrid blocks take a copy of the embeddings beside the hidden state: a later
    stage gave them zeros (losses and gradients off, silently). One stage is exact."""
    cfg = tf.ZambaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    assert hf.find(model).feeds_blocks == {"model.embed_tokens"}
    assert not hf.find(fam.build("llama")).feeds_blocks
    stage_module(model, 2, 0)  # stage 0 has the embeddings
    with pytest.raises(PartitionError, match="take the output of model.embed_tokens.*stages=1"):
        stage_module(model, 2, 1)


def _tiny(family: str) -> torch.nn.Module:
    """A 4-block model of `family` from its config class, the fields it takes set small."""
    import inspect

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=64, num_experts=4, num_local_experts=4,
                 num_experts_per_tok=2, attention_dropout=0.0, hidden_dropout=0.0,
                 embedding_dropout=0.0, n_routed_experts=4, moe_intermediate_size=16,
                 shared_expert_intermediate_size=16)  # fmt: skip
    cls = CONFIG_MAPPING[family]
    takes = inspect.signature(cls.__init__).parameters
    fields = {k: v for k, v in small.items() if k in takes}
    torch.manual_seed(0)
    cfg = cls(**fields, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("family", ["rwkv", "nemotron_h", "llama4_text", "modernbert-decoder"])
def test_families_whose_forward_reads_the_stand_ins_run_in_stages(family):
    """RWKV unpacks (hidden, state, attentions) from every block, Nemotron-H reads a
    block's `block_type`, Llama 4 the embedding's `weight`, ModernBERT's decoder calls its
    embeddings by keyword: a later stage's stand-ins failed each (at 1 stage all worked)."""
    model = _tiny(family)
    ids, mask, _ = fam.batch(0)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        for stages, partition in ((2, None), (3, [1, 4, 1])):
            out = (ids, mask)
            for s in range(stages):
                module = stage_module(model, stages, s, partition=partition)
                out = module(*(out if isinstance(out, tuple) else (out,)))
            assert torch.equal(out, want), (family, stages)
