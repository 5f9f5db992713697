"""Adam that updates only the rows a sparse gradient touched, each row on its own clock.

    optimizer = LazyAdam(model.parameters(), lr=1e-3)   # dense and sparse gradients alike

A wide layer whose batch touches a few thousand of its 10^5-10^6 rows should pay for
those rows only. For a sparse gradient (torch.sparse_coo, as `LSHSoftmax` and
`nn.Embedding(sparse=True)` produce) the moments and the weights of the touched rows are
updated and every other row is left exactly as it was; each row counts its own steps, so
a row after its n-th update equals dense `torch.optim.Adam` run n times on that row with
the same gradients (the bias correction uses the row's count, not the global one). A
dense gradient is the case where every row is touched, so one code path serves both.
State per row of a (rows, d) parameter: 2 d floats of moments and one int64 step count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from myelin.errors import ConfigError

__all__ = ["LazyAdam"]


class LazyAdam(torch.optim.Optimizer):
    """Row-wise lazy Adam; see the module docstring. torch Adam's weight_decay, amsgrad
    and maximize are refused with a ConfigError, in the constructor and in a param group
    alike (their defaults, 0, False and False, are accepted). lr may be 0, as torch's."""

    per_parameter_state = True  # each row's own state: offload may step it a bucket at a time

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        **torch_only: Any,
    ) -> None:
        if torch_only:  # foreach, fused, capturable, differentiable: torch Adam's kernels
            names = ", ".join(sorted(torch_only))
            raise ConfigError(
                f"LazyAdam does not take {names}: it has one row-wise update of its own "
                "(torch.optim.Adam's foreach, fused, capturable and differentiable choose "
                "among torch's kernels); leave them out"
            )
        _refuse_unsupported(weight_decay, amsgrad, maximize)
        defaults = {"lr": lr, "betas": betas, "eps": eps}
        _check_settings(defaults)
        super().__init__(params, {**defaults, "betas": tuple(betas)})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, and check the group's own lr, betas and eps (a group may set them)
        and refuse weight_decay, amsgrad and maximize in it, before the group is added."""
        if isinstance(param_group, dict):  # torch's own check names anything else
            merged = {**self.defaults, **param_group}
            _refuse_unsupported(
                merged.get("weight_decay", 0.0),
                merged.get("amsgrad", False),
                merged.get("maximize", False),
            )
            _check_settings(merged)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.is_complex():
                self.param_groups.pop()
                raise ConfigError(
                    f"LazyAdam: a complex parameter {tuple(p.shape)} is not supported (its "
                    "second moment would be g*g, not |g|^2 as torch.optim.Adam's); train it "
                    "with torch.optim.Adam, or as torch.view_as_real of a real parameter"
                )
        group["betas"] = tuple(group["betas"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Update every parameter that has a gradient, only on the rows it touched."""
        loss = None
        if closure is not None:
            with torch.enable_grad():  # as torch's optimizers: the closure runs backward
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        lr, eps = group["lr"], group["eps"]
        beta1, beta2 = group["betas"]
        rows_of = _as_rows(p)  # (R, d): a view of p, or a copy written back below
        state = self.state[p]
        if state and state["step"].dim() == 0:  # torch Adam's one count: every row's
            count = int(state["step"].item())
            state["step"] = torch.full((rows_of.shape[0],), count, dtype=torch.long,
                                       device=p.device)  # fmt: skip
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].reshape(rows_of.shape)
        if not state:
            state["exp_avg"] = torch.zeros_like(rows_of)
            state["exp_avg_sq"] = torch.zeros_like(rows_of)
            state["step"] = torch.zeros(rows_of.shape[0], dtype=torch.long, device=p.device)
        grad = p.grad
        if grad.is_sparse:
            if grad.sparse_dim() != 1:
                raise ValueError(
                    f"LazyAdam: a sparse gradient must be sparse in its rows only (sparse_dim "
                    f"1); got sparse_dim {grad.sparse_dim()} for a parameter of shape "
                    f"{tuple(p.shape)}"
                )
            grad = grad.coalesce()
            rows = grad.indices()[0]
            g = grad.values().reshape(rows.numel(), rows_of.shape[1])  # no rows: (0, d)
        else:
            rows = None
            g = grad.reshape(rows_of.shape)
        m_all, v_all, steps = state["exp_avg"], state["exp_avg_sq"], state["step"]
        if steps.device != p.device:  # torch's load_state_dict leaves "step" where it was saved
            steps = state["step"] = steps.to(p.device)
        m = m_all if rows is None else m_all[rows]
        v = v_all if rows is None else v_all[rows]
        if rows is None:
            steps += 1
            t = steps
        else:
            t = steps[rows] + 1
            steps[rows] = t
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t64 = t.double()[:, None]
        step_size = (lr / (1 - beta1**t64)).to(p.dtype)
        bc2_sqrt = (1 - beta2**t64).sqrt().to(p.dtype)
        update = m / (v.sqrt() / bc2_sqrt + eps) * step_size
        if rows is None:
            rows_of.sub_(update)
        else:
            m_all[rows] = m
            v_all[rows] = v
            rows_of.index_add_(0, rows, update, alpha=-1)
        if rows_of.data_ptr() != p.data_ptr():  # p's layout (channels_last) has no row view
            p.copy_(rows_of.view(p.shape))


def _as_rows(p: torch.Tensor) -> torch.Tensor:
    """p as (rows, d), its first dimension the rows (a 0-d p is one row): a view when p's
    strides allow one, else a contiguous copy in the same logical order (a channels_last
    or permuted p), which the caller writes back; the state is (rows, d) either way."""
    shape = (1, -1) if p.dim() == 0 else (p.shape[0], -1)
    try:
        return p.view(shape)
    except RuntimeError:
        return p.reshape(shape)


def _refuse_unsupported(weight_decay: float, amsgrad: bool, maximize: bool) -> None:
    """torch Adam's weight_decay, amsgrad and maximize, which LazyAdam lacks: a clear
    refusal, not a TypeError or a silent dense-Adam mismatch."""
    if weight_decay:
        raise ConfigError(
            f"LazyAdam: weight_decay={weight_decay!r} is not supported: decay would reach "
            "only the rows a sparse gradient touched, not every row as in torch.optim.Adam; "
            "use torch.optim.AdamW for dense parameters, or add the decay to the loss"
        )
    if amsgrad:
        raise ConfigError(
            f"LazyAdam: amsgrad={amsgrad!r} is not supported (it keeps no running maximum "
            "of the second moment); use torch.optim.Adam(amsgrad=True) for dense parameters"
        )
    if maximize:
        raise ConfigError(
            f"LazyAdam: maximize={maximize!r} is not supported (it always descends); "
            "minimise the negated objective instead"
        )


def _check_settings(group: dict[str, Any]) -> None:
    """lr >= 0 (0, as torch's Adam allows, steps nothing: a warmup start, a frozen group),
    two betas in [0, 1) and eps > 0, for the defaults and for each group."""
    lr, betas, eps = group["lr"], group["betas"], group["eps"]
    if not (_is_number(lr) and lr >= 0):
        raise ConfigError(f"lr={lr!r} must be a number >= 0")
    if not (
        isinstance(betas, (tuple, list))
        and len(betas) == 2
        and all(_is_number(b) and 0 <= b < 1 for b in betas)
    ):
        raise ConfigError(f"betas={betas!r} must be two numbers in [0, 1)")
    if not (_is_number(eps) and eps > 0):
        raise ConfigError(f"eps={eps!r} must be a number > 0")


def _is_number(x: Any) -> bool:
    """An int or float, not a bool (True is an int to isinstance)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
