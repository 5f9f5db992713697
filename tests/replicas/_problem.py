"""The convex problem Hogbatch's tests train: a noisy linear regression and its optimum."""

from __future__ import annotations

import torch


def problem(n=512, d=8, seed=0):
    """A noisy linear regression: the model, the data and the least-squares optimum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.randn(d, generator=g) + 0.5 + 0.01 * torch.randn(n, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d, 1), torch.nn.Flatten(0))
    design = torch.cat([x, torch.ones(n, 1)], 1).double()
    best = torch.linalg.lstsq(design, y.double().unsqueeze(1)).solution.squeeze(1)
    return model, (x, y), best
