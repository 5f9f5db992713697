"""The active set's pieces of `LSHSoftmax`: SLIDE's soft multi-label target and the
gathered rows whose backward is a sparse gradient (only the rows the batch touched)."""

from __future__ import annotations

from typing import Any

import torch

from myelin.errors import ConfigError

__all__ = ["as_label_matrix", "soft_target", "soft_target_loss", "sparse_rows"]


def soft_target_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum over a row's labels of log softmax / the row's label count:
    SLIDE's multi-label target 1/|Y|. `labels`: (B,) or (B, M) class ids, -1 padding, a
    label repeated in a row counted once (checked: a ConfigError names what is wrong).
    Rows without labels add 0; no rows give 0. In fp32 or wider: bf16 and fp16 logits are
    raised to fp32, float64 ones kept."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ConfigError(f"soft_target_loss: logits {got} must be (B, num_classes)")
    return soft_target(logits, as_label_matrix(labels, logits.shape[0], logits.shape[1]))


def soft_target(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """soft_target_loss on labels already checked: (B, M) int64, -1 padding, no repeats."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), 1)
    valid = labels >= 0
    if logp.shape[0] == 0 or logp.shape[1] == 0 and not valid.any():  # nothing to score
        return logp.sum()  # 0, and a gradient of zeros (no rows, or an empty active set)
    # a pad gathers class 0, whose log p may be -inf (LSH inference): masked, not * 0 (nan)
    picked = logp.gather(1, labels.clamp(min=0)).masked_fill(~valid, 0.0)
    count = valid.sum(1).clamp(min=1)
    return -(picked.sum(1) / count).mean()


def as_label_matrix(labels: Any, rows: int, num_classes: int) -> torch.Tensor:
    """Labels as (B, M) int64 with -1 padding; a (B,) vector is one label per row. A
    label repeated within a row counts once (SLIDE's target is 1/|Y| over the label set)."""
    if not isinstance(labels, torch.Tensor):
        raise ConfigError(f"labels must be an integer tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ConfigError(f"labels must be an integer tensor of class ids, got {labels.dtype}")
    labels = labels.long()
    if labels.dim() == 1:
        labels = labels[:, None]
    if labels.dim() != 2 or labels.shape[0] != rows:
        raise ConfigError(
            f"labels of shape {tuple(labels.shape)} must be (B,) or (B, M) with B={rows}"
        )
    if labels.numel() and int(labels.max()) >= num_classes:
        raise ConfigError(f"labels hold {int(labels.max())}, but num_classes={num_classes}")
    if labels.numel() and int(labels.min()) < -1:
        raise ConfigError(f"labels hold {int(labels.min())}: class ids are >= 0, -1 pads a row")
    if labels.shape[1] > 1:  # a label given twice in a row is one label (the target is a set)
        labels = labels.sort(dim=1).values
        again = torch.zeros_like(labels, dtype=torch.bool)
        again[:, 1:] = (labels[:, 1:] == labels[:, :-1]) & (labels[:, 1:] >= 0)
        labels = labels.masked_fill(again, -1)
    return labels


def sparse_rows(
    active: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight[active], bias[active] whose backward gives weight and bias sparse gradients
    holding only the rows `active` (sorted, unique); for LazyAdam or SparseAdam."""
    return _SparseRows.apply(active, weight, bias)


class _SparseRows(torch.autograd.Function):
    """W[active], b[active], with sparse gradients: only the active rows get one."""

    @staticmethod
    def forward(ctx: Any, active: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Any:
        ctx.save_for_backward(active)
        ctx.shapes = (weight.shape, bias.shape)
        return weight[active], bias[active]

    @staticmethod
    def backward(ctx: Any, grad_w: torch.Tensor, grad_b: torch.Tensor) -> Any:
        (active,) = ctx.saved_tensors
        w_shape, b_shape = ctx.shapes
        idx = active[None, :]
        gw = torch.sparse_coo_tensor(
            idx, grad_w, w_shape, is_coalesced=True, check_invariants=False
        )
        gb = torch.sparse_coo_tensor(
            idx, grad_b, b_shape, is_coalesced=True, check_invariants=False
        )
        return None, gw, gb
