"""Every invalid setting is rejected before any process or socket starts, naming the
setting, the value and what is allowed: one table per owner, read top to bottom.

    python -m pytest -q tests/test_config_errors.py

Owners: Trainer / PipelineConfig, TransportConfig, MessageLimits, OffloadConfig,
ProfileConfig, TrainConfig, and the command line (`myelin train`, `myelin run`,
`myelin profile`). Each row is (setting=value, fragments the message must contain).
A row marked `bug=` is a known library defect, kept as a strict xfail until fixed.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import myelin
from myelin import cli
from myelin import train as train_job
from myelin.errors import ConfigError
from myelin.profile.report import ProfileConfig
from myelin.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
BIG = "[1, 1000000000]"
BYTES = "expected a positive int"  # parse_bytes names the forms a byte count takes
SCHEDULES = "message-driven, gpipe, 1f1b, zero-bubble"
UNSET = None  # an env override of None removes the variable


@dataclass(frozen=True)
class Bad:
    """One invalid setting: the keyword arguments that carry it and what the error must say."""

    kwargs: dict[str, Any]
    says: tuple[str, ...]
    bug: str | None = None  # the library gets this wrong: a strict xfail, with the reason
    env: dict[str, str | None] = field(default_factory=dict)  # Trainer: environment overrides
    absent: tuple[str, ...] = ()  # fragments the message must not contain

    def param(self) -> Any:
        parts = [f"{k}={short(v)}" for k, v in self.kwargs.items()]
        name = ",".join(parts + [f"${k}={v!r}" for k, v in self.env.items()])
        marks = [pytest.mark.xfail(strict=True, reason=self.bug)] if self.bug else []
        return pytest.param(self, id=name[:60], marks=marks)


def short(value: Any) -> str:
    """A test id's view of a value: modules and optimizers by their type name."""
    if isinstance(value, (nn.Module, torch.optim.Optimizer)):
        return type(value).__name__
    return repr(value)


def bad(*says: str, bug: str | None = None, env: dict | None = None, absent=(), **kwargs) -> Bad:
    return Bad(kwargs, says, bug, env or {}, absent)


def params(rows: list[Bad]) -> list[Any]:
    return [row.param() for row in rows]


def check_message(exc: BaseException, row: Bad) -> None:
    text = str(exc)
    for fragment in row.says:
        assert fragment in text, f"{fragment!r} missing from: {text}"
    for fragment in row.absent:
        assert fragment not in text, f"{fragment!r} should not be in: {text}"


# -- Trainer / PipelineConfig ------------------------------------------------------------
#
# Built in this process as rank 0 of a 2-process world (WORLD_SIZE=2) with stages=2, so a
# valid configuration would go on to start the process group; that call is replaced by
# one that raises, so a check that comes too late shows up as `Started`, never as a hang.


def tiny_model(n: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def paramless_tail() -> nn.Sequential:  # stage 1 of partition=[2, 2] has no parameters
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.0))


SGD = functools.partial(torch.optim.SGD, lr=0.1)
TRAINER_ENV = {
    "WORLD_SIZE": "2",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29599",
}

TRAINER = [
    # stages, microbatches, data_parallel: ints >= 1
    bad("stages=0", ">= 1", stages=0),
    bad("stages=-1", ">= 1", stages=-1),
    bad("stages=True", ">= 1", stages=True),
    bad("stages=2.0", ">= 1", stages=2.0),
    bad("stages='2'", ">= 1", stages="2"),
    bad("stages=None", ">= 1", stages=None),
    bad("microbatches=0", ">= 1", microbatches=0),
    bad("microbatches=True", ">= 1", microbatches=True),
    bad("microbatches=1.5", ">= 1", microbatches=1.5),
    bad("data_parallel=0", ">= 1", data_parallel=0),
    bad("data_parallel=-2", ">= 1", data_parallel=-2),
    bad("data_parallel='1'", ">= 1", data_parallel="1"),
    # schedule: one of SCHEDULES
    bad("schedule='zigzag'", SCHEDULES, schedule="zigzag"),
    bad("schedule='GPipe'", SCHEDULES, schedule="GPipe"),
    bad("schedule=None", SCHEDULES, schedule=None),
    bad("schedule=['gpipe']", SCHEDULES, schedule=["gpipe"]),
    # max_inflight: None or an int >= 1
    bad("max_inflight=0", ">= 1", max_inflight=0),
    bad("max_inflight=-1", ">= 1", max_inflight=-1),
    bad("max_inflight=True", ">= 1", max_inflight=True),
    bad("max_inflight=1.5", ">= 1", max_inflight=1.5),
    # partition: one int >= 1 per stage, covering the model's layers
    bad("partition=[1, 1, 2]", "stages=2", partition=[1, 1, 2]),
    bad("partition=[0, 4]", ">= 1", partition=[0, 4]),
    bad("partition=[2.0, 2]", ">= 1", partition=[2.0, 2]),
    bad("partition=[True, 3]", ">= 1", partition=[True, 3]),
    bad("partition='22'", "list of layer counts", partition="22"),
    bad("partition=[1, 5]", "has 4", partition=[1, 5]),
    # timeout: seconds in (0, 86400]
    bad("timeout=0", "(0, 86400]", timeout=0),
    bad("timeout=-1", "(0, 86400]", timeout=-1),
    bad("timeout=nan", "(0, 86400]", timeout=float("nan")),
    bad("timeout=inf", "(0, 86400]", timeout=float("inf")),
    bad("timeout=86401", "(0, 86400]", timeout=86401),
    bad("timeout=True", "number of seconds", timeout=True),
    bad("timeout='300'", "number of seconds", timeout="300"),
    # stage_devices: one 'cpu' or 'cuda' device per stage; cpu_threads: ints in [1, 1024]
    bad("stage_devices=['cpu']", "lists 1 devices", "stages=2", stage_devices=["cpu"]),
    bad("stage_devices[1]='tpu'", "stage_devices[1]='tpu'", stage_devices=["cpu", "tpu"]),
    bad("stage_devices='cpu'", "one device per stage", stage_devices="cpu"),
    bad("cpu_threads=0", "cpu_threads=0", "[1, 1024]", cpu_threads=0),
    bad("cpu_threads[1]=-1", "cpu_threads[1]=-1", cpu_threads=[1, -1]),
    bad("not both", device="cpu", stage_devices=["cpu", "cpu"]),
    # transport, offload: the config objects
    bad("transport='tcp'", "TransportConfig", transport="tcp"),
    bad("transport={}", "TransportConfig", transport={}),
    bad("offload=True", "OffloadConfig", offload=True),
    bad("offload='activations'", "OffloadConfig", offload="activations"),
    # profile: False/None, True, a directory, or a ProfileConfig
    bad("profile=3", "True, an output directory", profile=3),
    bad("profile=1.5", "True, an output directory", profile=1.5),
    bad("profile out_dir=''", "must name a directory", profile=""),
    # precision: one of fp32, bf16, fp16
    bad("precision='fp8'", "'fp32', 'bf16', 'fp16'", precision="fp8"),
    bad("precision='FP16'", "'fp32', 'bf16', 'fp16'", precision="FP16"),
    bad("precision=None", "'fp32', 'bf16', 'fp16'", precision=None),
    bad(
        "precision='fp16'",
        "no trainable parameters",
        model=paramless_tail(),
        partition=[2, 2],
        precision="fp16",
    ),
    # device_memory_limit: bytes > 0, an int or a string such as '6GiB'
    bad("device_memory_limit=0", BYTES, device_memory_limit=0),
    bad("device_memory_limit=-1", BYTES, device_memory_limit=-1),
    bad("device_memory_limit=True", BYTES, device_memory_limit=True),
    bad("device_memory_limit=1.5", BYTES, device_memory_limit=1.5),
    bad("device_memory_limit='lots'", BYTES, device_memory_limit="lots"),
    bad("device_memory_limit='6 GiBs'", BYTES, device_memory_limit="6 GiBs"),
    # device: a torch device this machine has
    bad("device='nope'", "not a device torch knows", device="nope"),
    bad("device=1.5", "a string like 'cuda:0' or 'cpu'", device=1.5),
    bad("device='cuda:99'", device="cuda:99"),  # names the CUDA devices there are, if any
    bad("tied_grads='exact'", "'step'", "'microbatch'", tied_grads="exact"),
    # resume: a checkpoint directory
    bad("resume=5", "checkpoint directory", resume=5),
    bad(
        "resume='/nonexistent/ckpt'",
        "checkpoint",
        resume="/nonexistent/ckpt",
    ),
    # run_dir: where flight records go
    bad("run_dir=5", "directory path", run_dir=5),
    bad("run_dir=''", "directory path", run_dir=""),
    # model, optimizer, loss_fn
    bad("NoneType", "nn.Sequential", model=None),
    bad("Linear", "nn.Sequential", model=nn.Linear(4, 4)),
    bad("stages", "5", model=tiny_model(4), stages=5, env={"WORLD_SIZE": "5"}),
    bad("optimizer", "instance", optimizer=torch.optim.SGD(tiny_model(1).parameters(), lr=0.1)),
    bad("optimizer='adamw'", "factory", optimizer="adamw"),
    bad("optimizer=None", "factory", optimizer=None),
    bad("loss_fn=None", "callable", loss_fn=None),
    bad("loss_fn='mse'", "callable", loss_fn="mse"),
    # the launcher's environment against stages x data_parallel
    bad("stages=2", "needs 2 processes", "started alone", env={"WORLD_SIZE": UNSET}),
    bad("WORLD_SIZE='two'", "not an integer", env={"WORLD_SIZE": "two"}),
    bad("WORLD_SIZE says 3", "needs a world of 2", env={"WORLD_SIZE": "3"}),
    bad("data_parallel=2", "needs a world of 4", data_parallel=2),
    bad("RANK='2'", "[0, 1]", env={"RANK": "2"}),
]


class Started(Exception):
    """Raised where the Trainer would start the process group: validation came too late."""


@pytest.fixture
def no_world(monkeypatch):
    """A 2-process environment in which starting the process group raises `Started`."""
    assert not dist.is_initialized()

    def refuse(*args, **kwargs):
        raise Started("torch.distributed.init_process_group was called")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in TRAINER_ENV.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def build_trainer(row: Bad) -> myelin.Trainer:
    kwargs = {"model": tiny_model(), "optimizer": SGD, "loss_fn": nn.functional.mse_loss}
    kwargs.update(stages=2)
    kwargs.update(row.kwargs)
    return myelin.Trainer(**kwargs)


@pytest.mark.parametrize("row", params(TRAINER))
def test_trainer_rejects(row, no_world, tmp_path):
    no_world.chdir(tmp_path)  # anything wrongly written lands here
    for key, value in row.env.items():
        if value is None:
            no_world.delenv(key)
        else:
            no_world.setenv(key, value)
    env = dict(os.environ)
    with pytest.raises(ConfigError) as exc:
        build_trainer(row)
    check_message(exc.value, row)
    assert not dist.is_initialized()
    assert dict(os.environ) == env, "the failed Trainer changed the environment"
    assert list(tmp_path.iterdir()) == [], "the failed Trainer wrote files"


def test_a_valid_trainer_gets_as_far_as_the_process_group(no_world):
    """The harness itself: without a bad setting the Trainer reaches the group's start."""
    with pytest.raises(Started):
        build_trainer(Bad({}, ()))
    assert not dist.is_initialized()


# -- TransportConfig -------------------------------------------------------------------

KINDS = "('auto', 'ipc', 'tcp')"
HOST = "an IP address or a host name"
TRANSPORT = [
    bad("TransportConfig.kind='udp'", KINDS, kind="udp"),
    bad("TransportConfig.kind='IPC'", KINDS, kind="IPC"),
    bad("TransportConfig.kind=None", KINDS, kind=None),
    bad("TransportConfig.host=''", HOST, host=""),
    bad("TransportConfig.host=None", HOST, host=None),
    bad("TransportConfig.host=5", HOST, host=5),
    bad("TransportConfig.host='not a host!'", HOST, host="not a host!"),
    bad("max_inflight_bytes=0", "[1, 4611686018427387904]", max_inflight_bytes=0),
    bad("max_inflight_bytes=-1", "[1, 4611686018427387904]", max_inflight_bytes=-1),
    bad("max_inflight_bytes=True", "[1, 4611686018427387904]", max_inflight_bytes=True),
    bad("max_inflight_bytes=1.5", "[1, 4611686018427387904]", max_inflight_bytes=1.5),
    bad("max_inflight_bytes='256MiB'", "[1, 4611686018427387904]", max_inflight_bytes="256MiB"),
    bad(f"max_inflight_bytes={2**62 + 1}", "[1, 46116", max_inflight_bytes=2**62 + 1),
    bad("linger_ms=-1", "[0, 600000]", linger_ms=-1),
    bad("linger_ms=600001", "[0, 600000]", linger_ms=600_001),
    bad("linger_ms=1.5", "[0, 600000]", linger_ms=1.5),
    bad("linger_ms=True", "[0, 600000]", linger_ms=True),
    bad("connect_timeout_s=0", "[0.001, 86400.0]", connect_timeout_s=0),
    bad("connect_timeout_s=0.0001", "[0.001, 86400.0]", connect_timeout_s=1e-4),
    bad("connect_timeout_s=86401", "[0.001, 86400.0]", connect_timeout_s=86401),
    bad("connect_timeout_s=nan", "[0.001, 86400.0]", connect_timeout_s=float("nan")),
    bad("connect_timeout_s=inf", "[0.001, 86400.0]", connect_timeout_s=float("inf")),
    bad("connect_timeout_s=True", "[0.001, 86400.0]", connect_timeout_s=True),
    bad("connect_timeout_s='60'", "[0.001, 86400.0]", connect_timeout_s="60"),
    bad("TransportConfig.ipc_dir=''", "None or a path", ipc_dir=""),
    bad("TransportConfig.ipc_dir=5", "None or a path", ipc_dir=5),
    bad(
        "TransportConfig.ipc_dir='/nonexistent/dir'", "not a directory", ipc_dir="/nonexistent/dir"
    ),
    bad("TransportConfig.limits={}", "MessageLimits", limits={}),
    bad("TransportConfig.limits=None", "MessageLimits", limits=None),
    bad("TransportConfig.shm=1", "True or False", shm=1),
    bad("TransportConfig.shm='yes'", "True or False", shm="yes"),
    bad("TransportConfig.shm=None", "True or False", shm=None),
    bad("shm_threshold_bytes=0", "[1, 1099511627776]", shm_threshold_bytes=0),
    bad("shm_threshold_bytes=True", "[1, 1099511627776]", shm_threshold_bytes=True),
    bad(f"shm_threshold_bytes={2**40 + 1}", "[1, 1099511627776]", shm_threshold_bytes=2**40 + 1),
    bad("shm_bytes=1048575", "[1048576, 1099511627776]", shm_bytes=2**20 - 1),
    bad("shm_bytes=0", "[1048576, 1099511627776]", shm_bytes=0),
    bad("shm_bytes='256MiB'", "[1048576, 1099511627776]", shm_bytes="256MiB"),
    bad(f"shm_bytes={2**40 + 1}", "[1048576, 1099511627776]", shm_bytes=2**40 + 1),
    bad("shm_wait_s=-0.1", "[0.0, 60.0]", shm_wait_s=-0.1),
    bad("shm_wait_s=61", "[0.0, 60.0]", shm_wait_s=61),
    bad("shm_wait_s=nan", "[0.0, 60.0]", shm_wait_s=float("nan")),
    bad("shm_wait_s=True", "[0.0, 60.0]", shm_wait_s=True),
    bad("ring_bytes=True", "0 (no ring) or a multiple of 8", ring_bytes=True),
    bad("ring_bytes=1000", "[65536, 1073741824]", ring_bytes=1000),
    bad("ring_bytes=65540", "a multiple of 8", ring_bytes=65540),
    bad(f"ring_bytes={2**31}", "[65536, 1073741824]", ring_bytes=2**31),
    bad("spin_us=nan", "[0.0, 10000.0]", spin_us=float("nan")),
    bad("spin_us=True", "[0.0, 10000.0]", spin_us=True),
    bad("spin_us=-1", "[0.0, 10000.0]", spin_us=-1),
    bad("TransportConfig.curve='yes'", "None, True or False", curve="yes"),
    bad("TransportConfig.curve=2", "None, True or False", curve=2),
    bad("TransportConfig.curve=1", "None, True or False", curve=1),
    bad("heartbeat_s=0", "[0.01, 60.0]", heartbeat_s=0),
    bad("heartbeat_s=61", "[0.01, 60.0]", heartbeat_s=61),
    bad("heartbeat_s=nan", "[0.01, 60.0]", heartbeat_s=float("nan")),
    bad("heartbeat_s=True", "[0.01, 60.0]", heartbeat_s=True),
    bad("peer_timeout_s=0.01", "[0.05, 3600.0]", peer_timeout_s=0.01),
    bad("peer_timeout_s=3601", "[0.05, 3600.0]", peer_timeout_s=3601),
    bad("peer_timeout_s=None", "[0.05, 3600.0]", peer_timeout_s=None),
    bad("peer_timeout_s=0.5", "at least twice", "heartbeat_s=0.5", peer_timeout_s=0.5),
    bad("exit_after_loss_s=-1", "[0.0, 3600.0]", exit_after_loss_s=-1),
    bad("exit_after_loss_s=3601", "[0.0, 3600.0]", exit_after_loss_s=3601),
    bad("exit_after_loss_s='5'", "[0.0, 3600.0]", exit_after_loss_s="5"),
    bad("exit_after_loss_s=True", "[0.0, 3600.0]", exit_after_loss_s=True),
]


@pytest.mark.parametrize("row", params(TRANSPORT))
def test_transport_config_rejects(row):
    with pytest.raises(ConfigError) as exc:
        myelin.TransportConfig(**row.kwargs)
    check_message(exc.value, row)


# -- MessageLimits -----------------------------------------------------------------------

MESSAGE_LIMITS = [
    bad(f"MessageLimits.{name}={value!r}", "must be an int >= 1", **{name: value})
    for name, value in [
        ("max_header_bytes", 0),
        ("max_header_bytes", "64KiB"),
        ("max_tensors", -1),
        ("max_tensors", True),
        ("max_ndim", 0),
        ("max_ndim", 2.0),
        ("max_tensor_bytes", -1),
        ("max_tensor_bytes", None),
        ("max_message_bytes", 0),
        ("max_message_bytes", 1.5),
    ]
]


@pytest.mark.parametrize("row", params(MESSAGE_LIMITS))
def test_message_limits_rejects(row):
    with pytest.raises(ConfigError) as exc:
        myelin.MessageLimits(**row.kwargs)
    check_message(exc.value, row)


# -- OffloadConfig -----------------------------------------------------------------------

OPT_MODES = "True, False or one of 'device', 'host', 'stream'"
OFFLOAD = [
    bad("OffloadConfig.activations='yes'", "True/False", activations="yes"),
    bad("OffloadConfig.activations=1", "True/False", activations=1),
    bad("OffloadConfig.activations=None", "True/False", activations=None),
    bad("OffloadConfig.optimizer='gpu'", OPT_MODES, optimizer="gpu"),
    bad("OffloadConfig.optimizer='Host'", OPT_MODES, optimizer="Host"),
    bad("OffloadConfig.optimizer=1", OPT_MODES, optimizer=1),
    bad("OffloadConfig.optimizer=None", OPT_MODES, optimizer=None),
    bad("OffloadConfig.min_bytes=-1", "at least 0 B", absent=("more than 0",), min_bytes=-1),
    bad("OffloadConfig.min_bytes='lots'", BYTES, min_bytes="lots"),
    bad("OffloadConfig.min_bytes=True", BYTES, min_bytes=True),
    bad("OffloadConfig.min_bytes=1.5", BYTES, min_bytes=1.5),
    bad("OffloadConfig.min_bytes=0.0", BYTES, min_bytes=0.0),
    bad("OffloadConfig.min_bytes=None", "byte count", min_bytes=None),
    bad("OffloadConfig.prefetch=-1", "[0, 64]", prefetch=-1),
    bad("OffloadConfig.prefetch=65", "[0, 64]", prefetch=65),
    bad("OffloadConfig.prefetch=True", "[0, 64]", prefetch=True),
    bad("OffloadConfig.prefetch=1.5", "[0, 64]", prefetch=1.5),
    bad("OffloadConfig.prefetch='1'", "[0, 64]", prefetch="1"),
    bad("OffloadConfig.prefetch=None", "[0, 64]", prefetch=None),
    bad("OffloadConfig.fetch_ahead=-1", "from 0 to 1024", fetch_ahead=-1),
    bad("OffloadConfig.fetch_ahead=67108864", "'64MiB'", fetch_ahead=64 << 20),
    bad("OffloadConfig.fetch_ahead=True", "number of layers", fetch_ahead=True),
    bad("OffloadConfig.fetch_ahead=1.5", "number of layers", fetch_ahead=1.5),
    bad("OffloadConfig.fetch_ahead=None", "number of layers", fetch_ahead=None),
    bad("OffloadConfig.fetch_ahead='lots'", "number of layers", "byte count", fetch_ahead="lots"),
    bad("OffloadConfig.fetch_ahead='0B'", "more than 0 bytes", fetch_ahead="0B"),
    bad("OffloadConfig.host_memory_limit=0", "at least 1 B", host_memory_limit=0),
    bad("OffloadConfig.host_memory_limit=-5", "at least 1 B", host_memory_limit=-5),
    bad("OffloadConfig.host_memory_limit='lots'", BYTES, host_memory_limit="lots"),
    bad("OffloadConfig.host_memory_limit=True", BYTES, host_memory_limit=True),
    bad("OffloadConfig.host_memory_limit=1.5", BYTES, host_memory_limit=1.5),
    bad("OffloadConfig.slab_bytes='1KiB'", "at least 1 MiB", slab_bytes="1KiB"),
    bad("OffloadConfig.slab_bytes=1000", "at least 1 MiB", slab_bytes=1000),
    bad("OffloadConfig.slab_bytes=0", "at least 1 MiB", slab_bytes=0),
    bad("OffloadConfig.slab_bytes='x'", BYTES, slab_bytes="x"),
    bad("OffloadConfig.slab_bytes=None", "byte count", slab_bytes=None),
    bad("OffloadConfig.bucket_bytes=0", "at least 1 B", bucket_bytes=0),
    bad("OffloadConfig.bucket_bytes='x'", BYTES, bucket_bytes="x"),
    bad("OffloadConfig.bucket_bytes=True", BYTES, bucket_bytes=True),
    bad("OffloadConfig.bucket_bytes=None", "byte count", bucket_bytes=None),
]


@pytest.mark.parametrize("row", params(OFFLOAD))
def test_offload_config_rejects(row):
    with pytest.raises(ConfigError) as exc:
        myelin.OffloadConfig(**row.kwargs)
    check_message(exc.value, row)


# -- ProfileConfig -----------------------------------------------------------------------

PROFILE = [
    bad("out_dir=5", "path", out_dir=5),
    bad("out_dir=b'out'", "path", out_dir=b"out"),
    bad("out_dir=''", "must name a directory", out_dir=""),
    bad("interval_s=0", "[0.001, 60.0]", interval_s=0),
    bad("interval_s=0.0005", "[0.001, 60.0]", interval_s=0.0005),
    bad("interval_s=61", "[0.001, 60.0]", interval_s=61),
    bad("interval_s=nan", "[0.001, 60.0]", interval_s=float("nan")),
    bad("interval_s=True", "number of seconds", interval_s=True),
    bad("interval_s='0.1'", "number of seconds", interval_s="0.1"),
    bad("warmup_steps=-1", ">= 0", warmup_steps=-1),
    bad("warmup_steps=1.5", ">= 0", warmup_steps=1.5),
    bad("warmup_steps=True", ">= 0", warmup_steps=True),
    bad("warmup_steps='1'", ">= 0", warmup_steps="1"),
    bad("gather_timeout_s=0.05", "[0.1, 3600.0]", gather_timeout_s=0.05),
    bad("gather_timeout_s=3601", "[0.1, 3600.0]", gather_timeout_s=3601),
    bad("gather_timeout_s=None", "number of seconds", gather_timeout_s=None),
    bad("print_summary='no'", "True/False", print_summary="no"),
    bad("print_summary=None", "True/False", print_summary=None),
]


@pytest.mark.parametrize("row", params(PROFILE))
def test_profile_config_rejects(row):
    with pytest.raises(ConfigError) as exc:
        ProfileConfig(**row.kwargs)
    check_message(exc.value, row)


# -- TrainConfig (`myelin train` options, from flags or TOML) ---------------------------

TRAIN = [
    bad("n_layer=0", "[1, 256]", n_layer=0),
    bad("n_layer=257", "[1, 256]", n_layer=257),
    bad("n_layer=2.0", "an int", n_layer=2.0),
    bad("n_layer=True", "an int", n_layer=True),
    bad("n_head=0", "[1, 256]", n_head=0),
    bad("d_model=0", "[1, 16384]", d_model=0),
    bad("d_model=16385", "[1, 16384]", d_model=16385),
    bad("block_size=0", "[1, 65536]", block_size=0),
    bad("block_size='128'", "an int", block_size="128"),
    bad("batch=0", "[1, 1048576]", batch=0),
    bad("microbatches=0", "[1, 4096]", microbatches=0),
    bad("microbatches=4097", "[1, 4096]", microbatches=4097),
    bad("stages=0", "[1, 1024]", stages=0),
    bad("data_parallel=0", "[1, 1024]", data_parallel=0),
    bad("data_parallel=None", "an int", data_parallel=None),
    bad("schedule='zigzag'", SCHEDULES, schedule="zigzag"),
    bad("schedule=1", "a string", schedule=1),
    bad("offload_activations='yes'", "on, off", offload_activations="yes"),
    bad("offload_activations=True", "a string", offload_activations=True),
    bad("offload_optimizer='gpu'", "on, off, host, stream", offload_optimizer="gpu"),
    bad("precision='fp8'", "fp32, bf16, fp16", precision="fp8"),
    bad("device_memory_limit='lots'", BYTES, device_memory_limit="lots"),
    bad("device_memory_limit='0'", BYTES, device_memory_limit="0"),
    bad("host_memory_limit='lots'", BYTES, host_memory_limit="lots"),
    bad("host_memory_limit='-1GiB'", BYTES, host_memory_limit="-1GiB"),
    bad("steps=0", BIG, steps=0),
    bad("steps=-1", BIG, steps=-1),
    bad("steps=1000000001", BIG, steps=10**9 + 1),
    bad("steps=1.5", "an int", steps=1.5),
    bad("lr=0.0", "(0, 1]", lr=0),
    bad("lr=-0.001", "(0, 1]", lr=-1e-3),
    bad("lr=2.0", "(0, 1]", lr=2.0),
    bad("lr=nan", "(0, 1]", lr=float("nan")),
    bad("lr=True", "a number", lr=True),
    bad("lr='1e-3'", "a number", lr="1e-3"),
    bad("min_lr=-0.1", "[0, 1]", min_lr=-0.1),
    bad("min_lr=0.01", "lr=0.002", min_lr=0.01),  # more than lr
    bad("warmup_steps=-1", "[0, 1000000000]", warmup_steps=-1),
    bad("weight_decay=1.5", "[0, 1]", weight_decay=1.5),
    bad("max_minutes=0.0", "(0, 10080]", max_minutes=0),
    bad("max_minutes=inf", "(0, 10080]", max_minutes=float("inf")),
    bad("eval_every=0", BIG, eval_every=0),
    bad("eval_batches=0", "[1, 1048576]", eval_batches=0),
    bad("log_every=0", BIG, log_every=0),
    bad("seed=-1", "[0, 9223372036854775807]", seed=-1),
    bad("seed=9223372036854775808", "[0, 9223372036854775807]", seed=2**63),
    bad("max_bytes=1023", "[1024, 1099511627776]", max_bytes=1023),
    bad("val_fraction=0.0", "(0, 1)", val_fraction=0),
    bad("val_fraction=1.0", "(0, 1)", val_fraction=1.0),
    bad("out=5", "a string", out=5),
    bad("resume=5", "a string", resume=5),
    bad("checkpoint_every=0", BIG, checkpoint_every=0),
    bad("sample_tokens=-1", "[0, 1048576]", sample_tokens=-1),
    bad("prompt=''", "at least one character", prompt=""),
    bad("prompt=None", "a string", prompt=None),
    bad("temperature=0.0", "(0, 100]", temperature=0),
    bad("temperature=101.0", "(0, 100]", temperature=101),
    bad("top_k=0", "[1, 256]", top_k=0),
    bad("top_k=257", "[1, 256]", top_k=257),
    # settings that are each fine but do not fit together
    bad("d_model=128", "n_head=3", n_head=3),
    bad("batch=10", "microbatches=4", batch=10),
    bad("stages=7", "6 layers", stages=7),
]


@pytest.mark.parametrize("row", params(TRAIN))
def test_train_config_rejects(row):
    with pytest.raises(ConfigError) as exc:
        TrainConfig(**row.kwargs)
    check_message(exc.value, row)


# -- the command line ------------------------------------------------------------------
#
# Each row runs `myelin.cli.main(argv)` in a fresh temporary directory, with every way
# to start work (the launcher, torch's elastic agent, an in-process training run)
# replaced by one that raises `Started`. A rejected command exits 2 with the message
# on stderr and leaves no run directory behind. A few rows also run as a real
# subprocess (`python -m myelin.cli ...`, below) to check the exit status end to end.


@dataclass(frozen=True)
class Cmd:
    argv: tuple[str, ...]
    says: tuple[str, ...]
    bug: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # written into the cwd first

    def param(self) -> Any:
        marks = [pytest.mark.xfail(strict=True, reason=self.bug)] if self.bug else []
        return pytest.param(self, id=" ".join(self.argv)[:60], marks=marks)


def cmd(line: str, *says: str, bug: str | None = None, **files: str) -> Cmd:
    return Cmd(tuple(line.split()), says, bug, {k.replace("_", "."): v for k, v in files.items()})


OK_SCRIPT = "import os\nprint('RANK=' + os.environ.get('RANK', '?'))\n"
CLI = [
    # myelin train: flags
    cmd("train --steps -1", "steps=-1", BIG),
    cmd("train --steps 0", "steps=0", BIG),
    cmd("train --steps abc", "--steps", "'abc'", BIG),
    cmd("train --lr 0", "lr=0.0", "(0, 1]"),
    cmd("train --lr nan", "lr=nan", "(0, 1]"),
    cmd("train --schedule zigzag", "schedule='zigzag'", SCHEDULES),
    cmd("train --precision fp8", "precision='fp8'", "fp32, bf16, fp16"),
    cmd("train --offload-optimizer gpu", "offload_optimizer='gpu'", "on, off, host, stream"),
    cmd("train --n-head 3", "d_model=128", "n_head=3"),
    cmd("train --stages 9", "stages=9", "6 layers"),
    cmd("train --device-memory-limit lots", "device_memory_limit='lots'", BYTES),
    cmd("train --host-memory-limit 0", "host_memory_limit='0'", BYTES),
    cmd("train --bogus-flag", "unrecognized arguments", "--bogus-flag"),
    cmd("train --resume nowhere", "resume='nowhere'", "config.json"),
    cmd("train --out /proc/no/run", "out='/proc/no/run'", "cannot be made"),
    # myelin train: --config TOML
    cmd("train --config unk.toml", "'stepz'", "did you mean 'steps'", unk_toml="stepz = 3\n"),
    cmd("train --config neg.toml", "steps=-1", BIG, neg_toml="steps = -1\n"),
    cmd("train --config str.toml", "steps='ten'", "an int", str_toml='steps = "ten"\n'),
    cmd("train --config flt.toml", "steps=10.0", "an int", flt_toml="steps = 10.0\n"),
    cmd("train --config sec.toml", "'model'", "known:", sec_toml="[model]\nn_layer = 2\n"),
    cmd("train --config syn.toml", "syn.toml", "line 1", syn_toml="steps = \n"),
    cmd("train --config missing.toml", "missing.toml", "No such file"),
    cmd("train --config ok.toml --lr 5", "lr=5.0", "(0, 1]", ok_toml="steps = 3\n"),
    # myelin run
    cmd("run -n 0 ok.py", "-n/--nproc: 0 is not a process count", "[1, 4096]", ok_py=OK_SCRIPT),
    cmd("run -n -3 ok.py", "-n/--nproc: -3 is not a process count", "[1, 4096]", ok_py=OK_SCRIPT),
    cmd("run -n abc ok.py", "-n/--nproc", "'abc'", "[1, 4096]", ok_py=OK_SCRIPT),
    cmd("run -n 2 --master-port 70000 ok.py", "--master-port", "70000", "[1, 65535]"),
    cmd("run -n 2 --master-port 0 ok.py", "--master-port: 0 is not a port", "[1, 65535]"),
    cmd("run -n 2 --master-port abc ok.py", "--master-port", "'abc'", "[1, 65535]"),
    cmd("run ok.py", "-n/--nproc", "required"),
    cmd("run -n 2", "script", "required"),
    cmd("run -n 2 missing.py", "script 'missing.py' does not exist"),
    cmd("run -n 2 -m no_such_module_xyz", "no module named 'no_such_module_xyz'"),
    cmd(
        "run -n 2 --master-addr bad_host! ok.py",
        "--master-addr",
        "'bad_host!'",
        HOST,
        ok_py=OK_SCRIPT,
    ),
    # myelin profile
    cmd("profile /nonexistent/prof", "/nonexistent/prof", "does not exist"),
    cmd("profile {prof} --steps abc --no-plot", "--steps 'abc'", "2-4"),
    cmd("profile {prof} --warmup-steps -1 --no-plot", "--warmup-steps", "'-1'", "[0, 1000000]"),
    cmd("profile {prof} --warmup-steps x --no-plot", "--warmup-steps", "'x'", "[0, 1000000]"),
    cmd("profile {prof} --short-gap-us -1 --no-plot", "--short-gap-us", "'-1'", "[0, 1e9]"),
    cmd("bogus", "invalid choice", "'bogus'", "'run', 'train', 'profile'"),
]


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory) -> Path:
    """A real (tiny) myelin profile directory for the `myelin profile` rows."""
    out = tmp_path_factory.mktemp("prof")
    config = ProfileConfig(out_dir=str(out), print_summary=False)
    trainer = myelin.Trainer(tiny_model(), SGD, nn.functional.mse_loss, profile=config)
    with trainer:
        trainer.step(torch.randn(4, 4), torch.randn(4, 4))
    return out


def run_in_process(row: Cmd, cwd: Path, prof: Path, capsys) -> tuple[int, str, str]:
    for name, text in row.files.items():
        (cwd / name).write_text(text)
    argv = [a.format(prof=prof) for a in row.argv]
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """A fresh cwd, and every way the CLI starts work replaced by one raising `Started`."""

    def refuse(*args, **kwargs):
        raise Started(f"work was started: {args}")

    import torch.distributed.run as elastic

    monkeypatch.setattr(cli, "launch", refuse)
    monkeypatch.setattr(elastic, "run", refuse)
    monkeypatch.setattr(train_job, "train", refuse)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("row", [row.param() for row in CLI])
def test_cli_rejects(row, no_launch, capsys, request):
    prof = request.getfixturevalue("profile_dir") if "{prof}" in row.argv else Path()
    env = dict(os.environ)
    code, out, err = run_in_process(row, no_launch, prof, capsys)
    assert code == 2, f"exit status {code}; stderr: {err}"
    for fragment in row.says:
        assert fragment in err, f"{fragment!r} missing from stderr: {err}"
    assert not (no_launch / "runs").exists(), "a run directory was created"
    assert dict(os.environ) == env, "the rejected command changed the environment"
    assert not dist.is_initialized()


# The same, end to end in real processes, for a few rows (each costs a torch import);
# they all start at once.
SUBPROCESS = {
    "train --steps -1": "a flag out of range",
    "run -n 0 ok.py": "a launcher argument out of range",
    "run -n 2 missing.py": "a script that is not there",
}


@pytest.fixture(scope="module")
def subprocess_results(tmp_path_factory) -> dict[str, tuple[int, str, str, Path]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    rows = {" ".join(row.argv): row for row in CLI}
    procs = {}
    for line in SUBPROCESS:
        cwd = tmp_path_factory.mktemp("cli")
        for name, text in rows[line].files.items():
            (cwd / name).write_text(text)
        (cwd / "ok.py").write_text(OK_SCRIPT)
        cmd_line = [sys.executable, "-m", "myelin.cli", *rows[line].argv]
        procs[line] = (
            subprocess.Popen(cmd_line, cwd=cwd, env=env, stdout=PIPE, stderr=PIPE, text=True),
            cwd,
        )
    results = {}
    try:
        for line, (proc, cwd) in procs.items():
            out, err = proc.communicate(timeout=120)
            results[line] = (proc.returncode, out, err, cwd)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def subprocess_params() -> list[Any]:
    rows = {" ".join(row.argv): row for row in CLI}
    return [
        pytest.param(rows[line], id=f"{line} ({why})", marks=rows[line].param().marks)
        for line, why in SUBPROCESS.items()
    ]


@pytest.mark.parametrize("row", subprocess_params())
def test_cli_rejects_in_a_subprocess(row, subprocess_results):
    code, out, err, cwd = subprocess_results[" ".join(row.argv)]
    assert code == 2, f"exit status {code}; stderr: {err[-2000:]}"
    for fragment in row.says:
        assert fragment in err, f"{fragment!r} missing from stderr: {err[-2000:]}"
    assert "RANK=" not in out and out == "", f"a rank ran: {out[-500:]}"
    assert "local_rank" not in err and "failed first" not in err, "rank processes were started"
    assert not (cwd / "runs").exists(), "a run directory was created"
