"""The `myelin` command line.

myelin run -n 2 train.py --lr 1e-3     # 2 local processes, as torchrun would start them
myelin profile out/prof                # where each rank sat idle and why; redraws the picture
myelin train --steps 30                # a small GPT on the stdlib's own source, 2 stages
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from myelin.errors import ConfigError
from myelin.launch import GRACE_S, launch
from myelin.runtime.addresses import is_address

__all__ = ["main", "launch"]


def _int_in(low: int, high: int, what: str = "an int") -> Callable[[str], int]:
    """An argparse type: an int in [low, high], the range named when it is not."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} in [{low}, {high}]") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not {what} in [{low}, {high}]")
        return value

    return parse


_positive = _int_in(1, 4096, "a process count")
_port = _int_in(1, 65535, "a port")


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds in [0, 3600]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds in [0, 3600]")
    return value


def _address(text: str) -> str:
    if not is_address(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address or a host name")
    return text


def build_parser(only_run: bool = False) -> argparse.ArgumentParser:
    """The whole command line; `only_run`: just `myelin run`, whose ranks then start before
    torch is imported here (train's and profile's options import it)."""
    parser = argparse.ArgumentParser(
        prog="myelin", description="Message-driven pipeline training for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a script in N local processes, started as torchrun starts them",
        description="Start N local processes of SCRIPT with RANK, WORLD_SIZE, LOCAL_RANK, "
        "MASTER_ADDR and MASTER_PORT set, exactly as torchrun does. If one process fails, "
        "the others are stopped (SIGTERM, then SIGKILL after --grace-period) and the exit "
        "status is that rank's.",
    )
    run.add_argument("-n", "--nproc", type=_positive, required=True, help="processes to start")
    run.add_argument(
        "--master-port",
        type=_port,
        default=None,
        help="rendezvous port on this host (default: a free port)",
    )
    run.add_argument(
        "--master-addr",
        type=_address,
        default="127.0.0.1",
        help="rendezvous address (default: loopback)",
    )
    run.add_argument(
        "--grace-period",
        type=_seconds,
        default=GRACE_S,
        help=f"seconds a rank gets between SIGTERM and SIGKILL when the job stops (default "
        f"{GRACE_S:g})",
    )
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module (python -m)")
    run.add_argument("script", help="the Python script (or module, with -m) to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    if only_run:
        parser.usage = "myelin [-h] {run,train,profile} ..."  # all three, though one is built
        return parser
    from myelin import train as train_job
    from myelin.profile import command as profile_command

    train_job.add_arguments(
        sub.add_parser(
            "train",
            help="train a small GPT (or, with --model, a HuggingFace Llama or config) on the "
            "Python standard library's source (no download, no GPU), as a 2-stage pipeline "
            "of local processes",
        )
    )

    profile_command.add_arguments(
        sub.add_parser(
            "profile",
            help="print where each rank sat idle and why; redraw the timeline",
            description="Read a profile directory written by Trainer(profile='DIR') and print "
            "busy time and idle time by cause per rank, redrawing DIR/timeline.png; or analyse "
            "torch.profiler traces (one file per rank) of any PyTorch program the same way.",
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only_run=argv[:1] == ["run"])
    args = parser.parse_args(argv)
    if args.command == "run":
        missing = _missing_script(args.script, args.module)
        if missing:
            parser.error(missing)  # before any process starts
        try:
            return launch(
                args.nproc,
                args.script,
                args.args,
                args.master_port,
                args.master_addr,
                args.module,
                grace_s=args.grace_period,
            )
        except ConfigError as exc:  # no rendezvous: no rank started, or none got to work
            text = str(exc)  # not a usage error: no usage line
            prefix = "" if text.startswith("myelin run:") else "myelin run: "
            print(prefix + text, file=sys.stderr)
            return 2
    if args.command == "train":
        from myelin import train as train_job

        return train_job.main(args)
    if args.command == "profile":
        from myelin.profile import command as profile_command

        return profile_command.main(args)
    raise AssertionError(args.command)  # argparse rejects unknown commands


def _missing_script(script: str, module: bool) -> str | None:
    """Why `script` (or module) cannot run, or None."""
    if module:
        import importlib.util

        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"run: no module named {script!r} (-m)"
    if not os.path.isfile(script):
        return f"run: script {script!r} does not exist"
    return None


if __name__ == "__main__":
    sys.exit(main())
