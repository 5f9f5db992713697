"""The `myelin` command line: the launcher sets the torchrun environment and reports failures."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

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


def test_run_alone_shows_the_whole_usage_line(capsys):
    """`myelin run` builds only its own options (its ranks start before torch is imported),
    but the usage line of its errors names every command."""
    with pytest.raises(SystemExit):
        build_parser(only_run=True).error("run: script 'x.py' does not exist")  # as main says it
    assert capsys.readouterr().err.startswith(build_parser().format_usage())


def test_a_busy_rendezvous_port_is_named_before_any_rank_starts(tmp_path):
    script = tmp_path / "mark.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = myelin("run", "-n", "2", "--master-port", str(port), str(script))
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"cannot serve the rendezvous at 127.0.0.1:{port}" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "started").exists()
    assert "usage:" not in res.stderr, res.stderr  # the command was right; the port was not


def test_ranks_start_before_the_launcher_imports_torch(tmp_path):
    """The launcher binds the rendezvous socket, starts every rank, and only then imports
    torch to serve the store: the imports overlap instead of adding up."""
    script = tmp_path / "join.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "assert t.item() == dist.get_world_size()\n"
        "dist.destroy_process_group()\n"
        "import os\n"  # the store listens on loopback only (torch's own binds every interface)
        "port = '%04X' % int(os.environ['MASTER_PORT'])\n"
        "rows = [r.split() for r in open('/proc/net/tcp').readlines()[1:]]\n"
        "listening = [r[1] for r in rows if r[1].endswith(':' + port) and r[3] == '0A']\n"
        "assert listening == ['0100007F:' + port], listening\n"
    )
    probe = (
        "import subprocess, sys\n"
        "import myelin, myelin.cli, myelin.launch\n"
        "assert 'torch' not in sys.modules, 'importing the command line imported torch'\n"
        "seen = []\n"
        "real = subprocess.Popen\n"
        "def spy(*a, **k):\n"
        "    seen.append('torch' in sys.modules)\n"
        "    return real(*a, **k)\n"
        "myelin.launch.subprocess.Popen = spy\n"
        f"code = myelin.cli.main(['run', '-n', '2', {str(script)!r}])\n"
        "print('torch loaded at each start:', seen, 'exit', code)\n"
        "assert code == 0 and seen == [False, False], seen\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


def test_the_package_exports_load_on_first_use():
    import ast

    import myelin

    tree = ast.parse(Path(myelin.__file__).read_text())
    checked = [
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    ]
    typed = {
        a.asname or a.name
        for n in ast.walk(checked[0])
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    }
    assert typed == set(myelin.__all__) - {"__version__"}, (
        "the TYPE_CHECKING imports differ from __all__"
    )
    for name in myelin.__all__:
        value = getattr(myelin, name)
        if name != "__version__":
            assert value is getattr(sys.modules[myelin._MODULE_OF[name]], name), name
            assert name in dir(myelin)
    assert myelin.nn.LSHSoftmax is sys.modules["myelin.nn"].LSHSoftmax  # a subpackage, on use
    with pytest.raises(AttributeError, match="'myelin' has no attribute 'Trainr'"):
        myelin.Trainr  # noqa: B018
    with pytest.raises(ImportError, match="Trainr"):
        from myelin import Trainr  # noqa: F401
