"""A HuggingFace Llama of ~300M parameters: loaded per stage, and trained against plain HF.

    python3 bench/hf.py            # ~4 minutes on 2 cores, writes bench/results/hf.json
    python3 bench/hf.py --quick    # a small Llama, well under a minute

The model is LlamaForCausalLM (hidden 1024, 20 layers, 16 heads / 8 KV heads, MLP 2816,
vocabulary 32000, untied: 302M parameters, 1.21 GB in fp32), written once with HF's own
`save_pretrained` in 500 MB shards. Each configuration runs in fresh processes, one torch
thread each:

- load: peak resident memory (VmHWM) up to the end of the first training step (AdamW:
  parameters, gradients and optimizer state all live), and the time to it, counted from
  after the imports, for
  * hf whole: `AutoModelForCausalLM.from_pretrained(folder)` in one process, plain HF step;
  * myelin meta: every rank builds the model under `myelin.init_empty()` from the config
    and `Trainer(model, stages=2, weights=folder)` reads its own stage's tensors;
  * myelin whole per rank: every rank calls `from_pretrained(folder)` and hands the whole
    model to `Trainer(model, stages=2)` (what was possible before `weights=`).
  The peak at load alone says little: transformers 5 maps safetensors files and reads a
  tensor's pages when first touched (myelin's `weights=` reads its stage's tensors into
  its parameters at once). A pipeline rank's RSS also counts the transport's
  shared-memory segments (committed as slots reach into them, shared with the
  neighbour); "less shared" takes them out.
- speed: tokens/s of `Trainer(model)` at stages=1 against plain HF in the same process,
  on the same model and the same batches (2 microbatches of gradient accumulation, HF's
  loss with num_items_in_batch), alternating step by step, the order reversed every other
  round so load that comes and goes on a shared machine hits both alike; "paired" is the
  median over rounds of myelin's step time over HF's. Then stages=2 (two processes) on the
  same batches, for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Any

from _harness import Workers, print_table, reply, summary, write_json

T0 = time.perf_counter()
FULL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=8,
)
QUICK = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
)
GOAL_MEMORY = 0.6  # per-rank peak at stages=2 over whole-model loading
GOAL_OVERHEAD = 0.05  # stages=1 tokens/s at most 5% under plain HF


def config(quick: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000 if not quick else 8000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **(QUICK if quick else FULL),
    )


def batches(n: int, rows: int, seq: int, vocab: int) -> list[tuple[Any, Any]]:
    """The same (input_ids, labels) steps everywhere; labels are the inputs, as HF takes them."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [
        (ids, ids.clone())
        for ids in (torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(n))
    ]


def memory() -> dict[str, int]:
    """This process's resident set now, at its peak, and now in private and in shared
    memory (the transport's shared-memory segments count in the RSS of every process
    that maps them), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssShmem")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return {
        "rss": out["VmRSS"],
        "peak": out["VmHWM"],
        "anon": out["RssAnon"],
        "shmem": out["RssShmem"],
    }


def plain_step(model: Any, opt: Any, ids: Any, labels: Any, microbatches: int) -> None:
    """Plain HF gradient accumulation, as HF's Trainer does it."""
    count = int((labels[:, 1:] != -100).sum())
    for x, y in zip(ids.chunk(microbatches), labels.chunk(microbatches)):
        model(input_ids=x, labels=y, num_items_in_batch=count).loss.backward()
    opt.step()
    opt.zero_grad()


# -- workers ------------------------------------------------------------------------------


def work(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    import myelin

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    adamw = partial(torch.optim.AdamW, lr=1e-4)
    data = batches(2 + 2 * args.rounds, args.rows, args.seq, config(args.quick).vocab_size)
    imported = {"after_imports_s": time.perf_counter() - T0, **memory()}
    start = time.perf_counter()
    if kind == "hf whole":
        model = transformers.AutoModelForCausalLM.from_pretrained(args.folder)
        loaded = memory()
        plain_step(model, adamw(model.parameters()), *data[0], args.microbatches)
        return _loaded(imported, loaded, start, rank=0)
    if kind in ("myelin meta", "myelin whole per rank", "speed 2 stages"):
        if kind == "myelin whole per rank":
            model, weights = transformers.AutoModelForCausalLM.from_pretrained(args.folder), None
        else:
            with myelin.init_empty():
                model = transformers.AutoModelForCausalLM.from_config(config(args.quick))
            weights = args.folder
        trainer = myelin.Trainer(
            model, adamw, stages=2, microbatches=args.microbatches, weights=weights, timeout=900
        )
        loaded = memory()
        trainer.step(*data[0])
        out = _loaded(imported, loaded, start, rank=trainer.rank)
        if kind == "speed 2 stages":
            times = []
            for ids, labels in data[2:]:
                t = time.perf_counter()
                trainer.step(ids, labels)
                times.append(time.perf_counter() - t)
            out["step_s"] = times
        trainer.close()
        return out
    if kind == "speed":
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(args.quick))
        trainer = myelin.Trainer(model, adamw, microbatches=args.microbatches)
        opt = adamw(model.parameters())
        peers = {
            "myelin": lambda ids, labels: trainer.step(ids, labels),
            "hf": lambda ids, labels: plain_step(model, opt, ids, labels, args.microbatches),
        }
        for name in peers:  # warm up both
            peers[name](*data[1])
        times: dict[str, list[float]] = {name: [] for name in peers}
        for r in range(args.rounds):
            order = list(peers) if r % 2 == 0 else list(reversed(peers))
            for i, name in enumerate(order):
                ids, labels = data[2 + 2 * r + i]
                t = time.perf_counter()
                peers[name](ids, labels)
                times[name].append(time.perf_counter() - t)
        trainer.close()
        return {"rank": 0, "step_s": times}
    raise ValueError(kind)


def _loaded(imported: dict, loaded: dict, start: float, rank: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "imported": imported,
        "loaded": loaded,
        "stepped": memory(),
        "first_step_s": time.perf_counter() - start,
    }


def serve(kind: str, args: argparse.Namespace) -> None:
    reply(work(kind, args))
    for line in sys.stdin:  # until the parent says quit
        if json.loads(line).get("quit"):
            return


# -- the parent ---------------------------------------------------------------------------


def run(kind: str, ranks: int, args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    argv = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--folder",
        args.folder,
        "--rounds",
        str(args.rounds),
        "--rows",
        str(args.rows),
        "--seq",
        str(args.seq),
        "--microbatches",
        str(args.microbatches),
    ] + (["--quick"] if args.quick else [])
    workers = Workers(kind, argv, ranks, tmp, threads=1, timeout_s=1800)
    try:
        print(f"  {kind} ...", flush=True)
        return sorted(workers.wait(), key=lambda r: r["rank"])
    finally:
        workers.close()


def write_model(args: argparse.Namespace) -> int:
    """Save the model once, as HF writes it; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(args.quick))
    model.save_pretrained(args.folder, max_shard_size="500MB")
    return sum(p.numel() for p in model.parameters())


def report(args: argparse.Namespace, params: int, got: dict[str, list[dict]]) -> dict[str, Any]:
    gib = 2**30
    whole = got["hf whole"][0]["stepped"]["peak"]
    rows, loads = [], {}
    for kind in ("hf whole", "myelin meta", "myelin whole per rank"):
        for r in got[kind]:
            peak, shared = r["stepped"]["peak"], r["stepped"]["shmem"]
            entry = {
                **r,
                "peak_over_hf": peak / whole,
                "private_peak_over_hf": (peak - shared) / whole,
            }
            loads[f"{kind} rank {r['rank']}"] = entry
            rows.append(
                [
                    f"{kind} (rank {r['rank']})",
                    f"{r['imported']['rss'] / gib:.2f}",
                    f"{r['loaded']['peak'] / gib:.2f}",
                    f"{peak / gib:.2f}",
                    f"{shared / gib:.2f}",
                    f"{entry['peak_over_hf']:.2f}",
                    f"{entry['private_peak_over_hf']:.2f}",
                    f"{r['first_step_s']:.1f}",
                ]
            )
    print_table(
        [
            "",
            "after imports",
            "peak at load",
            "peak to step 1",
            "of it shared",
            "vs hf",
            "less shared vs hf",
            "to step 1 s",
        ],
        rows,
        f"loading a {params / 1e6:.0f}M-parameter Llama ({params * 4 / gib:.2f} GiB fp32) "
        f"and training one step; memory in GiB",
    )
    tokens = args.rows * args.seq
    speed = got["speed"][0]["step_s"]
    ratios = [m / h for m, h in zip(speed["myelin"], speed["hf"])]
    two = got["speed 2 stages"][0]["step_s"]
    table = {
        "hf, one process": summary([tokens / s for s in speed["hf"]]),
        "myelin stages=1": summary([tokens / s for s in speed["myelin"]]),
        "myelin stages=2 (2 processes)": summary([tokens / s for s in two]),
    }
    print_table(
        ["peer", "tokens/s median", "min", "max"],
        [[k, f"{v['median']:.1f}", f"{v['min']:.1f}", f"{v['max']:.1f}"] for k, v in table.items()],
        f"training, {tokens} tokens a step in {args.microbatches} microbatches, "
        f"{args.rounds} rounds",
    )
    overhead = statistics.median(ratios) - 1
    metas = [v for k, v in loads.items() if k.startswith("myelin meta")]
    meta_peak = max(v["peak_over_hf"] for v in metas)
    meta_private = max(v["private_peak_over_hf"] for v in metas)
    print(
        f"\nstages=1 over plain HF, paired by round: {overhead:+.1%} step time "
        f"(goal at most {GOAL_OVERHEAD:.0%}); per-rank peak to the first step with "
        f"init_empty + weights=: {meta_peak:.2f}x plain HF's, {meta_private:.2f}x less the "
        f"transport's shared-memory segments (goal at most {GOAL_MEMORY})"
    )
    return {
        "params": params,
        "load": loads,
        "speed": {
            "tokens_per_step": tokens,
            "tokens_per_s": table,
            "step_s": speed,
            "stages2_step_s": two,
            "paired_myelin_over_hf": ratios,
            "overhead": overhead,
        },
        "goals": {
            "memory": {
                "got": meta_peak,
                "got_less_shared": meta_private,
                "goal": GOAL_MEMORY,
                "met": meta_peak <= GOAL_MEMORY,
            },
            "overhead": {"got": overhead, "goal": GOAL_OVERHEAD, "met": overhead <= GOAL_OVERHEAD},
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small Llama, for a fast check")
    p.add_argument("--rounds", type=int, default=None, help="timed steps per peer (speed)")
    p.add_argument("--rows", type=int, default=2, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--out", default=None, help="where to write the JSON (default bench/results)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        serve(args.worker, args)
        return 0
    start, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="myelin-bench-hf-") as tmp:
        args.folder = os.path.join(tmp, "llama")
        print(f"writing the model to {args.folder} ...", flush=True)
        params = write_model(args)
        got = {}
        for kind, ranks in (
            ("hf whole", 1),
            ("myelin meta", 2),
            ("myelin whole per rank", 2),
            ("speed", 1),
            ("speed 2 stages", 2),
        ):
            got[kind] = run(kind, ranks, args, tmp)
    payload = report(args, params, got)
    payload = {
        "quick": args.quick,
        "rows": args.rows,
        "seq": args.seq,
        "rounds": args.rounds,
        "wall_s": time.monotonic() - start,
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        **payload,
    }
    path = write_json("hf", payload, args.out or (None if not args.quick else os.devnull))
    print(f"\nwrote {path} ({payload['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
