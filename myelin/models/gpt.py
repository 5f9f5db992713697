"""A small GPT (decoder-only transformer), after nanoGPT, readable top to bottom.

    model = GPT(GPTConfig(vocab_size=256, n_layer=8, n_head=8, d_model=256))
    logits = model(idx)                        # idx (B, T) int64 -> logits (B, T, vocab)
    loss = lm_loss(logits, targets)            # targets (B, T)

`model.pipeline_layers()` lists it as [Embedding, Block x n_layer, Head], the
order in which myelin splits it into pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Embedding", "Block", "Head", "lm_loss"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Model size. Defaults give a ~6.5M parameter model for byte-level text."""

    vocab_size: int = 256
    block_size: int = 128  # longest sequence
    n_layer: int = 8
    n_head: int = 8
    d_model: int = 256
    dropout: float = 0.0
    bias: bool = True
    seed: int = 0  # layer i is initialised from seed + i, whichever rank builds it

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be an int >= 1")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")


class Embedding(nn.Module):
    """Token plus position embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.block_size = cfg.block_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size={self.block_size}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T) -> (B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, C) -> (B, T, vocab)


class GPT(nn.Module):
    """Embedding, `n_layer` blocks, head; initialised as GPT-2 is, layer by layer."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or GPTConfig()
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        if not self.embed.wte.weight.is_meta:  # under myelin.init_empty() nothing to fill
            for i, layer in enumerate(self.pipeline_layers()):
                self.init_layer(i, layer)

    def init_layer(self, index: int, layer: nn.Module) -> None:
        """Initialise pipeline layer `index` from its own seed, so that any rank holding it
        (or a meta-device model materialised stage by stage) gets the same weights."""
        g = torch.Generator().manual_seed(self.config.seed + index)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for name, module in layer.named_modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    std = residual_std if name.endswith("proj") else 0.02
                    module.weight.normal_(0.0, std, generator=g)
                if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                    module.bias.zero_()
                if isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as layers in order, for splitting into pipeline stages."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
