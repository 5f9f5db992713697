"""One-way latency and bandwidth between two ranks on this host: myelin vs gloo vs memcpy.

    python3 bench/transport.py            # about a minute; writes bench/results/transport.json
    python3 bench/transport.py --quick    # about 20 seconds
    python3 bench/transport.py --peers myelin myelin-zmq myelin-inline gloo memcpy
                                          # the ring's share, and shared memory's

Two spawned processes (one torch thread each) rendezvous through a TCPStore on loopback
and run, for every size and round, in turn: myelin's Transport (ipc, default config),
torch.distributed gloo send/recv, and a plain `dst.copy_(src)` in one process.
memcpy copies into one destination again and again: at 1 MiB its source and destination
stay in the core's L2 (2 MiB here). memcpy-2 copies into two destinations in turn, the
least a transport must do when its receiver may still hold the last message; it is shown
beside memcpy for that reason, and the targets are judged against memcpy alone.
Latency is half a ping-pong round trip; bandwidth streams a window of messages and
waits for one small acknowledgement. Each round yields one sample per peer; the table
shows the median (and the JSON also min, max and every sample).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _harness import fmt_size, free_port, print_table, summary, timed, write_json

from myelin.runtime.messages import Message
from myelin.runtime.transport import Transport, TransportConfig

SIZES = [2**k for k in (12, 14, 16, 18, 20, 22, 24, 26)]  # 4 KiB .. 64 MiB
PEERS = ("myelin", "gloo", "memcpy", "memcpy-2")
COPIES = {"memcpy": 1, "memcpy-2": 2}  # in-process peers: how many destinations in turn
CONFIGS = {  # myelin peers: the default, and (on request) without its ring or shared memory
    "myelin": TransportConfig(kind="ipc"),
    "myelin-zmq": TransportConfig(kind="ipc", ring_bytes=0),  # headers over ZeroMQ
    "myelin-inline": TransportConfig(kind="ipc", shm=False),
}


def _plan(quick: bool) -> dict[str, Any]:
    return {
        "rounds": 3 if quick else 9,
        "stream_bytes": (16 if quick else 128) * 2**20,  # bytes per bandwidth sample (about)
        "pingpong_bytes": (4 if quick else 16) * 2**20,  # bytes per latency sample (about)
    }


class MyelinPeer:
    """Ping-pong and streaming over myelin's Transport."""

    def __init__(self, rank: int, store: Any, name: str) -> None:
        self.rank, self.other = rank, 1 - rank
        self.tr = Transport(rank, 2, store, CONFIGS[name], prefix=f"bench/{name}")
        self.tr.connect([self.other])

    def recv(self, count: int = 1) -> None:
        got = 0
        while got < count:
            got += len(self.tr.poll(5.0))

    def settle(self) -> None:
        """Let credits and freed slots flow back so every sample starts from the same state."""
        for _ in range(3):
            self.tr.poll(0.002)

    def pingpong(self, t: torch.Tensor, iters: int) -> None:
        msg = Message("activation", self.rank, 0, 0, 0, [t])
        for _ in range(iters):
            if self.rank == 0:
                self.tr.send(1, msg)
                self.recv()
            else:
                self.recv()
                self.tr.send(0, msg)

    def stream(self, t: torch.Tensor, window: int) -> None:
        if self.rank == 0:
            for i in range(window):
                self.tr.send(1, Message("activation", 0, 0, i, 0, [t]))
            self.recv()  # the acknowledgement
        else:
            self.recv(window)
            self.tr.send_control(0, {"op": "ack"})

    def close(self) -> None:
        self.tr.close()


class GlooPeer:
    """The same two patterns with torch.distributed gloo send/recv."""

    def __init__(self, rank: int) -> None:
        self.rank, self.other = rank, 1 - rank
        self.ack = torch.zeros(1)

    def settle(self) -> None:
        pass

    def pingpong(self, t: torch.Tensor, iters: int) -> None:
        for _ in range(iters):
            if self.rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)

    def stream(self, t: torch.Tensor, window: int) -> None:
        for _ in range(window):
            dist.send(t, 1) if self.rank == 0 else dist.recv(t, 0)
        dist.recv(self.ack, 1) if self.rank == 0 else dist.send(self.ack, 0)

    def close(self) -> None:
        pass


def _measure(peer: Any, rank: int, nbytes: int, plan: dict[str, Any]) -> dict[str, float]:
    """One latency sample (seconds, one way) and one bandwidth sample (bytes/s)."""
    t = torch.full((nbytes,), nbytes % 251, dtype=torch.uint8)
    iters = max(2, min(200, plan["pingpong_bytes"] // nbytes))
    window = max(8, min(512, plan["stream_bytes"] // nbytes))
    peer.settle()
    dist.barrier()
    lat = timed(lambda: peer.pingpong(t, iters)) / (2 * iters)
    peer.settle()
    dist.barrier()
    bw = window * nbytes / timed(lambda: peer.stream(t, window))
    return {"latency_s": lat, "bandwidth_Bps": bw}


def _memcpy(nbytes: int, plan: dict[str, Any], copies: int = 1) -> dict[str, float]:
    src = torch.full((nbytes,), 7, dtype=torch.uint8)
    dsts = [torch.empty_like(src) for _ in range(copies)]
    for dst in dsts:
        dst.copy_(src)
    iters = max(2, min(200, plan["pingpong_bytes"] // nbytes))
    per_copy = timed(lambda: [dsts[i % copies].copy_(src) for i in range(iters)]) / iters
    return {"latency_s": per_copy, "bandwidth_Bps": nbytes / per_copy}


def _worker(
    rank: int, port: int, plan: dict[str, Any], sizes: list[int], names: list[str], out: str
) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2)
    peers = {n: MyelinPeer(rank, store, n) if n in CONFIGS else GlooPeer(rank) for n in names}
    for name in COPIES:
        peers.pop(name, None)
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    for nbytes in sizes:
        for peer in peers.values():  # warm up: connections, segments, caches
            _measure(peer, rank, nbytes, {**plan, "pingpong_bytes": 0, "stream_bytes": 0})
        for r in range(plan["rounds"]):
            order = list(peers) if r % 2 == 0 else list(reversed(peers))
            for name in order:
                result = _measure(peers[name], rank, nbytes, plan)
                samples.setdefault((name, nbytes), []).append(result)
            for name, copies in COPIES.items():
                if rank == 0 and name in names:
                    sample = _memcpy(nbytes, plan, copies)
                    samples.setdefault((name, nbytes), []).append(sample)
            dist.barrier()
    for peer in peers.values():
        peer.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        rows = [{"peer": p, "bytes": n, "runs": s} for (p, n), s in samples.items()]
        with open(out, "w") as f:
            json.dump(rows, f)


def _report(rows: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for row in rows:
        lat = summary([r["latency_s"] * 1e6 for r in row["runs"]])
        bw = summary([r["bandwidth_Bps"] / 1e9 for r in row["runs"]])
        results.setdefault(row["peer"], {})[row["bytes"]] = {
            "latency_us": lat,
            "bandwidth_GBps": bw,
        }
    peers = [p for p in dict.fromkeys((*PEERS, *CONFIGS)) if p in results]
    sizes = sorted({n for by_size in results.values() for n in by_size})

    def cell(peer: str, n: int, key: str, fmt: str) -> str:
        s = results[peer][n][key]
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"

    lat_rows = [[fmt_size(n)] + [cell(p, n, "latency_us", ".1f") for p in peers] for n in sizes]
    bw_rows = [[fmt_size(n)] + [cell(p, n, "bandwidth_GBps", ".2f") for p in peers] for n in sizes]
    print_table(["size", *peers], lat_rows, "one-way latency, us: median [min-max]")
    print_table(["size", *peers], bw_rows, "bandwidth, GB/s: median [min-max]")
    targets = _targets(results, sizes) if {"myelin", "gloo", "memcpy"} <= set(peers) else {}
    if targets:
        print()
    for name, ok in targets.items():
        print(f"{'PASS' if ok else 'MISS'}  {name}")
    return {"plan": plan, "targets": targets, "results": _jsonable(results)}


def _targets(results: dict[str, dict[int, Any]], sizes: list[int]) -> dict[str, bool]:
    """The issue's goals, judged on medians."""

    def med(peer: str, n: int, key: str) -> float:
        return results[peer][n][key]["median"]

    bw = "bandwidth_GBps"
    return {
        "bandwidth >= gloo at every size": all(
            med("myelin", n, bw) >= med("gloo", n, bw) for n in sizes
        ),
        "bandwidth >= memcpy/2 from 1 MiB": all(
            med("myelin", n, bw) >= med("memcpy", n, bw) / 2 for n in sizes if n >= 2**20
        ),
        "latency at 4 KiB <= gloo": 4096 not in sizes
        or med("myelin", 4096, "latency_us") <= med("gloo", 4096, "latency_us"),
    }


def _jsonable(results: dict[str, dict[int, Any]]) -> dict[str, Any]:
    return {p: {str(n): v for n, v in by_size.items()} for p, by_size in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~20 second run")
    parser.add_argument("--sizes", type=int, nargs="*", help="message sizes in bytes")
    parser.add_argument("--out", help="JSON path (default bench/results/transport.json)")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after seconds")
    parser.add_argument(
        "--peers", nargs="*", default=list(PEERS), choices=sorted({*PEERS, *CONFIGS})
    )
    args = parser.parse_args(argv)
    plan = _plan(args.quick)
    sizes = args.sizes or SIZES
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)  # the workers rendezvous on their own store
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmp:
        out = os.path.join(tmp, "rows.json")
        ctx = mp.start_processes(
            _worker,
            args=(free_port(), plan, sizes, args.peers, out),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + args.timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                print(f"transport bench: no result within {args.timeout:.0f}s", file=sys.stderr)
                return 1
        with open(out) as f:
            rows = json.load(f)
    payload = _report(rows, plan)
    configs = {n: dataclasses.asdict(c) for n, c in CONFIGS.items() if n in args.peers}
    extra = {"sizes": sizes, "peers": args.peers, "configs": configs, "threads_per_rank": 1}
    path = write_json("transport", {**extra, **payload}, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
