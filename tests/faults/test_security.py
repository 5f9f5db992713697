"""CURVE: encrypted, authenticated connections that a process without the keys cannot use."""

from __future__ import annotations

import pytest
import zmq

import myelin
from tests._procs import launch


@pytest.mark.skipif(not zmq.has("curve"), reason="this pyzmq has no CURVE support")
def test_curve_trains_the_same_and_shuts_outsiders_out(tmp_path):
    job = launch(2, "secure.py", [], tmp_path, timeout=120)
    assert job.returncode == 0, job.output[-4000:]
    for rank in (0, 1):
        plain, curve = job.results[rank]["plain"], job.results[rank]["curve"]
        assert plain["curve"] is False and curve["curve"] is True
        assert curve["losses"] == plain["losses"]
    # Without CURVE the outsiders' messages arrive (and are rejected as misaddressed); with
    # it, messages sent without the run's keys never reach rank 1's loop.
    assert job.results[1]["plain"]["rejected"] == 2
    assert job.results[1]["curve"]["rejected"] == 0
    assert "refused a connection with an unknown CURVE key" in job.output


def test_curve_is_off_on_loopback_and_on_beyond_it():
    assert not myelin.TransportConfig(kind="tcp").wants_curve("tcp")
    assert myelin.TransportConfig(kind="tcp", host="0.0.0.0").wants_curve("tcp")
    assert not myelin.TransportConfig(kind="tcp", host="0.0.0.0", curve=False).wants_curve("tcp")
    assert myelin.TransportConfig(curve=True).wants_curve("ipc")
