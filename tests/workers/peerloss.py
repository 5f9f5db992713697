"""Kill (or freeze) one rank at a chosen point and record what the survivors raised.

Run by tests/faults/test_peer_loss.py as `myelin run -n N peerloss.py --out DIR MODE`.
MODE is where rank VICTIM dies: forward, backward, allreduce, optimizer (SIGKILL); or it
goes silent in forward: silent (its heartbeats stop and it hangs) or frozen (SIGSTOP); or
it goes silent as DASO's or sync EASGD's collectives begin after the optimizer step: daso,
easgd (the others wait in a collective that will never finish).
The victim writes the time it died to victim.json.
"""

import argparse
import functools
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import myelin
import myelin.replicas.allreduce as allreduce_module
from myelin.replicas.daso import DasoReplicas
from myelin.replicas.easgd import EasgdReplicas

VICTIM = 1
DIE_AT_STEP = 3


class Slow(torch.nn.Module):
    """Makes a step last long enough that the launcher's timing is not all that is tested."""

    def forward(self, x):
        time.sleep(0.03)
        return x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    modes = ["forward", "backward", "allreduce", "optimizer", "silent", "frozen", "daso", "easgd"]
    parser.add_argument("mode", choices=modes)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer = None

    def die(where):
        if rank != VICTIM or trainer is None or trainer.steps_done != DIE_AT_STEP:
            return
        time.sleep(0.1)  # in the middle of the operation; its heartbeat has gone out
        with open(os.path.join(args.out, "victim.json"), "w") as f:
            json.dump({"time": time.time(), "where": where}, f)
        if args.mode in ("silent", "daso", "easgd"):  # alive, but nothing comes from it
            trainer.liveness._stop.set()
            time.sleep(120)
        os.kill(os.getpid(), signal.SIGSTOP if args.mode == "frozen" else signal.SIGKILL)

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), Slow(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]
    model = torch.nn.Sequential(*layers)
    if args.mode in ("forward", "silent", "frozen"):
        model[2].register_forward_hook(lambda *a: die("forward"))
    if args.mode == "backward":
        model[2].register_full_backward_hook(lambda *a: die("backward"))
    if args.mode == "allreduce":
        reduce = allreduce_module.AllReduceReplicas.backwards_done

        def dying_reduce(*a, **kw):
            die("allreduce")
            return reduce(*a, **kw)

        allreduce_module.AllReduceReplicas.backwards_done = dying_reduce
    sync = {
        "daso": myelin.DASO(node_size=1, epoch_steps=2, warmup_epochs=1, downcast="fp32"),
        "easgd": myelin.EASGD(tau=1, alpha=0.1),
    }
    for cls in (DasoReplicas, EasgdReplicas):
        after = cls.after_optimizer_step

        def dying_after(self, after=after):
            die(args.mode)
            return after(self)

        cls.after_optimizer_step = dying_after

    class Dying(torch.optim.SGD):
        def step(self, closure=None):
            die("optimizer")
            return super().step(closure)

    record = {"error_type": None, "error": None}
    try:
        trainer = myelin.Trainer(
            model,
            optimizer=functools.partial(Dying, lr=0.1),
            loss_fn=F.cross_entropy,
            stages=1 if args.mode in sync else 2,  # daso, easgd: the survivor's one peer
            data_parallel=world // (1 if args.mode in sync else 2),
            microbatches=4,
            timeout=60,
            run_dir=args.out,
            transport=myelin.TransportConfig(peer_timeout_s=3.0),
            sync=sync.get(args.mode, "allreduce"),
        )
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        for _ in range(50):
            trainer.step(x, y)
    except Exception as exc:
        record = {
            "error_type": type(exc).__name__,
            "error": str(exc),
            "notes": getattr(exc, "__notes__", []),
            "lost": getattr(exc, "rank", None),
        }
    record["time"] = time.time()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if trainer is not None:
        trainer.close()
    raise SystemExit(3 if record["error_type"] else 0)


if __name__ == "__main__":
    main()
