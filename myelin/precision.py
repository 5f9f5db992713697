"""Mixed precision: the dtype a model trains in, and fp16's dynamic loss scale.

In "bf16" and "fp16" the stage's parameters, activations and messages are half
precision while the optimizer updates fp32 master weights (see offload/optimizer.py).
fp16's narrow range needs the loss scaled up before backward and the gradients
scaled down before the update; a step whose gradients overflow anywhere is skipped on
every rank and the scale halves. A frozen parameter has no master: where half precision
would round it, its exact value is kept on the host beside it (`keep_exact`), and
exports (`state_dict()`, checkpoints, `save_pretrained`) give that value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DTYPES",
    "EXACT",
    "LossScaler",
    "compute_dtype",
    "exact_value",
    "forget_exact",
    "keep_exact",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype parameters and activations have under `precision`."""
    return DTYPES[precision]


EXACT = "_myelin_exact"  # a frozen parameter's attribute: its value before rounding, host


def keep_exact(param: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> None:
    """Before a frozen `param` holds `value` in `dtype`: keep `value` on the host beside it
    if `dtype` would round it (forget an older one otherwise)."""
    param.__dict__.pop(EXACT, None)
    if param.requires_grad or not value.is_floating_point() or value.dtype == dtype:
        return
    if not torch.equal(value.detach().to(dtype).to(value.dtype), value.detach()):
        setattr(param, EXACT, value.detach().to("cpu", copy=True))


def forget_exact(module: torch.nn.Module) -> None:
    """The kept exact values dropped (the trainer closed: the parameters are the user's)."""
    for p in module.parameters():
        p.__dict__.pop(EXACT, None)


def exact_value(param: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """What `param` holds for an export: its exact value if kept, else `held`."""
    return param.__dict__.get(EXACT, held)


@dataclass(slots=True)
class LossScaler:
    """A dynamic loss scale: halve on overflow, double after `growth_interval` good steps."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    good_steps: int = 0
    skipped: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])
