"""Tiny HuggingFace causal LMs of several families, their batches, and plain HF training.

Shared by tests/hf (in one process) and tests/workers/hf_pipeline.py (in many). Every
model is built from a config (random weights, nothing downloaded), dropout off.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB, TOKENS, ROWS, MICROBATCHES, STEPS, LR = 64, 12, 8, 4, 3, 1e-2

_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)

# family -> (config class, model class, config fields beyond _LLAMA_LIKE's)
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "llama_tied": (tf.LlamaConfig, tf.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 4}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 8, "tie_word_embeddings": True}),
    "gpt_neox": (
        tf.GPTNeoXConfig,
        tf.GPTNeoXForCausalLM,
        {"hidden_dropout": 0.0, "num_key_value_heads": None, "rotary_pct": 0.5},
    ),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, None),
    # Registers its final norm and output projection before its blocks, runs them after.
    "opt": (tf.OPTConfig, tf.OPTForCausalLM, None),
    # Not named in myelin: multipliers on the embedding, residuals, attention and logits.
    "granite": (
        tf.GraniteConfig,
        tf.GraniteForCausalLM,
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    ),
}
TIED = {"llama_tied", "gemma", "gpt2", "opt"}


def config(family: str, dropout: float = 0.0) -> tf.PretrainedConfig:
    """The family's tiny config; `dropout` (GPT-2 only) sets each of its dropouts."""
    config_class, _, extra = FAMILIES[family]
    if dropout and family != "gpt2":
        raise ValueError(f"dropout= is built for gpt2 only, not {family}")
    if family == "opt":  # its own names; projections in and out of a narrower embedding
        return config_class(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            word_embed_proj_dim=16,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    if extra is None:  # GPT-2's own names
        return config_class(
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=32,
            n_layer=4,
            n_head=4,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
        )
    fields = {k: v for k, v in {**_LLAMA_LIKE, **extra}.items() if v is not None}
    if family == "gpt_neox":
        fields.pop("num_key_value_heads", None)
    return config_class(**fields, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def build(family: str, dropout: float = 0.0) -> torch.nn.Module:
    """The family's tiny model, the same weights every time."""
    torch.manual_seed(0)
    return FAMILIES[family][1](config(family, dropout))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of a step: rows right-padded to different lengths
    (so microbatches hold different counts of labelled tokens), padding labelled -100."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (ROWS, TOKENS), generator=g)
    lengths = torch.randint(3, TOKENS + 1, (ROWS,), generator=g)
    lengths[0] = TOKENS
    mask = (torch.arange(TOKENS)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def labelled(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def train_plain(
    model: torch.nn.Module,
    steps: int = STEPS,
    masked: bool = True,
    microbatches: int = MICROBATCHES,
) -> list[float]:
    """Plain HF with gradient accumulation over the same microbatches, as HF's Trainer does
    it: each microbatch's loss over the step's count of labelled tokens, summed."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        ids, mask, labels = batch(step)
        count = labelled(labels)
        total = 0.0
        for i, m, y in zip(
            ids.chunk(microbatches), mask.chunk(microbatches), labels.chunk(microbatches)
        ):
            out = model(
                input_ids=i,
                attention_mask=m if masked else None,
                labels=y,
                num_items_in_batch=count,
            )
            out.loss.backward()
            total += out.loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
