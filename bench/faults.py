"""Soak under hostile peers: a 2-stage GPT trains for N minutes, then again under a flood.

    python3 bench/faults.py                          # 2 minutes each (~5 minutes in all)
    python3 bench/faults.py --minutes 0.5            # ~1.5 minutes
    python3 bench/faults.py --rate 5000 --out /tmp/faults.json

Two `myelin run -n 2` jobs train the same GPT on the same batches (same seeds) with
message-driven scheduling over ipc and shared memory, one torch thread per rank:

- clean: as many steps as fit in `--minutes` (rank 0 decides before each step, through
  the store, so both ranks stop after the same one);
- flood: the same number of steps while the attacker of tests/workers/hostile.py (its
  own process and ZeroMQ context, inbox addresses read from the store) sends both ranks
  `--rate` bad messages a second: garbage, truncated frames, lying or huge sizes, wrong
  versions, unknown ranks, forged control ops, and well-formed messages for the wrong
  stage, microbatch or step (the catalogue in hostile.py; frames over the size limit are
  left out, since they only cut the attacker's connection).

With `--quiet`, a third job repeats the flood with myelin's warnings silenced (logger
"myelin" at ERROR), to show how much of the cost is the line logged per dropped message.

The table gives steps/s (after the first `--warmup` steps) with and without the flood,
what the attacker sent, what each rank dropped (transport.stats.rejected counts frames
that failed decoding and abused control ops; loop.stats.rejected counts well-formed
messages the loop refused), the warning lines the ranks logged, their peak RSS, and
whether the losses of every step are bit-identical. On a machine with few cores the
attacker competes with the ranks for CPU: its CPU seconds are reported beside them.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
ATTACKER = ROOT / "tests" / "workers" / "hostile.py"
MICROBATCHES, BATCH, SEQ, LR = 4, 8, 64, 3e-4
MIB = 2**20
RUNS = ("clean", "flood", "flood-quiet")


# -- the ranks (run under `myelin run -n 2 faults.py --worker RUN`) ---------------------------


def worker(args: argparse.Namespace) -> None:
    """Train until rank 0's time is up (clean) or for `--steps` (flood); write rankN.json."""
    import torch

    import myelin
    from myelin.models import GPT, GPTConfig, lm_loss
    from myelin.runtime.messages import MessageLimits

    torch.set_num_threads(1)
    if args.worker == "flood-quiet":
        logging.getLogger("myelin").setLevel(logging.ERROR)
    rank, out = int(os.environ["RANK"]), Path(args.dir)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, d_model=128))
    limits = MessageLimits(max_tensor_bytes=MIB, max_message_bytes=2 * MIB)  # as the tests
    trainer = myelin.Trainer(
        model,
        optimizer=functools.partial(torch.optim.AdamW, lr=LR),
        loss_fn=lm_loss,
        stages=2,
        microbatches=MICROBATCHES,
        transport=myelin.TransportConfig(kind="ipc", limits=limits),
        timeout=60,
    )
    store = trainer.world.store
    with trainer:
        if rank == 0:
            _publish_inboxes(trainer, out)
            if args.worker != "clean":  # start training once the flood is on
                _wait_for(out / "attacker.json", 60)
        losses, times = [], []
        start = time.monotonic()
        step, last = 0, False
        while not last:
            if args.steps is not None:
                last = step == args.steps - 1
            elif rank == 0 and time.monotonic() - start > args.seconds:
                last = True  # said before this step's first message, so rank 1 knows in time
                store.set("faults/last", str(step))
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
            t0 = time.perf_counter()
            losses.append(trainer.step(x[:, :-1], x[:, 1:]))
            times.append(time.perf_counter() - t0)
            step += 1
            if rank == 0:
                (out / "progress.tmp").write_text(str(step))
                os.replace(out / "progress.tmp", out / "progress")
            elif args.steps is None and store.check(["faults/last"]):
                last = int(store.get("faults/last")) == step - 1
        record = {
            "losses": losses,
            "step_s": times,
            "transport_rejected": trainer.transport.stats.rejected,
            "loop_rejected": trainer.loop.stats.rejected,
            "loop_early": trainer.loop.stats.early,
            "received_messages": trainer.transport.stats.received_messages,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "cpu_s": time.process_time(),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _publish_inboxes(trainer: Any, out: Path) -> None:
    """Each rank's inbox address, as transport.py publishes it in the store."""
    store = trainer.world.store
    addresses = {}
    for r in range(trainer.world_size):
        generation = store.add(f"myelin/trainers/{r}", 0)
        addresses[r] = store.get(f"myelin/t{generation}/addr/{r}").decode()
    (out / "targets.tmp").write_text(json.dumps({"addresses": addresses}))
    os.replace(out / "targets.tmp", out / "targets.json")


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f}s")
        time.sleep(0.01)


# -- the driver -----------------------------------------------------------------------------


def run_job(name: str, args: argparse.Namespace, steps: int | None) -> dict[str, Any]:
    """One `myelin run` job (and, for the flood, the attacker); every rank's record."""
    with tempfile.TemporaryDirectory(prefix=f"faults-{name}-") as tmp:
        out = Path(tmp)
        argv = [sys.executable, "-m", "myelin.cli", "run", "-n", "2", __file__, "--worker", name]
        argv += ["--dir", tmp, "--seconds", str(args.minutes * 60)]
        argv += ["--steps", str(steps)] if steps is not None else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MYELIN_RUN_DIR": tmp, "TMPDIR": tmp}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        log_path = out / "ranks.log"
        limit = args.minutes * 60 * 4 + 300
        attacker, status = None, out / "attacker.json"
        start = time.monotonic()
        with open(log_path, "w") as log:
            job = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                if name != "clean":
                    _wait_for(out / "targets.json", 120)
                    attacker = subprocess.Popen(
                        [sys.executable, str(ATTACKER), "attack", "--junk"]
                        + ["--targets", str(out / "targets.json"), "--status", str(status)]
                        + ["--progress", str(out / "progress"), "--rate", str(args.rate)]
                        + ["--seconds", str(limit)],
                        env=env,
                    )
                code = job.wait(timeout=limit)
            finally:
                attacker_cpu = _cpu_s(attacker.pid) if attacker is not None else 0.0
                for proc in (attacker, job):
                    if proc is not None and proc.poll() is None:
                        _stop(proc)
        elapsed = time.monotonic() - start
        text = log_path.read_text(errors="replace")
        if code != 0:
            raise SystemExit(f"{name} run failed (exit {code}):\n{text[-4000:]}")
        ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
        sent = json.loads(status.read_text()) if status.exists() else {}
        lines = text.splitlines()
        for r, rec in ranks.items():
            rec["warnings_logged"] = sum(line.startswith(f"rank {r}: ") for line in lines)
        return {
            "ranks": ranks,
            "attacker": {**sent, "cpu_s": attacker_cpu} if sent else None,
            "wall_s": elapsed,
            "log_bytes": len(text.encode()),
        }


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a live process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the launcher passes it on to its ranks), then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summarize(name: str, job: dict[str, Any], warmup: int) -> dict[str, Any]:
    times = job["ranks"][0]["step_s"][warmup:]
    return {
        "run": name,
        "steps": len(job["ranks"][0]["losses"]),
        "steps_per_s": len(times) / sum(times),
        "median_step_ms": 1000 * statistics.median(times),
        "attacker_sent": job["attacker"]["total"] if job["attacker"] else 0,
        "attacker_dropped_by_zmq": job["attacker"]["dropped"] if job["attacker"] else 0,
        "attacker_cpu_s": job["attacker"]["cpu_s"] if job["attacker"] else 0.0,
        **{
            f"rank{r}_{key}": rec[key]
            for r, rec in job["ranks"].items()
            for key in ("transport_rejected", "loop_rejected", "warnings_logged", "cpu_s")
        },
        **{
            f"rank{r}_peak_rss_mib": round(rec["peak_rss_mib"], 1)
            for r, rec in job["ranks"].items()
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="training time of each run")
    parser.add_argument("--rate", type=float, default=2000.0, help="bad messages a second")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of steps/s")
    parser.add_argument("--out", help="JSON path (default bench/results/faults.json)")
    parser.add_argument("--quiet", action="store_true", help="also flood with warnings off")
    parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    clean = run_job("clean", args, None)
    steps = len(clean["ranks"][0]["losses"])
    jobs = {"clean": clean, "flood": run_job("flood", args, steps)}
    if args.quiet:
        jobs["flood-quiet"] = run_job("flood-quiet", args, steps)
    rows = [summarize(name, job, args.warmup) for name, job in jobs.items()]
    same = all(
        job["ranks"][r]["losses"] == clean["ranks"][0]["losses"]
        for job in jobs.values()
        for r in (0, 1)
    )
    keys = ["steps", "steps_per_s", "median_step_ms", "attacker_sent", "attacker_cpu_s"]
    keys += [f"rank{r}_{k}" for k in ("transport_rejected", "loop_rejected") for r in (0, 1)]
    keys += ["rank0_warnings_logged", "rank1_warnings_logged"]
    keys += ["rank0_peak_rss_mib", "rank1_peak_rss_mib", "rank0_cpu_s", "rank1_cpu_s"]
    title = (
        f"2-stage GPT, {args.minutes:g} min clean, then the same steps under "
        f"{args.rate:g} bad messages/s"
    )
    table = [[k, *(_fmt(row[k]) for row in rows)] for k in keys]
    print_table(["", *(row["run"] for row in rows)], table, title=title)
    slowdown = 1 - rows[1]["steps_per_s"] / rows[0]["steps_per_s"]
    print(
        f"\nsteps/s under the flood: {100 * slowdown:.1f}% lower; losses of all {steps} steps "
        f"bit-identical on both ranks in every run: {'yes' if same else 'NO'}"
    )
    payload = {
        "config": {
            "minutes": args.minutes,
            "rate": args.rate,
            "warmup": args.warmup,
            "microbatches": MICROBATCHES,
            "batch": BATCH,
            "seq": SEQ,
            "model": "GPT vocab 256, 4 layers, 4 heads, d_model 128, 2 stages",
        },
        "summary": rows,
        "losses_identical": same,
        "slowdown": slowdown,
        "runs": jobs,
    }
    path = write_json("faults", payload, args.out)
    print(f"wrote {path}")
    return 0 if same else 1


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
