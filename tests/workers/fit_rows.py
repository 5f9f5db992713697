"""fit's metrics rows on two stages, the first without parameters; and a model given as a
plain list of modules.

Run by tests/test_fit_ranks.py as `myelin run -n 2 fit_rows.py --out DIR`. Each rank
writes rank{r}.json: its rows, whether it has an optimizer, and its state_dict's keys.
"""

import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import myelin


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)]  # a list, not a module
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 2, 2, generator=g), torch.randint(0, 2, (8,), generator=g))] * 4
    with myelin.Trainer(
        layers,
        functools.partial(torch.optim.SGD, lr=0.05),
        F.cross_entropy,
        stages=2,
        partition=[1, 3],
        microbatches=2,
    ) as t:
        rows = t.fit(data, steps=4, log_every=2, progress=False)
        state = t.state_dict()
        record = {"rows": rows, "optimizer": t.optimizer is not None}
        record["keys"] = sorted(state) if state is not None else None
    with open(os.path.join(args.out, f"rank{t.rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
