"""Offload to host memory: tokens/s and peak device bytes, myelin's offloads vs save_on_cpu.

    python3 bench/offload.py            # ~2.5 minutes, writes bench/results/offload.json
    python3 bench/offload.py --quick    # well under a minute (both longer on a busy machine)

Every configuration trains the same GPT (myelin.models.GPT, vocab 256, same seed; sized so
saved activations dominate: 4 layers, d_model 128, 256-token sequences) on the same
batches with AdamW, under schedule="gpipe" so the saved activations of every microbatch
are in flight at once before the first backward (2 stages by default, `--stages 1` runs
the Trainer in one process):

- none: `myelin.Trainer(...)`, nothing offloaded;
- activations: `offload=OffloadConfig(activations=True)`, saved activations paged out
  to the host pool after each forward and prefetched back before their backward;
- optimizer: `offload=OffloadConfig(optimizer=True)` ("host" on a CPU: state, fp32
  master weights and the update in the host pool);
- both: the two together;
- torch / torch save_on_cpu: the peer, a plain single-process torch loop over the same
  microbatches with gradient accumulation, without and with
  `torch.autograd.graph.save_on_cpu()` around each forward. It runs `--peer-threads`
  torch threads (default 1, as each pipeline rank: two threads on a 2-core machine shared
  with other work wait at every parallel region for a descheduled thread).

Tokens/s is the median over the timed steps of one step's tokens over the seconds between
consecutive step ends (on rank 0). Peak device bytes is the max over ranks of
`trainer.memory_stats()["device_peak_bytes"]`: on a CPU the runtime's accounting of
parameters, gradients, optimizer state and saved activations resident on the "device".
For the torch loop the same sum is estimated: parameters + gradients + AdamW state + the
saved activations of one microbatch (its peak: gradient accumulation runs each backward
right after its forward), counted by a saved_tensors_hooks counter in one untimed step.
save_on_cpu has no figure on a CPU: `.cpu()` of a CPU tensor is the tensor itself, so
nothing moves (on a GPU it would take every saved activation off the device).
Prefetch hits/misses and offload wait are per timed step, summed over ranks (wait: the
max over ranks). After the timed rounds each myelin job runs 3 more steps with its
timeline recording, whose median splits a step's time per rank into forward (page-out copies
included), backward, optimizer, prefetch copies and fetch waits, and idle time.

Each configuration is its own set of processes (spawned with subprocess, rendezvous on a
free loopback port), started together and warmed up, then told over stdin to run its
steps; configurations take turns, in reversed order every other round, so load that comes
and goes on a shared machine hits all alike; "paired" is the median over rounds of a
configuration's tokens/s over none's in the same round. Per turn the 1-minute load average
and the share of the CPUs other processes used (from /proc/stat, less the job's own CPU
seconds) are noted: a shared machine blurs tokens/s, so re-run when "others" is high.
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

SCHEDULE = "gpipe"
MAX_COST = 0.15  # the target: both offloads cost at most 15% of tokens/s against none
MIN_SHRINK = 4.0  # ... and the peak device bytes with both is at most 1/4 of none's
NOISY = 0.1  # other processes' share of the CPUs during the turns above which to warn
DIAGNOSE_STEPS = 3  # steps with the timeline on after the timed rounds (their median)

# name -> (kind, OffloadConfig fields); kind "myelin" is a Trainer, "torch" the plain loop.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("myelin", {}),
    "activations": ("myelin", {"activations": True}),
    "optimizer": ("myelin", {"optimizer": True}),
    "both": ("myelin", {"activations": True, "optimizer": True}),
    "torch": ("torch", {}),
    "torch save_on_cpu": ("torch", {"save_on_cpu": True}),
}


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run measures: model and batch shape, pipeline, offload knobs, how long."""

    layers: int
    d_model: int
    heads: int
    seq: int
    batch: int
    microbatches: int
    stages: int
    min_bytes: int
    prefetch: int
    peer_threads: int  # torch threads of the plain torch loop
    steps: int  # timed steps per configuration and round
    rounds: int
    warmup: int  # steps per configuration run once before the first round, not timed
    timeout_s: float  # longest any one command to a worker may take

    def ranks(self, name: str) -> int:
        return self.stages if CONFIGS[name][0] == "myelin" else 1


# -- the workload every configuration shares --------------------------------------------


def build_model(plan: Plan) -> Any:
    """The GPT every configuration trains, with the same initial weights in every process."""
    import torch

    from myelin.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=256,
        block_size=plan.seq,
        n_layer=plan.layers,
        n_head=plan.heads,
        d_model=plan.d_model,
    )
    return GPT(cfg)


def make_batches(plan: Plan) -> list[list[tuple[Any, Any]]]:
    """Every step's microbatches, (inputs, targets) of shape (batch/m, seq): warm-up
    steps, the timed rounds, then the diagnostic steps. Same seed everywhere."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    rows = plan.batch // plan.microbatches
    steps = []
    for _ in range(plan.warmup + plan.rounds * plan.steps + DIAGNOSE_STEPS):
        mbs = []
        for _ in range(plan.microbatches):
            tokens = torch.randint(0, 256, (rows, plan.seq + 1), generator=gen)
            mbs.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        steps.append(mbs)
    return steps


def tokens_of(mbs: list[tuple[Any, Any]]) -> int:
    return sum(x.numel() for x, _ in mbs)


# -- workers: one configuration's training step, in its own processes --------------------

Step = Callable[[list[tuple[Any, Any]]], None]


class MyelinWorker:
    """One rank of a myelin.Trainer with the configuration's offload."""

    def __init__(self, plan: Plan, offload: dict[str, Any]) -> None:
        import torch

        import myelin
        from myelin.models import lm_loss

        off = None
        if offload:
            off = myelin.OffloadConfig(**offload, min_bytes=plan.min_bytes, prefetch=plan.prefetch)
        self.trainer = myelin.Trainer(
            build_model(plan),
            optimizer=partial(torch.optim.AdamW, lr=1e-3),
            loss_fn=lm_loss,
            stages=plan.stages,
            microbatches=plan.microbatches,
            schedule=SCHEDULE,
            timeout=plan.timeout_s,
            offload=off,
            precision="fp32",
            device_memory_limit=None,
        )
        self.rank = self.trainer.rank

    def step(self, mbs: list[tuple[Any, Any]]) -> None:
        self.trainer.step([x for x, _ in mbs], [y for _, y in mbs])

    def stats(self) -> dict[str, Any]:
        return self.trainer.memory_stats()

    def diagnose(self, mbs: list[tuple[Any, Any]]) -> dict[str, float]:
        """Seconds of one step by what the loop did, from its timeline."""
        line = self.trainer.timeline
        before = len(line.spans)
        line.enabled = True
        start = time.perf_counter()
        self.step(mbs)
        wall = time.perf_counter() - start
        line.enabled = False
        out = {"step": wall}
        for span in line.spans[before:]:
            key = span.kind
            if span.kind == "offload":
                key = "prefetch" if "PREFETCH" in span.name else "fetch_wait"
            out[key] = out.get(key, 0.0) + span.end - span.start
        return out

    def close(self) -> None:
        self.trainer.close()


class TorchWorker:
    """The peer: one process, gradient accumulation, optionally save_on_cpu."""

    def __init__(self, plan: Plan, options: dict[str, Any]) -> None:
        import torch

        from myelin.models import lm_loss

        self.rank = 0
        self.model = build_model(plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.loss_fn = lm_loss
        self.save_on_cpu = bool(options.get("save_on_cpu"))
        self.saved_peak = 0  # bytes autograd saved for one microbatch, at most

    def _forward(self, x: Any) -> Any:
        import torch

        if not self.save_on_cpu:
            return self.model(x)
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            return self.model(x)

    def step(self, mbs: list[tuple[Any, Any]]) -> None:
        for x, y in mbs:
            logits = self._forward(x)
            (self.loss_fn(logits, y) / len(mbs)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def count_saved(self, mbs: list[tuple[Any, Any]]) -> None:
        """One untimed step whose forwards count the distinct storages autograd saves
        (parameters excluded, as myelin's accounting excludes them)."""
        import torch

        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        for x, y in mbs:
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params:
                    seen[ptr] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = self.model(x)
                loss = self.loss_fn(logits, y) / len(mbs)
            self.saved_peak = max(self.saved_peak, sum(seen.values()))
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def stats(self) -> dict[str, Any]:
        """The accounting myelin would do: parameters, gradients, AdamW state, activations
        of one microbatch (None under save_on_cpu, where on a CPU nothing moves)."""
        nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        state = sum(
            t.numel() * t.element_size()
            for s in self.opt.state.values()
            for t in s.values()
            if hasattr(t, "dim") and t.dim() > 0
        )
        peak = None if self.save_on_cpu else 2 * nbytes + state + self.saved_peak
        return {
            "device_peak_bytes": peak,
            "device_peak_measured_by": "estimate" if peak is not None else None,
            "saved_activations_peak_bytes": self.saved_peak,
            "parameter_bytes": nbytes,
            "optimizer_state_bytes": state,
        }

    def diagnose(self, mbs: list[tuple[Any, Any]]) -> dict[str, float]:
        start = time.perf_counter()
        self.step(mbs)
        return {"step": time.perf_counter() - start}

    def close(self) -> None:
        pass


def serve(name: str, plan: Plan) -> None:
    """A worker process: build the configuration, warm up, then run what the parent asks.

    Commands come one JSON line at a time on stdin: {"first", "count"} runs `count` steps
    from step `first`; {"diagnose"} runs the last batches with the timeline on. Every
    rank answers with its step times, CPU seconds and memory stats.
    """
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    kind, options = CONFIGS[name]
    worker = MyelinWorker(plan, options) if kind == "myelin" else TorchWorker(plan, options)
    batches = make_batches(plan)
    timed_steps(worker.step, batches[: max(plan.warmup - 1, 0)])
    if kind == "torch":
        worker.count_saved(batches[max(plan.warmup - 1, 0)])
    else:
        timed_steps(worker.step, batches[max(plan.warmup - 1, 0) : plan.warmup])
    reply({"ready": True, "stats": worker.stats()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("diagnose"):
            diag = [worker.diagnose(mbs) for mbs in batches[-DIAGNOSE_STEPS:]]
            keys = {k for d in diag for k in d}
            diag_median = {k: statistics.median(d.get(k, 0.0) for d in diag) for k in keys}
            reply({"diagnose": diag_median, "stats": worker.stats()})
            continue
        todo = batches[cmd["first"] : cmd["first"] + cmd["count"]]
        cpu0 = time.process_time()  # every thread of this process
        seconds = timed_steps(worker.step, todo)
        cpu = time.process_time() - cpu0
        tokens = [tokens_of(mbs) for mbs in todo]
        reply({"seconds": seconds, "tokens": tokens, "cpu_s": cpu, "stats": worker.stats()})
    worker.close()


# -- the parent: one Job per configuration, taking turns --------------------------------


class Job(Workers):
    """One configuration's processes."""

    def __init__(self, name: str, plan: Plan, tmp: str) -> None:
        argv = [sys.executable, __file__, "--worker", name, "--plan", json.dumps(asdict(plan))]
        threads = 1 if CONFIGS[name][0] == "myelin" else plan.peer_threads
        super().__init__(name, argv, plan.ranks(name), tmp, threads, plan.timeout_s)


def measure(plan: Plan, tmp: str) -> dict[str, dict[str, Any]]:
    """Start every configuration, let each run its steps in turn per round; raw samples."""
    jobs: dict[str, Job] = {}
    got: dict[str, dict[str, Any]] = {}
    try:
        for name in CONFIGS:  # started together: start-up and warm-up are not measured
            jobs[name] = Job(name, plan, tmp)
        for name, job in jobs.items():
            got[name] = {k: [] for k in ("seconds", "tokens", "cpu_s", "load", "others", "rounds")}
            got[name]["ready"] = [r["stats"] for r in job.wait()]
        print(f"{len(jobs)} configurations started and warmed up", flush=True)
        order = list(CONFIGS)
        for r in range(plan.rounds):
            first = plan.warmup + r * plan.steps
            for name in order if r % 2 == 0 else reversed(order):
                load, busy, own, start = (
                    os.getloadavg()[0],
                    _busy_s(),
                    time.process_time(),
                    time.perf_counter(),
                )
                replies = jobs[name].ask({"first": first, "count": plan.steps})
                wall, data, mine = time.perf_counter() - start, replies[0], got[name]
                cpu = sum(x["cpu_s"] for x in replies)
                mine["seconds"] += data["seconds"]
                mine["tokens"] += data["tokens"]
                mine["cpu_s"].append(cpu)
                mine["load"].append(load)
                if busy is not None:  # CPU seconds other processes took during the turn
                    others = _busy_s() - busy - cpu - (time.process_time() - own)
                    mine["others"].append(max(others, 0.0) / (wall * (os.cpu_count() or 1)))
                mine["stats"] = [x["stats"] for x in replies]
                rate = sum(data["tokens"]) / sum(data["seconds"])
                mine["rounds"].append(rate)
                print(
                    f"round {r + 1}/{plan.rounds}  {name:17}  {rate:7.0f} tok/s  "
                    f"(load average {load:.1f}, others {_pct(mine['others'][-1:])} of the CPUs)",
                    flush=True,
                )
        for name, job in jobs.items():
            replies = job.ask({"diagnose": True})
            got[name]["diagnose"] = [x["diagnose"] for x in replies]
        return got
    finally:
        for job in jobs.values():
            job.close()


def _busy_s() -> float | None:
    """CPU seconds all processes of the machine have used since boot (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    guest = sum(fields[8:10])  # counted in user already
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def _pct(shares: list[float]) -> str:
    return f"{100 * statistics.median(shares):.0f}%" if shares else "?"


# -- the report ---------------------------------------------------------------------------


def _per_step(got: dict[str, Any], key: str, plan: Plan) -> list[float]:
    """A counter's growth over the timed steps, per step, for each rank."""
    timed = plan.rounds * plan.steps
    return [
        (end.get(key, 0) - start.get(key, 0)) / timed
        for start, end in zip(got["ready"], got["stats"])
    ]


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}"


def summarize(name: str, data: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """One configuration's numbers from its raw samples and its ranks' memory stats."""
    stats = data["stats"]
    peaks = [s.get("device_peak_bytes") for s in stats]
    out = {
        "tokens_per_s": summary([t / s for t, s in zip(data["tokens"], data["seconds"])]),
        "step_s": summary(data["seconds"]),
        "cpu_s_per_step": sum(data["cpu_s"]) / len(data["seconds"]),
        "device_peak_bytes": None if None in peaks else max(peaks),
        "load": statistics.median(data["load"]),
        "others_cpu_share": statistics.median(data["others"]) if data["others"] else None,
    }
    for key in ("host_pool_peak_bytes", "activations_offloaded_bytes", "optimizer_host_bytes"):
        out[key] = sum(s.get(key, 0) for s in stats)
    myelin = CONFIGS[name][0] == "myelin"
    for key, total in (("prefetch_hits", sum), ("prefetch_misses", sum),
                       ("offload_wait_seconds", max)):  # fmt: skip
        out[f"{key}_per_step"] = total(_per_step(data, key, plan)) if myelin else None
    out["diagnose"] = data["diagnose"]
    out["stats_per_rank"] = stats
    out["raw"] = {k: data[k] for k in ("seconds", "tokens", "cpu_s", "load", "others", "rounds")}
    return out


def report(plan: Plan, got: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table, the diagnostic breakdown and the targets; what goes into the JSON."""
    results = {name: summarize(name, data, plan) for name, data in got.items()}
    base = results["none"]
    base_rate, base_peak = base["tokens_per_s"]["median"], base["device_peak_bytes"]
    rows = []
    for name, r in results.items():
        rates, peak = r["tokens_per_s"], r["device_peak_bytes"]
        r["vs_none"] = rates["median"] / base_rate
        r["vs_none_paired"] = statistics.median(
            a / b for a, b in zip(r["raw"]["rounds"], base["raw"]["rounds"])
        )
        r["peak_shrink"] = None if peak is None else base_peak / peak
        hits, misses = r["prefetch_hits_per_step"], r["prefetch_misses_per_step"]
        wait = r["offload_wait_seconds_per_step"]
        rows.append(
            [name, *(f"{rates[k]:.0f}" for k in ("median", "min", "max"))]
            + [f"{r['vs_none']:.3f}", f"{r['vs_none_paired']:.3f}"]
            + [_mib(peak), "n/a" if peak is None else f"{r['peak_shrink']:.2f}x"]
            + [_mib(r["host_pool_peak_bytes"])]
            + ["" if hits is None else f"{hits:.1f}/{misses:.1f}"]
            + ["" if wait is None else f"{1e3 * wait:.2f}"]
            + [f"{r['cpu_s_per_step']:.2f}", _pct(r["raw"]["others"]), f"{r['load']:.1f}"]
        )
    steps = len(base["step_s"]["samples"])
    title = (
        f"{plan.stages}-stage {SCHEDULE} GPT ({plan.layers} layers, d_model {plan.d_model}, "
        f"seq {plan.seq}, batch {plan.batch} in {plan.microbatches} microbatches): tokens/s, "
        f"median of {steps} steps; device peak max over ranks"
    )
    heads = ["config", "tok/s", "min", "max", "vs none", "paired", "peak MiB", "none/peak",
             "pool MiB", "hit/miss", "wait ms", "cpu s", "others", "load"]  # fmt: skip
    print_table(heads, rows, title)
    torch_rate = results["torch"]["tokens_per_s"]["median"]
    soc = results["torch save_on_cpu"]["tokens_per_s"]["median"] / torch_rate
    base_cpu = base["cpu_s_per_step"]
    cpu = {n: r["cpu_s_per_step"] / base_cpu for n, r in results.items() if n != "none"}
    print(
        "\npaired: median over rounds of the ratio of the turn's tokens/s to none's turn in the "
        "same round; pool MiB: host pool peak, summed over ranks; per step: hit/miss = prefetch "
        "hits/misses (all ranks), wait = offload wait (max over ranks), cpu s = CPU seconds "
        "(all ranks' threads; less blurred by other work than tokens/s); others = median share "
        "of the machine's CPUs other processes used during the turns (0% on a quiet machine)\n"
        "CPU seconds per step vs none: "
        + ", ".join(f"{n} {v:.3f}x" for n, v in cpu.items() if CONFIGS[n][0] == "myelin")
        + f"\ntorch save_on_cpu vs torch: {soc:.3f}x tokens/s (on a CPU it moves nothing); "
        f"torch (grad accumulation, 1 microbatch in flight) saves "
        f"{_mib(got['torch']['stats'][0]['saved_activations_peak_bytes'])} MiB of activations"
    )
    _print_breakdown(results)
    out = {"configs": results, "save_on_cpu_vs_torch": soc, "cpu_vs_none": cpu}
    out["targets"] = targets(results)
    print()
    for target in out["targets"].values():
        print(f"{'PASS' if target['pass'] else 'MISS'}  {target['text']}")
    return out


def _print_breakdown(results: dict[str, Any]) -> None:
    """Where one step's time went on each rank (the diagnostic step, timeline on)."""
    keys = ("forward", "backward", "optimizer", "prefetch", "fetch_wait", "wait", "send", "recv")
    rows = []
    for name, r in results.items():
        if CONFIGS[name][0] != "myelin":
            continue
        for rank, d in enumerate(r["diagnose"]):
            rows.append([f"{name} r{rank}", f"{d['step']:.3f}"]
                        + [f"{d.get(k, 0.0):.3f}" for k in keys])  # fmt: skip
    title = (
        f"{DIAGNOSE_STEPS} more steps with the timeline on: median seconds per step by what "
        f"each rank did (forward includes page-out copies)"
    )
    print_table(["config rank", "step", *keys], rows, title)


def targets(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The targets, judged on medians from this same run (the paired figure alongside)."""
    both = results["both"]
    cost, paired = 1 - both["vs_none"], 1 - both["vs_none_paired"]
    return {
        "tokens_per_s_cost_both": {
            "text": f"both offloads cost <= {100 * MAX_COST:.0f}% of tokens/s against none "
            f"(got {100 * cost:.1f}%; paired by round {100 * paired:.1f}%)",
            "got": cost,
            "paired": paired,
            "limit": MAX_COST,
            "pass": cost <= MAX_COST,
        },
        "device_peak_shrink_both": {
            "text": f"peak device bytes with both <= 1/{MIN_SHRINK:.0f} of none "
            f"(got 1/{both['peak_shrink']:.2f})",
            "got": both["peak_shrink"],
            "limit": MIN_SHRINK,
            "pass": both["peak_shrink"] >= MIN_SHRINK,
        },
    }


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, help="rounds; configurations alternate order")
    parser.add_argument("--warmup", type=int, help="untimed steps per configuration (2)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (1: in-process)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-bytes", type=int, default=64 << 10, help="OffloadConfig.min_bytes")
    parser.add_argument("--prefetch", type=int, default=1, help="OffloadConfig.prefetch")
    parser.add_argument("--peer-threads", type=int, default=1, help="the torch loop's threads")
    parser.add_argument("--quick", action="store_true", help="a tiny, fast smoke run")
    parser.add_argument("--out", help="JSON path (default bench/results/offload.json)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """The plan from the flags; --quick shrinks the model and the run."""
    if args.quick:
        args.d_model, args.seq, args.batch = min(args.d_model, 64), min(args.seq, 128), 8
        args.microbatches = min(args.microbatches, 4)
    if args.stages < 1 or args.layers + 2 < args.stages:
        raise SystemExit(f"--stages {args.stages} must be from 1 to layers + 2")
    if args.batch % args.microbatches:
        raise SystemExit(
            f"--batch {args.batch} does not split into {args.microbatches} microbatches"
        )
    return Plan(
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        seq=args.seq,
        batch=args.batch,
        microbatches=args.microbatches,
        stages=args.stages,
        min_bytes=args.min_bytes,
        prefetch=args.prefetch,
        peer_threads=args.peer_threads,
        steps=args.steps or (2 if args.quick else 3),
        rounds=args.rounds or (1 if args.quick else 8),
        warmup=max(args.warmup or (1 if args.quick else 2), 1),
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        serve(args.worker, Plan(**json.loads(args.plan)))
        return 0
    plan = make_plan(args)
    start, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="myelin-bench-") as tmp:
        got = measure(plan, tmp)
    payload = report(plan, got)
    load = {"before": list(load_before), "after": list(os.getloadavg()), "cores": os.cpu_count()}
    shares = [x for data in got.values() for x in data["others"]]
    load["others_cpu_share"] = statistics.median(shares) if shares else None
    # The load average also counts this bench's own start-up, so judge by the others' share.
    busy = max(load["before"][0], load["after"][0]) > (os.cpu_count() or 1)
    if statistics.median(shares) > NOISY if shares else busy:
        print(
            f"\nnote: load average {load['before'][0]:.1f} before, {load['after'][0]:.1f} "
            f"after, on {load['cores']} cores; other processes used {_pct(shares)} of the CPUs "
            f"during the turns: other work shared the machine, so the numbers are noisy"
        )
    payload = {"plan": asdict(plan), "wall_s": time.monotonic() - start, "load": load, **payload}
    path = write_json("offload", payload, args.out)
    print(f"\nwrote {path} ({payload['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
