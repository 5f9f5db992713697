"""The model `myelin train` trains, from its `--model` option, the same on every rank.

    myelin train                                # gpt: myelin's reference GPT (models/gpt.py)
    myelin train --model llama                  # a HuggingFace LlamaForCausalLM (myelin[hf])
    myelin train --model path/to/config.json    # any HuggingFace causal LM of that config

All three read the same byte-level data (a vocabulary of 256) and take the same loss
(`lm_loss` on next-byte targets). A Llama's size comes from --n-layer, --n-head and
--d-model; a config file brings its own and must hold at least 256 tokens. A HuggingFace
model is built with `from_config` after seeding torch with --seed, so every rank starts
from the same weights and keeps its own stage.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from myelin.data import VOCAB_SIZE
from myelin.errors import ConfigError
from myelin.models.gpt import GPT

if TYPE_CHECKING:
    from myelin.train_config import TrainConfig

__all__ = ["NAMED", "build", "check", "context", "describe", "is_hf", "logits", "read_config"]

NAMED = ("gpt", "llama")


def is_hf(model: str) -> bool:
    """Whether the `--model` value names a HuggingFace model (needs transformers)."""
    return model != "gpt"


def read_config(model: str) -> dict[str, Any]:
    """The JSON of a `--model` config path (a config.json, or a folder holding one)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model={model!r} must be one of {', '.join(NAMED)} or a HuggingFace config.json "
            f"(a file or a folder holding one); cannot read {path}: {exc}"
        ) from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ConfigError(f"model={model!r}: {path} has no 'model_type'; is it a HF config.json?")
    return values


def check(model: str) -> int | None:
    """Check a `--model` value before any process starts; returns the model's block count
    (None where the config does not say)."""
    if model == "gpt":
        return None
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            f"model={model!r} needs HuggingFace transformers: pip install 'myelin[hf]'"
        )
    if model == "llama":
        return None
    values = read_config(model)
    vocab = values.get("vocab_size")
    if not isinstance(vocab, int) or vocab < VOCAB_SIZE:
        raise ConfigError(
            f"model={model!r}: vocab_size={vocab!r} must be at least {VOCAB_SIZE}, the byte "
            f"values myelin train's data holds"
        )
    layers = values.get("num_hidden_layers", values.get("n_layer"))
    return layers if isinstance(layers, int) else None


def positions(model: str) -> int | None:
    """The longest sequence a `--model` config.json's position embeddings take (None: not
    said, or myelin builds the model for the block size)."""
    if model in NAMED:
        return None
    values = read_config(model)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(values.get(key), int):
            return values[key]
    return None


def _hf_config(cfg: TrainConfig) -> Any:
    """The HuggingFace config of `cfg.model`: a Llama sized by the options, or the file's."""
    import transformers

    if cfg.model == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=cfg.d_model,
            intermediate_size=-(-8 * cfg.d_model // 3 // 32) * 32,  # SwiGLU's 8/3, rounded up
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_head,
            max_position_embeddings=cfg.block_size,
            tie_word_embeddings=False,
        )
    values = read_config(cfg.model)
    return transformers.AutoConfig.for_model(**values)


def build(cfg: TrainConfig) -> nn.Module:
    """The model `cfg` asks for, with the same weights in every process that builds it."""
    if cfg.model == "gpt":
        return GPT(cfg.model_config())
    import transformers

    config = _hf_config(cfg)
    torch.manual_seed(cfg.seed)  # from_config initialises from torch's global generator
    return transformers.AutoModelForCausalLM.from_config(config)


def describe(cfg: TrainConfig, model: nn.Module) -> str:
    """The model in a few words, for the run's header: `GPT 4 layers x 128 (0.82M params)`."""
    params = sum(p.numel() for p in model.parameters()) / 1e6
    if cfg.model == "gpt":
        return f"GPT {cfg.n_layer} layers x {cfg.d_model} ({params:.2f}M params)"
    c = model.config
    return (
        f"{type(model).__name__} {c.num_hidden_layers} layers x {c.hidden_size} "
        f"({params:.2f}M params)"
    )


def logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of `idx` (B, T), from a GPT or a HuggingFace model's output."""
    out = model(idx)
    return out if isinstance(out, torch.Tensor) else out.logits


def context(model: nn.Module) -> int:
    """How many tokens the model attends to at most (for sampling)."""
    c = model.config
    for name in ("block_size", "max_position_embeddings", "n_positions"):
        if isinstance(getattr(c, name, None), int):
            return getattr(c, name)
    return 1024
