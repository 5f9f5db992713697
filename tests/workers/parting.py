"""Ranks that part ways: one dies or leaves while the others are somewhere in particular.

Run by tests/faults/test_parting.py as
`myelin run -n N parting.py --out DIR MODE [--die HOW] [--end-with-error]`.

Places (the last rank, the victim, dies after 3 steps, 1 s after the others entered the
place; one stage per rank):
  close       rank 0 is inside trainer.close(), gathering the profile
  gather      rank 0 is inside trainer.profile_report()
  checkpoint  rank 0 is inside trainer.save()
  state_dict  rank 0 is inside trainer.state_dict(), receiving the last stage's weights
  barrier     rank 0 is inside torch.distributed.barrier()
  user        rank 0 is in its own code between steps (a sleep)
  with        rank 0 is in its 4th training step; the victim raises inside its
              `with Trainer(...)` block (profile on), so it closes with an error in flight
HOW is `kill` (SIGKILL), `stop` (SIGSTOP: frozen) or `raise` (an exception in the
victim's own code after its last step, its trainer left to close at exit). The victim
writes the time it died to victim.json. With --end-with-error the survivors' errors end
their scripts (after their records are written), as most scripts' do; at exit, after the
trainer's exit handlers, each sends itself SIGTERM, as a launcher stopping the job does,
and writes exit{r}.json if it lived through it.

Uneven runs (rank 1 closes its trainer; it writes the time to victim.json):
  uneven-steps  rank 0 calls trainer.step 3 times, rank 1 twice
  uneven-eval   both train 2 steps; rank 0 calls eval_step twice, rank 1 once
  mixed-steps   both train a step; then rank 0 calls eval_step where rank 1 calls step
  save-on-one   both train a step; then rank 0 saves a checkpoint (the DDP habit) where
                rank 1 trains its next step
  uneven-fit    stages=1 x data_parallel=2: fit over loaders of 5 and 3 batches stops
                both at 3 (uneven="shortest"); uneven="raise" raises before a step; then
                generators (no len) of 5 and 3 batches: rank 0 is told rank 1 left.

A resume that fails on one rank (bad-resume): both save after 2 steps and close; rank 1
truncates its own shard and resumes (CheckpointError), rank 0 resumes and steps.

Each rank writes rank{r}.json: what it raised (type, message, .rank), when, and the
counters of its trainer.
"""

import argparse
import atexit
import functools
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import myelin

PLACES = ["close", "gather", "checkpoint", "state_dict", "barrier", "user", "with"]
UNEVEN = ["uneven-steps", "uneven-eval", "uneven-fit", "mixed-steps", "save-on-one"]
RESUME = ["bad-resume"]
VICTIM = int(os.environ.get("WORLD_SIZE", 2)) - 1


def write(out, name, record):
    with open(os.path.join(out, name), "w") as f:
        json.dump(record, f)


def build(out, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    settings = dict(stages=VICTIM + 1, microbatches=4, timeout=30, run_dir=out, profile=True)
    settings.update(kw)
    return myelin.Trainer(
        model,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=F.cross_entropy,
        **settings,
    )


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def in_with_block(args, rank, record):
    with build(args.out) as trainer:
        for i in range(3):
            trainer.step(*batch(i))
        record["steps"] = trainer.steps_done
        if rank == VICTIM:
            time.sleep(1.0)  # rank 0 is in its 4th step by now
            write(args.out, "victim.json", {"time": time.time(), "how": args.die})
            raise RuntimeError("the victim's own code failed inside its with block")
        trainer.step(*batch(3))
    record["finished_place"] = True


def place(args, rank, record):
    if args.mode == "with":
        return in_with_block(args, rank, record)
    trainer = build(args.out)
    for i in range(3):
        trainer.step(*batch(i))
    record["steps"] = trainer.steps_done
    if rank == VICTIM:
        time.sleep(1.0)  # rank 0 is in its place by now
        write(args.out, "victim.json", {"time": time.time(), "how": args.die})
        if args.die in ("kill", "stop"):  # stop: frozen, alive to the OS, silent to peers
            os.kill(os.getpid(), signal.SIGKILL if args.die == "kill" else signal.SIGSTOP)
        raise RuntimeError("the victim's own code failed after its last step")
    if args.mode == "close":
        trainer.close()
    elif args.mode == "gather":
        trainer.profile_report()
    elif args.mode == "checkpoint":
        trainer.save(os.path.join(args.out, "ckpt"))
    elif args.mode == "state_dict":
        trainer.state_dict()
    elif args.mode == "barrier":
        dist.barrier()
    elif args.mode == "user":
        time.sleep(30)
    record["finished_place"] = True
    time.sleep(30)  # rank 0 must not end by itself: the error has to come from the place


def mixed_steps(args, rank, record):
    """Rank 0 evaluates the second batch where rank 1 trains on it: both fail at once, and
    rank 1's stage is not trained on rank 0's evaluation activations."""
    with build(args.out, profile=False) as trainer:
        trainer.step(*batch(0))
        before = [p.detach().clone() for p in trainer.module.parameters()]
        if rank == VICTIM:
            write(args.out, "victim.json", {"time": time.time()})
        try:
            if rank == 0:
                trainer.eval_step(*batch(1))
            else:
                trainer.step(*batch(1))
        finally:
            after = list(trainer.module.parameters())
            record["unchanged"] = all(torch.equal(a, b) for a, b in zip(after, before))


def save_on_one(args, rank, record):
    """Rank 0 saves where rank 1 trains: each waits in a call the other never makes."""
    with build(args.out, profile=False) as trainer:
        trainer.step(*batch(0))
        if rank == VICTIM:
            write(args.out, "victim.json", {"time": time.time()})
        if rank == 0:
            trainer.save(os.path.join(args.out, "ckpt"))
        else:
            trainer.step(*batch(1))


def uneven_steps(args, rank, record):
    with build(args.out, profile=False) as trainer:
        steps = 3 if rank == 0 else 2
        evals = 0
        if args.mode == "uneven-eval":
            steps, evals = 2, (2 if rank == 0 else 1)
        for i in range(steps):
            trainer.step(*batch(i))
        for i in range(evals):
            trainer.eval_step(*batch(100 + i))
        record["steps"] = trainer.steps_done
    if rank == VICTIM:
        write(args.out, "victim.json", {"time": time.time(), "steps": steps, "evals": evals})


def uneven_fit(args, rank, record):
    trainer = build(args.out, stages=1, data_parallel=2, microbatches=2, profile=False)
    lengths = {0: 5, 1: 3}
    rows = 16 - 4 * rank  # the replicas' batches differ in size too
    mine = [tuple(t[:rows] for t in batch(10 * rank + i)) for i in range(lengths[rank])]
    history = trainer.fit(mine, log_every=1, progress=False)
    record["shortest"] = {
        "steps": [h["step"] for h in history],
        "losses": [h["loss"] for h in history],
        "tokens_per_s": [h["tokens_per_s"] for h in history],
    }
    try:
        trainer.fit(mine, log_every=1, progress=False, uneven="raise")
        record["raise"] = {"error_type": None, "steps_done": trainer.steps_done}
    except Exception as exc:
        record["raise"] = {
            "error_type": type(exc).__name__,
            "error": str(exc),
            "steps_done": trainer.steps_done,
        }
    stream = (batch(20 * rank + i) for i in range(lengths[rank]))  # no len(): found out late
    before = trainer.steps_done
    if rank == VICTIM:
        with trainer:
            trainer.fit(stream, log_every=1, progress=False)
        write(
            args.out,
            "victim.json",
            {"time": time.time(), "steps": trainer.steps_done, "before": before},
        )
        return
    record["steps_before_stream"] = before
    trainer.fit(stream, log_every=1, progress=False)


def bad_resume(args, rank, record):
    ckpt = os.path.join(args.out, "ckpt")
    with build(args.out, profile=False) as trainer:
        for i in range(2):
            trainer.step(*batch(i))
        version = trainer.save(ckpt)
    if rank == VICTIM:
        shard = version / f"rank{rank}.pt"
        shard.write_bytes(shard.read_bytes()[:100])
        write(args.out, "victim.json", {"time": time.time()})
    with build(args.out, profile=False, resume=ckpt) as again:
        record["resumed_at"] = again.steps_done
        again.step(*batch(2))
        record["steps"] = again.steps_done


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("mode", choices=PLACES + UNEVEN + RESUME)
    parser.add_argument("--die", choices=["kill", "stop", "raise"], default="kill")
    parser.add_argument("--end-with-error", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.end_with_error and rank != VICTIM:  # registered first, so it runs last
        atexit.register(sigterm_at_exit, args.out, rank)
    record = {"error_type": None, "error": None}
    failure = None
    try:
        if args.mode in PLACES:
            place(args, rank, record)
        elif args.mode == "uneven-fit":
            uneven_fit(args, rank, record)
        elif args.mode == "bad-resume":
            bad_resume(args, rank, record)
        elif args.mode == "mixed-steps":
            mixed_steps(args, rank, record)
        elif args.mode == "save-on-one":
            save_on_one(args, rank, record)
        else:
            uneven_steps(args, rank, record)
    except BaseException as exc:
        if rank == VICTIM and args.mode in PLACES:
            raise  # the victim's own failure: it ends the victim's script
        record.update(
            error_type=type(exc).__name__,
            error=str(exc),
            lost=getattr(exc, "rank", None),
            notes=getattr(exc, "__notes__", []),
        )
        failure = exc
    record["time"] = time.time()
    write(args.out, f"rank{rank}.json", record)
    if args.end_with_error and failure is not None:
        raise failure
    sys.exit(3 if record["error_type"] else 0)


def sigterm_at_exit(out, rank):
    """A launcher's SIGTERM that finds the rank exiting must not break off its exit."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # a handler runs at the next bytecode; a default one kills at once
    write(out, f"exit{rank}.json", {"lived": True})


if __name__ == "__main__":
    main()
