"""The GPU suite: every test here is marked `gpu`, runs by default where CUDA is present and
is skipped, saying why, where it is not.

    python -m pytest tests/gpu -q -rs        # on a GPU machine: run; elsewhere: the skip reasons
    python -m pytest -m gpu                  # the same tests, wherever they live

cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, when it first starts in a process, and
`torch.use_deterministic_algorithms(True)` needs it: so it is set here, at import, before
any test touches the GPU (worker processes inherit it).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402


def cuda_missing() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    if torch.cuda.is_available():
        return None
    build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (
        f"needs a CUDA GPU: torch.cuda.is_available() is False here (torch {torch.__version__}, "
        f"{build}); run `python -m pytest tests/gpu` on a GPU machine (bench/gpu_session.sh)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_missing()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def deterministic():
    """Kernels that give the same bits on every run: deterministic algorithms, the math
    attention kernel (flash and memory-efficient attention accumulate with atomics in
    backward), no TF32. Restored afterwards."""
    cuda = torch.backends.cuda
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        getattr(cuda, "cudnn_sdp_enabled", lambda: False)(),
    )
    torch.use_deterministic_algorithms(True)
    cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda.enable_flash_sdp(False)
    cuda.enable_mem_efficient_sdp(False)
    if hasattr(cuda, "enable_cudnn_sdp"):
        cuda.enable_cudnn_sdp(False)
    yield
    torch.use_deterministic_algorithms(saved[0])
    cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]
    cuda.enable_flash_sdp(saved[3])
    cuda.enable_mem_efficient_sdp(saved[4])
    if hasattr(cuda, "enable_cudnn_sdp"):
        cuda.enable_cudnn_sdp(saved[5])


@pytest.fixture
def fresh_device():
    """Free what earlier tests left in torch's caching allocator, and lift any cap a
    `device_memory_limit` put on it (the cap is process-wide and outlives the Trainer)."""
    from tests.gpu._gpu import release

    release()
    yield
    release()
