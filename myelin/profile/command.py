"""`myelin profile PATH...`: print where each rank sat idle and why; redraw the picture.

    myelin profile out/prof                      # a directory written by Trainer(profile=...)
    myelin profile traces/ --out report/         # torch.profiler traces of any program

PATH is a myelin profile directory (its raw records are read back and the table and
timeline.png made again) or torch.profiler trace files, one per rank (see
`torch_trace.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from myelin.errors import MyelinError
from myelin.profile.report import ProfileReport, load
from myelin.profile.torch_trace import load_traces

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `myelin profile PATH...`."""
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a profile directory written by myelin, or torch.profiler trace files "
        "(.json or .json.gz, one per rank) or a directory of them",
    )
    parser.add_argument(
        "--out",
        help="write summary.json, trace.json and timeline.png here (default: a myelin "
        "profile directory is redrawn in place; an imported trace writes nothing)",
    )
    parser.add_argument("--steps", help="draw these steps, e.g. '3' or '2-4' (default: last 3)")
    parser.add_argument(
        "--warmup-steps", type=_count, help="steps left out of the steady-state figures"
    )
    parser.add_argument(
        "--short-gap-us",
        type=_microseconds,
        default=0.03,
        help="torch traces: idle gaps shorter than this are 'short gaps' (HTA: 30 ns)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw timeline.png")
    parser.add_argument("--json", action="store_true", help="print summary.json, not a table")
    return parser


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an int in [0, 1000000]")
    return int(text)


def _microseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e9:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of microseconds in [0, 1e9]")
    return value


def main(args: argparse.Namespace) -> int:
    """Run `myelin profile`: print the figures, redraw or write the files; exit status."""
    try:
        steps = _parse_steps(args.steps)  # a bad flag fails before anything is printed
        report, here = _open(args)
        print(json.dumps(report.summary(), indent=1) if args.json else report.format())
        out = Path(args.out) if args.out else here
        if args.out:
            report.save(out, plot=False)
        if out is not None and not args.no_plot:
            print(f"drew {report.plot(out / 'timeline.png', steps)}", file=sys.stderr)
    except (MyelinError, OSError, ValueError) as exc:
        print(f"myelin profile: {exc}", file=sys.stderr)
        return 2
    return 0


def _open(args: argparse.Namespace) -> tuple[ProfileReport, Path | None]:
    """The report PATH holds, and the directory to redraw in place (None for torch traces)."""
    paths = [Path(p) for p in args.paths]
    if len(paths) == 1 and (paths[0] / "profile" / "ranks").is_dir():
        paths = [paths[0] / "profile"]  # a `myelin train` run directory: its profile
    if len(paths) == 1 and (paths[0] / "ranks").is_dir():
        return load(paths[0], args.warmup_steps), paths[0]
    records = load_traces(paths, short_gap_us=args.short_gap_us)
    warmup = 0 if args.warmup_steps is None else args.warmup_steps
    return ProfileReport.from_ranks(records, warmup), None


def _parse_steps(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        parts = [int(p) for p in text.split("-", 1)]
    except ValueError:
        raise MyelinError(f"--steps {text!r} must be a step or a range such as 2-4") from None
    if parts[-1] < parts[0]:
        raise MyelinError(f"--steps {text!r}: the range ends before it starts")
    return [parts[0], parts[-1]]


if __name__ == "__main__":
    sys.exit(main(add_arguments(argparse.ArgumentParser(prog="myelin profile")).parse_args()))
