"""What the profiler costs: tokens/s of the pipeline bench's workload with recording off and on.

    python3 bench/profile_overhead.py            # ~4 minutes; bench/results/profile_overhead.json
    python3 bench/profile_overhead.py --quick    # ~1 minute

One two-stage myelin job trains the GPT of bench/pipeline.py (same model, batches and
message-driven trainer), started once and warmed up. Steps alternate between profiling
off and on (off, on, on, off, ...), so load that comes and goes on a shared machine hits
both alike; "on" is what `Trainer(profile=True)` does while training: every operation,
wait and send recorded as a span, and the counter sampler (NVML where there is a GPU,
host memory) running at its default 10 Hz. Same processes and memory throughout, so the
difference is the profiler's. The overhead is the median over adjacent (off, on) step
pairs of 1 - on/off tokens/s. A shared machine blurs that figure, so two that load blurs
less stand next to it: the CPU seconds both ranks spend per step (every thread), off
against on, and the cost from unit costs (spans per step times the cost of recording
one, plus the sampler's reads, against the median step).
After training, rank 0 also times what happens at close: collecting the records,
gathering them through the store, and building, printing and saving the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from _harness import free_port, print_table, summary, write_json
from pipeline import STAGES, Plan, build_model, make_batches, real_tokens, timed_steps

_TAG = "@bench "
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TARGET = 0.03  # the issue: at most 3% fewer tokens/s with the profiler on


# -- the workers ---------------------------------------------------------------------------


def serve(plan: Plan, out_dir: str) -> None:
    """One rank: warm up, then run the rounds the parent asks for, profiling on or off."""
    import torch

    import myelin
    from myelin.models import lm_loss
    from myelin.profile.nvml import Sampler
    from myelin.profile.report import ProfileReport, collect, gather

    torch.set_num_threads(1)
    trainer = myelin.Trainer(
        build_model(plan),
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        loss_fn=lm_loss,
        stages=STAGES,
        microbatches=plan.microbatches,
        timeout=plan.timeout_s,
    )
    batches = make_batches(plan, "fixed")

    def step(mbs: list[tuple[Any, Any]]) -> None:
        trainer.step([x for x, _ in mbs], [y for _, y in mbs])

    timed_steps(step, batches[: plan.warmup])
    rank0 = trainer.rank == 0
    counters: dict[str, list] = {}
    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("report"):
            _reply(_close_cost(trainer, counters, out_dir, collect, gather, ProfileReport))
            continue
        seconds, cpu = [], []
        for i, on in enumerate(cmd["profile"]):
            trainer.timeline.enabled = on
            sampler = Sampler(trainer.world.device, origin=trainer.timeline.origin)
            if on:
                sampler.start()
            cpu0 = time.process_time()  # every thread of this process: loop, ZeroMQ, sampler
            seconds.append(timed_steps(step, [batches[cmd["first"] + i]])[0])
            sampler.stop()
            cpu.append(time.process_time() - cpu0)
            for name, samples in sampler.counters.items():
                counters.setdefault(name, []).extend(samples)
        todo = batches[cmd["first"] : cmd["first"] + len(cmd["profile"])]
        tokens = [real_tokens(m) for m in todo] if rank0 else []
        _reply({"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens})
    trainer.close()


def _close_cost(trainer, counters, out_dir, collect, gather, report_cls) -> dict[str, Any]:
    """Seconds to collect, gather, summarise and save the profile, as close() does."""
    t0 = time.perf_counter()
    record = collect(trainer.timeline, counters, device=trainer.world.device)
    t1 = time.perf_counter()
    records, missing = gather(record, trainer.world, timeout_s=60)
    t2 = time.perf_counter()
    report = report_cls.from_ranks(records, warmup_steps=1, missing=missing)
    report.summary()
    t3 = time.perf_counter()
    if trainer.rank != 0:
        return {}
    report.save(out_dir)
    t4 = time.perf_counter()
    steps = {s.step for s in trainer.timeline.spans}
    return {
        **_micro_costs(trainer.world.device),
        "spans_per_step": len(trainer.timeline.spans) / max(len(steps), 1),
        "spans": len(trainer.timeline.spans),
        "record_json_bytes": len(json.dumps(record)),
        "collect_s": t1 - t0,
        "gather_s": t2 - t1,
        "summary_s": t3 - t2,
        "save_s": t4 - t3,
        "summary": report.summary()["mean"],
    }


def _micro_costs(device: Any, n: int = 20_000) -> dict[str, float]:
    """Seconds one recorded span costs the loop (two clock reads and an add), and one sample."""
    from myelin.profile.nvml import Sampler
    from myelin.profile.timeline import Timeline

    line = Timeline(0, 0)
    start = time.perf_counter()
    for i in range(n):
        line.add("forward", "0F1", line.now(), line.now(), i, microbatch=1)
    per_span = (time.perf_counter() - start) / n
    sampler = Sampler(device)
    start = time.perf_counter()
    for _ in range(100):
        sampler.sample()
    return {"span_s": per_span, "sample_s": (time.perf_counter() - start) / 100}


def _reply(obj: dict[str, Any]) -> None:
    print(_TAG + json.dumps(obj), flush=True)


# -- the parent ------------------------------------------------------------------------------


class Job:
    """The two ranks, told what to run over stdin, answering on stdout."""

    def __init__(self, plan: Plan, tmp: str) -> None:
        self.timeout = plan.timeout_s
        argv = [sys.executable, __file__, "--worker", "--plan", json.dumps(asdict(plan))]
        argv += ["--profile-dir", os.path.join(tmp, "profile")]
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env.update(OMP_NUM_THREADS="1", TMPDIR=tmp, PYTHONUNBUFFERED="1")
        port = free_port()
        self.procs, self.replies, self.logs = [], [], []
        for rank in range(STAGES):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(STAGES))
            rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = os.path.join(tmp, f"rank{rank}.log")
            with open(log, "w") as err:
                proc = subprocess.Popen(argv, env=rank_env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
            self.procs.append(proc)
            self.logs.append(log)
            self.replies.append(_reader(proc))

    def ask(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        """Send a command to both ranks; their answers (a dead rank raises with its log)."""
        for proc in self.procs:
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        return self.wait()

    def wait(self) -> list[dict[str, Any]]:
        out = []
        for rank, replies in enumerate(self.replies):
            replies["done"].wait(self.timeout)
            if not replies["items"]:
                tail = Path(self.logs[rank]).read_text()[-3000:]
                raise RuntimeError(f"rank {rank} gave no answer:\n{tail}")
            out.append(replies["items"].pop(0))
            if not replies["items"]:
                replies["done"].clear()
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.write(json.dumps({"quit": True}) + "\n")
                    proc.stdin.flush()
                except BrokenPipeError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _reader(proc: subprocess.Popen) -> dict[str, Any]:
    """Replies of one worker as they come, with an event set while any is waiting."""
    box: dict[str, Any] = {"items": [], "done": threading.Event()}

    def pump() -> None:
        for line in proc.stdout:
            if line.startswith(_TAG):
                box["items"].append(json.loads(line[len(_TAG) :]))
                box["done"].set()
        box["done"].set()

    threading.Thread(target=pump, daemon=True).start()
    return box


def measure(plan: Plan, tmp: str) -> dict[str, Any]:
    """Steps alternating off, on, on, off, ...; each step's tokens/s, and the cost at close."""
    job = Job(plan, tmp)
    try:
        job.wait()
        print("2 ranks started and warmed up", flush=True)
        steps: list[dict[str, Any]] = []
        for r in range(plan.rounds):
            first = plan.warmup + r * plan.steps
            pattern = [(first + i) % 4 in (1, 2) for i in range(plan.steps)]
            replies = job.ask({"profile": pattern, "first": first})
            data = replies[0]
            cpu = [sum(c) for c in zip(*(r["cpu_seconds"] for r in replies), strict=True)]
            for on, t, s, c in zip(pattern, data["tokens"], data["seconds"], cpu, strict=True):
                steps.append({"profile": on, "tokens": t, "seconds": s, "tokens_per_s": t / s,
                              "cpu_s": c})  # fmt: skip
            rates = " ".join(f"{'on' if p else 'off'} {x['tokens_per_s']:.0f}"
                             for p, x in zip(pattern, steps[-plan.steps :]))  # fmt: skip
            print(f"round {r + 1}/{plan.rounds}  tok/s per step: {rates}", flush=True)
        close = job.ask({"report": True})[0]
        return {"steps": steps, "close": close}
    finally:
        job.close()


def report(plan: Plan, got: dict[str, Any]) -> dict[str, Any]:
    """The table, the paired overhead and whether it is within the target."""
    steps = got["steps"]
    rates = {
        mode: summary([x["tokens_per_s"] for x in steps if x["profile"] == (mode == "on")])
        for mode in ("off", "on")
    }
    pairs = _pairs(steps, lambda on, off: 1 - on["tokens_per_s"] / off["tokens_per_s"])
    cpu_pairs = _pairs(steps, lambda on, off: on["cpu_s"] / off["cpu_s"] - 1)
    overhead, cpu_overhead = statistics.median(pairs), statistics.median(cpu_pairs)
    off = rates["off"]["median"]
    rows = [
        [mode, *(f"{s[k]:.0f}" for k in ("median", "min", "max")), f"{s['median'] / off:.3f}"]
        for mode, s in rates.items()
    ]
    title = f"2-stage GPT, real tokens/s per step, {len(steps) // 2} steps each"
    print_table(["profile", "median", "min", "max", "vs off"], rows, title)
    close = got["close"]
    step_s = statistics.median(x["seconds"] for x in steps)
    bound = (close["spans_per_step"] * close["span_s"] + 10 * step_s * close["sample_s"]) / step_s
    print(
        f"\nrecording, from its unit costs: {close['spans_per_step']:.0f} spans/step x "
        f"{1e6 * close['span_s']:.2f} us + 10 samples/s x {1e6 * close['sample_s']:.0f} us "
        f"= {100 * bound:.3f}% of a {step_s:.2f}s step"
    )
    print(
        f"CPU seconds per step, both ranks (median of {len(pairs)} adjacent off/on step pairs): "
        f"{100 * cpu_overhead:+.2f}%"
    )
    print(
        f"tokens/s (median of {len(pairs)} adjacent off/on step pairs): {100 * overhead:.2f}% "
        f"fewer  (target <= {100 * TARGET:.0f}%)  {'PASS' if overhead <= TARGET else 'MISS'}"
    )
    print(
        f"at close: {close['spans']} spans on rank 0 ({close['record_json_bytes'] / 2**20:.1f} MiB "
        f"JSON); collect {close['collect_s']:.3f}s, gather {close['gather_s']:.3f}s, "
        f"summary {close['summary_s']:.3f}s, save (trace, PNG) {close['save_s']:.2f}s"
    )
    return {
        "tokens_per_s": rates,
        "pair_overheads": pairs,
        "overhead": overhead,
        "cpu_overhead": cpu_overhead,
        "cpu_pair_overheads": cpu_pairs,
        "unit_cost_bound": bound,
        "target": TARGET,
        "pass": overhead <= TARGET,
        "close": close,
        "steps": steps,
    }


def _pairs(steps: list[dict[str, Any]], cost: Any) -> list[float]:
    """cost(on, off) for each pair of adjacent steps, one profiled and one not."""
    return [
        cost(b, a) if b["profile"] else cost(a, b)
        for a, b in zip(steps, steps[1:])
        if a["profile"] != b["profile"]
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="steps per round (a multiple of 4)")
    parser.add_argument("--rounds", type=int, help="rounds of steps")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--quick", action="store_true", help="a ~1 minute run")
    parser.add_argument("--out", help="JSON path (default bench/results/profile_overhead.json)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--profile-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        serve(Plan(**json.loads(args.plan)), args.profile_dir)
        return 0
    rounds = args.rounds or (2 if args.quick else 8)
    steps = args.steps or (4 if args.quick else 8)
    if rounds < 1 or steps < 4 or steps % 4:
        raise SystemExit(f"--rounds {rounds} must be >= 1, --steps {steps} a multiple of 4")
    plan = Plan(
        layers=args.layers,
        d_model=args.d_model,
        seq=args.seq,
        batch=args.batch,
        microbatches=args.microbatches,
        steps=steps,
        warmup=args.warmup,
        rounds=rounds,
        extras=False,
        timeout_s=args.timeout,
    )
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="myelin-bench-") as tmp:
        payload = report(plan, measure(plan, tmp))
    payload = {"plan": asdict(plan), "wall_s": time.monotonic() - start, **payload}
    path = write_json("profile_overhead", payload, args.out)
    print(f"\nwrote {path} ({payload['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
