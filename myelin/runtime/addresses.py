"""What a host string names: an address at all, or this machine's loopback. Kept free of
torch and zmq so that `myelin run` can check its options before anything heavy loads."""

from __future__ import annotations

import ipaddress
import re

__all__ = ["is_address", "is_loopback"]

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def is_address(host: str) -> bool:
    """An IP literal, or a host name as RFC 1123 spells one."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return 0 < len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface."""
    return host in ("localhost", "::1") or host.startswith("127.")
