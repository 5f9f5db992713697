"""Train a small model under each replica strategy and record what the tests check.

Run by tests/replicas/test_strategies.py as `myelin run -n 4 replicas.py --out DIR CASE...`
with CASE one of: daso (4 replicas as 2 nodes of 2), easgd (4 replicas, sync mode),
async (one replica: async and hogwild EASGD against sync, through the hub), overlap
(AllReduce's buckets during the last backward against after it), or a case of
replicas_cases.py (foreign, foreign_async, clip).
"""

import argparse
import functools
import hashlib
import json
import logging
import math
import os
import random
import time

import safetensors.torch
import torch
import torch.distributed as dist
import zmq

import myelin
from myelin.profile.config import ProfileConfig
from myelin.replicas.daso_schedule import Average

OUT = ""


def build(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(replica, step):
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(8, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def digest(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def trainer(
    sync,
    lr=0.05,
    dp=None,
    momentum=0.0,
    stages=1,
    resume=None,
    profile=None,
    transport=None,
    max_grad_norm=None,
):
    dp = dp or int(os.environ.get("WORLD_SIZE", "1")) // stages
    opt = functools.partial(torch.optim.SGD, lr=lr, momentum=momentum)
    return myelin.Trainer(
        build(),
        opt,
        torch.nn.functional.mse_loss,
        data_parallel=dp,
        stages=stages,
        microbatches=2 if stages > 1 else 1,
        sync=sync,
        timeout=60,
        resume=resume,
        profile=profile,
        transport=transport,
        max_grad_norm=max_grad_norm,
    )


def gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


class _Captured(logging.Handler):
    """The messages logged to it."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def case_daso():
    """Warm-up equals all-reduce SGD; ranks identical after every blocking average;
    cycling sends, merges and averages happen; bf16 blocking averages are bf16 values."""
    res = {}
    # 1. warm-up (fp32) against global gradient averaging in one process
    spec = myelin.DASO(node_size=2, epoch_steps=3, warmup_epochs=5, downcast="fp32")
    t = trainer(spec)
    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    own, mine = [], []
    for step in range(6):
        own.append(t.step(*batch(t.replica, step)))
        opt.zero_grad()
        losses = [
            torch.nn.functional.mse_loss(ref(batch(r, step)[0]), batch(r, step)[1])
            for r in range(4)
        ]
        (sum(losses) / 4).backward()
        mine.append(float(losses[t.replica]))
        opt.step()
    res["warmup_max_diff"] = float((flat(t.module) - flat(ref)).abs().max())
    res["own_loss"], res["reference_loss"] = own, mine  # this replica's loss, not the mean
    t.close()
    # 2. cycling from epoch 0: identical at each epoch end; the events of the run
    spec = myelin.DASO(
        node_size=2, epoch_steps=6, warmup_epochs=0, total_epochs=3, cooldown_epochs=1
    )
    t = trainer(spec)
    identical, differ_mid, kinds = [], 0, []
    synced = flat(t.module)
    for step in range(18):
        t.step(*batch(t.replica, step))
        events = t.replicas.schedule_events = getattr(t.replicas, "last_events", [])
        kinds.append([type(e).__name__ for e in events])
        copies = gather(flat(t.module))
        same = all(torch.equal(c, copies[0]) for c in copies)
        if any(isinstance(e, Average) for e in events):
            identical.append(same)
        elif not same:
            differ_mid += 1
        if step == 8:  # mid-epoch: the model (eval, state_dict) is the last average's
            with t.model_view():
                res["view_is_synced"] = torch.equal(flat(t.module), synced)
            res["view_restores"] = not torch.equal(flat(t.module), synced)
        if any(isinstance(e, Average) for e in events):
            synced = flat(t.module)
        if step == 17:  # the cool-down epoch averages in bf16
            res["bf16_representable"] = bool(
                torch.equal(flat(t.module), flat(t.module).bfloat16().float())
            )
    res.update(identical=identical, differ_mid=differ_mid, kinds=kinds)
    res["loss_traffic"] = t.replicas.traffic().get("loss")  # once per epoch, not per step
    res["bytes_local"], res["bytes_global"] = t.replicas.bytes_local, t.replicas.bytes_global
    res["downcast"] = str(t.replicas.downcast)
    t.close()
    # 3. a checkpoint taken while a send is pending resumes exactly
    ckpt = os.path.join(os.path.dirname(OUT), "daso-ckpt")
    spec = myelin.DASO(node_size=2, epoch_steps=6, warmup_epochs=0)
    t = trainer(spec)
    full = [t.step(*batch(t.replica, s)) for s in range(8)]
    t.close()
    t = trainer(spec)
    for s in range(5):  # step 4 sent; its merge is due at step 5
        t.step(*batch(t.replica, s))
    res["pending_at_save"] = t.replicas.schedule.pending is not None
    t.save(ckpt)
    t.close()
    t = trainer(spec, resume=ckpt)
    res["resumed"], res["full"] = [t.step(*batch(t.replica, s)) for s in range(5, 8)], full[5:]
    t.close()
    # 3b. resumed as other nodes: the pending send dropped (its sum is over the old nodes),
    # every replica from the checkpoint's synchronised parameters, saying so
    t = trainer(spec)
    for s in range(5):
        t.step(*batch(t.replica, s))
    with t.model_view():
        synced = digest(flat(t.module))
    t.close()
    res["regrouped"] = {}
    for node_size in (4, 1):
        warned = _Captured()
        logging.getLogger("myelin.replicas.daso").addHandler(warned)
        spec2 = myelin.DASO(node_size=node_size, epoch_steps=6, warmup_epochs=0)
        t = trainer(spec2, resume=ckpt)
        logging.getLogger("myelin.replicas.daso").removeHandler(warned)
        loaded = digest(flat(t.module))
        losses = [t.step(*batch(t.replica, s)) for s in range(5, 8)]
        res["regrouped"][node_size] = {
            "loaded_is_synced": loaded == synced,
            "warning": warned.lines,
            "losses_finite": all(math.isfinite(v) for v in losses),
        }
        t.close()
    # 4. a 2-stage pipeline, 2 replicas: each stage runs DASO over its own replicas
    t = trainer(myelin.DASO(node_size=1, epoch_steps=4, warmup_epochs=0), stages=2)
    same = []
    for step in range(8):
        t.step(*batch(t.replica, step))
        # ranks 0, 2 hold stage 0; 1, 3 stage 1 (of another size: gather digests)
        copies = gather(
            torch.tensor(list(bytes.fromhex(digest(flat(t.module)))), dtype=torch.uint8)
        )
        if step % 4 == 3:
            same.append(torch.equal(copies[t.stage], copies[t.stage + 2]))
    res["pipeline_same_at_epoch_end"] = same
    res["pipeline_stats"] = t.replicas.stats()
    t.close()
    return res


def case_easgd():
    """Sync EASGD: conservation and consensus at eta = 0, alpha = 0 is local SGD, momentum
    on the local update equals SGD's momentum, exchange counts, bitwise reproducibility
    with random delays."""
    rank, res = int(os.environ["RANK"]), {}
    p = int(os.environ["WORLD_SIZE"])
    # 1. eta = 0: sum_i x_i + center conserved; spread shrinks by (1 - alpha) per round
    alpha = 0.1
    t = trainer(myelin.EASGD(tau=1, alpha=alpha), lr=0.0)
    with torch.no_grad():
        for q in t.module.parameters():
            q.add_(0.01 * (rank + 1))
    totals, spreads = [], []
    for step in range(5):
        x = flat(t.module)
        total = x.clone()
        dist.all_reduce(total)
        totals.append(float((total + t.replicas.center).double().sum()))
        mean = total / p
        spread = (x - mean).abs().max().reshape(1)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        spreads.append(float(spread))
        t.step(*batch(t.replica, step))
    res.update(totals=totals, spreads=spreads, alpha=alpha)
    t.close()
    # 2. alpha = 0 is independent SGD, bit for bit
    t = trainer(myelin.EASGD(tau=1, alpha=0.0))
    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    own, mine = [], []
    for step in range(4):
        own.append(t.step(*batch(t.replica, step)))
        opt.zero_grad()
        x, y = batch(t.replica, step)
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        mine.append(float(loss))
        opt.step()
    res["alpha0_equal"] = torch.equal(flat(t.module), flat(ref))
    res["own_loss"], res["reference_loss"] = own, mine  # step() returns this replica's loss
    res["alpha0_center_still"] = torch.equal(t.replicas.center, flat(build()))
    t.close()
    # 3. momentum on the local update == torch SGD's momentum, the elastic term outside it
    a = trainer(myelin.EASGD(tau=2, alpha=0.1, momentum=0.9))
    for step in range(6):
        a.step(*batch(a.replica, step))
    xa, ca = flat(a.module), a.replicas.center.clone()
    a.close()
    b = trainer(myelin.EASGD(tau=2, alpha=0.1), momentum=0.9)
    for step in range(6):
        b.step(*batch(b.replica, step))
    res["momentum_diff"] = float(
        max((xa - flat(b.module)).abs().max(), (ca - b.replicas.center).abs().max())
    )
    b.close()
    # 4. exchanges: floor((T - 1) / tau) + 1; sync rounds all-reduce |W| floats; the
    # profile shows each kind of the strategy's communication
    profile = ProfileConfig(print_summary=False)
    t = trainer(myelin.EASGD(tau=3, alpha=0.1), profile=profile)
    flights, waited = [], []  # the round's all-reduce runs on until the center is needed
    wait = t.replicas.comm.wait
    t.replicas.comm.wait = lambda work, kind: (waited.append(work), wait(work, kind))[1]
    collectives, original = [], {}  # every collective any step makes

    def counted(name, fn):
        return lambda *a, **k: (collectives.append(name), fn(*a, **k))[1]

    for name in ("all_reduce", "broadcast", "all_gather", "barrier"):
        original[name] = getattr(dist, name)
        setattr(dist, name, counted(name, original[name]))
    try:
        for step in range(7):
            t.step(*batch(t.replica, step))
            running = t.replicas._round[1] if t.replicas.in_flight else None
            flights.append(t.replicas.in_flight and not any(w is running for w in waited))
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
    res["flights"], res["step_collectives"] = flights, collectives
    res["settled"] = t.replicas.center is not None and not t.replicas.in_flight
    res["exchanges"], res["bytes"] = t.replicas.exchanges, t.replicas.bytes_sent
    res["numel"] = flat(t.module).numel()
    t.close()
    report = t.profile_report()
    res["profile_rows"] = [r["detail"]["communication"] for r in report.summary()["ranks"]]
    res["profile_text"] = report.format()
    # 5. bitwise reproducible, with random delays, and the center equal on every rank
    runs = []
    for _ in range(2):
        t = trainer(myelin.EASGD(tau=2, alpha=0.2))
        for step in range(6):
            time.sleep(random.random() * 0.05)
            t.step(*batch(t.replica, step))
        centers = gather(t.replicas.center)
        res["centers_equal"] = all(torch.equal(c, centers[0]) for c in centers)
        sd = t.state_dict()
        runs.append([digest(flat(t.module)), digest(t.replicas.center)])
        if rank == 0:  # state_dict is the center
            res["state_dict_is_center"] = torch.equal(
                torch.cat([v.reshape(-1) for v in sd.values()]), t.replicas.center
            )
        t.close()
    res["runs"] = runs
    # 5b. downcast rounds send x_i - x~ in half precision: half the bytes, one center on
    # every rank, reproducible, and the run close to the fp32 one (the sum is of small
    # differences, not of the weights)
    for dtype, width in (("fp16", 2), ("bf16", 2)):
        runs = []
        for _ in range(2):
            t = trainer(myelin.EASGD(tau=2, alpha=0.2, downcast=dtype))
            for step in range(6):
                t.step(*batch(t.replica, step))
            centers = gather(t.replicas.center)
            runs.append([digest(flat(t.module)), digest(t.replicas.center)])
            res[f"{dtype}_centers_equal"] = all(torch.equal(c, centers[0]) for c in centers)
            res[f"{dtype}_bytes"] = [t.replicas.bytes_sent, t.replicas.exchanges * width]
            res[f"{dtype}_numel"] = flat(t.module).numel()
            center = t.replicas.center.clone()
            t.close()
        res[f"{dtype}_runs"] = runs
        t = trainer(myelin.EASGD(tau=2, alpha=0.2))
        for step in range(6):
            t.step(*batch(t.replica, step))
        moved = (t.replicas.center - flat(build())).abs().max()
        res[f"{dtype}_off"] = float((center - t.replicas.center).abs().max() / moved)
        t.close()
    # 6. fit's rows: the mean over replicas of the losses each step returned on its replica
    t = trainer(myelin.EASGD(tau=2, alpha=0.1))
    seen = []

    class Keep(myelin.Callback):
        def on_step_end(self, trainer, step, loss):
            seen.append(loss)

    rows = t.fit([batch(t.replica, s) for s in range(4)], log_every=2, callbacks=[Keep()],
                 progress=False)  # fmt: skip
    losses = torch.stack(gather(torch.tensor(seen, dtype=torch.float64)))  # (replicas, steps)
    res["fit_rows"] = [[row["loss"], row["loss_avg"]] for row in rows]
    res["fit_tokens_per_s"] = [row["tokens_per_s"] for row in rows]
    mean = losses.mean(0).tolist()
    res["fit_means"] = [[mean[1], (mean[0] + mean[1]) / 2], [mean[3], (mean[2] + mean[3]) / 2]]
    res["fit_own_differ"] = len(set(losses[:, 3].tolist())) == p
    t.close()
    return res


def deep(seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 32), torch.nn.Tanh()]
    for _ in range(3):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 1))


def case_overlap():
    """AllReduce with buckets launched during the last backward against the same buckets
    launched after it: the same bits (fp32, bf16, optimizer offload), and launches before
    backward ends."""
    res = {}
    offload = myelin.OffloadConfig(optimizer=True, bucket_bytes=4096)
    for variant in ("fp32", "bf16", "offload"):
        for overlap in (True, False):
            t = myelin.Trainer(
                deep(),
                functools.partial(torch.optim.AdamW, lr=0.01),
                torch.nn.functional.mse_loss,
                data_parallel=int(os.environ["WORLD_SIZE"]),
                microbatches=2,
                precision="bf16" if variant == "bf16" else "fp32",
                offload=offload if variant == "offload" else None,
                sync=myelin.AllReduce(bucket_mb=0.004, overlap=overlap),  # ~4 KiB buckets
                timeout=60,
            )
            events = t.replicas.trace = []
            first = t.module[0].weight  # its gradient is final last in every backward
            first.register_post_accumulate_grad_hook(
                lambda _, events=events: events.append(["first", -1])
            )
            losses = []
            for step in range(3):
                events.clear()
                losses.append(t.step(*batch(t.replica, step)))
            res[f"{variant}:{overlap}"] = {
                "digest": digest(flat(t.module).float()),
                "losses": losses,
                "events": [list(e) for e in events],
                "stats": t.replicas.stats(),
                "traffic": t.replicas.traffic(),
                "numel": flat(t.module).numel(),
                "params": len(list(t.module.parameters())),
            }
            t.close()
    return res


def case_one():
    """One worker: async and hogwild EASGD through the hub equal sync EASGD bit for bit;
    evaluation and state_dict see the center; a checkpoint resumes exactly."""
    res = {}
    finals = {}
    curve = myelin.TransportConfig(curve=True)
    for mode in ("sync", "async", "hogwild", "async-curve"):
        spec = myelin.EASGD(tau=2, alpha=0.3, mode=mode.split("-")[0])
        t = trainer(spec, dp=1, transport=curve if mode.endswith("curve") else None)
        losses = [t.step(*batch(0, step)) for step in range(5)]
        center = t.replicas.current_center()
        finals[mode] = [digest(flat(t.module)), digest(center), losses]
        if mode == "async-curve":  # the hub's sockets are CURVE clients of a CURVE server
            res["curve_client"] = t.replicas.hub.req.getsockopt(zmq.MECHANISM) == zmq.CURVE
            t.close()
            continue
        res[f"{mode}_eval"] = t.eval_step(*batch(0, 99))
        with torch.no_grad():  # the model under evaluation is the center
            model = build()
            torch.nn.utils.vector_to_parameters(center, model.parameters())
            res[f"{mode}_eval_center"] = float(
                torch.nn.functional.mse_loss(model(batch(0, 99)[0]), batch(0, 99)[1])
            )
        sd = t.state_dict()
        res[f"{mode}_state_dict_is_center"] = torch.equal(
            torch.cat([v.reshape(-1) for v in sd.values()]), center
        )
        if mode == "async":
            res["hub_requests"] = t.replicas.hub.requests
            res["exchanges"] = t.replicas.exchanges
            t.evaluate([batch(0, 99)] * 3)  # one read of the center for the whole evaluation
            res["evaluate_reads"] = t.replicas.hub.requests - res["hub_requests"]
        folder = os.path.join(os.path.dirname(OUT), f"pretrained-{mode}")
        t.save_pretrained(folder)  # the exported model is the center too
        saved = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
        flat_saved = torch.cat([saved[k].reshape(-1) for k in sd])
        res[f"{mode}_save_pretrained_is_center"] = torch.equal(flat_saved, center)
        t.close()
    res["finals"] = finals
    # resume: 3 steps, save, 3 more; against 6 uninterrupted (sync mode, with momentum)
    ckpt = os.path.join(os.path.dirname(OUT), "ckpt")
    spec = myelin.EASGD(tau=2, alpha=0.3, momentum=0.5)
    t = trainer(spec, dp=1)
    full = [t.step(*batch(0, s)) for s in range(6)]
    t.close()
    t = trainer(spec, dp=1)
    for s in range(3):
        t.step(*batch(0, s))
    t.save(ckpt)
    t.close()
    t = myelin.Trainer(
        build(),
        functools.partial(torch.optim.SGD, lr=0.05),
        torch.nn.functional.mse_loss,
        sync=spec,
        resume=ckpt,
    )
    res["resumed"] = [t.step(*batch(0, s)) for s in range(3, 6)]
    res["full"] = full[3:]
    t.close()
    return res


def case_hub():
    """Four workers on one hub: every exchange conserves x_i + center (eta = 0) in async
    and hogwild modes; a view of the model (evaluation's, state_dict's) waits for the
    other replicas' exchanges, so all see one center; then the hub is killed and every
    rank raises PeerLostError: rank 0 sees its process gone and closes its trainer, whose
    goodbye tells the others (stuck waiting for the hub, whose own silence would take
    peer_timeout_s = 20 s)."""
    rank, res = int(os.environ["RANK"]), {}
    patient = myelin.TransportConfig(peer_timeout_s=20.0)
    for mode in ("async", "hogwild"):
        spec = myelin.EASGD(tau=1, alpha=0.2, mode=mode)
        t = trainer(spec, lr=0.0, transport=patient if mode == "hogwild" else None)
        with torch.no_grad():
            for q in t.module.parameters():
                q.add_(0.01 * (rank + 1))
        x = flat(t.module)
        dist.all_reduce(x)
        before = float((x + flat(build())).double().sum())
        for step in range(4):
            time.sleep(random.random() * 0.02)
            t.step(*batch(t.replica, step))
        dist.barrier()
        x = flat(t.module)
        dist.all_reduce(x)
        after = float((x + t.replicas.current_center()).double().sum())
        res[mode] = [before, after, t.replicas.exchanges]
        res[f"{mode}_traffic"] = sorted(t.replicas.traffic())  # the hub's exchanges only
        if rank > 0:  # replica 0 views the model while the others still exchange
            time.sleep(0.5)
            t.step(*batch(t.replica, 4))
        with t.model_view():
            seen = flat(t.module)
        dist.barrier()
        res[f"{mode}_view_is_final"] = torch.equal(seen, t.replicas.current_center())
        if mode == "async":
            t.close()
    dist.barrier()  # the hogwild trainer's hub is killed now
    if rank == 0:
        os.kill(t.replicas.hub.pid, 9)
    killed = time.time()
    try:
        for step in range(5, 1000):
            t.step(*batch(t.replica, step))
        res["error"] = None
    except myelin.MyelinError as exc:
        res["error"] = type(exc).__name__
        res["after_s"] = time.time() - killed
        res["message"] = str(exc)[:300]
    if rank == 0:
        t.close()  # as a script's end would: its goodbye relays the loss (not a failure)
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump({"hub": res}, f)
    deadline = time.time() + 20  # every rank finds the hub gone before an exit is news
    while len(os.listdir(OUT)) < 4 and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    os._exit(0)  # the world is broken on purpose: leave without its teardown


def case_daso_edges():
    """DASO at its edges on 2 ranks: saved (and stats read) before any step or plan, then
    resumed; fit over loaders of different lengths (uneven="shortest")."""
    rank = int(os.environ["RANK"])
    ck = os.path.join(OUT, "daso_step0")
    t = trainer(myelin.DASO(node_size=1))
    sends_before = t.replicas.stats()["sends"]
    t.save(ck)
    t.close()
    spec = myelin.DASO(node_size=1, warmup_epochs=0, cooldown_epochs=0)
    t = trainer(spec, resume=ck)
    data = [batch(rank, s) for s in range(4 if rank == 0 else 6)]
    history = t.fit(data, epochs=2, progress=False)
    s = t.replicas.schedule
    out = {"sends_before": sends_before, "steps": t.steps_done, "rows": len(history)}
    out.update(epoch_steps=s.last_batch + 1, epoch=s.epoch, params=digest(flat(t.module)))
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("myelin.replicas.daso").addHandler(handler)
    t.fit(data[:3], epochs=1, progress=False)  # another length: the plan stays, and says so
    out["second_fit"] = heard
    t.close()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    global OUT
    OUT = args.out
    out = {}
    for case in args.cases:
        run = globals().get(f"case_{case}")
        if run is None:  # replicas_cases.py's, which take the output folder
            import replicas_cases

            run = functools.partial(getattr(replicas_cases, f"case_{case}"), args.out)
        out[case] = run()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
