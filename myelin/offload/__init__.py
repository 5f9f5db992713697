"""CPU scratch memory: a host pool, paged-out activations, and the optimizer on the host."""

from myelin.offload.config import OffloadConfig

__all__ = ["OffloadConfig"]
