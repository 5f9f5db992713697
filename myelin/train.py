"""`myelin train`: a small byte-level GPT trained on the Python standard library's source.

    myelin train                                   # ~3 minutes on 2 CPU cores, 2 stages
    myelin train --steps 30 --out /tmp/run         # a quick run
    myelin train --config run.toml --lr 1e-3       # options from TOML; flags override it
    myelin train --model llama                     # a HuggingFace Llama instead (myelin[hf])
    torchrun --nproc-per-node 2 -m myelin.train    # the same job under torchrun

Nothing to download and no GPU needed. Started alone, the job launches its own
`stages x data_parallel` local processes; inside a rank (RANK set) it trains, on
`Trainer.fit`. Rank 0 shows a progress bar and writes the run directory: config.json
(the resolved options), metrics.jsonl, model.pt (the final weights as the model's own
state_dict; a HuggingFace model also gets hf/, a save_pretrained folder), profile/ (where
the time went, and a Perfetto trace) and sample.txt; at the end it prints where the time
went and a sample of generated text. The options are `train_config.py`'s; the models
`train_model.py`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from myelin import checkpoint, train_model
from myelin.callbacks import Callback
from myelin.data import VOCAB_SIZE, Batches, TextData, decode, encode, load_stdlib_text
from myelin.errors import ConfigError
from myelin.launch import launch
from myelin.lr import WarmupCosine
from myelin.metrics import all_reduce
from myelin.models.gpt import lm_loss
from myelin.profile.config import ProfileConfig
from myelin.profile.records import write_json
from myelin.train_config import TrainConfig, add_arguments, config_from_args, read_toml, to_argv
from myelin.trainer import Trainer

__all__ = [
    "TrainConfig",
    "WarmupCosine",
    "add_arguments",
    "config_from_args",
    "main",
    "read_toml",
    "sample",
    "to_argv",
    "train",
]


def new_run_dir(parent: Path = Path("runs")) -> Path:
    """A fresh `runs/<timestamp>` directory (suffixed if two runs start in one second)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"cannot create a run directory under {parent}")


def main(args: argparse.Namespace) -> int:
    """Run `myelin train`: launch the ranks when started alone, else train as this rank."""
    try:
        cfg = config_from_args(args)
        _make_out(cfg)
        if "RANK" in os.environ or cfg.world_size == 1:
            train(cfg)
            return 0
    except ConfigError as exc:
        print(f"myelin train: error: {exc}", file=sys.stderr)
        return 2
    if cfg.resume and _complete(cfg):
        return 0
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=str(new_run_dir()))
    return launch(cfg.world_size, "myelin.train", to_argv(cfg), module=True)


def _make_out(cfg: TrainConfig) -> None:
    """The run directory given, made now: one that cannot be, or that holds an earlier
    run's checkpoint a fresh run would leave beside its own config, is said before any
    rank starts."""
    if cfg.out is None:
        return
    try:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"out={cfg.out!r}: the run directory cannot be made: {exc}") from None
    saved = Path(cfg.out) / "checkpoint"
    if not cfg.resume and saved.is_dir() and any(saved.iterdir()):
        try:
            which = f" (step {checkpoint.steps_saved(saved)})"
        except (checkpoint.CheckpointError, KeyError, ValueError):
            which = ""
        raise ConfigError(
            f"out={cfg.out!r} holds an earlier run's checkpoint{which}: continue it with "
            f"--resume {cfg.out}, or start afresh in another --out (or remove {saved})"
        )


def _complete(cfg: TrainConfig) -> bool:
    """Whether the run to resume already holds all its steps or used all its time (said
    without starting ranks; a missing or broken checkpoint is left for the ranks)."""
    saved = Path(cfg.resume) / "checkpoint"
    try:
        done, seconds = checkpoint.steps_saved(saved), checkpoint.seconds_saved(saved)
    except (checkpoint.CheckpointError, KeyError, ValueError):
        return False
    why = _nothing_left(cfg, done, seconds or 0.0)
    if why is not None:
        _say(f"{cfg.resume}: {why}")
    return why is not None


def _nothing_left(cfg: TrainConfig, done: int, seconds: float) -> str | None:
    """Why a run resumed at step `done` after `seconds` of training has nothing to do (its
    steps done, or its max_minutes used: a longer --steps or --max-minutes goes on)."""
    if done >= cfg.steps:
        return f"already complete at step {done} of {cfg.steps}: nothing to do"
    if seconds >= cfg.max_minutes * 60:
        return (
            f"already complete: max_minutes={cfg.max_minutes:g} used at step {done} of "
            f"{cfg.steps}; nothing to do (give a larger --max-minutes to go on)"
        )
    return None


# -- one rank's run ------------------------------------------------------------------


def train(cfg: TrainConfig) -> None:
    """Train as this process's rank: build, run the steps, then report and sample."""
    data = load_stdlib_text(cfg.max_bytes, cfg.val_fraction)
    model = train_model.build(cfg)  # the same weights on every rank; each keeps its stage
    optimizer = functools.partial(_adamw, lr=cfg.lr, weight_decay=cfg.weight_decay)
    trainer = Trainer(
        model,
        optimizer=optimizer,
        loss_fn=lm_loss,
        stages=cfg.stages,
        microbatches=cfg.microbatches,
        data_parallel=cfg.data_parallel,
        schedule=cfg.schedule,
        # this job prints its own summary; its warm-up is the first training step (and the
        # validation batches before it, which share the step numbering)
        profile=ProfileConfig(print_summary=False, warmup_steps=1 + _first_evals(cfg)),
        resume=Path(cfg.resume) / "checkpoint" if cfg.resume else None,
        offload=cfg.offload(),
        precision=cfg.precision,
        device_memory_limit=cfg.device_memory_limit,
        run_dir=cfg.resume or cfg.out,  # (a resume that fails leaves its record there too)
    )
    with trainer:
        run_dir = _agree_run_dir(cfg, trainer)
        trainer.flight_dir = run_dir / "flight"  # where a failing rank leaves its record
        cfg = dataclasses.replace(cfg, out=str(run_dir))
        why = _nothing_left(cfg, trainer.steps_done, trainer.seconds_trained)
        if why is not None:  # resumed after its last step or its time: leave it as it is
            if trainer.rank == 0:
                _say(why)
            return
        if trainer.rank == 0:
            (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
            _say(_header(cfg, model, data, run_dir))
        run_log = RunLog(run_dir, leader=trainer.rank == 0, resumed_at=trainer.steps_done)
        try:
            _train_steps(cfg, trainer, data, run_log)
        finally:
            run_log.close()
        _finish(cfg, trainer, run_dir, run_log.val_curve)


def _first_evals(cfg: TrainConfig) -> int:
    """Evaluation batches before the first training step: the untrained model's
    validation, which a resumed run does not repeat."""
    return 0 if cfg.resume else cfg.eval_batches


def _adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW that decays matrices only, not biases, norms' gains or other vectors."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.99))


def _agree_run_dir(cfg: TrainConfig, trainer: Trainer) -> Path:
    """The run directory, the same on every rank: given, or made by rank 0 and shared."""
    if cfg.out is not None:
        path = Path(cfg.out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    if trainer.world_size == 1:
        return new_run_dir()
    key = "myelin/train/run_dir"
    if trainer.rank == 0:
        trainer.world.store.set(key, str(new_run_dir()))
    return Path(trainer.world.store.get(key).decode())  # waits until rank 0 has set it


def _header(cfg: TrainConfig, model: torch.nn.Module, data: TextData, run_dir: Path) -> str:
    """What is about to run, on what data, and where its results go."""
    return (
        f"myelin train: {train_model.describe(cfg, model)} "
        f"as {cfg.stages} stages x {cfg.data_parallel} replica(s); up to {cfg.steps} steps of "
        f"{cfg.batch} x {cfg.block_size} bytes in {cfg.max_minutes:g} min\n"
        f"data: {data.train.numel() / 1e6:.1f} MB train, {data.val.numel() / 1e6:.2f} MB val "
        f"from {data.train_files} + {data.val_files} source files under {data.root}\n"
        f"run directory: {run_dir}"
    )


def _say(text: str) -> None:
    """Print on stdout, flushed so it keeps its place beside the progress bar on stderr."""
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


# -- the training loop: Trainer.fit --------------------------------------------------


def _train_steps(cfg: TrainConfig, trainer: Trainer, data: TextData, run_log: RunLog) -> None:
    """Run up to `cfg.steps` steps (fewer if time runs out) on `Trainer.fit`: validating,
    logging and checkpointing as the options say."""
    train_set = Batches(data.train, cfg.block_size, cfg.batch, cfg.seed, ("train", trainer.replica))
    val_set = Batches(data.val, cfg.block_size, cfg.batch, cfg.seed, ("val", trainer.replica))
    first = trainer.steps_done  # resumed: where it left off; batch i follows i steps
    left_s = cfg.max_minutes * 60 - trainer.seconds_trained  # resumed: what is left of it
    if first >= cfg.steps or left_s <= 0:
        if left_s <= 0 and run_log.leader:
            _say(f"stopped at step {first} of {cfg.steps}: max_minutes={cfg.max_minutes} used")
        return
    trainer.fit(
        (train_set.get(i) for i in itertools.count(first)),
        steps=cfg.steps - first,
        max_seconds=left_s,
        lr_schedule=functools.partial(
            WarmupCosine, warmup_steps=cfg.warmup_steps, floor=cfg.min_lr / cfg.lr
        ),
        eval_loader=val_set,  # iterated afresh each time: batches 0..eval_batches-1
        eval_every=cfg.eval_every,
        eval_first=first == 0,  # the untrained model's loss, for the closing line
        eval_batches=cfg.eval_batches,
        log_every=cfg.log_every,
        checkpoint_dir=run_log.run_dir / "checkpoint",
        checkpoint_every=cfg.checkpoint_every,
        callbacks=[run_log],
    )
    if trainer.steps_done < cfg.steps and run_log.leader:
        done = trainer.steps_done
        _say(f"stopped at step {done} of {cfg.steps}: max_minutes={cfg.max_minutes} used")


class RunLog(Callback):
    """Rank 0's record of training: metrics.jsonl, one rounded row per logged step, and
    the validation curve. On every other rank it only keeps the curve."""

    def __init__(self, run_dir: Path, leader: bool, resumed_at: int = 0) -> None:
        self.run_dir = run_dir
        self.leader = leader
        path = run_dir / "metrics.jsonl"
        # resumed: the rows up to the checkpoint stay (and their validations start the
        # curve); rows logged after it, before the run stopped, are logged again
        kept = _rows_until(path, resumed_at) if leader and resumed_at else []
        self.val_curve = [(r["step"], r["val_loss"]) for r in kept if "val_loss" in r]
        self.metrics = open(path, "w") if leader else None  # (read above, before this)
        if self.metrics is not None:
            self.metrics.writelines(json.dumps(row) + "\n" for row in kept)

    def on_log(self, trainer: Any, metrics: dict[str, Any]) -> None:
        row = _rounded(metrics)
        if "val_loss" in row:
            self.val_curve.append((row["step"], row["val_loss"]))
        if self.metrics is not None:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        """Close the metrics file."""
        if self.metrics is not None:
            self.metrics.close()


def _rows_until(path: Path, step: int) -> list[dict[str, Any]]:
    """The rows of a metrics file logged at or before `step` (a torn last line dropped)."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                rows.append(row)
    return rows


_DIGITS = {"loss": 5, "loss_avg": 5, "tokens_per_s": 1, "idle_frac": 4, "val_loss": 5}


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row as metrics.jsonl keeps it: losses to 5 places, lr to 4 digits."""
    out = {k: round(v, _DIGITS[k]) if k in _DIGITS else v for k, v in row.items()}
    if "lr" in out:
        out["lr"] = float(f"{out['lr']:.4g}")
    return out


# -- the end of the run --------------------------------------------------------------


def _finish(cfg: TrainConfig, trainer: Trainer, run_dir: Path, val_curve: list) -> None:
    """Every rank hands in its timeline and its stage's weights; rank 0 reports and samples."""
    report = trainer.profile_report()  # collective, JSON via the store; the run's warm-up
    state = trainer.state_dict()  # collective: the whole model on rank 0, None elsewhere
    memory = trainer.memory_stats()
    if train_model.is_hf(cfg.model):  # collective: a folder from_pretrained loads
        trainer.save_pretrained(run_dir / "hf")
    write_json(run_dir / "memory" / f"rank{trainer.rank}.json", memory, indent=1)
    slots = [0.0] * trainer.world_size  # every rank's resident memory, for rank 0's summary
    slots[trainer.rank] = float(memory["rss_bytes"])
    rss = all_reduce(slots, waits=trainer.world.waits, what="the run's memory summary")
    if trainer.rank != 0:
        return
    report.save(run_dir / "profile")  # summary, trace, PNG timeline, raw records
    torch.save(state, run_dir / "model.pt")
    _say("where the time went:\n" + report.format())
    _say(_memory_line(memory))
    _say(
        "resident memory: " + ", ".join(f"rank {r} {b / 2**20:.1f} MiB" for r, b in enumerate(rss))
    )
    if val_curve:
        (first_step, first), (last_step, last) = val_curve[0], val_curve[-1]
        _say(f"validation loss {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})")
    if cfg.sample_tokens:
        model = train_model.build(cfg)
        model.load_state_dict(state)
        text = sample(
            model.eval(), cfg.prompt, cfg.sample_tokens, cfg.temperature, cfg.top_k, cfg.seed
        )
        (run_dir / "sample.txt").write_text(text)
        shown = "\n".join(f"  | {line}" for line in text.splitlines()[:12])
        _say(f"sample (temperature {cfg.temperature}, top-k {cfg.top_k}):\n{shown}")
    else:  # a reused run directory keeps no sample of an earlier run's model
        (run_dir / "sample.txt").unlink(missing_ok=True)
    _say(f"run directory: {run_dir} (profile/trace.json opens in Perfetto)")


def _memory_line(m: dict[str, Any]) -> str:
    """Rank 0's memory in one line (every rank's is in memory/rankN.json)."""
    mib = 1 << 20
    return (
        f"memory (rank 0): device peak {m['device_peak_bytes'] / mib:.1f} MiB "
        f"({m['device_peak_measured_by']}), host pool peak {m['host_pool_peak_bytes'] / mib:.1f} "
        f"MiB; per step {m['activations_offloaded_bytes'] / mib:.1f} MiB of activations paged "
        f"out, optimizer {m['optimizer_mode']} ({m['optimizer_host_bytes'] / mib:.1f} MiB on the "
        f"host); prefetch hits {m['prefetch_hits']}, misses {m['prefetch_misses']}, backward "
        f"waited {m['offload_wait_seconds']:.2f}s"
    )


@torch.no_grad()
def sample(
    model: torch.nn.Module, prompt: str, tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    """Continue `prompt` by `tokens` bytes, sampling from the top-k at `temperature`."""
    g = torch.Generator().manual_seed(seed)
    idx = encode(prompt)[None, :]  # (1, T)
    for _ in range(tokens):
        window = idx[:, -train_model.context(model) :]
        logits = train_model.logits(model, window)[0, -1, :VOCAB_SIZE] / temperature  # (vocab,)
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        probs = torch.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)[None]], dim=1)
    return decode(idx[0])


def _parser() -> argparse.ArgumentParser:
    """The parser of `python -m myelin.train`, the same options as `myelin train`."""
    parser = argparse.ArgumentParser(prog="myelin train")
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(_parser().parse_args()))
