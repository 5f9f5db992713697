"""The `myelin` command line: the launcher sets the torchrun environment and reports failures."""

from __future__ import annotations

import subprocess
import sys

import pytest

from myelin.cli import build_parser


def myelin(*args, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "myelin.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def test_run_sets_the_torchrun_environment_and_passes_arguments(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys\n"
        "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')\n"
        "vals = [os.environ[k] for k in keys]\n"
        "open(os.path.join(sys.argv[1], 'r' + vals[0]), 'w').write(' '.join(vals + sys.argv[2:]))\n"
    )
    res = myelin("run", "-n", "2", str(script), str(tmp_path), "--flag", "x")
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        rank_, world, local, addr, port, *rest = (tmp_path / f"r{rank}").read_text().split()
        assert (rank_, world, local) == (str(rank), "2", str(rank))
        assert int(port) > 0 and rest == ["--flag", "x"]


def test_run_fails_when_a_process_fails_and_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(7)\ntime.sleep(60)\n"
    )
    res = myelin("run", "-n", "2", str(script), timeout=60)
    assert res.returncode == 7
    assert "rank 1 failed first (exit code 7)" in res.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "-n", "0", "x.py"], "0 is not a process count in [1, 4096]"),
        (["run", "-n", "2", "--master-port", "70000", "x.py"], "70000 is not a port in [1, 65535]"),
        (["run", "x.py"], "required: -n/--nproc"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
