"""Replica strategies on a GPT over real text: AllReduce, torch DDP, DASO, the EASGD family.

    python3 bench/replicas.py                  # one host, 4 ranks as 2 nodes of 2 (~15 min)
    python3 bench/replicas.py --netns 100mbit  # each node in its own network namespace,
                                               # the veth between them limited by tc tbf (root)
    python3 bench/replicas.py --quick          # 10 s per peer, one round

Four ranks (data_parallel=4, node_size=2) train myelin.models.GPT (byte level, 2 layers x
64, sequence 64, batch 8 per rank, AdamW 2e-3) on the Python standard library's source;
every peer takes the same batches (replica r reads stream ("train", r)), for the same
training time (`--seconds`, 30; at most `--steps`), so a peer whose steps are faster takes
more of them. Peers run in turn, each in processes of its own, the order reversed every
other round:

- allreduce: myelin.AllReduce (gradients averaged every step); ddp: torch DDP over gloo,
  the anchor a user would pick; daso: myelin.DASO(epoch_steps=20, warmup 1 epoch; its
  cool-down, the last of steps / 20 epochs, is past the time budget);
- easgd-sync / easgd-async / easgd-hogwild: myelin.EASGD(tau=4, or --tau for every EASGD
  mode, alpha=0.9/4); easgd-sync-fp16: sync with downcast="fp16" (each round sends
  x_i - x~ in fp16, half the bytes); measgd: async with momentum=0.9 (You et al.'s mu)
  on the local update, which is plain SGD as in the paper (lr 0.1), not AdamW: momentum
  on AdamW's update is not MEASGD (and myelin refuses it); its anchor allreduce-sgd:
  AllReduce with SGD(lr 0.1, momentum 0.9). The learning rates are the best of
  bench/replicas_lr.py's sweep.

Every `--eval-every` steps, once every rank has got there (a barrier, on the training
clock: replicas that do not wait for each other every step would otherwise wait for the
slowest inside the validation, off the clock), the validation loss (8 fixed batches; the
center for EASGD) is taken with its time, and the ranks agree whether the time is up.
Reported per peer: the time to the target (`--target`, else 1.02 x the validation loss
its anchor ends at: allreduce-sgd for measgd, allreduce for the rest), the loss reached at
the shortest run's wall time, bytes each rank put into communication across nodes (its
strategy's global bytes; for allreduce and ddp the gradient bytes of a ring all-reduce
across the 4 ranks), the share of step time spent in the strategy's hooks (communication
and its waits), and step time. Results: bench/results/replicas.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, machine_info, print_table  # noqa: E402

PEERS = (
    "allreduce",
    "ddp",
    "daso",
    "easgd-sync",
    "easgd-sync-fp16",
    "easgd-async",
    "easgd-hogwild",
    "allreduce-sgd",
    "measgd",
)
# the learning rates: the best of a single-process sweep at the bench's 200 steps and 4 x 8
# rows (AllReduce's update), 3 seeds (README): AdamW {3e-4 .. 1e-2}, heavy-ball SGD
# (momentum 0.9) {0.03 .. 1.0}
ADAMW_LR = 2e-3
SGD_LR, MOMENTUM = 0.1, 0.9  # MEASGD's mu: You et al.'s
TAU = 4  # every EASGD mode's (MEASGD's too); --tau sets another
ANCHOR = {"measgd": "allreduce-sgd", "allreduce-sgd": "allreduce-sgd"}  # else "allreduce"
ADDRS = ("10.77.0.1", "10.77.0.2")


def model():
    from myelin.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, d_model=64))


def strategy(peer: str, steps: int, tau: int = TAU) -> Any:
    import myelin

    if peer in ("allreduce", "allreduce-sgd"):
        return myelin.AllReduce()
    if peer == "daso":
        epochs = max(3, steps // 20)
        return myelin.DASO(
            node_size=2,
            epoch_steps=steps // epochs,
            total_epochs=epochs,
            warmup_epochs=1,
            cooldown_epochs=1,
        )
    if peer.startswith("easgd-sync"):
        downcast = "fp16" if peer == "easgd-sync-fp16" else "fp32"
        return myelin.EASGD(tau=tau, alpha=0.9 / 4, mode="sync", downcast=downcast)
    mode = "hogwild" if peer == "easgd-hogwild" else "async"
    momentum = MOMENTUM if peer == "measgd" else 0.0
    return myelin.EASGD(tau=tau, alpha=0.9 / 4, mode=mode, momentum=momentum)


def optimizer(peer: str) -> Any:
    """AdamW, but for MEASGD, whose momentum is on the local SGD update (You et al.): plain
    SGD, the momentum being EASGD's own; and its anchor, AllReduce with SGD's momentum."""
    if peer == "measgd":
        return functools.partial(torch.optim.SGD, lr=SGD_LR)
    if peer == "allreduce-sgd":
        return functools.partial(torch.optim.SGD, lr=SGD_LR, momentum=MOMENTUM)
    return functools.partial(torch.optim.AdamW, lr=ADAMW_LR)


class Clock:
    """Seconds spent inside a strategy's hooks (its communication and waits)."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.seconds = 0.0
        for name in names:
            fn = getattr(obj, name)
            setattr(obj, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def worker(args: argparse.Namespace) -> None:
    """One rank of one peer: train `steps` steps, validate, write rank{r}.json."""
    import torch.distributed as dist

    import myelin
    from myelin.data import Batches, load_stdlib_text
    from myelin.models import lm_loss

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    data = load_stdlib_text(max_bytes=2 << 20)
    replica = rank
    train = Batches(data.train, 64, 8, seed=0, stream=("train", replica))
    val = [Batches(data.val, 64, 8, seed=0, stream=("val",)).get(i) for i in range(8)]
    host = os.environ.get("MYELIN_HOST", "127.0.0.1")
    steps, curve, step_s = args.steps, [], []
    if args.peer == "ddp":
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(model())
        opt = optimizer(args.peer)(net.parameters())

        def train_step(x, y):
            opt.zero_grad()
            loss = lm_loss(net(x), y)
            loss.backward()
            opt.step()

        def evaluate():
            with torch.no_grad():
                t = torch.tensor([sum(float(lm_loss(net(x), y)) for x, y in val) / len(val)])
            dist.all_reduce(t)
            return float(t) / dist.get_world_size()

        comm = traffic = None
        numel = sum(p.numel() for p in net.parameters())
        stats = lambda: {"global_bytes": numel * 4 * len(step_s)}  # noqa: E731
    else:
        torch.manual_seed(0)
        t = myelin.Trainer(
            model(),
            optimizer(args.peer),
            lm_loss,
            data_parallel=4,
            sync=strategy(args.peer, steps, args.tau),
            timeout=300,
            transport=myelin.TransportConfig(kind="tcp", host=host)
            if host != "127.0.0.1"
            else None,
        )
        comm = Clock(t.loop.replicas, ("backwards_done", "after_optimizer_step", "step_end"))
        train_step = t.step
        evaluate = lambda: t.evaluate(val)  # noqa: E731
        stats = t.loop.replicas.stats
        traffic = t.loop.replicas.traffic
    start, cpu = time.monotonic(), 0.0
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(*train.get(step))
        step_s.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0  # every thread of the rank, its own and torch's
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            # training time until every rank has done these steps: where replicas do not
            # wait for each other every step (DASO, EASGD), the first to get here would
            # otherwise wait for the last inside evaluate(), outside the training clock
            dist.barrier()
            pause = time.monotonic()
            loss = evaluate()
            curve.append([pause - start, step + 1, loss])
            used = torch.tensor([pause - start])  # every rank stops at the same step
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
            start += time.monotonic() - pause  # validation time is not training time
            if float(used) >= args.seconds:
                break
    record = {
        "peer": args.peer,
        "curve": curve,
        "step_s": step_s,
        "comm_s": comm.seconds if comm is not None else None,
        "stats": stats(),
        "traffic": traffic() if traffic is not None else None,  # waits and bytes by kind
        "load": os.getloadavg()[0],
        "cpu_s": cpu,
        "threads": thread_cpu(),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
    if args.peer != "ddp":
        t.close()
    os._exit(0)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads by name, since it started (Linux;
    empty elsewhere): where a rank's CPU goes beside the training thread."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    named = {t.native_id: t.name for t in threading.enumerate()}  # Python's names, not comm's
    for task in Path("/proc/self/task").glob("*"):
        try:
            name = named.get(int(task.name)) or (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_peer(peer: str, args: argparse.Namespace, out: Path, spaces: tuple | None) -> dict:
    """Start the 4 ranks of `peer` (in the namespaces, if any); their records."""
    out.mkdir(parents=True, exist_ok=True)
    base = [
        sys.executable,
        __file__,
        "--role",
        "worker",
        "--peer",
        peer,
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--seconds",
        str(args.seconds),
        "--tau",
        str(args.tau),
    ]
    port, procs = str(_free_port()), []
    for rank in range(4):
        node = rank // 2
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % 2),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        cmd = base
        if spaces is not None:
            env.update(
                MASTER_ADDR=ADDRS[0], MYELIN_HOST=ADDRS[node], GLOO_SOCKET_IFNAME=spaces[1][node]
            )
            cmd = ["ip", "netns", "exec", spaces[0][node], *base]
        else:
            env.update(MASTER_ADDR="127.0.0.1")
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    texts = [p.communicate(timeout=1800)[0] for p in procs]
    for p, text in zip(procs, texts, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"{peer} failed:\n{text[-3000:]}")
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


def make_namespaces(rate: str) -> tuple:
    """Two namespaces joined by a veth pair whose both ends are limited by tc tbf."""
    tag = uuid.uuid4().hex[:6]
    spaces, links = (f"myelin-r0-{tag}", f"myelin-r1-{tag}"), (f"mra{tag}", f"mrb{tag}")

    def sh(*cmd):
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)

    for ns in spaces:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
    for ns, link, addr in zip(spaces, links, ADDRS, strict=True):
        sh("ip", "link", "set", link, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
        sh("ip", "-n", ns, "link", "set", link, "up")
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            link,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "64kb",
            "latency",
            "50ms",
        )
    return spaces, links


def link_bytes(spaces: tuple) -> int:
    """Bytes sent over the veth so far, both directions."""
    total = 0
    for ns, link in zip(*spaces, strict=True):
        text = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{link}/statistics/tx_bytes"],
            capture_output=True,
            text=True,
        ).stdout
        total += int(text.strip() or 0)
    return total


def targets(records: dict[str, list[dict]], target: float | None) -> dict[str, float]:
    """Each anchor's target: `target`, else 1.02 x the validation loss it ends at (best run)."""
    out = {}
    for anchor in ("allreduce", "allreduce-sgd"):
        if anchor in records or target is not None:
            out[anchor] = target or 1.02 * min(r[0]["curve"][-1][2] for r in records[anchor])
    return out


def summarise(records: dict[str, list[dict]], target: float | None) -> tuple[list, dict]:
    """Per peer: time to its anchor's target, loss at the shortest wall time, bytes, comm
    share, step. MEASGD's anchor is AllReduce with the same local optimizer (SGD's
    momentum); every other peer's is AllReduce with AdamW."""
    goals = targets(records, target)
    horizon = min(r[0]["curve"][-1][0] for runs in records.values() for r in runs)
    rows = []
    for peer, runs in records.items():
        anchor = ANCHOR.get(peer, "allreduce")
        goal = goals.get(anchor, target)
        if goal is None:
            raise SystemExit(f"{peer}: run {anchor} too, or pass --target")
        reach, at_h, share, step, sent, cpu = [], [], [], [], [], []
        for run in runs:
            curve = run[0]["curve"]
            hit = [t for t, _, v in curve if v <= goal]
            reach.append(hit[0] if hit else float("inf"))
            at_h.append(min((v for t, _, v in curve if t <= horizon), default=curve[0][2]))
            steps = [sum(run[r]["step_s"]) for r in run]
            if run[0]["comm_s"] is not None:
                share.append(sum(run[r]["comm_s"] for r in run) / sum(steps))
            step.append(sum(steps) / sum(len(run[r]["step_s"]) for r in run))
            if all("cpu_s" in run[r] for r in run):
                cpu.append(
                    sum(run[r]["cpu_s"] for r in run) / sum(len(run[r]["step_s"]) for r in run)
                )
            sent.append(
                run[0].get("link_bytes") or max(run[r]["stats"].get("global_bytes", 0) for r in run)
            )
        rows.append(
            {
                "peer": peer,
                "anchor": anchor,
                "target": goal,
                "to_target_s": min(reach),
                "loss_at_horizon": min(at_h),
                "final_val": min(run[0]["curve"][-1][2] for run in runs),
                "comm_share": min(share) if share else None,
                "step_ms": 1000 * min(step),
                "cpu_ms": 1000 * min(cpu) if cpu else None,  # a rank's CPU a step
                "bytes": min(sent),
            }
        )
    return rows, goals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default="driver")
    parser.add_argument("--peer", default="allreduce")
    parser.add_argument("--out", default="")
    parser.add_argument("--steps", type=int, default=2000, help="at most this many steps")
    parser.add_argument("--seconds", type=float, default=30.0, help="training time per peer")
    parser.add_argument("--tau", type=int, default=TAU, help="every EASGD mode's period")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--netns", default="", help="rate of the slow link, e.g. 100mbit (root)")
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--save", default="", help="results file (default bench/results/...)")
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    if args.quick:
        args.seconds, args.rounds = 10.0, 1
    peers = args.peers.split(",")
    spaces = make_namespaces(args.netns) if args.netns else None
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"myelin-bench-replicas-{uuid.uuid4().hex[:6]}"
    records: dict[str, list[dict]] = {p: [] for p in peers}
    try:
        for rnd in range(args.rounds):
            for peer in peers if rnd % 2 == 0 else peers[::-1]:
                before = link_bytes(spaces) if spaces else 0
                run = run_peer(peer, args, tmp / f"{peer}-{rnd}", spaces)
                if spaces:
                    run[0]["link_bytes"] = link_bytes(spaces) - before
                records[peer].append(run)
                print(
                    f"round {rnd} {peer}: final val {run[0]['curve'][-1][2]:.3f} "
                    f"in {run[0]['curve'][-1][0]:.1f}s",
                    flush=True,
                )
    finally:
        if spaces:
            for ns in spaces[0]:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    rows, goals = summarise(records, args.target)
    print_table(
        [
            "peer",
            "to target s",
            "loss @ horizon",
            "final val",
            "comm share",
            "step ms",
            "cpu ms",
            "bytes",
        ],
        [
            [
                r["peer"],
                f"{r['to_target_s']:.1f}",
                f"{r['loss_at_horizon']:.3f}",
                f"{r['final_val']:.3f}",
                "n/a" if r["comm_share"] is None else f"{100 * r['comm_share']:.0f}%",
                f"{r['step_ms']:.0f}",
                "n/a" if r["cpu_ms"] is None else f"{r['cpu_ms']:.1f}",
                f"{r['bytes'] / 2**20:.1f} MiB",
            ]
            for r in rows
        ],
        title=f"4 ranks as 2 nodes of 2, {'link ' + args.netns if spaces else 'one host'}; "
        + "; ".join(f"target ({a}) {v:.3f}" for a, v in goals.items()),
    )
    name = "replicas_netns.json" if spaces else "replicas.json"
    RESULTS.mkdir(exist_ok=True)
    path = Path(args.save) if args.save else RESULTS / name
    path.write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "args": vars(args),
                "targets": goals,
                "rows": rows,
                "runs": {
                    p: [
                        {
                            r: {k: v for k, v in rec.items() if k != "step_s"}
                            for r, rec in run.items()
                        }
                        for run in runs
                    ]
                    for p, runs in records.items()
                },
            },
            indent=1,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
