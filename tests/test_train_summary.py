"""`myelin train`'s closing lines: learning from the untrained model on, memory per rank.

Issue 11: a short run printed "3.012 (step 40) -> 3.012 (step 40)" because the first
validation came at the end; and nothing said how much memory each rank held (about
950 MiB resident per rank, 512 MiB of it shared-memory segments committed up front).
"""

from __future__ import annotations

import json
import re

from tests.test_train import QUICK, run_train


def test_validation_at_step_0_and_resident_memory_per_rank(tmp_path):
    out_dir = tmp_path / "run"
    argv = [*QUICK, "--steps=6", "--eval-every=50", "--warmup-steps=0", "--sample-tokens=0"]
    code, out, err = run_train([*argv, f"--out={out_dir}"], tmp_path)
    assert code == 0, err[-5000:]
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [step for step, _ in vals] == [0, 6], rows
    (_, untrained), (_, final) = vals
    assert final < untrained, vals
    line = f"validation loss {untrained:.3f} (step 0) -> {final:.3f} (step 6)"
    assert line in out, out
    # resident memory of every rank, in the summary and in memory/rankN.json
    found = re.search(r"resident memory: rank 0 ([\d.]+) MiB, rank 1 ([\d.]+) MiB", out)
    assert found, out
    for rank in (0, 1):
        memory = json.loads((out_dir / "memory" / f"rank{rank}.json").read_text())
        assert memory["rss_peak_bytes"] >= memory["rss_bytes"] > 0, memory
        shown = float(found.group(rank + 1))
        assert abs(shown - memory["rss_bytes"] / 2**20) < 0.25 * shown, (shown, memory)
