"""The transport's own control messages: credits, and the shared-memory handshake.

Each handler checks that the message could only have come from the rank it names (the
segment's token, bytes actually in flight) and refuses, counting it, what does not.
They act on the transport's state directly, as its own methods would (split out of
transport.py by job).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from myelin.runtime.transport import Transport

__all__ = ["OPS"]


def on_credit(t: Transport, src: int, meta: dict[str, Any]) -> None:
    """Bytes (and shared-memory slots) the receiver took: they may be sent again."""
    peer = t._peers.get(src)
    amount, free = meta.get("bytes"), meta.get("free", [])
    if peer is None or type(amount) is not int or amount < 0 or not isinstance(free, list):
        return t._refuse(src, "credit", f"malformed: bytes={amount!r}")
    if amount > peer.inflight:  # more than was sent: not from the real receiver
        return t._refuse(src, "credit", f"{amount} bytes, but {peer.inflight} in flight")
    peer.inflight -= amount
    if free:
        if peer.shm is None or not peer.shm.owns(meta.get("token")):
            return t._refuse(src, "credit", "slots freed without the segment's token")
        bad = peer.shm.free(free)
        if bad:
            t._refuse(src, "credit", f"{bad} freed slots that are not in use")
    t._flush(peer)
    return None


def on_offer(t: Transport, src: int, meta: dict[str, Any]) -> None:
    """A sender offers its segment: map it, and say whether its ring will be read."""
    if t._shm_in is None:
        reply = {"op": "shm_refused", "reason": "shared memory is off here"}
    elif t._shm_in.token_of(src) is not None:  # one segment per sender, for life
        return t._refuse(src, "shm_offer", "a segment from this rank is mapped already")
    else:
        reply = t._shm_in.accept(src, meta)
        if t._bell is not None:
            t._bell.readers = t._shm_in.rings()
            if reply["op"] == "shm_ready" and t._shm_in.max_frames and meta.get("ring"):
                reply["bell"] = t._bell.name  # whole messages may come in its ring
    t._send_control(t._peer(src), reply)
    return None


def on_ready(t: Transport, src: int, meta: dict[str, Any]) -> None:
    """The receiver mapped this rank's segment (and gave its doorbell for the ring)."""
    peer = t._peers.get(src)
    side = peer.shm if peer is not None else None
    if side is None or not side.ready(meta.get("token"), meta.get("bell")):
        return t._refuse(src, "shm_ready", "no offer with that token")
    if side.ring is not None:  # after every message sent over ZeroMQ, before the ring's
        t._send_control(peer, {"op": "ring_start", "token": side.segment.token})
    t._flush(peer)
    return None


def on_ring_start(t: Transport, src: int, meta: dict[str, Any]) -> None:
    """The sender sends through its ring from now on: read it."""
    if t._shm_in is None or not t._shm_in.open_ring(src, meta.get("token")):
        return t._refuse(src, "ring_start", "no ring of that token mapped")
    t._bell.readers = t._shm_in.rings()
    return None


def on_ring_off(t: Transport, src: int, meta: dict[str, Any]) -> None:
    """The receiver no longer reads this rank's ring."""
    peer = t._peers.get(src)
    if peer is None or peer.shm is None or not peer.shm.owns(meta.get("token")):
        return t._refuse(src, "ring_off", "not the token of a segment sent to it")
    peer.shm.bell = None  # whole messages go over ZeroMQ again; slots still work
    peer.retry = False
    t._flush(peer)
    return None


def on_refused(t: Transport, src: int, meta: dict[str, Any]) -> None:
    """The receiver cannot map this rank's segment: send inline."""
    peer = t._peers.get(src)
    if peer is None or peer.shm is None or peer.shm.state != "offered":
        return t._refuse(src, "shm_refused", "no offer was pending")
    peer.shm.refused(meta.get("reason"))
    return None


OPS = {
    "credit": on_credit,
    "shm_offer": on_offer,
    "shm_ready": on_ready,
    "shm_refused": on_refused,
    "ring_start": on_ring_start,
    "ring_off": on_ring_off,
}
