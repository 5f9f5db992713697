"""The GPU figures: myelin against plain PyTorch on one GPU (needs CUDA).

    python bench/gpu.py                      # sections 1, 3 and 4: a few minutes on one H100
    python bench/gpu.py --sections 2         # the capacity sweep (several minutes): run apart
    python bench/gpu.py --quick              # smaller models, one round: a smoke run
    python bench/gpu.py --cpu-smoke          # developers: the machinery on a CPU, tiny models

Sections (each updates only its own part of bench/results/gpu.json, when it finishes, so
sections can run in separate commands and a killed run keeps what finished):

1. throughput: tokens/s and MFU of a GPT in bf16 on one GPU. myelin.Trainer(stages=1,
   precision="bf16") against plain torch: autocast bf16 over fp32 weights (the usual
   recipe), and bf16 weights with fp32 masters (myelin's own recipe, by hand). The same
   AdamW, the same microbatches, gradient accumulation, one loss.item() a step. MFU =
   tokens/s x FLOPs per token / the GPU's dense bf16 peak from its datasheet (--peak-tflops
   to give another); FLOPs per token = 6 x (parameters less the embedding tables) +
   12 x layers x width x sequence (attention, not discounted for the causal mask: the
   nanoGPT / PaLM count). A bf16 8192^3 matmul is also timed, as the achievable peak.
2. capacity: the deepest GPT at a fixed width that trains three steps in bf16, without
   offload and with both offloads, found by trials in fresh processes (a linear fit of
   reserved memory against depth picks where to look). The device is capped with
   `device_memory_limit` (--capacity-limit, 8 GiB by default, "none" for the whole GPU) so
   a sweep takes minutes and the host has room for what offload puts there. For each: its
   parameters, tokens/s, and tokens/s x parameters (6 x that is the matmul FLOP rate; it is
   what "tokens/s per parameter" compares across model sizes).
3. overlap: the share of offload copy time hidden under compute. Each configuration runs
   two steps under torch.profiler; every device-host copy (memcpy HtoD / DtoH) is compared
   with the union of the kernels running meanwhile. myelin (GPipe, so every microbatch but
   the last pages its activations out) with activations paged and with both offloads,
   against torch with `save_on_cpu(pin_memory=True)`; tokens/s of each and of both without
   offload.
4. pipeline: 2 stages as 2 processes on one GPU: myelin against torch.distributed.pipelining
   Schedule1F1B, fp32 with TF32 matmuls. NCCL refuses two ranks on one GPU and gloo sends
   only CPU tensors, so torch's stages pass their boundary tensors through host memory
   (each stage module moves its input to the GPU and its output back), as myelin's do.
   One process with gradient accumulation on the same GPU is the reference row. myelin's
   ranks get a gloo default process group from the bench, which a user's script may also
   make (see tests/gpu: the Trainer's own one asks NCCL for a communicator).

Every peer is its own set of processes (bench/_harness.Workers), warmed up, then told over
stdin to run its steps; peers take turns, in reversed order every other round. Each turn
starts with one untimed step, and after it the peer empties torch's allocator cache, so
idle peers hold only their live tensors on the shared GPU.

Goals (issue 16): MFU >= 50% of the GPU's bf16 peak without offload (1); with offload, 4x
the parameters at >= 70% of the tokens/s x parameters (2); copy time hidden under compute
and tokens/s at least torch save_on_cpu's (3); 2 stages on one GPU at least torch
Schedule1F1B's tokens/s (4).

Without CUDA it prints that it needs a GPU, measures and writes nothing, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from _harness import RESULTS, TAG, Workers, machine_info, print_table, reply, summary

SECTIONS = {1: "throughput", 2: "capacity", 3: "overlap", 4: "pipeline"}
GOALS = {
    "throughput": "MFU >= 50% of the GPU's dense bf16 peak without offload",
    "capacity": "with both offloads, >= 4x the parameters at >= 70% of the tokens/s x params",
    "overlap": "share of copy time hidden under compute, and tokens/s, >= torch save_on_cpu's",
    "pipeline": "2 stages as 2 processes on one GPU: tokens/s >= torch Schedule1F1B's",
}
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; the first
# name found in torch.cuda.get_device_name() wins, so the specific come before the general.
PEAK_BF16_TFLOPS = (
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100", 989.4),
    ("H800", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10", 125.0),
)
CAPACITY_STEPS = 3  # a trial trains this many steps (the first untimed)


# -- the plan ---------------------------------------------------------------------------------


def gpt(layers: int, width: int, heads: int, seq: int, vocab: int) -> dict[str, int]:
    return {"n_layer": layers, "d_model": width, "n_head": heads, "seq": seq, "vocab": vocab}


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Every section's models and batches, as plain data (it travels to the workers)."""
    quick, smoke = args.quick or args.cpu_smoke, args.cpu_smoke
    if smoke:  # tiny: the machinery only
        tp = gpt(2, 64, 4, 32, 256)
        ov = pp = gpt(2, 64, 4, 32, 256)
        width, heads, cap_seq = 64, 4, 32
    elif quick:
        tp = gpt(6, 512, 8, 512, 8192)
        ov = pp = gpt(4, 512, 8, 512, 256)
        width, heads, cap_seq = 1024, 16, 512
    else:
        tp = gpt(12, 768, 12, 1024, 50304)  # GPT-2 small's shape, untied head
        ov = gpt(8, 1024, 16, 1024, 256)
        pp = gpt(8, 1024, 16, 1024, 256)
        width, heads, cap_seq = 2048, 16, 1024
    limit = args.capacity_limit
    if limit is None:
        limit = "64MiB" if smoke else "2GiB" if quick else "8GiB"
    return {
        "device": "cpu" if smoke else "cuda",
        "smoke": smoke,
        "rounds": args.rounds or (1 if quick else 3),
        "steps": args.steps or (2 if quick else 5),
        "warmup": 1 if quick else 3,
        "timeout_s": args.timeout,
        "peak_tflops": args.peak_tflops,
        "throughput": {"model": tp, "rows": 2 if quick else 8, "microbatches": 4},
        "capacity": {
            "width": width,
            "heads": heads,
            "seq": cap_seq,
            "vocab": 256,
            "rows": 1,
            "microbatches": 8 if not smoke else 2,
            "limit": None if limit == "none" else limit,
            "max_depth": min(args.capacity_max_depth, 6) if smoke else args.capacity_max_depth,
        },
        "overlap": {"model": ov, "rows": 2, "microbatches": 8 if not smoke else 4},
        "pipeline": {"model": pp, "rows": 4 if not smoke else 2, "microbatches": 8},
    }


# -- what a worker process runs ------------------------------------------------------------------


def build_model(model: dict[str, int]) -> Any:
    import torch

    from myelin.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=model["vocab"],
            block_size=model["seq"],
            n_layer=model["n_layer"],
            n_head=model["n_head"],
            d_model=model["d_model"],
        )
    )


def matmul_params(net: Any) -> int:
    """Parameters that take part in matmuls: all but the token and position tables."""
    skip = {id(net.embed.wte.weight), id(net.embed.wpe.weight)}
    return sum(p.numel() for p in net.parameters() if id(p) not in skip)


def flops_per_token(model: dict[str, int], params: int) -> float:
    return 6.0 * params + 12.0 * model["n_layer"] * model["d_model"] * model["seq"]


def step_batches(spec: dict[str, Any], step: int) -> list[tuple[Any, Any]]:
    """Step `step`'s microbatches, the same in every process and peer."""
    import torch

    model = spec["model"]
    g = torch.Generator().manual_seed(1234 + step)
    mbs = []
    for _ in range(spec["microbatches"]):
        x = torch.randint(0, model["vocab"], (spec["rows"], model["seq"] + 1), generator=g)
        mbs.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return mbs


class MyelinPeer:
    """myelin.Trainer as the spec says."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        import myelin
        from myelin.models import lm_loss

        if spec.get("pg_gloo") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group("gloo")  # ranks that share a GPU: no NCCL communicator
        offload = spec.get("offload")
        device = spec["device"] if spec["device"] == "cpu" else None
        net = build_model(spec["model"])
        self.params = matmul_params(net)
        self.trainer = myelin.Trainer(
            net,
            optimizer=partial(torch.optim.AdamW, lr=1e-4),
            loss_fn=lm_loss,
            stages=spec.get("stages", 1),
            microbatches=spec["microbatches"],
            schedule=spec.get("schedule", "message-driven"),
            offload=myelin.OffloadConfig(**offload) if offload else None,
            precision=spec.get("precision", "fp32"),
            device_memory_limit=spec.get("limit"),
            device=device,
            timeout=spec["timeout_s"],
        )
        self.rank = self.trainer.rank

    def step(self, mbs: list[tuple[Any, Any]]) -> float:
        return self.trainer.step([x for x, _ in mbs], [y for _, y in mbs])

    def stats(self) -> dict[str, Any]:
        return self.trainer.memory_stats()

    def close(self) -> None:
        self.trainer.close()


class TorchPeer:
    """Plain PyTorch, one process, gradient accumulation over the same microbatches.

    recipe "autocast": fp32 weights, autocast to bf16; "masters": bf16 weights, fp32
    master weights in the optimizer (myelin's recipe by hand); "fp32": no half precision.
    save_on_cpu: torch.autograd.graph.save_on_cpu(pin_memory=True) around each forward.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        self.rank = 0
        self.device = torch.device(spec["device"])
        net = build_model(spec["model"])
        self.params = matmul_params(net)
        self.model = net.to(self.device)
        self.recipe = spec.get("recipe", "autocast")
        self.save_on_cpu = bool(spec.get("save_on_cpu"))
        weights = list(self.model.parameters())
        self.masters = weights
        if self.recipe == "masters":
            self.masters = [torch.nn.Parameter(p.detach().clone()) for p in weights]
            self.model.to(torch.bfloat16)
        self.weights = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.masters, lr=1e-4)

    def step(self, mbs: list[tuple[Any, Any]]) -> float:
        import torch

        from myelin.models import lm_loss

        total = torch.zeros((), device=self.device)
        for x, y in mbs:
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            with self._saving(), self._autocast():
                logits = self.model(x)
            loss = lm_loss(logits.float(), y)
            (loss / len(mbs)).backward()
            total += loss.detach()
        if self.masters is not self.weights:
            for m, w in zip(self.masters, self.weights, strict=True):
                m.grad = w.grad.float()
                w.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.weights:
            with torch.no_grad():
                torch._foreach_copy_(self.weights, self.masters)
        return float(total) / len(mbs)  # one synchronisation a step, as Trainer.step's float

    def _autocast(self) -> Any:
        import contextlib

        import torch

        if self.recipe != "autocast" or self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.bfloat16)

    def _saving(self) -> Any:
        import contextlib

        import torch

        if not self.save_on_cpu:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

    def stats(self) -> dict[str, Any]:
        import torch

        if self.device.type != "cuda":
            return {}
        return {"device_peak_bytes": torch.cuda.max_memory_allocated(self.device)}

    def close(self) -> None:
        pass


class TorchPipePeer:
    """torch.distributed.pipelining: PipelineStage + Schedule1F1B over gloo, one stage per
    process. Parameters and compute on the GPU; the tensors between stages cross through
    host memory (gloo sends CPU tensors only; NCCL refuses two ranks on one GPU)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from myelin.models import lm_loss
        from myelin.partition import split

        dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout_s"]))
        self.rank = dist.get_rank()
        self.device = torch.device(spec["device"])
        stages = 2
        net = build_model(spec["model"])
        self.params = matmul_params(net)
        layers = nn.Sequential(*split(net, stages)[self.rank]).to(self.device)
        last = self.rank == stages - 1
        device = self.device

        class OnDevice(nn.Module):
            """Compute on the GPU; hand the next stage a CPU tensor."""

            def __init__(self) -> None:
                super().__init__()
                self.layers = layers

            def forward(self, x: Any) -> Any:
                y = self.layers(x.to(device))
                return y if last else y.cpu()

        self.module = OnDevice()
        stage = PipelineStage(self.module, self.rank, stages, torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, spec["microbatches"], loss_fn=lm_loss)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.last = last

    def step(self, mbs: list[tuple[Any, Any]]) -> float:
        import torch

        x = torch.cat([x for x, _ in mbs])
        y = torch.cat([y for _, y in mbs]).to(self.device)
        if self.rank == 0:
            self.schedule.step(x)
        else:
            losses: list[Any] = []
            self.schedule.step(target=y, losses=losses)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return 0.0

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


PEERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "myelin": MyelinPeer,
    "torch": TorchPeer,
    "torch-pipe": TorchPipePeer,
}


def _setup_torch(spec: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if spec["device"] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(spec.get("tf32"))
        torch.backends.cudnn.allow_tf32 = bool(spec.get("tf32"))


def _empty_cache(spec: dict[str, Any]) -> None:
    if spec["device"] == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def serve(spec: dict[str, Any]) -> None:
    """A worker: build the peer, warm up, then run what the parent asks for.

    {"run": n, "first": k} runs one untimed step then n timed ones from step k; rank 0
    answers with step times and tokens. {"profile": n, "first": k} runs n steps under
    torch.profiler and answers with the copies it saw. {"quit": true} ends it.
    """
    _setup_torch(spec)
    peer = PEERS[spec["peer"]](spec)
    tokens = spec["rows"] * spec["microbatches"] * spec["model"]["seq"]
    for k in range(spec["warmup"]):
        peer.step(step_batches(spec, k))
    _empty_cache(spec)
    reply({"ready": True, "params": peer.params, "stats": peer.stats()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        first = cmd["first"]
        if "profile" in cmd:
            got = profile_copies(peer, spec, first, cmd["profile"])
            reply(got if peer.rank == 0 else {})
            _empty_cache(spec)
            continue
        peer.step(step_batches(spec, first))  # untimed: the allocator refills its cache
        ends = [time.perf_counter()]
        for k in range(cmd["run"]):
            peer.step(step_batches(spec, first + 1 + k))
            ends.append(time.perf_counter())
        seconds = [b - a for a, b in zip(ends, ends[1:])]
        out = {"seconds": seconds, "tokens": [tokens] * len(seconds), "stats": peer.stats()}
        reply(out if peer.rank == 0 else {})
        _empty_cache(spec)
    peer.close()


def oneshot(spec: dict[str, Any]) -> None:
    """A capacity trial: build, train CAPACITY_STEPS steps, answer once, exit."""
    import torch

    _setup_torch(spec)
    start = time.perf_counter()
    try:
        peer = PEERS[spec["peer"]](spec)
        built = time.perf_counter() - start
        peer.step(step_batches(spec, 0))
        ends = [time.perf_counter()]
        for k in range(1, CAPACITY_STEPS):
            peer.step(step_batches(spec, k))
            ends.append(time.perf_counter())
        seconds = [b - a for a, b in zip(ends, ends[1:])]
        stats = peer.stats()
        reserved = torch.cuda.max_memory_reserved() if spec["device"] == "cuda" else None
        tokens = spec["rows"] * spec["microbatches"] * spec["model"]["seq"]
        reply({
            "ok": True, "params": peer.params, "build_s": built, "seconds": seconds,
            "tokens_per_s": tokens / statistics.median(seconds), "reserved_peak": reserved,
            "device_peak": stats.get("device_peak_bytes"),
            "activations_offloaded": stats.get("activations_offloaded_bytes"),
            "host_pool_peak": stats.get("host_pool_peak_bytes"),
        })  # fmt: skip
        peer.close()
    except Exception as exc:  # the answer is that this depth does not train
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        reply({"ok": False, "error": f"{type(exc).__name__}: {first}"})


def profile_copies(peer: Any, spec: dict[str, Any], first: int, count: int) -> dict[str, Any]:
    """Run `count` steps under torch.profiler; how much of the device-host copy time had a
    kernel running beside it."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if spec["device"] == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        for k in range(count):
            peer.step(step_batches(spec, first + k))
        if spec["device"] == "cuda":
            import torch

            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return copy_overlap(events)


def copy_overlap(events: list[dict[str, Any]]) -> dict[str, Any]:
    """From a torch.profiler Chrome trace: device-host copy time, and the part of it during
    which some non-NCCL kernel ran (on any stream)."""
    kernels, copies = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = str(e.get("cat", "")), str(e.get("name", ""))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if cat == "kernel" and "nccl" not in name.lower():
            kernels.append(span)
        elif cat == "gpu_memcpy" and ("HtoD" in name or "DtoH" in name):
            copies.append((*span, "HtoD" if "HtoD" in name else "DtoH"))
    union = _merge(kernels)
    out: dict[str, Any] = {"kernel_us": sum(b - a for a, b in union)}
    for direction in ("HtoD", "DtoH", "all"):
        mine = [(a, b) for a, b, d in copies if direction in ("all", d)]
        total = sum(b - a for a, b in mine)
        hidden = sum(_covered(a, b, union) for a, b in mine)
        out[direction] = {
            "copies": len(mine),
            "copy_us": total,
            "hidden_us": hidden,
            "hidden_frac": hidden / total if total else None,
        }
    return out


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _covered(a: float, b: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union if x < b and y > a)


# -- the parent: peers taking turns ---------------------------------------------------------------


def worker_argv(spec: dict[str, Any], oneshot_run: bool = False) -> list[str]:
    argv = [sys.executable, __file__, "--worker", json.dumps(spec)]
    return argv + (["--oneshot"] if oneshot_run else [])


def alternate(
    plan: dict[str, Any], specs: dict[str, dict[str, Any]], tmp: str, profile: bool = False
) -> dict[str, dict[str, Any]]:
    """Start every peer, let each run its steps in turn per round; raw samples per peer."""
    jobs: dict[str, Workers] = {}
    got: dict[str, dict[str, Any]] = {}
    try:
        for name, spec in specs.items():
            ranks = 2 if spec["peer"] == "torch-pipe" or spec.get("stages", 1) == 2 else 1
            jobs[name] = Workers(name, worker_argv(spec), ranks, tmp, 1, plan["timeout_s"])
            ready = jobs[name].wait()  # one at a time: warm-ups do not share the GPU
            got[name] = {"seconds": [], "tokens": [], "rounds": [], "params": ready[0]["params"]}
            got[name]["ready_stats"] = [r.get("stats", {}) for r in ready]
            print(f"  {name}: started and warmed up", flush=True)
        names = list(specs)
        first = plan["warmup"]
        for r in range(plan["rounds"]):
            for name in names if r % 2 == 0 else names[::-1]:
                data = jobs[name].ask({"run": plan["steps"], "first": first})[0]
                mine = got[name]
                mine["seconds"] += data["seconds"]
                mine["tokens"] += data["tokens"]
                mine["stats"] = data.get("stats", {})
                rate = sum(data["tokens"]) / sum(data["seconds"])
                mine["rounds"].append(rate)
                print(f"  round {r + 1}/{plan['rounds']}  {name:24} {rate:10.0f} tok/s", flush=True)
            first += plan["steps"] + 1
        if profile:
            for name, job in jobs.items():
                got[name]["copies"] = job.ask({"profile": 2, "first": first})[0]
        return got
    finally:
        for job in jobs.values():
            job.close()


def rates(data: dict[str, Any]) -> dict[str, Any]:
    return summary([t / s for t, s in zip(data["tokens"], data["seconds"], strict=True)])


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


# -- section 1: throughput and MFU -----------------------------------------------------------------


def peak_tflops(plan: dict[str, Any]) -> tuple[float | None, str]:
    if plan["peak_tflops"]:
        return plan["peak_tflops"], "--peak-tflops"
    if plan["device"] != "cuda":
        return None, "no GPU"
    import torch

    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value, f"datasheet, {key}"
    return None, f"unknown GPU {name!r}: pass --peak-tflops"


def measured_matmul_tflops(plan: dict[str, Any]) -> float | None:
    """A bf16 8192^3 matmul's TFLOP/s here: the achievable peak, beside the datasheet's."""
    if plan["device"] != "cuda":
        return None
    code = (
        "import torch, time\n"
        "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
        "b = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
        "for _ in range(3): a @ b\n"
        "torch.cuda.synchronize(); t = time.perf_counter()\n"
        "for _ in range(10): a @ b\n"
        "torch.cuda.synchronize(); print(10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12)\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def section_throughput(plan: dict[str, Any], tmp: str) -> dict[str, Any]:
    cfg = plan["throughput"]
    base = {**cfg, "device": plan["device"], "warmup": plan["warmup"]}
    base["timeout_s"] = plan["timeout_s"]
    specs = {
        "myelin bf16": {**base, "peer": "myelin", "precision": "bf16"},
        "torch autocast bf16": {**base, "peer": "torch", "recipe": "autocast"},
        "torch bf16 + fp32 masters": {**base, "peer": "torch", "recipe": "masters"},
    }
    got = alternate(plan, specs, tmp)
    peak, source = peak_tflops(plan)
    matmul = measured_matmul_tflops(plan)
    model = cfg["model"]
    rows, out = [], {"peers": {}}
    ref = rates(got["torch autocast bf16"])["median"]
    for name, data in got.items():
        r = rates(data)
        fpt = flops_per_token(model, data["params"])
        tflops = r["median"] * fpt / 1e12
        mfu = tflops / peak if peak else None
        out["peers"][name] = {
            "tokens_per_s": r,
            "tflops": tflops,
            "mfu": mfu,
            "mfu_of_measured_matmul": tflops / matmul if matmul else None,
            "vs_torch_autocast": r["median"] / ref,
            "params_in_matmuls": data["params"],
            "flops_per_token": fpt,
            "stats": data.get("stats"),
            "raw": {k: data[k] for k in ("seconds", "tokens", "rounds")},
        }
        rows.append([name, f"{r['median']:.0f}", f"{r['min']:.0f}", f"{r['max']:.0f}",
                     f"{tflops:.1f}", _pct(mfu), f"{r['median'] / ref:.2f}"])  # fmt: skip
    tokens = cfg["rows"] * cfg["microbatches"] * model["seq"]
    title = (
        f"1. throughput: GPT {model['n_layer']} x {model['d_model']}, vocab {model['vocab']}, "
        f"seq {model['seq']}, {tokens} tokens a step in {cfg['microbatches']} microbatches, bf16; "
        f"peak {peak or 'unknown'} TFLOP/s ({source}), bf16 matmul measured "
        f"{'n/a' if matmul is None else f'{matmul:.0f}'} TFLOP/s"
    )
    print_table(["peer", "tok/s", "min", "max", "TFLOP/s", "MFU", "vs autocast"], rows, title)
    mine = out["peers"]["myelin bf16"]["mfu"]
    out.update(peak_tflops=peak, peak_source=source, measured_matmul_tflops=matmul)
    passed = None if mine is None else mine >= 0.5
    out["goals"] = {"throughput": _goal(GOALS["throughput"], mine, passed)}
    return out


# -- section 2: capacity ---------------------------------------------------------------------------


def capacity_spec(plan: dict[str, Any], depth: int, offload: bool) -> dict[str, Any]:
    cfg = plan["capacity"]
    model = gpt(depth, cfg["width"], cfg["heads"], cfg["seq"], cfg["vocab"])
    spec = {
        "peer": "myelin", "model": model, "rows": cfg["rows"],
        "microbatches": cfg["microbatches"], "precision": "bf16", "device": plan["device"],
        "limit": cfg["limit"], "timeout_s": plan["timeout_s"], "warmup": 0,
    }  # fmt: skip
    if offload:
        spec["offload"] = {"activations": True, "optimizer": True}
    return spec


def run_trial(plan: dict[str, Any], depth: int, offload: bool, tmp: str) -> dict[str, Any]:
    spec = capacity_spec(plan, depth, offload)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"), TMPDIR=tmp)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            worker_argv(spec, oneshot_run=True), capture_output=True, text=True,
            timeout=plan["timeout_s"], env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {plan['timeout_s']:.0f}s", "depth": depth}
    answers = [json.loads(x[len(TAG) :]) for x in proc.stdout.splitlines() if x.startswith(TAG)]
    got = answers[-1] if answers else {"ok": False, "error": _last_line(proc.stderr)}
    got.update(depth=depth, wall_s=time.perf_counter() - start)
    state = "trains" if got["ok"] else f"fails ({got['error']})"
    which = "both offloads" if offload else "no offload"
    print(f"  {which:13} depth {depth:4}: {state}", flush=True)
    return got


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def deepest(plan: dict[str, Any], offload: bool, tmp: str) -> dict[str, Any]:
    """The deepest model that trains: two small probes, a linear fit of reserved memory
    against depth for the first guess, then bracketing and bisection."""
    cap = plan["capacity"]
    trials: dict[int, dict[str, Any]] = {}

    def ok(depth: int) -> bool:
        if depth not in trials:
            trials[depth] = run_trial(plan, depth, offload, tmp)
        return trials[depth]["ok"]

    if not ok(1):
        return {"depth": 0, "trials": trials}
    guess = 4
    if ok(2) and trials[1].get("reserved_peak") and trials[2].get("reserved_peak"):
        slope = trials[2]["reserved_peak"] - trials[1]["reserved_peak"]
        limit = _bytes(cap["limit"]) if cap["limit"] else _gpu_bytes()
        if slope > 0 and limit:
            guess = int((0.95 * limit - trials[1]["reserved_peak"]) / slope) + 1
    elif not ok(2):
        return {"depth": 1, "trials": trials}
    good, bad = 2, None
    guess = max(3, min(guess, cap["max_depth"]))
    while bad is None:  # bracket
        if ok(guess):
            good = guess
            if guess >= cap["max_depth"]:
                break
            guess = min(cap["max_depth"], max(guess + 1, int(guess * 1.15)))
        else:
            bad = guess
    while bad is not None and bad - good > 1:  # bisect
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return {"depth": good, "capped_by_max_depth": bad is None, "trials": trials}


def _bytes(text: str) -> int:
    from myelin.offload.pool import parse_bytes

    return parse_bytes(text, "--capacity-limit")


def _gpu_bytes() -> int | None:
    try:
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    except Exception:
        return None


def section_capacity(plan: dict[str, Any], tmp: str) -> dict[str, Any]:
    cap = plan["capacity"]
    out: dict[str, Any] = {"configs": {}}
    rows = []
    for name, offload in (("no offload", False), ("both offloads", True)):
        found = deepest(plan, offload, tmp)
        best = found["trials"].get(found["depth"], {})
        params = best.get("params")
        rate = best.get("tokens_per_s")
        out["configs"][name] = {
            "depth": found["depth"],
            "params": params,
            "tokens_per_s": rate,
            "tokens_per_s_x_params": rate * params if rate and params else None,
            "activations_offloaded_bytes": best.get("activations_offloaded"),
            "host_pool_peak_bytes": best.get("host_pool_peak"),
            "capped_by_max_depth": found.get("capped_by_max_depth"),
            "trials": {str(k): v for k, v in sorted(found["trials"].items())},
        }
    none, both = out["configs"]["no offload"], out["configs"]["both offloads"]
    for name, c in out["configs"].items():
        rows.append([
            name, c["depth"], f"{(c['params'] or 0) / 1e6:.0f}M",
            "n/a" if c["tokens_per_s"] is None else f"{c['tokens_per_s']:.0f}",
            "n/a" if c["tokens_per_s_x_params"] is None else f"{c['tokens_per_s_x_params']:.3g}",
            "n/a" if c["activations_offloaded_bytes"] is None
            else f"{c['activations_offloaded_bytes'] / 2**20:.0f}",
        ])  # fmt: skip
    limit = cap["limit"] or "the whole GPU"
    title = (
        f"2. capacity: deepest GPT of width {cap['width']} (seq {cap['seq']}, "
        f"{cap['rows'] * cap['microbatches'] * cap['seq']} tokens a step) that trains in bf16 "
        f"under device_memory_limit={limit}"
    )
    heads = ["config", "depth", "params", "tok/s", "tok/s x params", "paged MiB/step"]
    print_table(heads, rows, title)
    ratio = work = None
    if none["params"] and both["params"]:
        ratio = both["params"] / none["params"]
    if none["tokens_per_s_x_params"] and both["tokens_per_s_x_params"]:
        work = both["tokens_per_s_x_params"] / none["tokens_per_s_x_params"]
    out.update(params_ratio=ratio, work_ratio=work, limit=cap["limit"])
    print(
        f"\nboth offloads: {'n/a' if ratio is None else f'{ratio:.2f}x'} the parameters at "
        f"{_pct(work)} of the tokens/s x parameters; on one stage each backward follows its "
        "forward at once, so activations are paged only where 'paged MiB/step' says so"
    )
    passed = None if ratio is None or work is None else ratio >= 4 and work >= 0.7
    out["goals"] = {"capacity": _goal(GOALS["capacity"], {"params": ratio, "work": work}, passed)}
    return out


# -- section 3: overlap ----------------------------------------------------------------------------


def section_overlap(plan: dict[str, Any], tmp: str) -> dict[str, Any]:
    cfg = plan["overlap"]
    base = {**cfg, "device": plan["device"], "warmup": plan["warmup"]}
    base["timeout_s"] = plan["timeout_s"]
    mine = {**base, "peer": "myelin", "precision": "bf16", "schedule": "gpipe"}
    specs = {
        "myelin none": mine,
        "myelin activations": {**mine, "offload": {"activations": True}},
        "myelin both": {**mine, "offload": {"activations": True, "optimizer": True}},
        "torch autocast": {**base, "peer": "torch", "recipe": "autocast"},
        "torch save_on_cpu": {**base, "peer": "torch", "recipe": "autocast", "save_on_cpu": 1},
    }
    got = alternate(plan, specs, tmp, profile=True)
    out: dict[str, Any] = {"peers": {}}
    rows = []
    for name, data in got.items():
        r = rates(data)
        copies = data.get("copies", {})
        allc = copies.get("all", {})
        out["peers"][name] = {
            "tokens_per_s": r,
            "copies": copies,
            "hidden_frac": allc.get("hidden_frac"),
            "stats": data.get("stats"),
            "raw": {k: data[k] for k in ("seconds", "tokens", "rounds")},
        }
        rows.append([
            name, f"{r['median']:.0f}", f"{allc.get('copies', 0)}",
            f"{allc.get('copy_us', 0) / 2e3:.1f}", _pct(allc.get("hidden_frac")),
            _pct(copies.get("DtoH", {}).get("hidden_frac")),
            _pct(copies.get("HtoD", {}).get("hidden_frac")),
        ])  # fmt: skip
    model = cfg["model"]
    title = (
        f"3. overlap: GPT {model['n_layer']} x {model['d_model']}, seq {model['seq']}, "
        f"{cfg['microbatches']} microbatches of {cfg['rows']}, bf16; myelin under GPipe; copies "
        "= device-host memcpys in 2 profiled steps (ms per step), hidden = share with a kernel "
        "running beside"
    )
    heads = ["peer", "tok/s", "copies", "copy ms/step", "hidden", "DtoH hidden", "HtoD hidden"]
    print_table(heads, rows, title)
    both, soc = out["peers"]["myelin both"], out["peers"]["torch save_on_cpu"]
    act = out["peers"]["myelin activations"]
    hidden, theirs = act["hidden_frac"], soc["hidden_frac"]
    faster = act["tokens_per_s"]["median"] >= soc["tokens_per_s"]["median"]
    passed = None if hidden is None or theirs is None else hidden >= theirs and faster
    out["goals"] = {
        "overlap": _goal(
            GOALS["overlap"],
            {
                "myelin_activations_hidden": hidden,
                "torch_save_on_cpu_hidden": theirs,
                "myelin_both_hidden": both["hidden_frac"],
                "tokens_per_s_at_least": faster,
            },
            passed,
        )  # fmt: skip
    }
    return out


# -- section 4: two stages on one GPU ------------------------------------------------------------


def section_pipeline(plan: dict[str, Any], tmp: str) -> dict[str, Any]:
    cfg = plan["pipeline"]
    base = {**cfg, "device": plan["device"], "warmup": plan["warmup"], "tf32": True}
    base["timeout_s"] = plan["timeout_s"]
    specs = {
        "myelin 2 stages": {**base, "peer": "myelin", "stages": 2, "pg_gloo": True},
        "myelin 2 stages 1f1b": {
            **base,
            "peer": "myelin",
            "stages": 2,
            "pg_gloo": True,
            "schedule": "1f1b",
        },  # fmt: skip
        "torch Schedule1F1B": {**base, "peer": "torch-pipe"},
        "torch 1 process": {**base, "peer": "torch", "recipe": "fp32"},
    }
    got = alternate(plan, specs, tmp)
    out: dict[str, Any] = {"peers": {}}
    ref = rates(got["torch Schedule1F1B"])["median"]
    rows = []
    for name, data in got.items():
        r = rates(data)
        out["peers"][name] = {
            "tokens_per_s": r,
            "vs_torch_1f1b": r["median"] / ref,
            "raw": {k: data[k] for k in ("seconds", "tokens", "rounds")},
        }
        rows.append([name, f"{r['median']:.0f}", f"{r['min']:.0f}", f"{r['max']:.0f}",
                     f"{r['median'] / ref:.2f}"])  # fmt: skip
    model = cfg["model"]
    title = (
        f"4. pipeline: 2 stages as 2 processes on one GPU, GPT {model['n_layer']} x "
        f"{model['d_model']}, seq {model['seq']}, {cfg['microbatches']} microbatches of "
        f"{cfg['rows']}, fp32 with TF32 matmuls; torch's stages pass boundary tensors through "
        "host memory over gloo"
    )
    print_table(["peer", "tok/s", "min", "max", "vs torch 1F1B"], rows, title)
    ratio = out["peers"]["myelin 2 stages"]["vs_torch_1f1b"]
    out["goals"] = {"pipeline": _goal(GOALS["pipeline"], ratio, ratio >= 1.0)}
    return out


# -- the report -------------------------------------------------------------------------------


def _goal(text: str, got: Any, passed: bool | None) -> dict[str, Any]:
    return {"text": text, "got": got, "pass": passed}


RUNNERS = {
    "throughput": section_throughput,
    "capacity": section_capacity,
    "overlap": section_overlap,
    "pipeline": section_pipeline,
}


def gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None}
    props = torch.cuda.get_device_properties(0)
    info = {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "gpus": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        pynvml.nvmlShutdown()
    except Exception:
        pass
    return info


def merge_results(path: Path, sections: dict[str, Any]) -> dict[str, Any]:
    """gpu.json with these sections replaced and the others kept as they were."""
    old: dict[str, Any] = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
    kept = old.get("sections", {}) if old.get("bench") == "gpu" else {}
    return {**kept, **sections}


def write_results(path: Path, plan: dict[str, Any], sections: dict[str, Any]) -> None:
    record = {
        "bench": "gpu",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "machine": machine_info(**gpu_info()),
        "goals": GOALS,
        "sections": merge_results(path, sections),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def no_gpu_reason() -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})"


# -- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="1,3,4", help="comma-separated, of 1 2 3 4")
    parser.add_argument("--quick", action="store_true", help="smaller models, one round")
    parser.add_argument("--rounds", type=int, help="rounds; peers alternate order each round")
    parser.add_argument("--steps", type=int, help="timed steps per peer and round")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, TFLOP/s")
    parser.add_argument("--capacity-limit", help="device cap for section 2, e.g. 8GiB, or none")
    parser.add_argument("--capacity-max-depth", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per command")
    parser.add_argument("--out", help="JSON path (default bench/results/gpu.json)")
    parser.add_argument(
        "--cpu-smoke", action="store_true",
        help="developers: run the processes and tables on the CPU with tiny models; the "
        "figures mean nothing and nothing is written unless --out names a file",
    )  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--oneshot", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        oneshot(spec) if args.oneshot else serve(spec)
        return 0
    try:
        wanted = [SECTIONS[int(s)] for s in args.sections.split(",") if s.strip()]
    except (KeyError, ValueError):
        raise SystemExit(f"--sections {args.sections!r}: expected numbers from 1 to 4") from None
    reason = None if args.cpu_smoke else no_gpu_reason()
    if reason is not None:
        print(
            f"bench/gpu.py needs a CUDA GPU: {reason}. Nothing was measured and nothing "
            f"written. On a GPU machine: bench/gpu_session.sh (see the README's GPU suite)."
        )
        return 0
    try:
        import myelin  # noqa: F401  (the workers import it the same way)
    except ImportError as exc:
        print(f"myelin is not importable ({exc}): `pip install -e .`, or PYTHONPATH=$PWD")
        return 2
    plan = make_plan(args)
    if not args.cpu_smoke:  # every section measures one GPU: the workers see only the first
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        os.environ["CUDA_VISIBLE_DEVICES"] = first or "0"
    if args.cpu_smoke:
        print("CPU SMOKE RUN: tiny models on the CPU; these figures say nothing about GPUs")
    path = Path(args.out) if args.out else (None if args.cpu_smoke else RESULTS / "gpu.json")
    print("goals (issue 16):")
    for name in wanted:
        print(f"  {name}: {GOALS[name]}")
    done: dict[str, Any] = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="myelin-gpu-bench-") as tmp:
        for name in wanted:
            print(f"\n== section {name}", flush=True)
            t0 = time.monotonic()
            try:
                result = RUNNERS[name](plan, tmp)
            except Exception as exc:  # one section's failure must not lose the others
                print(f"section {name} failed: {type(exc).__name__}: {exc}", flush=True)
                result = {"error": f"{type(exc).__name__}: {exc}"[:4000], "goals": {}}
            result.update(plan=plan[name], wall_s=time.monotonic() - t0, quick=args.quick)
            result.update(when=time.strftime("%Y-%m-%dT%H:%M:%S%z"), gpu=gpu_info())
            done[name] = result
            if path is not None:
                write_results(path, plan, {name: result})
    print("\ngoals:")
    failed = False
    for name, result in done.items():
        failed = failed or "error" in result
        for goal in result.get("goals", {}).values():
            verdict = {True: "PASS", False: "MISS", None: "n/a "}[goal["pass"]]
            print(f"  {verdict}  {goal['text']} (got {_fmt_got(goal['got'])})")
        if "error" in result:
            print(f"  ERROR {name}: {result['error'][:300]}")
    where = f"wrote {path}" if path is not None else "nothing written (--cpu-smoke)"
    print(f"\n{where} ({time.monotonic() - start:.0f}s)")
    return 1 if failed else 0


def _fmt_got(got: Any) -> str:
    if isinstance(got, float):
        return f"{got:.3f}"
    if isinstance(got, dict):
        return ", ".join(f"{k} {_fmt_got(v)}" for k, v in got.items())
    return str(got)


if __name__ == "__main__":
    sys.exit(main())
