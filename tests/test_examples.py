"""The examples a user copies run as their first line says, and learn."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run_example(tmp_path, *args, ranks=2, timeout=240, **env):
    """Run an example as its first line says: `myelin run -n ranks script ...`, or the
    script alone with ranks=None; a bare environment, plus `env`."""
    launch = ["-m", "myelin.cli", "run", "-n", str(ranks)] if ranks is not None else []
    cmd = [sys.executable, *launch, *map(str, args)]
    env = {"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
    )


@pytest.mark.slow  # 13 s; test_pipeline's four processes check 2 stages x 2 replicas bit for bit
def test_quickstart_trains_with_two_stages_and_two_replicas(tmp_path):
    script = EXAMPLES / "quickstart.py"
    res = _run_example(
        tmp_path, script, "--data-parallel", "2", "--steps", "10", ranks=4, timeout=180
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) >= 3 and losses[-1] < losses[0], res.stdout


@pytest.mark.slow  # 14 s; tests/hf checks GPT-2's tied pipeline bit for bit
def test_hf_gpt2_example_learns_and_leaves_a_plain_tied_model(tmp_path):
    pytest.importorskip("transformers")
    script = EXAMPLES / "hf_gpt2.py"
    res = _run_example(tmp_path, script, "--steps", "50", "--meta", HF_HUB_OFFLINE="1")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    vals = [float(x) for x in re.findall(r"val loss (\d+\.\d+)", res.stdout)]
    assert len(vals) == 2 and vals[-1] < vals[0], res.stdout
    assert "embedding and head tied: True" in res.stdout


@pytest.mark.slow  # 19 s; offload on two stages is checked bit for bit in test_pipeline
def test_large_model_example_needs_offload_and_trains_with_it(tmp_path):
    script = EXAMPLES / "large_model_offload.py"
    res = _run_example(tmp_path, script, "--steps", "10")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) == 2 and losses[-1] < losses[0], res.stdout
    peaks = [float(x) for x in re.findall(r"device peak (\d+\.\d+) MiB", res.stdout)]
    assert len(peaks) == 2 and max(peaks) <= 32, res.stdout  # under the 32MiB limit

    res = _run_example(tmp_path, script, "--steps", "2", "--no-offload")
    assert res.returncode != 0
    assert "DeviceMemoryError" in res.stderr and "device_memory_limit=32 MiB" in res.stderr
    assert "OffloadConfig(activations=True)" in res.stderr


@pytest.mark.slow  # 18 s; tests/offload checks the encoder and the peak
def test_large_model_example_on_one_process_needs_offload_and_trains_with_it(tmp_path):
    """The whole model on one device, each backward right after its forward: only paging
    within the microbatch, layer by layer, brings it under the limit."""
    script = EXAMPLES / "large_model_offload.py"
    run = functools.partial(_run_example, tmp_path, script, "--one-process", ranks=None)
    res = run("--steps", "6")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) == 2 and losses[-1] < losses[0], res.stdout
    peak = float(re.search(r"device peak (\d+\.\d+) MiB", res.stdout).group(1))
    assert peak <= 40, res.stdout
    assert "misses 0" in res.stdout, res.stdout  # every page back before backward needed it

    res = run("--steps", "2", "--no-offload")
    assert res.returncode != 0
    assert "DeviceMemoryError" in res.stderr and "device_memory_limit=40 MiB" in res.stderr
    assert "OffloadConfig(activations=True)" in res.stderr


@pytest.mark.slow  # 32 s; tests/hf checks Llama's stages, save_pretrained and weights=
def test_hf_llama_example_learns_saves_and_starts_again_from_its_folder(tmp_path):
    pytest.importorskip("transformers")
    script = EXAMPLES / "hf_llama.py"
    first = _run_example(tmp_path, script, "--steps", "25", "--out", tmp_path / "a")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    again = _run_example(
        tmp_path, script, "--steps", "25", "--out", tmp_path / "b", "--start-from", tmp_path / "a"
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    val = [float(re.search(r"val loss (\d+\.\d+)", r.stdout).group(1)) for r in (first, again)]
    assert val[1] < val[0], (first.stdout, again.stdout)  # the second run went on from the first
    assert f"loaded {tmp_path / 'b'} with from_pretrained" in again.stdout
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()


def test_xc_lsh_example_learns_with_the_lsh_layer(tmp_path):
    script = EXAMPLES / "xc_lsh.py"
    sizes = ["--rows", "2000", "--labels", "1000", "--features", "500"]
    res = _run_example(tmp_path, script, "--stages", "1", "--epochs", "2", *sizes, ranks=None)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    p1 = [float(x) for x in re.findall(r"P@1 (\d\.\d+)", res.stdout)]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(p1) == 2 and losses[1] < losses[0], res.stdout
    assert p1[-1] > 0.1, res.stdout  # chance is about 1/1000; the ceilings are printed
