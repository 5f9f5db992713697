"""LazyAdam resumed on the GPU from a state saved on the CPU: torch's load_state_dict
leaves each "step" entry on the device it was saved from, and LazyAdam's per-row steps
are indexed by the GPU's rows."""

from __future__ import annotations

import pytest
import torch

from myelin.nn import LazyAdam

pytestmark = pytest.mark.gpu


def test_a_cpu_state_resumes_on_the_gpu_as_it_would_on_the_cpu():
    def run(device, state=None):
        torch.manual_seed(0)  # drawn on the CPU: CUDA's generator draws other numbers
        w = torch.nn.Parameter(torch.randn(16, 4).to(device))
        opt = LazyAdam([w], lr=0.1)
        if state is not None:
            opt.load_state_dict(state)
        for step in range(3):
            rows = torch.tensor([step, step + 3, 7], device=device)
            w.grad = torch.sparse_coo_tensor(rows[None], torch.ones(3, 4, device=device), (16, 4))
            opt.step()
        return w.detach().cpu(), opt.state_dict()

    _, saved = run("cpu")
    on_cpu, _ = run("cpu", saved)
    on_gpu, _ = run("cuda", saved)
    assert torch.allclose(on_gpu, on_cpu, atol=1e-6)
