"""LazyAdam beyond row-wise sparse updates: parameter layouts, and the settings it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from myelin import ConfigError
from myelin.nn import LazyAdam


def test_a_channels_last_parameter_steps_as_torch_adam_steps_it():
    # `p.view(rows, -1)` raised on a channels_last weight (no such view of its strides)
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).double().to(memory_format=torch.channels_last)
    ref = nn.Conv2d(3, 4, 3).double()
    ref.load_state_dict(conv.state_dict())
    lazy, dense = LazyAdam(conv.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    for _ in range(3):
        for p, q in zip(conv.parameters(), ref.parameters(), strict=True):
            g = torch.randn_like(q)
            p.grad = g.contiguous(memory_format=torch.channels_last) if p.dim() == 4 else g.clone()
            q.grad = g.clone()
        lazy.step()
        dense.step()
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)  # layout kept
    for p, q in zip(conv.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)
    assert lazy.state[conv.weight]["exp_avg"].shape == (4, 27)  # (rows, d) as for any layout


def test_a_permuted_parameter_takes_a_sparse_gradient_on_its_rows():
    w0 = torch.randn(2, 3, 4, dtype=torch.float64)
    p = nn.Parameter(w0.clone().permute(2, 1, 0))  # (4, 3, 2): no (4, 6) view of it
    q = nn.Parameter(w0.permute(2, 1, 0).contiguous())
    lazy, ref = LazyAdam([p], lr=0.1), LazyAdam([q], lr=0.1)
    values = torch.randn(2, 3, 2, dtype=torch.float64)
    for param in (p, q):
        param.grad = torch.sparse_coo_tensor(
            torch.tensor([[1, 3]]), values, (4, 3, 2), check_invariants=True
        )
    lazy.step()
    ref.step()
    assert torch.equal(p, q)
    assert not torch.equal(p[1], w0.permute(2, 1, 0)[1])
    assert torch.equal(p[0], w0.permute(2, 1, 0)[0])  # an untouched row did not move


@pytest.mark.parametrize(("setting", "name"), [({"weight_decay": 0.01}, "weight_decay"),
                                                ({"amsgrad": True}, "amsgrad")])  # fmt: skip
def test_torch_adams_weight_decay_and_amsgrad_are_refused_naming_them(setting, name):
    # they raised a bare TypeError ("unexpected keyword argument")
    with pytest.raises(ConfigError, match=f"{name}=.* is not supported"):
        LazyAdam([nn.Parameter(torch.zeros(2))], **setting)
    LazyAdam([nn.Parameter(torch.zeros(2))], weight_decay=0.0, amsgrad=False)  # the defaults


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({"lr": -0.1}, "lr="),
        ({"lr": "0.1"}, "lr="),
        ({"betas": (0.9, 1.0)}, "betas="),
        ({"betas": (0.9,)}, "betas="),
        ({"eps": -1e-8}, "eps="),
    ],
)
def test_each_param_groups_own_settings_are_checked(group, match):
    # only the defaults were checked; a group's own betas=(0.9, 1.0) divided by zero later
    with pytest.raises(ConfigError, match=match):
        LazyAdam([{"params": [nn.Parameter(torch.zeros(2))], **group}], lr=0.1)
    opt = LazyAdam([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError, match=match):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], **group})


def test_a_groups_betas_given_as_a_list_are_kept_as_a_tuple():
    p, q = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = LazyAdam([{"params": [p], "betas": [0.5, 0.6]}, {"params": [q]}], betas=[0.8, 0.9])
    assert [g["betas"] for g in opt.param_groups] == [(0.5, 0.6), (0.8, 0.9)]


def test_torch_adams_state_loaded_into_lazy_adam_continues_as_torch_adam():
    # the 0-d "step" of torch's Adam was an IndexError at LazyAdam's next step
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(5, 3, dtype=torch.float64)), nn.Parameter(torch.randn(5))
    w2, b2 = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
    adam, ref = torch.optim.Adam([w, b], lr=0.1), torch.optim.Adam([w2, b2], lr=0.1)
    grads = [(torch.randn(5, 3, dtype=torch.float64), torch.randn(5)) for _ in range(4)]
    for gw, gb in grads[:2]:
        for opt, (p, q) in ((adam, (w, b)), (ref, (w2, b2))):
            p.grad, q.grad = gw.clone(), gb.clone()
            opt.step()
    lazy = LazyAdam([w, b], lr=0.1)
    lazy.load_state_dict(adam.state_dict())
    for gw, gb in grads[2:]:
        for opt, (p, q) in ((lazy, (w, b)), (ref, (w2, b2))):
            p.grad, q.grad = gw.clone(), gb.clone()
            opt.step()
    assert torch.allclose(w, w2, rtol=0, atol=1e-12) and torch.allclose(b, b2, rtol=0, atol=1e-6)
    assert lazy.state[w]["step"].tolist() == [4] * 5


def test_a_complex_parameter_is_refused_saying_why():
    # its second moment was g*g (complex), not |g|^2 as torch's Adam: silently another rule
    with pytest.raises(ConfigError, match=r"complex parameter \(4, 2\)"):
        LazyAdam([nn.Parameter(torch.zeros(4, 2, dtype=torch.complex64))])


@pytest.mark.parametrize("name", ["foreach", "fused", "capturable", "differentiable"])
def test_torch_adams_kernel_choices_are_a_config_error(name):
    with pytest.raises(ConfigError, match=f"does not take {name}"):
        LazyAdam([nn.Parameter(torch.zeros(2))], **{name: False})
