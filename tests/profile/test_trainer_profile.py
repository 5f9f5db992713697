"""Trainer(profile=...): the report at close, profile_report(), and bad settings."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F

import myelin
from myelin.errors import ConfigError
from myelin.profile.config import ProfileConfig
from myelin.profile.fixed import fixed_time_model

pytestmark = pytest.mark.skipif(
    not hasattr(myelin.Trainer, "profile_report"), reason="Trainer.profile_report not wired yet"
)


def trainer(profile):
    return myelin.Trainer(
        fixed_time_model(2, 0.002, 0.004),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=F.mse_loss,
        microbatches=4,
        profile=profile,
    )


def test_profile_directory_written_at_close(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    t = trainer(tmp_path / "prof")
    with t:
        for _ in range(3):
            x = torch.randn(8, 4)
            t.step(x, x)
        live = t.profile_report().summary()["ranks"][0]
        assert live["busy_frac"] > 0.5 and live["steps"] == [1, 2]
    assert "myelin profile: 1 rank(s)" in capsys.readouterr().out
    names = {p.name for p in (tmp_path / "prof").iterdir()}
    assert names == {"ranks", "summary.json", "trace.json", "timeline.png"}
    saved = json.loads((tmp_path / "prof" / "summary.json").read_text())
    assert saved == json.loads(json.dumps(t.profile_report().summary()))


def test_a_trainer_closed_before_any_step_saves_its_profile_without_a_timeline(tmp_path, caplog):
    pytest.importorskip("matplotlib")
    with caplog.at_level("WARNING"), trainer(tmp_path / "prof"):
        pass
    assert not [r for r in caplog.records if "could not finish the profile" in r.getMessage()]
    names = {p.name for p in (tmp_path / "prof").iterdir()}
    assert names == {"ranks", "summary.json", "trace.json"}  # nothing to draw: no steps


def test_profile_true_prints_only(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with trainer(True) as t:
        x = torch.randn(8, 4)
        t.step(x, x)
    assert "bubble" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_profile_settings_are_checked():
    with pytest.raises(ConfigError, match="profile=3"):
        trainer(3)
    with trainer(False) as t, pytest.raises(ConfigError, match="profile=True"):
        t.profile_report()


def test_profile_config_is_public_beside_the_other_configs():
    assert myelin.ProfileConfig is ProfileConfig and "ProfileConfig" in myelin.__all__
