"""The hub's rules without sockets: what each request does to a slot, and what it refuses."""

import pytest
import torch

from myelin.errors import MessageError
from myelin.replicas.hub import Hub
from myelin.runtime.messages import Message, decode, encode


def request(op, tensors=(), stage=0, **meta):
    msg = Message("control", 1, 0, 0, stage, list(tensors), {"op": op, **meta})
    return decode(encode(msg))  # through the codec, as over the wire


def test_exchange_conserves_worker_plus_center_and_push_adds():
    hub = Hub()
    center = torch.tensor([1.0, 2.0, -3.0])
    assert hub.handle(request("init", [center])) == []
    x = torch.tensor([2.0, 0.0, 1.0])
    (old,) = hub.handle(request("exchange", [x], alpha=0.25))
    assert torch.equal(old, center)
    e = 0.25 * (x - old)
    assert torch.equal(hub.slots[0], center + e)  # x_i - e + (center + e): conserved
    assert hub.handle(request("push", [torch.ones(3)])) == []  # answered: a credit back
    assert torch.equal(hub.handle(request("read"))[0], center + e + 1)
    hub.handle(request("init", [torch.zeros(3)]))  # a later init does not reset the slot
    assert torch.equal(hub.slots[0], center + e + 1)
    hub.handle(request("set", [torch.zeros(3)]))  # set does (a resumed run's center)
    assert torch.equal(hub.slots[0], torch.zeros(3))
    assert hub.served == {"init": 2, "set": 1, "read": 1, "push": 1, "exchange": 1, "bye": 0}


@pytest.mark.parametrize(
    "req,field",
    [
        (request("steal"), "meta.op"),
        (request("read", stage=3), "stage"),
        (request("push", [torch.ones(4)]), "tensors[0].shape"),
        (request("push", [torch.ones(3, dtype=torch.float64)]), "tensors"),
        (request("exchange", [torch.ones(3)], alpha=2.0), "meta.alpha"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(req, field):
    hub = Hub()
    hub.handle(request("init", [torch.zeros(3)]))
    with pytest.raises(MessageError) as info:
        hub.handle(req)
    assert info.value.field == field
    assert torch.equal(hub.slots[0], torch.zeros(3))


# -- the hub process over its sockets: CURVE, limits, credits -------------------------------

import threading  # noqa: E402
import time  # noqa: E402

import zmq  # noqa: E402

from myelin.errors import DeadlineError, MyelinError  # noqa: E402
from myelin.replicas.hub_client import CREDITS, HubClient, _hub_curve, start_hub  # noqa: E402
from myelin.runtime.messages import MessageLimits  # noqa: E402


def _client(addresses, keys=None, rank=0, timeout_s=10.0, limits=None):
    return HubClient(
        addresses,
        0,
        rank,
        peer_timeout_s=1.5,
        timeout_s=timeout_s,
        limits=limits or MessageLimits(),
        keys=keys,
    )


def _stop(proc, *clients):
    for c in clients:
        c.req.close(linger=0)
        c.beats.close(linger=0)
        c.ctx.term()
    proc.kill()
    proc.wait()


def test_a_hub_under_curve_serves_its_ranks_and_refuses_anyone_else():
    """About 4 s: the hub starts; two strangers wait out the heartbeat timeout."""
    public, secret = zmq.curve_keypair()
    limits = MessageLimits(max_tensor_bytes=1024)
    proc, addresses = start_hub(3, "127.0.0.1", 30.0, limits, _hub_curve([public]))
    hub_key = addresses["public"].encode()
    rank = _client(addresses, (public, secret, hub_key), limits=limits)
    other = zmq.curve_keypair()
    stranger = _client(addresses, (other[0], other[1], hub_key), rank=1)
    plain = _client(addresses, None, rank=2)  # no CURVE at all
    try:
        rank.init(torch.arange(3.0))
        assert torch.equal(rank.read(), torch.arange(3.0))
        for intruder in (stranger, plain):
            start = time.monotonic()
            with pytest.raises(MyelinError, match="heartbeat|answer"):
                intruder.read()  # refused at the handshake: no answer, no heartbeat
            assert time.monotonic() - start < 8
        # the ranks' MessageLimits hold at the hub: a tensor over them is refused, named
        with pytest.raises(MessageError, match="the hub refused"):
            rank.exchange(torch.zeros(512), 0.5)  # 2 KiB > max_tensor_bytes
        assert torch.equal(rank.read(), torch.arange(3.0))  # and the hub serves on
        # over the hub's frame limit the connection would be cut unanswered: refused here
        start = time.monotonic()
        with pytest.raises(MessageError, match="frame limit"):
            rank.exchange(torch.zeros(2**15), 0.5)  # 128 KiB > max(1 KiB, 64 KiB header)
        assert time.monotonic() - start < 1
    finally:
        _stop(proc, rank, stranger, plain)


def test_unanswered_requests_are_bounded_by_credits_with_a_clear_error():
    """A hub that is alive (heartbeats) but answers nothing: CREDITS pushes go out, the
    next one waits for a credit and fails after the timeout saying why (about 1 s)."""
    ctx = zmq.Context()
    router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    beat_port = pub.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            pub.send(b"beat")

    beats = threading.Thread(target=beat, daemon=True)
    beats.start()
    addresses = {"serve": f"tcp://127.0.0.1:{port}", "beat": f"tcp://127.0.0.1:{beat_port}"}
    client = _client(addresses, timeout_s=0.5)
    try:
        for _ in range(CREDITS):
            client.push(torch.ones(3))
        start = time.monotonic()
        with pytest.raises(DeadlineError, match=f"{CREDITS} requests unanswered"):
            client.push(torch.ones(3))
        assert 0.4 < time.monotonic() - start < 3
    finally:
        stop.set()
        beats.join()
        client.req.close(linger=0)
        client.beats.close(linger=0)
        client.ctx.term()
        router.close(linger=0)
        pub.close(linger=0)
        ctx.term()
