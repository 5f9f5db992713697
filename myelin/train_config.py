"""Every option of `myelin train`: `TrainConfig`, from defaults, a TOML file and flags.

    cfg = config_from_args(args)      # defaults < --config run.toml < flags; --resume: the
                                      # run's own config.json first
    to_argv(cfg)                      # flags that rebuild cfg, for the launched ranks

Each field carries its --help text, its section and its allowed values; a bad value is
a ConfigError naming the field, the value and the range, before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from myelin.data import VOCAB_SIZE
from myelin.errors import ConfigError
from myelin.models.gpt import GPTConfig
from myelin.offload.config import PRECISIONS, OffloadConfig
from myelin.offload.pool import parse_bytes
from myelin.runtime.schedule import SCHEDULES
from myelin.train_model import NAMED, check, positions

__all__ = ["TrainConfig", "add_arguments", "config_from_args", "read_toml", "to_argv"]


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

    model: str = _opt(
        "gpt",
        "model",
        "gpt (myelin's own), llama (a HuggingFace Llama sized by the options below; needs "
        "myelin[hf]) or the path of a HuggingFace config.json, whose own sizes count",
    )
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
        blocks = check(self.model)  # a config file's own block count
        if blocks is None and self.model in NAMED:
            blocks, where = self.n_layer, f"n_layer={self.n_layer}"
        else:
            where = f"{blocks} in {self.model}"
        if blocks is not None and self.stages > blocks + 2:
            raise ConfigError(
                f"stages={self.stages} exceeds the model's {blocks + 2} layers "
                f"(embedding, {where} blocks, head)"
            )
        longest = positions(self.model)
        if longest is not None and self.block_size > longest:
            raise ConfigError(
                f"block_size={self.block_size} exceeds the {longest} positions of {self.model}"
            )
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr={self.min_lr} must not exceed lr={self.lr}")
        if not self.prompt:
            raise ConfigError("prompt='' must hold at least one character")
        parse_bytes(self.device_memory_limit, "device_memory_limit")
        parse_bytes(self.host_memory_limit, "host_memory_limit")  # named as the option is
        if self.host_memory_limit is not None and "off" == self.offload_activations == (
            self.offload_optimizer
        ):
            raise ConfigError(
                f"host_memory_limit={self.host_memory_limit!r} caps the host pool that "
                "offload uses, but offload_activations and offload_optimizer are both off"
            )
        self.offload()  # checks the rest of the offload settings

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
        "Train a byte-level GPT (or a HuggingFace model, --model) on this Python's standard "
        "library source as a pipeline of local processes. Writes config.json, metrics.jsonl, "
        "model.pt, profile/ and sample.txt (and hf/ for a HuggingFace model) to the run "
        "directory. Training ends after --steps or --max-minutes, "
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
    for key, value in table.items():
        if isinstance(value, dict):
            raise ConfigError(
                f"{path}: {key!r} is a section ([{key}]); options are top-level keys, "
                f"known: {', '.join(FIELDS)}"
            )
        if key not in FIELDS:
            near = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{path}: unknown option {key!r}{hint}; known: {', '.join(FIELDS)}")
        if isinstance(value, bool) and "on" in (FIELDS[key].metadata["choices"] or ()):
            table[key] = "on" if value else "off"  # TOML's own booleans for on/off options
        if key.endswith("_memory_limit") and type(value) is int:
            table[key] = str(value)  # a byte count, as the flag takes it
    return table


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config: defaults, then the TOML file of --config, then the flags given.

    With --resume DIR the run's own config.json comes first, and the run continues in DIR.
    """
    values = read_toml(args.config) if getattr(args, "config", None) else {}
    for name in FIELDS:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    if values.get("resume") is not None and not isinstance(values["resume"], str):
        raise ConfigError(f"resume={values['resume']!r} must be a string: the run to resume")
    if values.get("resume"):
        saved = Path(values["resume"]) / "config.json"
        try:
            base = json.loads(saved.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"resume={values['resume']!r}: cannot read {saved}: {exc}") from None
        base = {k: v for k, v in base.items() if k in FIELDS}
        _check_resumed(values, base, saved)
        values = {**base, **values, "out": values["resume"]}
    return TrainConfig(**values)


# what a checkpoint fixes: the model it holds, the data its batches were drawn from, and
# the optimizer's settings and schedule it carries (they come back with it, over flags)
FIXED_ON_RESUME = ("seed", "max_bytes", "val_fraction", "lr", "min_lr", "warmup_steps",
                   "weight_decay")  # fmt: skip


def _check_resumed(given: dict[str, Any], base: dict[str, Any], saved: Path) -> None:
    """--resume continues a run as it was built: a model or data option given that differs
    from its config.json, or an --out elsewhere, is said before any rank starts."""
    out = given.get("out")
    if out is not None and Path(out).resolve() != Path(given["resume"]).resolve():
        raise ConfigError(
            f"out={out!r} with resume={given['resume']!r}: a resumed run continues in its "
            "own directory; leave --out out (or copy the run directory first)"
        )
    fixed = [n for n, f in FIELDS.items() if f.metadata["group"] == "model"]
    changed = [
        f"{n}={given[n]!r} (it was {base[n]!r})"
        for n in [*fixed, *FIXED_ON_RESUME]
        if n in given and n in base and given[n] != base[n]
    ]
    if changed:
        raise ConfigError(
            f"resume={given['resume']!r} continues the run as {saved} built it, but "
            f"{', '.join(changed)}: the model, its data and the optimizer's settings (kept "
            "in the checkpoint) cannot change on resume (steps, time, logging, the pipeline "
            "layout, memory and sampling options can)"
        )


def to_argv(cfg: TrainConfig) -> list[str]:
    """Flags that rebuild `cfg` exactly, for the processes this job launches."""
    return [
        f"--{name.replace('_', '-')}={getattr(cfg, name)!s}"
        for name in FIELDS
        if getattr(cfg, name) is not None
    ]
