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
    assert hub.handle(request("push", [torch.ones(3)])) is None
    assert torch.equal(hub.handle(request("read"))[0], center + e + 1)
    hub.handle(request("init", [torch.zeros(3)]))  # a later init does not reset the slot
    assert torch.equal(hub.slots[0], center + e + 1)
    assert hub.served == {"init": 2, "read": 1, "push": 1, "exchange": 1, "bye": 0}


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
