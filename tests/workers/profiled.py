"""Train with the profiler on; gather every rank's records and save the report on rank 0.

Run by tests/profile/test_profile_pipeline.py as
`myelin run -n N profiled.py --out DIR CASE...`, where CASE is model:stages:microbatches:
schedule, e.g. `fixed:2:4:gpipe` (every stage sleeps a fixed time: 20 ms forward, 40 ms
backward) or `mlp:2:8:gpipe` (real compute, the same block on every stage). Every case
must use all N processes. Each rank writes out/rank{r}.json with its figures per case;
for the cases named by --save, rank 0 also saves the whole report (trace, picture,
summary) under out/<case with : replaced by _>/.

CASE `torch` trains a plain PyTorch model (no myelin) with gradients all-reduced over
gloo under torch.profiler, each rank writing its trace to out/torch_traces/.
"""

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler
from torch.profiler import schedule as profiler_schedule

import myelin
from myelin.profile.fixed import fixed_time_model
from myelin.profile.nvml import Sampler
from myelin.profile.report import ProfileReport, collect, gather

STEPS, WARMUP = 5, 2  # steps run, and steps left out of the figures
FORWARD_S, BACKWARD_S = 0.020, 0.040
WIDTH, HIDDEN, ROWS = 16, 1024, 768


def build(name, stages):
    torch.manual_seed(0)
    if name == "fixed":
        return fixed_time_model(stages, FORWARD_S, BACKWARD_S), F.mse_loss
    # One equal block per stage, narrow at the boundary. It starts with a small Linear, so
    # stage 0 also needs the gradient at the input of its big first layer: without it,
    # only the later stages pay for that product and stage 0 waits on them.
    layers = []
    for _ in range(stages):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh()]
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH)]
    return torch.nn.Sequential(*layers), F.mse_loss


def run_case(case, out, save):
    name, stages, microbatches, schedule = case.split(":")
    stages, microbatches = int(stages), int(microbatches)
    model, loss_fn = build(name, stages)
    trainer = myelin.Trainer(
        model,
        optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
        loss_fn=loss_fn,
        stages=stages,
        partition=[len(model) // stages] * stages,  # the equal blocks, one per stage
        microbatches=microbatches,
        schedule=schedule,
        timeout=60,
        profile=True,
    )
    with trainer:
        sampler = Sampler(trainer.world.device, interval_s=0.05, origin=trainer.timeline.origin)
        g = torch.Generator().manual_seed(trainer.rank)
        with sampler:
            for _ in range(STEPS):
                rows = 8 if name == "fixed" else ROWS
                x = torch.randn(rows * microbatches, WIDTH, generator=g)
                trainer.step(x, torch.randn(x.shape, generator=g))
        record = collect(trainer.timeline, sampler.counters, device=trainer.world.device, replica=0)
        records, missing = gather(record, trainer.world, timeout_s=30)
        report = ProfileReport.from_ranks(records, warmup_steps=WARMUP, missing=missing)
        saved = None
        if trainer.rank == 0 and case in save:
            saved = os.path.join(out, case.replace(":", "_"))
            report.save(saved)
            report.print()
        row = next(r for r in report.summary()["ranks"] if r["rank"] == trainer.rank)
        return {"figures": row, "ranks": len(records), "missing": missing, "saved": saved}


def run_torch(out):
    """A data-parallel step loop profiled by torch.profiler, one trace file per rank."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, loss_fn = build("mlp", 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    handler = tensorboard_trace_handler(os.path.join(out, "torch_traces"), f"rank{rank}")
    when = profiler_schedule(wait=0, warmup=1, active=3, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=when, on_trace_ready=handler) as p:
        for _ in range(5):
            x = torch.randn(128, WIDTH)
            loss_fn(model(x), x).backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)
            opt.step()
            opt.zero_grad()
            p.step()
    return {"traces": sorted(os.listdir(os.path.join(out, "torch_traces")))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--save", action="append", default=[], help="save this case's files")
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {
        case: run_torch(args.out) if case == "torch" else run_case(case, args.out, args.save)
        for case in args.cases
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if "torch" in args.cases:
        # torch.profiler keeps the gloo group alive past destroy_process_group, and a gloo
        # worker thread still freeing an all-reduce's tensors when the interpreter shuts
        # down aborts the process (pytorch#179291; 2 in 12 runs on a loaded machine).
        # The results are written: leave without the interpreter's shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
