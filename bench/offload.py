"""Offload to host memory: tokens/s and peak device bytes, myelin's offloads vs torch's.

    python3 bench/offload.py                        # both sections, ~8 minutes
    python3 bench/offload.py --section pipeline     # ~2.5 minutes, bench/results/offload.json
    python3 bench/offload.py --section one-process  # ~5 minutes, .../offload_one_process.json
    python3 bench/offload.py --quick                # a smoke run of both (longer when busy)

Every configuration trains the same GPT (myelin.models.GPT, vocab 256, same seed; sized so
saved activations dominate) on the same batches with AdamW. Two sections:

pipeline (2 stages by default): 4 layers, d_model 128, 256-token sequences, batch 16 in 8
microbatches under schedule="gpipe", so the saved activations of every microbatch are in
flight at once before the first backward:

- none: `myelin.Trainer(...)`, nothing offloaded;
- activations: `offload=OffloadConfig(activations=True)`, saved activations paged out
  to the host pool as the forward makes them and prefetched back before their backward;
- optimizer: `offload=OffloadConfig(optimizer=True)` ("host" on a CPU: state, fp32
  master weights and the update in the host pool);
- both: the two together;
- torch / torch save_on_cpu: the peer, a plain single-process torch loop over the same
  microbatches with gradient accumulation, without and with
  `torch.autograd.graph.save_on_cpu()` around each forward.

one-process (`stages=1`, the commonest user: one device, a model that does not fit): 12
layers, batch 16 in 2 microbatches, the default message-driven schedule, so each backward
follows its forward at once and only paging within the microbatch, layer by layer, can
lower the peak. none, activations and both as above, and torch's own answers in the plain
loop: torch, torch save_on_cpu, and torch checkpoint (`torch.utils.checkpoint` around each
block, non-reentrant: the blocks' activations are recomputed in backward). Then a depth
sweep: under `--sweep-limit` (device_memory_limit, 64MiB), the deepest GPT (doubling, then
bisecting the layer count) that trains two steps with none and with both, and its
parameter count.

The torch loops run `--peer-threads` torch threads (default 1, as each myelin rank: two
threads on a 2-core machine shared with other work wait at every parallel region for a
descheduled thread).

Tokens/s is the median over the timed steps of one step's tokens over the seconds between
consecutive step ends (on rank 0). Peak device bytes is the max over ranks of
`trainer.memory_stats()["device_peak_bytes"]`: on a CPU the runtime's accounting of
parameters, gradients, optimizer state and saved activations resident on the "device".
For the torch loops the same sum is estimated: parameters + gradients + AdamW state + the
saved activations of one microbatch (its peak: gradient accumulation runs each backward
right after its forward), counted by a saved_tensors_hooks counter in one untimed step;
under checkpointing, what is saved outside the blocks, each block's input (kept for the
recomputation) and one block's saved activations (recomputed in backward). save_on_cpu
has no figure on a CPU: `.cpu()` of a CPU tensor is the tensor itself, so nothing moves
(on a GPU it would take every saved activation off the device). Losses: every
configuration's step losses, which must equal none's. Prefetch hits/misses and offload
wait are per timed step, summed over ranks (wait: the max over ranks). After the timed
rounds each myelin job runs 3 more steps with its timeline recording, whose median splits
a step's time per rank into forward (page-out copies included), backward, optimizer,
prefetch copies and fetch waits, and idle time.

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

MAX_COST = 0.15  # the target: both offloads cost at most 15% of tokens/s against none
MIN_SHRINK = 4.0  # ... and the peak device bytes with both is at most 1/4 of none's
MIN_DEPTH_GAIN = 4.0  # one process: the deepest GPT that trains has 4x the parameters
NOISY = 0.1  # other processes' share of the CPUs during the turns above which to warn
DIAGNOSE_STEPS = 3  # steps with the timeline on after the timed rounds (their median)

# section -> name -> (kind, options); kind "myelin" is a Trainer (options: OffloadConfig
# fields), "torch" the plain loop.
SECTIONS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "pipeline": {
        "none": ("myelin", {}),
        "activations": ("myelin", {"activations": True}),
        "optimizer": ("myelin", {"optimizer": True}),
        "both": ("myelin", {"activations": True, "optimizer": True}),
        "torch": ("torch", {}),
        "torch save_on_cpu": ("torch", {"save_on_cpu": True}),
    },
    "one-process": {
        "none": ("myelin", {}),
        "activations": ("myelin", {"activations": True}),
        "both": ("myelin", {"activations": True, "optimizer": True}),
        "torch": ("torch", {}),
        "torch save_on_cpu": ("torch", {"save_on_cpu": True}),
        "torch checkpoint": ("torch", {"checkpoint": True}),
    },
}
# The shape of each section unless flags say otherwise.
DEFAULTS = {
    "pipeline": {"stages": 2, "layers": 4, "microbatches": 8, "schedule": "gpipe"},
    "one-process": {"stages": 1, "layers": 12, "microbatches": 2, "schedule": "message-driven"},
}


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run measures: model and batch shape, pipeline, offload knobs, how long."""

    section: str  # a key of SECTIONS
    schedule: str
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
    sweep_limit: str  # one process: the device_memory_limit of the depth sweep
    sweep_max: int  # ... and the most layers it tries

    @property
    def configs(self) -> dict[str, tuple[str, dict[str, Any]]]:
        return SECTIONS[self.section]

    def ranks(self, name: str) -> int:
        return self.stages if self.configs[name][0] == "myelin" else 1


# -- the workload every configuration shares --------------------------------------------


def build_model(plan: Plan, layers: int | None = None) -> Any:
    """The GPT every configuration trains, with the same initial weights in every process."""
    import torch

    from myelin.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=256,
        block_size=plan.seq,
        n_layer=layers or plan.layers,
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

    def __init__(self, plan: Plan, offload: dict[str, Any], layers: int | None = None,
                 limit: str | None = None) -> None:  # fmt: skip
        import torch

        import myelin
        from myelin.models import lm_loss

        off = None
        if offload:
            off = myelin.OffloadConfig(**offload, min_bytes=plan.min_bytes, prefetch=plan.prefetch)
        self.model = build_model(plan, layers)
        self.trainer = myelin.Trainer(
            self.model,
            optimizer=partial(torch.optim.AdamW, lr=1e-3),
            loss_fn=lm_loss,
            stages=plan.stages,
            microbatches=plan.microbatches,
            schedule=plan.schedule,
            timeout=plan.timeout_s,
            offload=off,
            precision="fp32",
            device_memory_limit=limit,
        )
        self.rank = self.trainer.rank
        self.losses: list[float] = []

    def step(self, mbs: list[tuple[Any, Any]]) -> None:
        self.losses.append(self.trainer.step([x for x, _ in mbs], [y for _, y in mbs]))

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
    """The peer: one process, gradient accumulation, optionally save_on_cpu or activation
    checkpointing of each block."""

    def __init__(self, plan: Plan, options: dict[str, Any]) -> None:
        import torch

        from myelin.models import lm_loss

        self.rank = 0
        self.model = build_model(plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.loss_fn = lm_loss
        self.save_on_cpu = bool(options.get("save_on_cpu"))
        self.checkpoint = bool(options.get("checkpoint"))
        self.saved_peak = 0  # bytes autograd saved for one microbatch, at most
        self.recomputed = 0  # checkpointing: block inputs kept, one block's saved bytes
        self.losses: list[float] = []

    def _forward(self, x: Any) -> Any:
        import torch
        from torch.utils.checkpoint import checkpoint

        if self.save_on_cpu:
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                return self.model(x)
        if not self.checkpoint:
            return self.model(x)
        h = self.model.embed(x)
        for block in self.model.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.model.head(h)

    def step(self, mbs: list[tuple[Any, Any]]) -> None:
        losses = []
        for x, y in mbs:
            loss = self.loss_fn(self._forward(x), y)
            losses.append(float(loss))
            (loss / len(mbs)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(sum(losses) / len(losses))  # as myelin: the mean of the losses

    def count_saved(self, mbs: list[tuple[Any, Any]]) -> None:
        """One untimed step whose forwards count the distinct storages autograd saves
        (parameters excluded, as myelin's accounting excludes them)."""
        import torch

        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}

        def counted(fn: Callable[[], Any]) -> tuple[Any, int]:
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params:
                    seen[ptr] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn()
            return out, sum(seen.values())

        for x, y in mbs:
            loss, saved = counted(lambda x=x, y=y: self.loss_fn(self._forward(x), y) / len(mbs))
            self.saved_peak = max(self.saved_peak, saved)
            if self.checkpoint:  # block inputs stay for the recomputation; one block's
                h = self.model.embed(x)  # saved activations come back at a time
                _, block = counted(lambda h=h: self.model.blocks[0](h))
                kept = len(self.model.blocks) * h.numel() * h.element_size()
                self.recomputed = max(self.recomputed, kept + block)
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
        saved = self.saved_peak + self.recomputed
        peak = None if self.save_on_cpu else 2 * nbytes + state + saved
        return {
            "device_peak_bytes": peak,
            "device_peak_measured_by": "estimate" if peak is not None else None,
            "saved_activations_peak_bytes": saved,
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
    rank answers with its step times, losses, CPU seconds and memory stats.
    """
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if name == "sweep":
        reply({"ready": True, "stats": {}})
        for line in sys.stdin:
            if json.loads(line).get("sweep"):
                reply({"sweep": depth_sweep(plan)})
        return
    kind, options = plan.configs[name]
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
        before = len(worker.losses)
        seconds = timed_steps(worker.step, todo)
        cpu = time.process_time() - cpu0
        tokens = [tokens_of(mbs) for mbs in todo]
        reply({"seconds": seconds, "tokens": tokens, "cpu_s": cpu, "stats": worker.stats(),
               "losses": worker.losses[before:]})  # fmt: skip
    worker.close()


# -- one process: the deepest model that trains under a device memory limit --------------


def depth_sweep(plan: Plan) -> dict[str, Any]:
    """For none and both: the most layers (doubling, then bisecting up to `sweep_max`)
    with which the GPT trains two steps under `sweep_limit`, and its parameter count."""
    offloads = {"none": {}, "both": {"activations": True, "optimizer": True}}
    return {name: _deepest(plan, name, offload) for name, offload in offloads.items()}


def _deepest(plan: Plan, name: str, offload: dict[str, Any]) -> dict[str, Any]:
    probes: dict[int, dict[str, Any]] = {}

    def fits(layers: int) -> bool:
        if layers not in probes:
            probes[layers] = _probe(plan, layers, offload)
            print(f"sweep {name:5} {layers:3d} layers: {probes[layers]}", file=sys.stderr)
        return probes[layers]["fits"]

    lo, hi = 0, 1
    while hi <= plan.sweep_max and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, plan.sweep_max + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    deepest = probes.get(lo, {})
    return {
        "layers": lo,
        "params": deepest.get("params", 0),
        "peak_bytes": deepest.get("peak_bytes"),
        "capped": lo == plan.sweep_max,
        "probes": {str(k): v for k, v in sorted(probes.items())},
    }


def _probe(plan: Plan, layers: int, offload: dict[str, Any]) -> dict[str, Any]:
    """Whether the GPT with `layers` layers trains two steps under the sweep's limit."""
    import myelin

    worker = MyelinWorker(plan, offload, layers=layers, limit=plan.sweep_limit)
    params = sum(p.numel() for p in worker.model.parameters())
    start = time.perf_counter()
    try:
        for mbs in make_batches(plan)[:2]:
            worker.step(mbs)
        peak = worker.stats()["device_peak_bytes"]
    except myelin.DeviceMemoryError as exc:
        return {"fits": False, "params": params, "error": str(exc).split(" (resident")[0]}
    finally:
        worker.close()
    return {"fits": True, "params": params, "peak_bytes": peak,
            "step_s": (time.perf_counter() - start) / 2}  # fmt: skip


# -- the parent: one Job per configuration, taking turns --------------------------------


class Job(Workers):
    """One configuration's processes."""

    def __init__(self, name: str, plan: Plan, tmp: str) -> None:
        argv = [sys.executable, __file__, "--worker", name, "--plan", json.dumps(asdict(plan))]
        sweep = name == "sweep"
        threads = 1 if sweep or plan.configs[name][0] == "myelin" else plan.peer_threads
        ranks = 1 if sweep else plan.ranks(name)
        super().__init__(name, argv, ranks, tmp, threads, plan.timeout_s)


def measure(plan: Plan, tmp: str) -> dict[str, dict[str, Any]]:
    """Start every configuration, let each run its steps in turn per round; raw samples."""
    jobs: dict[str, Job] = {}
    got: dict[str, dict[str, Any]] = {}
    try:
        for name in plan.configs:  # started together: start-up and warm-up are not measured
            jobs[name] = Job(name, plan, tmp)
        for name, job in jobs.items():
            got[name] = {k: [] for k in ("seconds", "tokens", "cpu_s", "load", "others", "rounds")}
            got[name]["losses"] = {}
            got[name]["ready"] = [r["stats"] for r in job.wait()]
        print(f"{len(jobs)} configurations started and warmed up", flush=True)
        order = list(plan.configs)
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
                mine["losses"].update(zip(range(first, first + plan.steps), data["losses"]))
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
            job.close()
        if plan.section == "one-process":  # alone on the machine, after the timed rounds
            print(f"depth sweep under device_memory_limit={plan.sweep_limit}", flush=True)
            jobs["sweep"] = sweep = Job("sweep", plan, tmp)
            sweep.wait()
            sweep.timeout_s = 20 * plan.timeout_s
            got["sweep"] = sweep.ask({"sweep": True})[0]["sweep"]
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
    myelin = plan.configs[name][0] == "myelin"
    for key, total in (("prefetch_hits", sum), ("prefetch_misses", sum),
                       ("offload_wait_seconds", max)):  # fmt: skip
        out[f"{key}_per_step"] = total(_per_step(data, key, plan)) if myelin else None
    out["diagnose"] = data["diagnose"]
    out["losses"] = [data["losses"][k] for k in sorted(data["losses"])]
    out["stats_per_rank"] = stats
    out["raw"] = {k: data[k] for k in ("seconds", "tokens", "cpu_s", "load", "others", "rounds")}
    return out


def report(plan: Plan, got: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table, the diagnostic breakdown and the targets; what goes into the JSON."""
    results = {name: summarize(name, got[name], plan) for name in plan.configs}
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
        f"{plan.stages}-stage {plan.schedule} GPT ({plan.layers} layers, d_model {plan.d_model}, "
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
        + ", ".join(f"{n} {v:.3f}x" for n, v in cpu.items() if plan.configs[n][0] == "myelin")
        + f"\ntorch save_on_cpu vs torch: {soc:.3f}x tokens/s (on a CPU it moves nothing); "
        f"torch (grad accumulation, 1 microbatch in flight) saves "
        f"{_mib(got['torch']['stats'][0]['saved_activations_peak_bytes'])} MiB of activations"
    )
    _print_breakdown(results, plan)
    out = {"configs": results, "save_on_cpu_vs_torch": soc, "cpu_vs_none": cpu}
    out["losses_equal_none"] = {
        name: r["losses"] == base["losses"] for name, r in results.items() if name != "none"
    }
    same = out["losses_equal_none"]
    print("\nstep losses equal to none's: " + ", ".join(
        f"{n} {'yes' if ok else 'NO'}" for n, ok in same.items()))  # fmt: skip
    if "sweep" in got:
        out["depth_sweep"] = got["sweep"]
        _print_sweep(got["sweep"], plan)
    out["targets"] = targets(results, out, plan)
    print()
    for target in out["targets"].values():
        print(f"{'PASS' if target['pass'] else 'MISS'}  {target['text']}")
    return out


def _print_breakdown(results: dict[str, Any], plan: Plan) -> None:
    """Where one step's time went on each rank (the diagnostic step, timeline on)."""
    keys = ("forward", "backward", "optimizer", "prefetch", "fetch_wait", "wait", "send", "recv")
    rows = []
    for name, r in results.items():
        if plan.configs[name][0] != "myelin":
            continue
        for rank, d in enumerate(r["diagnose"]):
            rows.append([f"{name} r{rank}", f"{d['step']:.3f}"]
                        + [f"{d.get(k, 0.0):.3f}" for k in keys])  # fmt: skip
    title = (
        f"{DIAGNOSE_STEPS} more steps with the timeline on: median seconds per step by what "
        f"each rank did (forward includes page-out copies)"
    )
    print_table(["config rank", "step", *keys], rows, title)


def _print_sweep(sweep: dict[str, Any], plan: Plan) -> None:
    rows = []
    for name, r in sweep.items():
        probes = sorted(r["probes"].items(), key=lambda kv: int(kv[0]))
        tried = ", ".join(f"{k}{'' if p['fits'] else ' (no)'}" for k, p in probes)
        rows.append([name, r["layers"] if not r["capped"] else f">={r['layers']}",
                     f"{r['params'] / 1e6:.2f}", _mib(r["peak_bytes"]), tried])  # fmt: skip
    title = (
        f"depth sweep: the deepest GPT (d_model {plan.d_model}, seq {plan.seq}, batch "
        f"{plan.batch} in {plan.microbatches}) that trains 2 steps under "
        f"device_memory_limit={plan.sweep_limit}"
    )
    print_table(["config", "layers", "M params", "peak MiB", "layers tried"], rows, title)


def targets(results: dict[str, Any], out: dict[str, Any], plan: Plan) -> dict[str, dict[str, Any]]:
    """The targets, judged on medians from this same run (the paired figure alongside)."""
    both = results["both"]
    cost, paired = 1 - both["vs_none"], 1 - both["vs_none_paired"]
    max_cost = MAX_COST
    found = {
        "tokens_per_s_cost_both": {
            "text": f"both offloads cost <= {100 * max_cost:.0f}% of tokens/s against none "
            f"(got {100 * cost:.1f}%; paired by round {100 * paired:.1f}%)",
            "got": cost,
            "paired": paired,
            "limit": max_cost,
            "pass": cost <= max_cost,
        },
        "device_peak_shrink_both": {
            "text": f"peak device bytes with both <= 1/{MIN_SHRINK:.0f} of none "
            f"(got 1/{both['peak_shrink']:.2f})",
            "got": both["peak_shrink"],
            "limit": MIN_SHRINK,
            "pass": both["peak_shrink"] >= MIN_SHRINK,
        },
    }
    mine = [n for n in results if plan.configs[n][0] == "myelin" and n != "none"]
    same = all(out["losses_equal_none"][n] for n in mine)
    found["losses_identical"] = {
        "text": f"losses of {', '.join(mine)} identical to none's at every step",
        "pass": same,
    }
    if plan.section != "one-process":
        return found
    soc = results["torch save_on_cpu"]
    vs = both["tokens_per_s"]["median"] / soc["tokens_per_s"]["median"]
    paired_soc = statistics.median(
        a / b for a, b in zip(both["raw"]["rounds"], soc["raw"]["rounds"])
    )
    found["tokens_per_s_vs_save_on_cpu"] = {
        "text": f"both's tokens/s >= torch save_on_cpu's (got {vs:.3f}x; paired by round "
        f"{paired_soc:.3f}x)",
        "got": vs,
        "paired": paired_soc,
        "limit": 1.0,
        "pass": vs >= 1.0,
    }
    sweep = out.get("depth_sweep")
    if sweep:
        gain = sweep["both"]["params"] / max(sweep["none"]["params"], 1)
        capped = " (both at the sweep's cap: more)" if sweep["both"]["capped"] else ""
        found["depth_sweep_params"] = {
            "text": f"deepest GPT under {plan.sweep_limit} with both has >= "
            f"{MIN_DEPTH_GAIN:.0f}x the parameters of the deepest with none (got "
            f"{gain:.2f}x: {sweep['both']['layers']} vs {sweep['none']['layers']} layers){capped}",
            "got": gain,
            "limit": MIN_DEPTH_GAIN,
            "pass": gain >= MIN_DEPTH_GAIN,
        }
    return found


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=[*SECTIONS, "all"], default="all")
    parser.add_argument("--steps", type=int, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, help="rounds; configurations alternate order")
    parser.add_argument("--warmup", type=int, help="untimed steps per configuration (2)")
    parser.add_argument("--stages", type=int, help="pipeline section: stages (2)")
    parser.add_argument("--microbatches", type=int, help="8; one process 2")
    parser.add_argument("--layers", type=int, help="4; one process 12")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-bytes", type=int, default=64 << 10, help="OffloadConfig.min_bytes")
    parser.add_argument("--prefetch", type=int, default=1, help="OffloadConfig.prefetch")
    parser.add_argument("--peer-threads", type=int, default=1, help="the torch loops' threads")
    parser.add_argument("--sweep-limit", default="64MiB", help="one process: the depth sweep's "
                        "device_memory_limit")  # fmt: skip
    parser.add_argument("--sweep-max", type=int, default=64, help="the most layers it tries")
    parser.add_argument("--quick", action="store_true", help="a tiny, fast smoke run")
    parser.add_argument("--out", help="JSON path (default bench/results/offload[_SECTION].json)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace, section: str) -> Plan:
    """The plan of one section from the flags; --quick shrinks the model and the run."""
    shape = dict(DEFAULTS[section])
    if section == "pipeline" and args.stages:
        shape["stages"] = args.stages
    for key in ("layers", "microbatches"):
        shape[key] = getattr(args, key) or shape[key]
    d_model, seq, batch = args.d_model, args.seq, args.batch
    sweep_limit, sweep_max = args.sweep_limit, args.sweep_max
    if args.quick:
        d_model, seq, batch = min(d_model, 64), min(seq, 128), 8
        shape["microbatches"] = min(shape["microbatches"], 4)
        shape["layers"] = min(shape["layers"], 6)
        sweep_limit, sweep_max = "8MiB", min(sweep_max, 16)
    if shape["stages"] < 1 or shape["layers"] + 2 < shape["stages"]:
        raise SystemExit(f"--stages {shape['stages']} must be from 1 to layers + 2")
    if batch % shape["microbatches"]:
        m = shape["microbatches"]
        raise SystemExit(f"--batch {batch} does not split into {m} microbatches")
    return Plan(
        section=section,
        **shape,
        d_model=d_model,
        heads=args.heads,
        seq=seq,
        batch=batch,
        min_bytes=args.min_bytes,
        prefetch=args.prefetch,
        peer_threads=args.peer_threads,
        steps=args.steps or (2 if args.quick else 3),
        rounds=args.rounds or (1 if args.quick else 8),
        warmup=max(args.warmup or (1 if args.quick else 2), 1),
        timeout_s=args.timeout,
        sweep_limit=sweep_limit,
        sweep_max=sweep_max,
    )


def run_section(plan: Plan, out: str | None) -> None:
    """Measure one section, print its tables and targets, write its JSON."""
    start, load_before = time.monotonic(), os.getloadavg()
    print(f"\n== {plan.section} ==", flush=True)
    with tempfile.TemporaryDirectory(prefix="myelin-bench-") as tmp:
        got = measure(plan, tmp)
    payload = report(plan, got)
    load = {"before": list(load_before), "after": list(os.getloadavg()), "cores": os.cpu_count()}
    shares = [x for name in plan.configs for x in got[name]["others"]]
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
    name = "offload" if plan.section == "pipeline" else "offload_one_process"
    path = write_json(name, payload, out)
    print(f"\nwrote {path} ({payload['wall_s']:.0f}s)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        serve(args.worker, Plan(**json.loads(args.plan)))
        return 0
    sections = list(SECTIONS) if args.section == "all" else [args.section]
    if args.out and len(sections) > 1:
        raise SystemExit("--out needs one --section")
    for section in sections:
        run_section(make_plan(args, section), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
