"""fit across ranks: every rank's metrics rows are the same numbers (a stage without
parameters has no learning rate of its own: the row still says the run's), and a model
given as a plain list of modules trains and comes back under Sequential's keys."""

from __future__ import annotations

from tests._procs import launch


def test_rows_are_the_same_on_every_rank_and_a_list_of_modules_trains(tmp_path):
    job = launch(2, "fit_rows.py", [], tmp_path, timeout=120)
    assert job.returncode == 0, job.output[-5000:]
    first, second = job.results[0], job.results[1]
    assert not first["optimizer"] and second["optimizer"]  # stage 0 is Flatten alone
    assert first["rows"] == second["rows"]
    assert all(row["lr"] == 0.05 for row in first["rows"] if "loss" in row)
    assert first["keys"] == ["1.bias", "1.weight", "3.bias", "3.weight"]
