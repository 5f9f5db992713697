"""Start N local processes of a script through torch's elastic launcher (torchrun).

    launch(2, "train.py", ["--lr", "1e-3"])      # what `myelin run -n 2 train.py --lr 1e-3` does

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT exactly as
torchrun sets them; if one fails the others are stopped, and the exit status is that of
the rank that failed first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

__all__ = ["launch"]


def launch(
    nproc: int,
    script: str,
    args: Sequence[str] = (),
    master_port: int | None = None,
    master_addr: str = "127.0.0.1",
    module: bool = False,
) -> int:
    """Run `script` in `nproc` local processes through torch's elastic launcher; exit code."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    argv = ["--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", "0"]
    if master_port is None:
        argv += ["--standalone"]
    else:
        argv += ["--master-addr", master_addr, "--master-port", str(master_port)]
    if module:
        argv += ["-m"]
    argv += [script, *args]
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        failures = exc.failures
        # The first process to exit with an error is the cause; the others were stopped.
        causes = [r for r, f in failures.items() if isinstance(f.exitcode, int) and f.exitcode > 0]
        first = min(causes or failures, key=lambda r: (failures[r].timestamp, r))
        code = failures[first].exitcode
        codes = {r: f.exitcode for r, f in sorted(failures.items())}
        print(
            f"myelin run: rank {first} failed first (exit code {code}); exit codes by rank: "
            f"{codes}; see its error above",
            file=sys.stderr,
        )
        return code if isinstance(code, int) and 0 < code < 256 else 1
    return 0
