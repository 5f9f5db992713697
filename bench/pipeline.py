"""Two-stage pipeline training on one host: myelin vs torch.distributed.pipelining vs one process.

    python3 bench/pipeline.py            # ~5 minutes, writes bench/results/pipeline.json
    python3 bench/pipeline.py --quick    # ~1 minute (both longer on a busy machine)

Every peer trains the same GPT (myelin.models.GPT, vocab 256, same seed, stages split as
`myelin.partition.split(model, 2)` splits them) on the same batches with AdamW:

- myelin: `myelin.Trainer(stages=2)`, message-driven; as extra rows its fixed "1f1b"
  and "gpipe" policies (myelin-1f1b, myelin-gpipe) and "zero-bubble" (myelin-zb: split
  backwards, runtime/split.py);
- torch-1f1b / torch-gpipe: `PipelineStage` + `Schedule1F1B` / `ScheduleGPipe` over gloo;
- single-1t / single-2t: one process, gradient accumulation over the same microbatches,
  with 1 or 2 torch threads;
- 2x single-1t: two independent single-1t processes at once, their per-step tokens/s
  summed (meaningful when a step is long against the two processes' start skew).

Pipeline ranks run one torch thread each (OMP_NUM_THREADS=1). The ideal two-stage bound is
measured in the same run: single-1t's tokens/s x 2 cores x m / (m + p - 1). It assumes two
cores as fast together as one alone; "2x single-1t" x m / (m + p - 1) is the bound with the
cores as they really share (caches, memory, other tenants of the machine).

Two configs: "fixed" (every sequence `--seq` tokens) and "varlen" (each microbatch's length
drawn from 32 to `--seq`). myelin sends each microbatch at its real length; torch's schedules
need one static shape, so they get every microbatch padded to `--seq` (the loss ignores the
padding). Tokens/s counts real tokens only.

Each peer is its own set of processes (spawned with subprocess, rendezvous on a free
loopback port), started once and warmed up, then told over stdin to run `--steps` steps
per round; peers take turns, in reversed order every other round, so machine noise hits
all alike. The tables show the median of the per-step tokens/s, its min and max, the
ratio to myelin, and the median 1-minute load average during the peer's turns (anything
above the core count means other work shared the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from _harness import (
    Workers,
    print_table,
    reply,
    summary,
    timed_steps,
    write_json,
)

STAGES = 2
MIN_VARLEN = 32
CONFIGS = ("fixed", "varlen")


@dataclass(frozen=True, slots=True)
class Peer:
    """One contender: how many processes, threads each, what it runs, on which configs."""

    name: str
    kind: str  # "myelin", "torch", "single", or "pair" (independent single processes)
    ranks: int
    threads: int
    schedule: str = ""  # myelin's policy, or torch's schedule ("1f1b" / "gpipe")
    configs: tuple[str, ...] = CONFIGS
    extra: bool = False  # measured unless --quick or --no-extras


PEERS = {
    p.name: p
    for p in (
        Peer("myelin", "myelin", STAGES, 1, "message-driven"),
        Peer("torch-1f1b", "torch", STAGES, 1, "1f1b"),
        Peer("torch-gpipe", "torch", STAGES, 1, "gpipe"),
        Peer("single-1t", "single", 1, 1),
        Peer("single-2t", "single", 1, 2, configs=("fixed",)),
        Peer("2x single-1t", "pair", 2, 1, configs=("fixed",)),
        Peer("myelin-1f1b", "myelin", STAGES, 1, "1f1b", configs=("fixed",), extra=True),
        Peer("myelin-gpipe", "myelin", STAGES, 1, "gpipe", configs=("fixed",), extra=True),
        Peer("myelin-zb", "myelin", STAGES, 1, "zero-bubble", configs=("fixed",), extra=True),
    )
}


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run measures: model and batch shape, and how long to measure."""

    layers: int
    d_model: int
    seq: int
    batch: int
    microbatches: int
    steps: int  # measured steps per peer, config and round
    warmup: int  # steps per peer and config run once before the first round, not measured
    rounds: int
    extras: bool  # also measure myelin's "1f1b", "gpipe" and "zero-bubble" policies
    timeout_s: float  # longest any one command to a worker may take

    def peers(self) -> list[Peer]:
        return [p for p in PEERS.values() if self.extras or not p.extra]


# -- the workload every peer shares ----------------------------------------------------


def build_model(plan: Plan) -> Any:
    """The GPT every peer trains, with the same initial weights in every process."""
    import torch

    from myelin.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=256, block_size=plan.seq, n_layer=plan.layers, n_head=8, d_model=plan.d_model
    )
    return GPT(cfg)


def make_batches(plan: Plan, config: str) -> list[list[tuple[Any, Any]]]:
    """Every step's microbatches, (inputs, targets) of shape (batch/m, length), warm-up first.

    The same seed everywhere, so every peer trains on the same tokens in the same order.
    """
    import torch

    gen = torch.Generator().manual_seed(1234 + CONFIGS.index(config))
    rows = plan.batch // plan.microbatches
    low = min(MIN_VARLEN, plan.seq)
    steps = []
    for _ in range(plan.warmup + plan.rounds * plan.steps):
        mbs = []
        for _ in range(plan.microbatches):
            length = plan.seq
            if config == "varlen":
                length = int(torch.randint(low, plan.seq + 1, (1,), generator=gen))
            tokens = torch.randint(0, 256, (rows, length + 1), generator=gen)
            mbs.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        steps.append(mbs)
    return steps


def padded_batch(mbs: list[tuple[Any, Any]], seq: int) -> tuple[Any, Any]:
    """The whole batch padded to `seq`: inputs with token 0, targets with -100 (ignored)."""
    import torch
    import torch.nn.functional as F

    xs = [F.pad(x, (0, seq - x.shape[1]), value=0) for x, _ in mbs]
    ys = [F.pad(y, (0, seq - y.shape[1]), value=-100) for _, y in mbs]
    return torch.cat(xs), torch.cat(ys)


def real_tokens(mbs: list[tuple[Any, Any]]) -> int:
    return sum(x.numel() for x, _ in mbs)


# -- workers: each peer's training step, in its own processes --------------------------------

Step = Callable[[list[tuple[Any, Any]]], None]


def single_step(plan: Plan) -> tuple[Step, Callable[[], None]]:
    """One process: forward and backward of every microbatch, then one optimizer step."""
    import torch

    from myelin.models import lm_loss

    model = build_model(plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(mbs: list[tuple[Any, Any]]) -> None:
        for x, y in mbs:
            (lm_loss(model(x), y) / len(mbs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def myelin_step(plan: Plan, schedule: str) -> tuple[Step, Callable[[], None]]:
    """myelin.Trainer with 2 stages; every microbatch is passed at its own length."""
    import torch

    import myelin
    from myelin.models import lm_loss

    trainer = myelin.Trainer(
        build_model(plan),
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        loss_fn=lm_loss,
        stages=STAGES,
        microbatches=plan.microbatches,
        schedule=schedule,
        timeout=plan.timeout_s,
    )

    def step(mbs: list[tuple[Any, Any]]) -> None:
        trainer.step([x for x, _ in mbs], [y for _, y in mbs])

    return step, trainer.close


def torch_step(plan: Plan, schedule: str) -> tuple[Step, Callable[[], None]]:
    """torch.distributed.pipelining over gloo; every microbatch padded to one static shape."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from myelin.models import lm_loss
    from myelin.partition import split

    dist.init_process_group("gloo", timeout=timedelta(seconds=plan.timeout_s))
    rank = dist.get_rank()
    module = nn.Sequential(*split(build_model(plan), STAGES)[rank])
    stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))
    kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = kind(stage, plan.microbatches, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def step(mbs: list[tuple[Any, Any]]) -> None:
        x, y = padded_batch(mbs, plan.seq)
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, dist.destroy_process_group


def serve(peer: Peer, plan: Plan, config: str) -> None:
    """A worker process: build the peer, warm up, then run the steps the parent asks for.

    Commands come one JSON line at a time on stdin: {"config", "first", "count"} runs
    `count` steps from step `first`; rank 0 answers with its step times and real tokens.
    """
    import torch

    torch.set_num_threads(peer.threads)
    if peer.kind in ("single", "pair"):
        step, close = single_step(plan)
    elif peer.kind == "myelin":
        step, close = myelin_step(plan, peer.schedule)
    else:
        step, close = torch_step(plan, peer.schedule)
    # One config per process: shapes seen earlier in a process (the varied lengths) change
    # the speed of what follows (allocator and kernel caches), so configs never share one.
    batches = {config: make_batches(plan, config)}
    timed_steps(step, batches[config][: plan.warmup])
    answers = peer.kind == "pair" or int(os.environ.get("RANK", "0")) == 0
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        todo = batches[cmd["config"]][cmd["first"] : cmd["first"] + cmd["count"]]
        seconds = timed_steps(step, todo)
        tokens = [real_tokens(mbs) for mbs in todo]
        reply({"seconds": seconds, "tokens": tokens} if answers else {})
    close()


# -- the parent: one Job per peer, taking turns ------------------------------------------------


class Job(Workers):
    """One peer's processes for one config."""

    def __init__(self, peer: Peer, plan: Plan, tmp: str, config: str) -> None:
        self.peer = peer
        argv = [sys.executable, __file__, "--worker", peer.name, "--plan", json.dumps(asdict(plan))]
        argv += ["--worker-config", config]
        name = f"{peer.name}-{config}"
        distributed = peer.kind != "pair"
        super().__init__(name, argv, peer.ranks, tmp, peer.threads, plan.timeout_s, distributed)

    def run(self, config: str, first: int, count: int) -> dict[str, list]:
        """Run `count` steps of `config` from step `first`; the step times and real tokens."""
        replies = self.ask({"config": config, "first": first, "count": count})
        if self.peer.kind != "pair":
            return replies[0]
        # Independent processes: per step, their rates add up; report the seconds in
        # which the pair's combined rate trains the tokens of both.
        tokens = [sum(r["tokens"][k] for r in replies) for k in range(count)]
        rates = [sum(r["tokens"][k] / r["seconds"][k] for r in replies) for k in range(count)]
        return {"seconds": [t / v for t, v in zip(tokens, rates, strict=True)], "tokens": tokens}


def measure(plan: Plan, tmp: str) -> dict[str, dict[str, dict[str, list]]]:
    """Start every peer, then each round let each run its steps in turn; raw samples."""
    peers = plan.peers()
    jobs = {}
    try:
        for peer in peers:  # started together: start-up and warm-up are not measured
            for config in peer.configs:
                jobs[peer.name, config] = Job(peer, plan, tmp, config)
        for job in jobs.values():
            job.wait()
        print(f"{len(jobs)} peers started and warmed up", flush=True)
        turns = [(c, p.name) for c in CONFIGS for p in peers if c in p.configs]
        samples: dict[str, dict[str, dict[str, list]]] = {c: {} for c in CONFIGS}
        for r in range(plan.rounds):
            first = plan.warmup + r * plan.steps
            for config, name in turns if r % 2 == 0 else reversed(turns):
                load = os.getloadavg()[0]
                data = jobs[name, config].run(config, first, plan.steps)
                got = samples[config].setdefault(name, {"seconds": [], "tokens": [], "load": []})
                got["seconds"] += data["seconds"]
                got["tokens"] += data["tokens"]
                got["load"].append(load)
                rate = sum(data["tokens"]) / sum(data["seconds"])
                print(
                    f"round {r + 1}/{plan.rounds}  {config:6}  {name:12}  {rate:7.0f} tok/s  "
                    f"(load average {load:.1f})",
                    flush=True,
                )
        return samples
    finally:
        for job in jobs.values():
            job.close()


# -- the report --------------------------------------------------------------------------


def report(plan: Plan, samples: dict[str, dict[str, dict[str, list]]]) -> dict[str, Any]:
    """Print a table per config and the targets; return what goes into the JSON."""
    out: dict[str, Any] = {}
    for config, peers in samples.items():
        loads = {name: statistics.median(d["load"]) for name, d in peers.items()}
        rates = {
            name: summary([t / s for t, s in zip(d["tokens"], d["seconds"], strict=True)])
            for name, d in peers.items()
        }
        fill = plan.microbatches / (plan.microbatches + STAGES - 1)
        bounds = {"ideal 2-stage bound": rates["single-1t"]["median"] * STAGES * fill}
        if "2x single-1t" in rates:
            bounds["concurrent 2-stage bound"] = rates["2x single-1t"]["median"] * fill
        bound, ref = bounds["ideal 2-stage bound"], rates["myelin"]["median"]
        rows = [
            [name, f"{s['median']:.0f}", f"{s['min']:.0f}", f"{s['max']:.0f}"]
            + [f"{s['median'] / ref:.2f}", f"{100 * s['median'] / bound:.0f}%"]
            + [f"{loads[name]:.1f}"]
            for name, s in rates.items()
        ]
        for name, b in bounds.items():
            rows.append([name, f"{b:.0f}", "", "", f"{b / ref:.2f}", f"{100 * b / bound:.0f}%", ""])
        steps = len(peers["myelin"]["seconds"])
        title = f"{config}: real tokens/s, median of {steps} steps per peer"
        heads = ["peer", "median", "min", "max", "vs myelin", "of bound", "load"]
        print_table(heads, rows, title)
        out[config] = {
            "bound_tokens_per_s": bound,
            "bounds_tokens_per_s": bounds,
            "tokens_per_s": rates,
            "raw": peers,
        }
    out["targets"] = targets(out)
    print()
    for name, ok in out["targets"].items():
        print(f"{'PASS' if ok else 'MISS'}  {name}")
    return out


def targets(results: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets, each judged on medians from this same run."""
    fixed = {name: s["median"] for name, s in results["fixed"]["tokens_per_s"].items()}
    var = {name: s["median"] for name, s in results["varlen"]["tokens_per_s"].items()}
    bound = results["fixed"]["bound_tokens_per_s"]
    myelin, torch_1f1b = fixed["myelin"], fixed["torch-1f1b"]
    return {
        "fixed: myelin >= 1.05x torch-1f1b": myelin >= 1.05 * torch_1f1b,
        "fixed, torch-1f1b within 5% of the bound: myelin >= 95% of it and >= torch-1f1b": (
            torch_1f1b >= 0.95 * bound and myelin >= max(0.95 * bound, torch_1f1b)
        ),
        "varlen: myelin >= 1.3x torch-1f1b": var["myelin"] >= 1.3 * var["torch-1f1b"],
    }


# -- command line ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="measured steps per peer, config and round")
    parser.add_argument("--rounds", type=int, help="rounds; peers alternate order each round")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per peer, config")
    parser.add_argument("--no-extras", action="store_true", help="skip myelin's other policies")
    parser.add_argument("--quick", action="store_true", help="a ~1 minute run")
    parser.add_argument("--out", help="JSON path (default bench/results/pipeline.json)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    parser.add_argument("--worker", choices=list(PEERS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", default="fixed", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """The plan from the flags; --quick shortens the defaults and skips the extras."""
    if args.batch % args.microbatches:
        raise SystemExit(
            f"--batch {args.batch} does not split into {args.microbatches} microbatches"
        )
    if args.microbatches < STAGES:
        raise SystemExit(f"--microbatches must be at least {STAGES} (torch's 1F1B needs it)")
    return Plan(
        layers=args.layers,
        d_model=args.d_model,
        seq=args.seq,
        batch=args.batch,
        microbatches=args.microbatches,
        steps=args.steps or 2,
        warmup=args.warmup,
        rounds=args.rounds or (1 if args.quick else 5),
        extras=not (args.quick or args.no_extras),
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        serve(PEERS[args.worker], Plan(**json.loads(args.plan)), args.worker_config)
        return 0
    plan = make_plan(args)
    start, load_before = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="myelin-bench-") as tmp:
        samples = measure(plan, tmp)
    payload = report(plan, samples)
    load = {"before": load_before, "after": os.getloadavg()[0], "cores": os.cpu_count()}
    if max(load["before"], load["after"]) > (os.cpu_count() or 1):
        print(
            f"\nnote: load average {load['before']:.1f} before, {load['after']:.1f} after, on "
            f"{load['cores']} cores: other work shared the machine, so the numbers are noisy"
        )
    payload = {"plan": asdict(plan), "wall_s": time.monotonic() - start, "load": load, **payload}
    path = write_json("pipeline", payload, args.out)
    print(f"\nwrote {path} ({payload['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
