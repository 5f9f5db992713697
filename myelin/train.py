"""`myelin train`: a small byte-level GPT trained on the Python standard library's source.

    myelin train                                   # ~3 minutes on 2 CPU cores, 2 stages
    myelin train --steps 30 --out /tmp/run         # a quick run
    myelin train --config run.toml --lr 1e-3       # options from TOML; flags override it
    torchrun --nproc-per-node 2 -m myelin.train    # the same job under torchrun

Nothing to download and no GPU needed. Started alone, the job launches its own
`stages x data_parallel` local processes; inside a rank (RANK set) it trains. Rank 0
shows a progress bar and writes the run directory: config.json (the resolved options),
metrics.jsonl, model.pt (the final weights as a plain GPT state_dict), profile/ (where
the time went, and a Perfetto trace) and sample.txt; at the end it prints where the
time went and a sample of generated text.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from myelin.data import VOCAB_SIZE, Batches, TextData, decode, encode, load_stdlib_text
from myelin.errors import ConfigError
from myelin.launch import launch
from myelin.models.gpt import GPT, GPTConfig, lm_loss
from myelin.offload.config import PRECISIONS, OffloadConfig
from myelin.offload.pool import parse_bytes
from myelin.profile.accounting import account
from myelin.profile.config import ProfileConfig
from myelin.profile.report import gather_report
from myelin.profile.timeline import Timeline
from myelin.runtime.schedule import SCHEDULES
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


class Range(NamedTuple):
    """Allowed values of a number; `open_lo`/`open_hi` exclude the bound itself."""

    lo: float
    hi: float
    open_lo: bool = False
    open_hi: bool = False

    def __contains__(self, x: object) -> bool:
        lo_ok = x > self.lo if self.open_lo else x >= self.lo
        return lo_ok and (x < self.hi if self.open_hi else x <= self.hi)

    def __str__(self) -> str:
        return f"{'(' if self.open_lo else '['}{self.lo}, {self.hi}{')' if self.open_hi else ']'}"


def _opt(
    default: Any,
    group: str,
    help: str,
    within: Range | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A config field with its --help text and section, and its allowed values."""
    meta = {"group": group, "help": help, "within": within, "choices": choices}
    return field(default=default, metadata=meta)


BIG = 10**9
POSITIVE = Range(0, 1, open_lo=True)  # (0, 1]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Every option of `myelin train`; checked when built, each error naming field and range."""

    n_layer: int = _opt(4, "model", "transformer blocks", Range(1, 256))
    n_head: int = _opt(4, "model", "attention heads per block", Range(1, 256))
    d_model: int = _opt(128, "model", "width of the residual stream", Range(1, 16384))
    block_size: int = _opt(128, "model", "context length in bytes", Range(1, 65536))
    batch: int = _opt(16, "pipeline", "sequences per step per replica", Range(1, 1 << 20))
    microbatches: int = _opt(4, "pipeline", "microbatches per step", Range(1, 4096))
    stages: int = _opt(2, "pipeline", "pipeline stages (processes per replica)", Range(1, 1024))
    data_parallel: int = _opt(1, "pipeline", "replicas of the pipeline", Range(1, 1024))
    schedule: str = _opt("message-driven", "pipeline", "operation order", choices=SCHEDULES)
    offload_activations: str = _opt(
        "on", "memory", "page saved activations out to host memory", choices=("on", "off")
    )
    offload_optimizer: str = _opt(
        "on",
        "memory",
        "keep optimizer state and fp32 master weights in host memory; on = host on a CPU, "
        "stream on a GPU",
        choices=("on", "off", "host", "stream"),
    )
    precision: str = _opt("fp32", "memory", "training precision", choices=PRECISIONS)
    device_memory_limit: str | None = _opt(None, "memory", "cap each rank's device, e.g. 6GiB")
    host_memory_limit: str | None = _opt(
        None, "memory", "cap each rank's host pool, e.g. 16GiB; default 80%% of free memory"
    )
    steps: int = _opt(2000, "optimization", "training steps, at most", Range(1, BIG))
    lr: float = _opt(2e-3, "optimization", "peak learning rate (AdamW)", POSITIVE)
    min_lr: float = _opt(2e-4, "optimization", "learning rate after cosine decay", Range(0, 1))
    warmup_steps: int = _opt(20, "optimization", "steps of linear warmup", Range(0, BIG))
    weight_decay: float = _opt(0.1, "optimization", "AdamW decay of matrices", Range(0, 1))
    max_minutes: float = _opt(
        2.75, "optimization", "stop training after this many minutes", Range(0, 10080, open_lo=True)
    )
    eval_every: int = _opt(50, "logging", "validate every N steps and at the end", Range(1, BIG))
    eval_batches: int = _opt(8, "logging", "batches per validation", Range(1, 1 << 20))
    log_every: int = _opt(10, "logging", "write a metrics row every N steps", Range(1, BIG))
    seed: int = _opt(0, "data", "seed of the model and the batches", Range(0, 2**63 - 1))
    max_bytes: int = _opt(4 << 20, "data", "bytes of stdlib source to read", Range(1024, 1 << 40))
    val_fraction: float = _opt(
        0.05, "data", "share of files held out", Range(0, 1, open_lo=True, open_hi=True)
    )
    out: str | None = _opt(None, "run", "run directory; default runs/<timestamp>")
    resume: str | None = _opt(None, "run", "continue the run in this directory from its checkpoint")
    checkpoint_every: int = _opt(
        100, "run", "checkpoint every N steps and at the end", Range(1, BIG)
    )
    sample_tokens: int = _opt(300, "sampling", "bytes to generate at the end", Range(0, 1 << 20))
    prompt: str = _opt("def ", "sampling", "text the sample starts from")
    temperature: float = _opt(0.8, "sampling", "sampling temperature", Range(0, 100, True))
    top_k: int = _opt(40, "sampling", "sample among the k likeliest bytes", Range(1, VOCAB_SIZE))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field(self, f)
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.batch % self.microbatches:
            raise ConfigError(
                f"batch={self.batch} must split evenly into microbatches={self.microbatches}"
            )
        if self.stages > self.n_layer + 2:
            raise ConfigError(
                f"stages={self.stages} exceeds the model's {self.n_layer + 2} layers "
                f"(embedding, n_layer={self.n_layer} blocks, head)"
            )
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr={self.min_lr} must not exceed lr={self.lr}")
        if not self.prompt:
            raise ConfigError("prompt='' must hold at least one character")
        parse_bytes(self.device_memory_limit, "device_memory_limit")
        self.offload()  # checks host_memory_limit

    def offload(self) -> OffloadConfig:
        """The offload settings these options ask for."""
        optimizer = {"on": True, "off": False}.get(self.offload_optimizer, self.offload_optimizer)
        return OffloadConfig(
            activations=self.offload_activations == "on",
            optimizer=optimizer,
            host_memory_limit=self.host_memory_limit,
        )

    @property
    def world_size(self) -> int:
        """Processes the job runs in: stages x data_parallel."""
        return self.stages * self.data_parallel

    def model_config(self) -> GPTConfig:
        """The GPT these options describe (byte-level: a vocabulary of 256)."""
        return GPTConfig(
            vocab_size=VOCAB_SIZE,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.d_model,
            seed=self.seed,
        )


def _check_field(cfg: TrainConfig, f: dataclasses.Field) -> None:
    """Check one field's type and allowed values; ints given for floats become floats."""
    value, kind = getattr(cfg, f.name), f.type
    if value is None and kind.endswith("None"):
        return
    if kind == "float" and type(value) is int:
        value = float(value)
        object.__setattr__(cfg, f.name, value)
    expected = {"int": int, "float": float}.get(kind, str)
    if type(value) is not expected:
        what = {int: "an int", float: "a number"}.get(expected, "a string")
        raise ConfigError(f"{f.name}={value!r} must be {what}")
    within, choices = f.metadata["within"], f.metadata["choices"]
    if within is not None and value not in within:
        raise ConfigError(f"{f.name}={value!r} must be in {within}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{f.name}={value!r} must be one of {', '.join(choices)}")


# -- command line and TOML ---------------------------------------------------------

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_GROUPS = ("model", "pipeline", "memory", "optimization", "logging", "data", "sampling", "run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option of `myelin train` to `parser`; each flag defaults to None (not given)."""
    parser.description = (
        "Train a byte-level GPT on this Python's standard library source as a pipeline of "
        "local processes. Writes config.json, metrics.jsonl, model.pt, profile/ and "
        "sample.txt to the run directory. Training ends after --steps or --max-minutes, "
        "whichever comes first, and the learning rate anneals by then. Options come from "
        "--config (TOML, keys as below with underscores) and from flags, which override it."
    )
    parser.add_argument("--config", metavar="TOML", help="read options from this TOML file")
    sections = {g: parser.add_argument_group(f"{g} options") for g in _GROUPS}
    for name, f in FIELDS.items():
        sections[f.metadata["group"]].add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_flag_type(f),
            default=None,
            metavar={"int": "N", "float": "X"}.get(f.type, name.upper()),
            help=_help(f),
        )


def _flag_type(f: dataclasses.Field) -> Any:
    """The argparse type of a field's flag: a number that does not parse names the range."""
    kind = {"int": int, "float": float}.get(f.type)
    if kind is None:
        return str
    within = f.metadata["within"]

    def parse(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            what = "an int" if kind is int else "a number"
            where = f" in {within}" if within is not None else ""
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}{where}") from None

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _help(f: dataclasses.Field) -> str:
    """A field's --help line: what it is, its default, and the values it takes."""
    text = f.metadata["help"]
    shown = {"str": repr, "float": lambda x: f"{x:g}"}.get(f.type, str)
    if f.default is not None:
        text += f" (default: {shown(f.default)})"
    if f.metadata["choices"]:
        text += f"; one of {', '.join(f.metadata['choices'])}"
    return text


def read_toml(path: str | Path) -> dict[str, Any]:
    """Options from a TOML file; an unknown key is a ConfigError naming it."""
    try:
        with open(path, "rb") as fh:
            table = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    for key in table:
        if key not in FIELDS:
            near = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{path}: unknown option {key!r}{hint}; known: {', '.join(FIELDS)}")
    return table


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config: defaults, then the TOML file of --config, then the flags given.

    With --resume DIR the run's own config.json comes first, and the run continues in DIR.
    """
    values = read_toml(args.config) if getattr(args, "config", None) else {}
    for name in FIELDS:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    if values.get("resume"):
        saved = Path(values["resume"]) / "config.json"
        try:
            base = json.loads(saved.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"resume={values['resume']!r}: cannot read {saved}: {exc}") from None
        base = {k: v for k, v in base.items() if k in FIELDS}
        values = {**base, **values, "out": values["resume"]}
    return TrainConfig(**values)


def to_argv(cfg: TrainConfig) -> list[str]:
    """Flags that rebuild `cfg` exactly, for the processes this job launches."""
    return [
        f"--{name.replace('_', '-')}={getattr(cfg, name)!s}"
        for name in FIELDS
        if getattr(cfg, name) is not None
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
        if "RANK" in os.environ or cfg.world_size == 1:
            train(cfg)
            return 0
    except ConfigError as exc:
        print(f"myelin train: error: {exc}", file=sys.stderr)
        return 2
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=str(new_run_dir()))
    return launch(cfg.world_size, "myelin.train", to_argv(cfg), module=True)


# -- one rank's run ------------------------------------------------------------------


def train(cfg: TrainConfig) -> None:
    """Train as this process's rank: build, run the steps, then report and sample."""
    data = load_stdlib_text(cfg.max_bytes, cfg.val_fraction)
    model = GPT(cfg.model_config())  # the same weights on every rank; each keeps its stage
    optimizer = functools.partial(_adamw, lr=cfg.lr, weight_decay=cfg.weight_decay)
    trainer = Trainer(
        model,
        optimizer=optimizer,
        loss_fn=lm_loss,
        stages=cfg.stages,
        microbatches=cfg.microbatches,
        data_parallel=cfg.data_parallel,
        schedule=cfg.schedule,
        profile=ProfileConfig(print_summary=False),  # this job prints its own summary
        resume=Path(cfg.resume) / "checkpoint" if cfg.resume else None,
        offload=cfg.offload(),
        precision=cfg.precision,
        device_memory_limit=cfg.device_memory_limit,
    )
    with trainer:
        run_dir = _agree_run_dir(cfg, trainer)
        trainer.flight_dir = run_dir / "flight"  # where a failing rank leaves its record
        cfg = dataclasses.replace(cfg, out=str(run_dir))
        if trainer.rank == 0:
            (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
            _say(_header(cfg, model, data, run_dir))
        run_log = RunLog(run_dir, cfg.steps, leader=trainer.rank == 0, done=trainer.steps_done)
        try:
            _train_steps(cfg, trainer, data, run_log, run_dir)
        finally:
            run_log.close()
        _finish(cfg, trainer, run_dir, run_log.val_curve)


def _adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW that decays matrices only, not biases, norms' gains or other vectors."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.99))


class WarmupCosine(torch.optim.lr_scheduler.LRScheduler):
    """Linear warmup over `warmup_steps`, then cosine decay to `floor` x lr as progress 0 -> 1.

    The loop sets `progress` before each `step()`: the larger of the share of steps done
    and the share of the time budget used, so a run that time cuts short still anneals.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, floor: float) -> None:
        self.warmup_steps = warmup_steps
        self.floor = floor
        self.progress = 0.0
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        """Each group's rate for the step `last_epoch` at `progress`."""
        if self.last_epoch < self.warmup_steps:
            factor = (self.last_epoch + 1) / self.warmup_steps
        else:
            cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, self.progress)))
            factor = self.floor + (1 - self.floor) * cosine
        return [base * factor for base in self.base_lrs]


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


def _header(cfg: TrainConfig, model: GPT, data: TextData, run_dir: Path) -> str:
    """What is about to run, on what data, and where its results go."""
    params = sum(p.numel() for p in model.parameters())
    return (
        f"myelin train: GPT {cfg.n_layer} layers x {cfg.d_model} ({params / 1e6:.2f}M params) "
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


# -- the training loop ---------------------------------------------------------------


class Meter:
    """Throughput and idle share since the last `read()`, from step times and the timeline."""

    def __init__(self, timeline: Timeline, tokens_per_step: int, host_device: bool) -> None:
        self.timeline = timeline
        self.tokens_per_step = tokens_per_step
        self.host_device = host_device  # on the CPU, sends inside an operation are not compute
        self._reset()

    def _reset(self) -> None:
        self.since = self.timeline.now()
        self.first_span = len(self.timeline.spans)
        self.losses: list[float] = []
        self.step_seconds = 0.0

    def add_step(self, loss: float, seconds: float) -> None:
        """Count one training step: its loss and how long `trainer.step` took."""
        self.losses.append(loss)
        self.step_seconds += seconds

    def read(self) -> dict[str, float]:
        """Last and mean loss, tokens/s of the training steps, compute-busy and wall seconds."""
        now = self.timeline.now()
        spans = self.timeline.spans[self.first_span :]
        use = account(spans, self.since, now, host_device=self.host_device)
        n = len(self.losses)
        out = {
            "loss": self.losses[-1] if n else math.nan,
            "loss_avg": sum(self.losses) / max(1, n),
            "tokens_per_s": n * self.tokens_per_step / max(self.step_seconds, 1e-9),
            "busy_s": use["busy_frac"] * use["wall_s"],
            "wall_s": use["wall_s"],
        }
        self._reset()
        return out


def _all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum or max over every rank (a tiny gloo all-reduce, no pickling); as is when alone."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def evaluate(trainer: Trainer, batches: Batches, count: int) -> float:
    """Mean validation loss over the fixed batches 0..count-1 (the same set every time)."""
    return sum(trainer.eval_step(*batches.get(i)) for i in range(count)) / count


class RunLog:
    """Rank 0's view of training: the progress bar, metrics.jsonl and the validation curve.

    On every other rank it only counts; all output comes from one place.
    """

    def __init__(self, run_dir: Path, steps: int, leader: bool, done: int = 0) -> None:
        self.leader = leader
        mode = "a" if done else "w"  # a resumed run appends to its metrics
        self.metrics = open(run_dir / "metrics.jsonl", mode) if leader else None
        self.bar = tqdm(total=steps, initial=done, disable=not leader, file=sys.stderr, unit="step")
        self.postfix = {"loss": "-", "val": "-", "tok/s": "-", "idle": "-"}
        self.val_curve: list[tuple[int, float]] = []

    def log(self, row: dict[str, Any]) -> None:
        """Write one metrics row and show it on the bar (which keeps the last val loss)."""
        if "val_loss" in row:
            self.val_curve.append((row["step"], row["val_loss"]))
            self.postfix["val"] = f"{row['val_loss']:.3f}"
        self.postfix["loss"] = f"{row['loss_avg']:.3f}"
        self.postfix["tok/s"] = f"{row['tokens_per_s']:,.0f}"
        self.postfix["idle"] = f"{100 * row['idle_frac']:.0f}%"
        self.bar.set_postfix(self.postfix, refresh=False)
        if self.metrics is not None:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        """Close the bar and the metrics file."""
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()


def _train_steps(
    cfg: TrainConfig, trainer: Trainer, data: TextData, run_log: RunLog, run_dir: Path
) -> None:
    """Run up to `cfg.steps` steps (fewer if time runs out), evaluating and logging."""
    train_set = Batches(data.train, cfg.block_size, cfg.batch, cfg.seed, ("train", trainer.replica))
    val_set = Batches(data.val, cfg.block_size, cfg.batch, cfg.seed, ("val", trainer.replica))
    floor = cfg.min_lr / cfg.lr
    sched = (
        WarmupCosine(trainer.optimizer, cfg.warmup_steps, floor)
        if trainer.optimizer is not None
        else None
    )
    if sched is not None and trainer.resumed_extra:
        sched.load_state_dict(trainer.resumed_extra["scheduler"])
        # building the scheduler reset the optimizer's lr; put back the resumed one
        for group, lr in zip(trainer.optimizer.param_groups, sched.get_last_lr(), strict=True):
            group["lr"] = lr
    tokens = cfg.batch * cfg.block_size * cfg.data_parallel
    meter = Meter(trainer.timeline, tokens, host_device=trainer.world.device.type != "cuda")
    start, budget = time.monotonic(), cfg.max_minutes * 60
    for step in range(trainer.steps_done + 1, cfg.steps + 1):  # resumed: where it left off
        t0 = time.perf_counter()
        loss = trainer.step(*train_set.get(step - 1))  # batch i follows i steps
        meter.add_step(loss, time.perf_counter() - t0)
        lr = sched.get_last_lr()[0] if sched is not None else cfg.lr
        # Steps or time, whichever runs out first; agreed by all ranks, which stop together.
        used = _all_reduce([(time.monotonic() - start) / budget], op="max")[0]
        progress = max(step / cfg.steps, used)
        if sched is not None:
            sched.progress = progress
            sched.step()
        last = progress >= 1.0
        val = None
        if last or step % cfg.eval_every == 0:
            val = evaluate(trainer, val_set, cfg.eval_batches)
        if last or val is not None or step % cfg.log_every == 0:
            run_log.log(_metrics_row(step, lr, meter, val))
        run_log.bar.update(1)
        if last or step % cfg.checkpoint_every == 0:
            extra = {"scheduler": sched.state_dict()} if sched is not None else {}
            trainer.save(run_dir / "checkpoint", extra=extra)
        if last:
            if step < cfg.steps and run_log.leader:
                _say(f"stopped at step {step} of {cfg.steps}: max_minutes={cfg.max_minutes} used")
            return


def _metrics_row(step: int, lr: float, meter: Meter, val: float | None) -> dict[str, Any]:
    """One metrics.jsonl row, keyed as `Trainer.fit` keys its metrics.

    loss is this step's, loss_avg the mean since the last row; idle_frac is the share of
    wall time the ranks were not computing, over all ranks.
    """
    m = meter.read()
    busy, wall = _all_reduce([m["busy_s"], m["wall_s"]])
    row = {
        "step": step,
        "loss": round(m["loss"], 5),
        "loss_avg": round(m["loss_avg"], 5),
        "lr": float(f"{lr:.4g}"),
        "tokens_per_s": round(m["tokens_per_s"], 1),
        "idle_frac": round(max(0.0, 1 - busy / wall), 4) if wall > 0 else 0.0,
    }
    if val is not None:
        row["val_loss"] = round(val, 5)
    return row


# -- the end of the run --------------------------------------------------------------


def _finish(cfg: TrainConfig, trainer: Trainer, run_dir: Path, val_curve: list) -> None:
    """Every rank hands in its timeline and its stage's weights; rank 0 reports and samples."""
    report = gather_report(trainer.timeline, trainer.world)  # collective, JSON via the store
    state = trainer.state_dict()  # collective: the whole model on rank 0, None elsewhere
    memory = trainer.memory_stats()
    (run_dir / "memory").mkdir(exist_ok=True)
    (run_dir / "memory" / f"rank{trainer.rank}.json").write_text(json.dumps(memory, indent=1))
    if trainer.rank != 0:
        return
    report.save(run_dir / "profile")  # summary, trace, PNG timeline, raw records
    torch.save(state, run_dir / "model.pt")
    _say("where the time went:\n" + report.format())
    _say(_memory_line(memory))
    (first_step, first), (last_step, last) = val_curve[0], val_curve[-1]
    _say(f"validation loss {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})")
    if cfg.sample_tokens:
        model = GPT(cfg.model_config())
        model.load_state_dict(state)
        text = sample(
            model.eval(), cfg.prompt, cfg.sample_tokens, cfg.temperature, cfg.top_k, cfg.seed
        )
        (run_dir / "sample.txt").write_text(text)
        shown = "\n".join(f"  | {line}" for line in text.splitlines()[:12])
        _say(f"sample (temperature {cfg.temperature}, top-k {cfg.top_k}):\n{shown}")
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
def sample(model: GPT, prompt: str, tokens: int, temperature: float, top_k: int, seed: int) -> str:
    """Continue `prompt` by `tokens` bytes, sampling from the top-k at `temperature`."""
    g = torch.Generator().manual_seed(seed)
    idx = encode(prompt)[None, :]  # (1, T)
    for _ in range(tokens):
        logits = model(idx[:, -model.config.block_size :])[0, -1] / temperature  # (vocab,)
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
