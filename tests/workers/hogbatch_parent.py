"""A Hogbatch run whose runner a test kills: prints its workers' pids after epoch 0.

python tests/workers/hogbatch_parent.py      # then SIGKILL it; its workers must leave
"""

from __future__ import annotations

import json
import multiprocessing

import torch

import myelin


def main() -> None:
    x = torch.randn(4096, 8)
    y = x.sum(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0))

    def on_epoch(epoch: int, wall_s: float) -> None:
        if epoch == 0:
            pids = [p.pid for p in multiprocessing.active_children() if "hogbatch" in p.name]
            print(json.dumps({"pids": pids}), flush=True)

    cfg = myelin.Hogbatch(cpu_workers=2, device_batch=(64, 64), timeout_s=60,
                          emulate=((0.01, 0.0), (0.005, 0.0)))  # fmt: skip
    cfg.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.MSELoss(), (x, y),
            epochs=1000, on_epoch=on_epoch)  # fmt: skip


if __name__ == "__main__":
    main()
