"""DeviceBudget's accounting and errors, and OffloadConfig's validation.

Run: python -m pytest -q tests/offload/test_budget.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from myelin import ConfigError, DeviceMemoryError, OffloadConfig
from myelin.offload.budget import CATEGORIES, DeviceBudget
from myelin.offload.config import check_precision

CPU = torch.device("cpu")
KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

# What each category's hint says, as the error words it.
HINTS = {
    "activations": "OffloadConfig(activations=True)",
    "optimizer": "OffloadConfig(optimizer=True)",
    "parameters": "split the parameters",
    "gradients": "split the gradients",
}


# -- DeviceBudget ---------------------------------------------------------------------------


def test_add_set_and_release_by_category():
    budget = DeviceBudget(CPU, 10 * KIB)
    assert budget.resident == dict.fromkeys(CATEGORIES, 0)
    budget.set("parameters", 4 * KIB, "placing")
    budget.add("activations", 3 * KIB, "saving")
    budget.add("activations", 2 * KIB, "saving")
    assert budget.resident["activations"] == 5 * KIB
    assert budget.total == 9 * KIB
    budget.set("parameters", 1 * KIB, "shrinking")
    budget.add("activations", -5 * KIB, "")
    assert budget.resident == {**dict.fromkeys(CATEGORIES, 0), "parameters": 1 * KIB}
    assert budget.total == 1 * KIB


def test_exactly_at_the_limit_fits():
    budget = DeviceBudget(CPU, 1000)
    budget.set("parameters", 600, "placing")
    budget.add("gradients", 400, "the backward")
    assert budget.total == 1000
    with pytest.raises(DeviceMemoryError):
        budget.add("gradients", 1, "the backward")


def test_no_limit_never_raises():
    budget = DeviceBudget(CPU)
    budget.add("activations", 1 << 50, "saving")
    assert budget.peak_bytes == 1 << 50


def test_releasing_never_raises_even_over_the_limit():
    budget = DeviceBudget(CPU, 100)
    budget.set("parameters", 90, "placing")
    budget.limit_bytes = 50  # now over: shrinking must still work
    budget.add("parameters", -10, "")
    budget.set("parameters", 60, "")
    assert budget.total == 60


@pytest.mark.parametrize(
    ("resident", "category", "nbytes", "offloading", "hints", "not_hints"),
    [
        # Only categories holding bytes (or the one growing) are suggested, biggest first.
        (
            {"parameters": 4 * KIB},
            "activations",
            8 * KIB,
            (),
            ["activations", "parameters"],
            ["optimizer", "gradients"],
        ),
        (
            {"parameters": 8 * KIB, "activations": 1 * KIB},
            "optimizer",
            2 * KIB,
            (),
            ["parameters", "optimizer", "activations"],
            ["gradients"],
        ),
        # Offloaded categories are not suggested again.
        (
            {"parameters": 4 * KIB, "activations": 4 * KIB},
            "activations",
            8 * KIB,
            ("activations",),
            ["parameters"],
            ["activations", "optimizer", "gradients"],
        ),
        (
            {"parameters": 4 * KIB, "optimizer": 4 * KIB},
            "gradients",
            8 * KIB,
            ("activations", "optimizer"),
            ["gradients", "parameters"],
            ["activations", "optimizer"],
        ),
    ],
)
def test_error_names_resident_limit_and_helpful_options(
    resident, category, nbytes, offloading, hints, not_hints
):
    budget = DeviceBudget(CPU, 10 * KIB, where="rank 3 (stage 1)", offloading=offloading)
    for name, n in resident.items():
        budget.set(name, n, "setting up")
    before = dict(budget.resident)
    peak = budget.peak_bytes
    with pytest.raises(DeviceMemoryError) as err:
        budget.add(category, nbytes, "the forward of microbatch 2")
    text = str(err.value)
    assert text.startswith("rank 3 (stage 1): the forward of microbatch 2 needs ")
    assert "device_memory_limit=10 KiB" in text
    for name in CATEGORIES:  # every category, with what it would have held
        would = before[name] + (nbytes if name == category else 0)
        assert f"{name} {would // KIB} KiB" in text or (would == 0 and f"{name} 0 B" in text)
    positions = [text.index(HINTS[h]) for h in hints]
    assert positions == sorted(positions), "hints are not biggest first"
    for name in not_hints:
        assert HINTS[name] not in text
    # The failed add changed nothing.
    assert budget.resident == before
    assert budget.peak_bytes == peak


def test_error_total_counts_what_was_asked():
    budget = DeviceBudget(CPU, 1 * MIB)
    budget.set("parameters", 768 * KIB, "placing")
    with pytest.raises(DeviceMemoryError, match=r"needs 1\.25 MiB on the device"):
        budget.set("optimizer", 512 * KIB, "the optimizer step")


def test_nothing_left_to_offload_says_raise_the_limit():
    budget = DeviceBudget(CPU, 1 * KIB, offloading=("activations",))
    with pytest.raises(DeviceMemoryError, match="To fit: raise device_memory_limit"):
        budget.add("activations", 2 * KIB, "saving")


def test_set_checks_the_difference():
    budget = DeviceBudget(CPU, 100)
    budget.set("optimizer", 80, "step")
    budget.set("optimizer", 100, "step")  # grows by 20: fits exactly
    with pytest.raises(DeviceMemoryError):
        budget.set("optimizer", 101, "step")
    assert budget.resident["optimizer"] == 100


def test_peak_tracking_and_reset():
    budget = DeviceBudget(CPU)
    budget.set("parameters", 100, "placing")
    budget.add("activations", 300, "saving")
    budget.add("activations", -300, "")
    budget.add("gradients", 50, "backward")
    assert budget.peak_bytes == 400
    assert budget.device_peak() == 400  # on a CPU the accounting is the measure
    assert budget.peak_resident == {
        "parameters": 100,
        "gradients": 0,
        "optimizer": 0,
        "activations": 300,
    }
    budget.reset_peak()
    assert budget.peak_bytes == 150
    assert budget.peak_resident == budget.resident
    budget.add("activations", 10, "saving")
    assert budget.peak_bytes == 160
    assert not budget.measured


def test_describe_oom_keeps_the_cause_and_hints():
    budget = DeviceBudget(CPU, 2 * GIB, where="rank 0 (stage 0)", offloading=("optimizer",))
    budget.set("parameters", 1 * GIB, "placing")
    err = budget.describe_oom(RuntimeError("CUDA out of memory"), "the backward")
    text = str(err)
    assert isinstance(err, DeviceMemoryError)
    said = "rank 0 (stage 0): the device ran out of memory (device_memory_limit=2 GiB) while"
    assert f"{said} the backward" in text
    assert "parameters 1 GiB" in text
    assert HINTS["activations"] in text
    assert HINTS["optimizer"] not in text
    assert "CUDA out of memory" in text


# -- OffloadConfig --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("activations", "yes"),
        ("activations", 1),
        ("activations", None),
        ("optimizer", "gpu"),
        ("optimizer", "Host"),
        ("optimizer", 1),
        ("optimizer", None),
        ("prefetch", -1),
        ("prefetch", 1.5),
        ("prefetch", 65),
        ("prefetch", True),
        ("prefetch", "2"),
        ("min_bytes", "lots"),
        ("min_bytes", -1),
        ("min_bytes", False),
        ("min_bytes", 0.5),
        ("slab_bytes", 1024),
        ("slab_bytes", 0),
        ("host_memory_limit", 0),
        ("host_memory_limit", "0GiB"),
        ("host_memory_limit", "6 gigs"),
        ("bucket_bytes", -5),
        ("bucket_bytes", "1.5 xB"),
    ],
)
def test_config_rejects_bad_values_naming_field_and_value(field, value):
    with pytest.raises(ConfigError) as err:
        OffloadConfig(**{field: value})
    text = str(err.value)
    assert f"OffloadConfig.{field}=" in text
    assert repr(value) in text or str(value) in text


@pytest.mark.parametrize("field", ["min_bytes", "slab_bytes", "bucket_bytes"])
def test_config_rejects_none_for_required_sizes(field):
    with pytest.raises(ConfigError, match=rf"OffloadConfig\.{field}=None"):
        OffloadConfig(**{field: None})


def test_config_small_slab_message_shows_the_value_as_written():
    with pytest.raises(ConfigError) as err:
        OffloadConfig(slab_bytes="1KiB")
    text = str(err.value)
    assert "OffloadConfig.slab_bytes=" in text
    assert "1 MiB" in text  # the allowed range
    assert "1KiB" in text


@pytest.mark.parametrize(
    ("field", "value", "parsed"),
    [
        ("host_memory_limit", "6GiB", 6 * GIB),
        ("host_memory_limit", "48GB", 48 * 1000**3),
        ("host_memory_limit", 4096, 4096),
        ("host_memory_limit", None, None),
        ("slab_bytes", "1MiB", MIB),
        ("slab_bytes", "64 MiB", 64 * MIB),
        ("bucket_bytes", "2KiB", 2 * KIB),
        ("bucket_bytes", 5, 5),
        ("min_bytes", 0, 0),
        ("min_bytes", "1.5KiB", 1536),
        ("prefetch", 0, 0),
        ("prefetch", 64, 64),
        ("optimizer", "stream", "stream"),
        ("activations", True, True),
    ],
)
def test_config_parses_good_values(field, value, parsed):
    cfg = OffloadConfig(**{field: value})
    assert getattr(cfg, field) == parsed


def test_config_defaults():
    cfg = OffloadConfig()
    assert cfg.min_bytes == 64 * KIB
    assert cfg.slab_bytes == 64 * MIB
    assert cfg.bucket_bytes == 32 * MIB
    assert cfg.host_memory_limit is None
    assert cfg.prefetch == 1
    assert not cfg.enabled


def test_config_is_frozen():
    cfg = OffloadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.activations = True


@pytest.mark.parametrize(
    ("optimizer", "cpu", "cuda", "enabled"),
    [
        (True, "host", "stream", True),
        (False, "device", "device", False),
        ("device", "device", "device", False),
        ("host", "host", "host", True),
        ("stream", "stream", "stream", True),
    ],
)
def test_optimizer_mode(optimizer, cpu, cuda, enabled):
    cfg = OffloadConfig(optimizer=optimizer)
    assert cfg.optimizer_mode("cpu") == cpu
    assert cfg.optimizer_mode("cuda") == cuda
    assert cfg.enabled is enabled


def test_activations_alone_enable_offload():
    assert OffloadConfig(activations=True).enabled


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_check_precision_accepts(precision):
    assert check_precision(precision) == precision


@pytest.mark.parametrize("precision", ["fp8", "FP16", "float32", None])
def test_check_precision_rejects_naming_the_choices(precision):
    with pytest.raises(ConfigError, match=r"precision=.*must be one of 'fp32', 'bf16', 'fp16'"):
        check_precision(precision)
