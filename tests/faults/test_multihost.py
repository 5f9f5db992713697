"""Two hosts for real: one rank in each of two network namespaces joined by veth.

Marked slow, and skipped (with the reason) unless run as root with `ip` available. The
ranks talk tcp with CURVE on across the link, and must train to the losses of the
single-host run; then, with `tc netem` delay and loss on the link, they still finish,
only slower.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

from tests._procs import WORKERS, launch

pytestmark = pytest.mark.slow

ADDRS = ("10.231.7.1", "10.231.7.2")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    spaces = (f"myelin-a-{tag}", f"myelin-b-{tag}")
    links = (f"mya{tag}", f"myb{tag}")
    try:
        for ns in spaces:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(spaces, links, ADDRS, strict=True):
            sh("ip", "link", "set", link, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            sh("ip", "-n", ns, "link", "set", link, "up")
    except subprocess.CalledProcessError as exc:
        for ns in spaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.strip()}")
    yield spaces, links
    for ns in spaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_across(spaces, links, out, timeout=180):
    """Start rank r in namespace r; return each rank's record."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    procs = []
    for rank, (ns, link, addr) in enumerate(zip(spaces, links, ADDRS, strict=True)):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": ADDRS[0],
            "MASTER_PORT": port,
            "MYELIN_HOST": addr,
            "GLOO_SOCKET_IFNAME": link,
            "OMP_NUM_THREADS": "1",
        }
        cmd = ["ip", "netns", "exec", ns, sys.executable, str(WORKERS / "multihost.py")]
        procs.append(
            subprocess.Popen(
                [*cmd, "--out", str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _one_host_losses(tmp_path):
    (tmp_path / "local").mkdir()
    job = launch(2, "multihost.py", [], tmp_path / "local", timeout=180)
    assert job.returncode == 0, job.output[-4000:]
    return job.results[0]["losses"]


def test_two_namespaces_train_like_one_host(tmp_path, two_hosts):
    spaces, links = two_hosts
    want = _one_host_losses(tmp_path)
    across = run_across(spaces, links, tmp_path / "across")
    for rank, rec in enumerate(across):
        assert rec["losses"] == want, (rank, rec["losses"], want)
        assert rec["curve"] is True and rec["same_host"] is False
        assert rec["address"].startswith(f"tcp://{ADDRS[rank]}:")


def test_a_slow_lossy_link_only_slows_training(tmp_path, two_hosts):
    spaces, links = two_hosts
    clean = run_across(spaces, links, tmp_path / "clean")
    try:
        for ns, link in zip(spaces, links, strict=True):
            netem = ("netem", "delay", "20ms", "loss", "2%")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", *netem)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"tc netem is not available here: {exc.stderr.strip()}")
    lossy = run_across(spaces, links, tmp_path / "lossy", timeout=300)
    for a, b in zip(clean, lossy, strict=True):
        assert a["losses"] == b["losses"]
    assert max(r["seconds"] for r in lossy) > max(r["seconds"] for r in clean)
