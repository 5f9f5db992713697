"""`myelin train` and its data: options, TOML, the stdlib text, and short real runs."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from myelin import train as train_module
from myelin.data import Batches, is_validation, load_stdlib_text, source_files, stdlib_root
from myelin.errors import ConfigError
from myelin.models import GPT
from myelin.train import (
    TrainConfig,
    WarmupCosine,
    add_arguments,
    config_from_args,
    main,
    to_argv,
)
from tests._procs import _reap_session

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"

# Small enough to finish in seconds on two cores, big enough for the loss to fall.
QUICK = [
    "--n-layer=2",
    "--d-model=64",
    "--n-head=4",
    "--block-size=64",
    "--batch=8",
    "--microbatches=2",
    "--eval-every=10",
    "--eval-batches=2",
    "--log-every=5",
    "--max-bytes=1000000",
    "--sample-tokens=80",
]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="myelin train")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def run(cmd: list[str], cwd: Path, timeout: float = 180) -> tuple[int, str, str]:
    """Run a command as a user would, in its own session; kill it all on timeout."""
    sockets = cwd / "sock"
    sockets.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(sockets), "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout}s:\n{err[-5000:]}") from None
    finally:
        _reap_session(proc.pid)
    assert not [p.name for p in sockets.iterdir() if p.name.startswith("myelin")]
    return proc.returncode, out, err


def run_train(argv: list[str], cwd: Path, launcher: list[str] | None = None):
    """`python -m myelin.train ARGV` (or under `launcher`, e.g. torchrun)."""
    return run([*(launcher or [sys.executable]), "-m", "myelin.train", *argv], cwd)


# -- real runs -----------------------------------------------------------------------


def test_a_short_run_learns_and_writes_its_run_directory(tmp_path):
    out_dir = tmp_path / "run"
    code, out, err = run_train(["--steps=30", f"--out={out_dir}", *QUICK], tmp_path)
    assert code == 0, err[-5000:]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["steps"] == 30 and config["stages"] == 2 and config["out"] == str(out_dir)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 5, 10, 15, 20, 25, 30]  # 0: validation only
    for r in rows[1:]:
        assert r["loss"] > 0 and r["loss_avg"] > 0 and r["tokens_per_s"] > 0
        assert 0 <= r["idle_frac"] <= 1
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 4 and vals[-1] < vals[0], vals
    # issue 11: learning shown from the untrained model on (a short run used to print
    # "3.012 (step 40) -> 3.012 (step 40)"), and the memory each rank holds
    assert f"validation loss {vals[0]:.3f} (step 0) -> {vals[-1]:.3f} (step 30)" in out, out
    found = re.search(r"resident memory: rank 0 ([\d.]+) MiB, rank 1 ([\d.]+) MiB", out)
    assert found, out
    for rank in (0, 1):
        memory = json.loads((out_dir / "memory" / f"rank{rank}.json").read_text())
        assert memory["rss_peak_bytes"] >= memory["rss_bytes"] > 0, memory
        shown = float(found.group(rank + 1))
        assert abs(shown - memory["rss_bytes"] / 2**20) < 0.25 * shown, (shown, memory)
    assert "where the time went" in out and "validation loss" in out and "sample (" in out
    assert (out_dir / "sample.txt").read_text().startswith("def ")
    model = GPT(TrainConfig(**config).model_config())  # the final weights, a plain GPT
    model.load_state_dict(torch.load(out_dir / "model.pt", weights_only=True))
    ranks = {p.name for p in (out_dir / "profile" / "ranks").iterdir()}
    assert ranks == {"rank0.json", "rank1.json"}
    summary = json.loads((out_dir / "profile" / "summary.json").read_text())
    assert summary["warmup_steps"] == 3  # the 2 validation batches at step 0, training's first
    assert summary["steady_steps"][0] == 3  # (they share the step numbering)
    assert (out_dir / "profile" / "timeline.png").stat().st_size > 10_000
    assert (out_dir / "profile" / "trace.json").exists()
    assert "step" in err  # the progress bar, on stderr
    # Offload is on by default: stage 0 pages activations out, both keep AdamW on the host.
    memory = [json.loads((out_dir / "memory" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert memory[0]["activations_offloaded_total_bytes"] > 0
    assert all(m["optimizer_mode"] == "host" and m["optimizer_host_bytes"] > 0 for m in memory)
    assert "memory (rank 0): device peak" in out


def test_resume_refuses_a_changed_model_or_data_and_another_out(tmp_path):
    """--resume continues a run as it was built: a model or data option that differs from
    its config.json, or --out elsewhere, is a ConfigError naming it; time, steps, layout
    and logging options may change."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = config_from_args(parse(*QUICK, f"--out={run_dir}"))
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(saved)))
    with pytest.raises(ConfigError, match=r"n_layer=3 \(it was 2\).*cannot change on resume"):
        config_from_args(parse(f"--resume={run_dir}", "--n-layer=3"))
    with pytest.raises(ConfigError, match=r"seed=5 \(it was 0\)"):
        config_from_args(parse(f"--resume={run_dir}", "--seed=5"))
    # the optimizer's settings and schedule come back with the checkpoint, over any flag
    flags = {"lr": "--lr=0.01", "min_lr": "--min-lr=0.001", "warmup_steps": "--warmup-steps=0",
             "weight_decay": "--weight-decay=0.5"}  # fmt: skip
    for field, flag in flags.items():
        with pytest.raises(ConfigError, match=rf"{field}=.*\(it was .*optimizer's settings"):
            config_from_args(parse(f"--resume={run_dir}", flag))
    with pytest.raises(ConfigError, match="continues in its own directory"):
        config_from_args(parse(f"--resume={run_dir}", f"--out={tmp_path / 'elsewhere'}"))
    cfg = config_from_args(parse(f"--resume={run_dir}", "--steps=50", "--stages=1",
                                 "--n-layer=2", f"--out={run_dir}"))  # fmt: skip
    assert (cfg.steps, cfg.stages, cfg.n_layer, cfg.out) == (50, 1, 2, str(run_dir))
    with pytest.raises(ConfigError, match="both off"):
        TrainConfig(offload_activations="off", offload_optimizer="off", host_memory_limit="1GiB")


def test_resume_continues_a_killed_run_with_the_same_losses(tmp_path):
    out_dir = tmp_path / "run"
    argv = [*QUICK, "--steps=14", "--checkpoint-every=7", "--log-every=1", "--eval-every=7"]
    out_dir.mkdir()
    (out_dir / "sample.txt").write_text("an earlier run's sample")  # a reused directory
    code, _, err = run_train([*argv, f"--out={out_dir}", "--sample-tokens=0"], tmp_path)
    assert code == 0, err[-5000:]
    assert not (out_dir / "sample.txt").exists()  # not sampled: no sample of another model
    metrics = out_dir / "metrics.jsonl"
    full = [json.loads(line) for line in metrics.read_text().splitlines()]
    # as if killed after step 7's checkpoint, having logged steps 8 to 14 (and a torn line)
    ckpt = out_dir / "checkpoint"
    shutil.rmtree(ckpt / "step-00000014")
    (ckpt / "latest").write_text("step-00000007")
    metrics.write_text(metrics.read_text() + '{"step": 15, "lo')
    code, out, err = run_train([f"--resume={out_dir}"], tmp_path)
    assert code == 0, err[-5000:]
    again = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in again] == [r["step"] for r in full]  # each step once
    first, last = full[0]["val_loss"], full[-1]["val_loss"]
    assert f"validation loss {first:.3f} (step 0) -> {last:.3f} (step 14)" in out
    for a, b in zip(again, full):
        assert (a.get("loss"), a.get("val_loss"), a.get("lr")) == (
            b.get("loss"),
            b.get("val_loss"),
            b.get("lr"),
        )
    # resumed once more, finished: it says so and leaves the run's results as they are
    summary = (out_dir / "profile" / "summary.json").read_bytes()
    code, out, err = run_train([f"--resume={out_dir}"], tmp_path)
    assert code == 0, err[-5000:]
    assert "already complete at step 14 of 14" in out
    assert "myelin train: GPT" not in out  # said by the launcher: no rank was started
    assert (out_dir / "profile" / "summary.json").read_bytes() == summary
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == again
    # given more steps but a time budget its checkpoint has used up: complete as well, said
    # by the launcher, its results left as they are
    argv = [f"--resume={out_dir}", "--steps=30", "--max-minutes=0.001", "--sample-tokens=0"]
    code, out, err = run_train(argv, tmp_path)
    assert code == 0, err[-5000:]
    assert "already complete: max_minutes=0.001 used at step 14 of 30" in out, out
    assert "myelin train: GPT" not in out
    assert (out_dir / "profile" / "summary.json").read_bytes() == summary
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1] == 14
    # a shard damaged: the resume fails, and its flight records go to the run directory
    # (they went to ./myelin-flight, where the run was started)
    (ckpt / "step-00000014" / "rank1.pt").write_bytes(b"damaged")
    code, out, err = run_train([f"--resume={out_dir}", "--steps=20"], tmp_path)
    assert code != 0 and "rank1.pt" in err, err[-3000:]
    assert (out_dir / "flight" / "rank1.json").exists()
    assert not (tmp_path / "myelin-flight").exists()


def test_runs_unchanged_under_torchrun_and_agrees_on_one_run_directory(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    code, out, err = run_train([*QUICK, "--steps=3", "--eval-every=3"], tmp_path, torchrun)
    assert code == 0, err[-5000:]
    (run_dir,) = (tmp_path / "runs").iterdir()  # one timestamped directory, not one per rank
    assert (run_dir / "model.pt").exists() and (run_dir / "config.json").exists()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 3] and "val_loss" in rows[1]


def test_one_stage_trains_in_this_process(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    assert main(parse(*QUICK, "--stages=1", "--steps=2", "--sample-tokens=5")) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "config.json").read_text())["stages"] == 1
    assert "sample (" in capsys.readouterr().out


@pytest.mark.slow  # 10 s; `myelin train` runs the same way in the default suite
def test_the_example_runs_as_its_first_line_says_and_learns(tmp_path):
    cmd = [sys.executable, "-m", "myelin.cli", "run", "-n", "2", str(EXAMPLE), "--steps", "10"]
    code, out, err = run(cmd, tmp_path)
    assert code == 0, err[-5000:]
    rows = re.findall(r"step +(\d+) +loss (\d+\.\d+) +val loss (\d+\.\d+)", out)
    assert [int(r[0]) for r in rows] == [10], out
    assert float(rows[-1][2]) < 5.0, out  # from ln(256) = 5.55 at the start
    assert (tmp_path / "gpt.pt").exists()


# -- options -------------------------------------------------------------------------


def test_help_lists_every_option():
    parser = argparse.ArgumentParser(prog="myelin train")
    add_arguments(parser)
    text = parser.format_help()
    for name in TrainConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in text
    assert "--config" in text and "TOML" in text


def test_flags_override_toml_and_toml_overrides_defaults(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\nlr = 1\nschedule = "1f1b"\nout = "somewhere"\n')
    cfg = config_from_args(parse("--config", str(toml), "--steps", "9"))
    assert (cfg.steps, cfg.lr, cfg.schedule, cfg.out) == (9, 1.0, "1f1b", "somewhere")
    assert type(cfg.lr) is float and cfg.n_layer == TrainConfig().n_layer


def test_toml_booleans_set_on_off_options(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("offload_activations = false\noffload_optimizer = true\n")
    cfg = config_from_args(parse("--config", str(toml)))
    assert (cfg.offload_activations, cfg.offload_optimizer) == ("off", "on")
    toml.write_text("device_memory_limit = 1000000\n")  # a byte count as an int, too
    assert config_from_args(parse("--config", str(toml))).device_memory_limit == "1000000"
    toml.write_text("steps = true\n")  # a boolean for a number is still named
    with pytest.raises(ConfigError, match="steps=True must be an int"):
        config_from_args(parse("--config", str(toml)))


def test_a_block_longer_than_an_hf_configs_positions_is_named(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_positions": 128}))
    with pytest.raises(ConfigError, match="block_size=256 exceeds the 128 positions of"):
        TrainConfig(model=str(config), block_size=256)
    assert TrainConfig(model=str(config), block_size=128).block_size == 128


def test_unknown_toml_key_is_named(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("n_layers = 3\n")
    with pytest.raises(ConfigError, match=r"unknown option 'n_layers' \(did you mean 'n_layer'"):
        config_from_args(parse("--config", str(toml)))


@pytest.mark.parametrize(
    "values, message",
    [
        ({"lr": -1.0}, r"lr=-1.0 must be in \(0, 1\]"),
        ({"steps": "10"}, r"steps='10' must be an int"),
        ({"steps": True}, r"steps=True must be an int"),
        ({"schedule": "zigzag"}, r"schedule='zigzag' must be one of message-driven"),
        ({"d_model": 30, "n_head": 4}, r"d_model=30 must be divisible by n_head=4"),
        ({"batch": 10, "microbatches": 4}, r"batch=10 must split evenly into microbatches=4"),
        ({"stages": 5, "n_layer": 2}, r"stages=5 exceeds the model's 4 layers"),
        ({"offload_optimizer": "gpu"}, r"offload_optimizer='gpu' must be one of on, off"),
        ({"precision": "fp8"}, r"precision='fp8' must be one of fp32, bf16, fp16"),
        ({"device_memory_limit": "6 gigs"}, r"device_memory_limit"),
        ({"host_memory_limit": "0"}, r"host_memory_limit"),
        ({"host_memory_limit": "abc"}, r"^host_memory_limit=.abc."),
    ],
)
def test_bad_values_are_named(values, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**values)


def test_a_huggingface_model_without_transformers_says_which_extra_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"model='llama' needs .*pip install 'myelin\[hf\]'"):
        TrainConfig(model="llama")


def test_bad_toml_value_names_the_field(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("val_fraction = 1.5\n")
    with pytest.raises(ConfigError, match=r"val_fraction=1.5 must be in \(0, 1\)"):
        config_from_args(parse("--config", str(toml)))


def test_main_reports_a_bad_config_without_starting_processes(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(parse("--n-layer=1", "--stages=4")) == 2
    assert "myelin train: error: stages=4 exceeds" in capsys.readouterr().err


def test_a_fresh_run_into_a_directory_holding_a_checkpoint_is_refused(
    tmp_path, capsys, monkeypatch
):
    """A fresh run would leave the earlier checkpoint beside its own config, and a later
    --resume would load the earlier run's weights under this run's settings."""
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "latest").write_text("step-00000012")
    assert main(parse("--n-layer=1", "--stages=1", f"--out={tmp_path / 'run'}")) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run's checkpoint: continue it with --resume" in err
    with pytest.raises(ConfigError, match="holds an earlier run's checkpoint"):
        train_module._make_out(config_from_args(parse(f"--out={tmp_path / 'run'}", "--resume=")))
    toml = tmp_path / "bad.toml"
    for value in ("5", "true"):
        toml.write_text(f"resume = {value}\n")
        shown = "True" if value == "true" else value
        with pytest.raises(ConfigError, match=f"resume={shown} must be a string"):
            config_from_args(parse("--config", str(toml)))


def test_argv_for_the_ranks_rebuilds_the_config():
    cfg = TrainConfig(steps=11, lr=3e-4, min_lr=1e-5, prompt="x = -1", out="r")
    assert config_from_args(parse(*to_argv(cfg))) == cfg


def test_learning_rate_warms_up_then_anneals_by_steps_or_time():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosine(opt, warmup_steps=2, floor=0.1)

    def lr_after_a_step(progress: float) -> float:
        opt.step()
        sched.progress = progress  # the larger share used: of the steps, or of the time
        sched.step()
        return sched.get_last_lr()[0]

    assert sched.get_last_lr() == [0.5]  # warmup: step 0 of 2
    assert lr_after_a_step(0.0) == 1.0
    assert lr_after_a_step(0.5) == pytest.approx(0.55)
    assert lr_after_a_step(1.0) == pytest.approx(0.1)


def test_a_run_shorter_than_its_warmup_still_anneals():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosine(opt, warmup_steps=20, floor=0.1)  # a run of 12 steps
    lrs = []
    for step in range(12):
        opt.step()
        sched.progress = (step + 1) / 12
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs[0] == pytest.approx(0.1)  # the warmup's ramp (2 of 20) is the lower
    assert lrs[-1] == pytest.approx(0.1)  # and the run ends at the floor, annealed
    assert max(lrs) < 0.6  # the ramp capped by the cosine on its way down


# -- data ----------------------------------------------------------------------------


def test_stdlib_split_is_deterministic_and_by_file():
    files = source_files(stdlib_root())
    assert files and all(p.suffix == ".py" for p in files)
    assert not any("site-packages" in p.parts for p in files)
    rel = [p.relative_to(stdlib_root()).as_posix() for p in files]
    val = [r for r in rel if is_validation(r, 0.05)]
    assert 0 < len(val) < len(rel) // 5
    assert val == [r for r in rel if is_validation(r, 0.05)]
    a, b = load_stdlib_text(max_bytes=200_000), load_stdlib_text(max_bytes=200_000)
    assert a.train.dtype == torch.uint8 and a.train.numel() + a.val.numel() == 200_000
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)


def test_batches_depend_on_seed_stream_and_index_only():
    tokens = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    x, y = Batches(tokens, 16, 4, seed=1, stream=("train", 0)).get(5)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    same = Batches(tokens, 16, 4, seed=1, stream=("train", 0)).get(5)
    assert torch.equal(same[0], x)  # ranks of one replica see one batch
    assert not torch.equal(Batches(tokens, 16, 4, 1, ("train", 1)).get(5)[0], x)  # replicas
    assert not torch.equal(Batches(tokens, 16, 4, 2, ("train", 0)).get(5)[0], x)  # seeds
    first, second = itertools.islice(Batches(tokens, 16, 4, 1, ("train", 0)), 2)  # a loader
    assert torch.equal(second[0], Batches(tokens, 16, 4, 1, ("train", 0)).get(1)[0])


def test_no_source_files_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no Python source files found under"):
        load_stdlib_text(root=tmp_path)
    with pytest.raises(ConfigError, match="cannot fill one window"):
        Batches(torch.zeros(10, dtype=torch.uint8), 16, 1, seed=0)
