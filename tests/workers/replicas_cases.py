"""More cases of replicas.py (run through its main, in the same launches): checkpoints of
another strategy or layout resumed under EASGD and DASO, DASO's epoch length asked before
any work, max_grad_norm under strategies whose replicas apply their own gradients, and
a weight tied across stages kept one weight under each strategy.

Each case takes the job's output folder and returns what the tests check.
"""

import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from replicas import batch, build, flat, trainer

import myelin


def model_of(t):
    """The model as `t` says it is (state_dict(), which rank 0 gathers), on every rank."""
    sd = t.state_dict()
    size = flat(build()).numel()
    v = torch.cat([x.reshape(-1) for x in sd.values()]) if sd is not None else torch.empty(size)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(v, 0)
    return v


def saved_model(ckpt):
    """The model a checkpoint holds, as a plain AllReduce trainer resumed from it sees it."""
    t = trainer("allreduce", resume=ckpt)
    v = model_of(t)
    t.close()
    return v


def steps(t, first, count):
    for s in range(first, first + count):
        t.step(*batch(t.replica, s))


def case_foreign(out):
    """4 ranks: an AllReduce checkpoint resumed under sync EASGD and DASO, a DASO one under
    EASGD and back, an EASGD one in another layout (stages=2 x data_parallel=2): the model
    is the checkpoint's, and the next checkpoint holds the trained weights, not the initial
    ones. Then DASO without an epoch length refuses step() before any work."""
    res, init = {}, flat(build())
    ck = {k: os.path.join(os.path.dirname(out), f"foreign-{k}") for k in ("ar", "ea", "da")}
    t = trainer("allreduce")
    steps(t, 0, 3)
    trained = flat(t.module)
    t.save(ck["ar"])
    t.close()
    res["trained_is_init"] = torch.equal(trained, init)
    for name, spec in (
        ("easgd", myelin.EASGD(tau=2, alpha=0.1)),
        ("daso", myelin.DASO(node_size=2, epoch_steps=4, warmup_epochs=0)),
    ):
        t = trainer(spec, resume=ck["ar"])
        res[f"{name}_model_is_checkpoint"] = torch.equal(model_of(t), trained)
        steps(t, 3, 2)
        model = model_of(t)
        t.save(ck[name[:2]])
        t.close()
        again = saved_model(ck[name[:2]])
        res[f"{name}_next_checkpoint"] = [torch.equal(again, model), torch.equal(again, init)]
    # one strategy's state resumed under the other: each reads only its own
    center = saved_model(ck["ea"])
    for name, spec, source in (
        ("daso_to_easgd", myelin.EASGD(tau=2, alpha=0.1), "da"),
        ("easgd_to_daso", myelin.DASO(node_size=2, epoch_steps=4, warmup_epochs=0), "ea"),
    ):
        t = trainer(spec, resume=ck[source])
        res[f"{name}_model_is_checkpoint"] = torch.equal(model_of(t), saved_model(ck[source]))
        steps(t, 5, 2)
        t.close()
    # another layout: the center is the checkpoint's model
    t = trainer(myelin.EASGD(tau=2, alpha=0.1), stages=2, resume=ck["ea"])
    res["layout_model_is_checkpoint"] = torch.equal(model_of(t), center)
    steps(t, 5, 3)  # the exchange of the third moves the center
    res["layout_moved"] = not torch.equal(model_of(t), center)
    t.close()
    res["daso_no_epoch_length"] = daso_without_epoch_length()
    return res


def daso_without_epoch_length():
    """step() under DASO with no epoch length: the ConfigError before any work, and the
    trainer still trains (fit gives the length)."""
    t = trainer(myelin.DASO(node_size=2))
    try:
        t.step(*batch(t.replica, 0))
        error = None
    except myelin.MyelinError as exc:  # its own ConfigError, or a peer's that reached it first
        error = str(exc)
    before = t.steps_done
    t.fit([batch(t.replica, s) for s in range(2)], epochs=1, progress=False)
    out = {"error": error, "steps_before": before, "steps_after": t.steps_done}
    t.close()
    return out


def case_foreign_async(out):
    """One replica: an AllReduce checkpoint (no strategy state) resumed under async EASGD
    puts its weights in the hub as the center."""
    ckpt = os.path.join(os.path.dirname(out), "foreign-async")
    t = trainer("allreduce", dp=1)
    steps(t, 0, 3)
    trained = flat(t.module)
    t.save(ckpt)
    t.close()
    t = trainer(myelin.EASGD(tau=2, alpha=0.3, mode="async"), dp=1, resume=ckpt)
    res = {"center_is_checkpoint": torch.equal(t.replicas.current_center(), trained)}
    res["state_dict_is_checkpoint"] = torch.equal(model_of(t), trained)
    steps(t, 3, 2)
    res["center_is_init"] = torch.equal(t.replicas.current_center(), flat(build()))
    t.close()
    return res


def clipped_sgd(model, grads, max_norm, lr):
    """One SGD step by `grads` clipped to `max_norm`, as clip_grad_norm_ and then
    torch.optim.SGD compute it in one process."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.add_(g * coef, alpha=-lr)


def grads_of(model, replica, step):
    model.zero_grad()
    x, y = batch(replica, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def case_clip(out):
    """4 ranks, max_grad_norm=0.05: EASGD(alpha=0) is each replica's own clipped SGD (one
    stage: no collective for the clip; two stages: the norm over the replica's pipeline),
    and DASO's warm-up clips each node's averaged gradient by its own norm."""
    res, rank = {}, int(os.environ["RANK"])
    t = trainer(myelin.EASGD(tau=1, alpha=0.0), max_grad_norm=0.05)
    ref = build()
    calls, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), all_reduce(*a, **k))[1]
    try:
        for s in range(3):
            t.step(*batch(t.replica, s))
            clipped_sgd(ref, grads_of(ref, t.replica, s), 0.05, 0.05)
    finally:
        dist.all_reduce = all_reduce
    res["easgd_own"] = torch.equal(flat(t.module), flat(ref))
    res["easgd_all_reduces"] = [len(calls), t.replicas.exchanges]
    t.close()
    t = trainer(myelin.EASGD(tau=1, alpha=0.0), stages=2, max_grad_norm=0.05)
    ref = build()
    for s in range(3):
        t.step(*batch(t.replica, s))
        clipped_sgd(ref, grads_of(ref, t.replica, s), 0.05, 0.05)
    first = rank - rank % 2  # rank r holds stage r % 2 of replica r // 2
    mine = torch.cat(gather_list(flat(t.module))[first : first + 2])  # this replica's stages
    res["pipeline_own_diff"] = float((mine - flat(ref)).abs().max())
    t.close()
    spec = myelin.DASO(node_size=2, epoch_steps=100, warmup_epochs=1, downcast="fp32")
    t = trainer(spec, max_grad_norm=0.05)
    ref = build()
    for s in range(3):
        t.step(*batch(t.replica, s))
        daso_warmup_reference(ref, s)
    res["daso_diff"] = float((flat(t.module) - flat(ref)).abs().max())
    t.close()
    return res


def gather_list(v):
    """Every rank's vector (of any length), by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, v)
    return out


def daso_warmup_reference(model, step, nodes=2, size=2, max_norm=0.05, lr=0.05):
    """A DASO warm-up step in one process: each node's mean gradient clipped by its own
    norm and stepped, then the nodes' parameters averaged."""
    start = [p.detach().clone() for p in model.parameters()]
    ends = []
    for n in range(nodes):
        each = [grads_of(model, r, step) for r in range(n * size, (n + 1) * size)]
        mean = [sum(g) / size for g in zip(*each, strict=True)]
        node = build()
        with torch.no_grad():
            for p, v in zip(node.parameters(), start, strict=True):
                p.copy_(v)
        clipped_sgd(node, mean, max_norm, lr)
        ends.append(flat(node))
    torch.nn.utils.vector_to_parameters(sum(ends) / nodes, model.parameters())


VOCAB, WIDTH = 16, 8


class _Head(torch.nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.proj.weight = emb.weight  # tied: stage 0's embedding is stage 1's head

    def forward(self, x):
        return self.proj(x)


def tied_trainer(sync, precision="fp32"):
    """2 stages x (world / 2) replicas of a model whose embedding is tied to its head."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(VOCAB, WIDTH)
    model = torch.nn.Sequential(emb, torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), _Head(emb))

    def loss(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))

    dp = int(os.environ["WORLD_SIZE"]) // 2
    opt = functools.partial(torch.optim.SGD, lr=0.5)
    return myelin.Trainer(model, opt, loss, stages=2, partition=[2, 2], data_parallel=dp,
                          microbatches=2, sync=sync, timeout=60,
                          precision=precision)  # fmt: skip


def tied_copies(t, steps=3):
    """Train `steps` steps; whether every replica's holders have bit-identical copies of the
    tied weight, their own and in the model's view (state_dict's, evaluation's)."""
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * t.replica + s)
        x, y = (torch.randint(0, VOCAB, (4, 6), generator=g) for _ in range(2))
        t.step(x, y)
    tied = next(p for p in t.module.parameters() if p.shape == (VOCAB, WIDTH))
    master = (t.updater.link.moved([tied]) or [tied])[0]  # its fp32 master under bf16

    def copies():
        return torch.cat([tied.detach().float().reshape(-1), master.detach().reshape(-1)])

    own = copies()
    with t.model_view():
        view = copies()
    mine = torch.cat([own.reshape(-1), view.reshape(-1)])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[2 * r], every[2 * r + 1]) for r in range(len(every) // 2))


class Skewed(myelin.AllReduce):
    """AllReduce whose reduction rounds stage 1's gradients its own way, as gloo's ring
    does with 3+ replicas (an element's sum order follows its offset in the bucket, and a
    tied weight sits at another offset on each stage)."""

    def build(self, ctx):
        inner = super().build(ctx)
        reduce, skew = inner.backwards_done, 1 + 2**-20 * ctx.world.stage

        def skewed(params, loss):
            loss = reduce(params, loss)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(skew)
            return loss

        inner.backwards_done = skewed
        return inner


def _serve_stages_in_other_orders(t, tag):
    """The hub takes stage 0's exchanges from replica 1 first and stage 1's from replica
    0 first (forced through the store)."""
    hub, store, count = t.replicas.hub, t.world.store, [0]
    exchange, first = hub.exchange, 1 - t.stage

    def ordered(x, alpha):
        key = f"tied-order/{tag}/{t.stage}/{count[0]}"
        count[0] += 1
        if t.replica != first:
            store.wait([key], timedelta(seconds=60))
        old = exchange(x, alpha)
        if t.replica == first:
            store.set(key, "1")
        return old

    hub.exchange = ordered


def case_tied(out):
    """4 ranks (2 stages x 2 replicas), a tied embedding: each replica's copies stay
    bit-identical under async EASGD with the hub serving stage 0's slot in the other
    replica order than stage 1's (forced through the store), and under an AllReduce whose
    reduction rounds each stage its own way (the tied gradients are summed after it)."""
    res = {}
    for precision in ("fp32", "bf16"):  # bf16: the fp32 masters are what is made equal
        t = tied_trainer(myelin.EASGD(tau=1, alpha=0.3, mode="async"), precision)
        _serve_stages_in_other_orders(t, precision)
        res["async_ordered" + ("" if precision == "fp32" else "_bf16")] = tied_copies(t)
        t.close()
    t = tied_trainer(Skewed())
    res["allreduce_skewed"] = tied_copies(t)
    t.close()
    return res


def case_tied_all(out):
    """Each strategy with a tied embedding: every replica's copies bit-identical (with 4
    replicas: the ring's sum order differs by a tied weight's offset on each stage)."""
    syncs = {
        "allreduce": myelin.AllReduce(),
        "daso": myelin.DASO(node_size=1, epoch_steps=3, warmup_epochs=0, downcast="fp32"),
        **{m: myelin.EASGD(tau=1, alpha=0.2, mode=m) for m in ("sync", "async", "hogwild")},
    }
    res = {}
    for name, sync in syncs.items():
        t = tied_trainer(sync)
        res[name] = tied_copies(t, steps=6)
        t.close()
    return res


class _WithUnused(torch.nn.Module):
    """A model holding a layer its forward never calls (an auxiliary head off this phase)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.used(x)


class _UsedOnRankZero(torch.nn.Module):
    """A head that rank 0 calls with a zero weight (its gradient is zeros) and rank 1 does
    not call (no gradient): used by a replica, so every replica's optimizer moves it."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.used, self.aux = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)

    def forward(self, x):
        y = self.used(x)
        return y + 0.0 * self.aux(x) if self.rank == 0 else y


def _partly_used(rank):
    """The aux head after 3 AdamW steps with weight decay, and how far it moved."""
    got = {}
    for name, sync in (("daso", myelin.DASO(node_size=2, epoch_steps=10)),
                       ("allreduce", myelin.AllReduce()),
                       ("allreduce_after", myelin.AllReduce(overlap=False))):  # fmt: skip
        torch.manual_seed(0)
        model = _UsedOnRankZero(rank)
        before = model.aux.weight.detach().clone()
        opt = functools.partial(torch.optim.AdamW, lr=0.1, weight_decay=0.5)
        t = myelin.Trainer(torch.nn.Sequential(model), opt, torch.nn.functional.mse_loss,
                           data_parallel=2, sync=sync, timeout=60)  # fmt: skip
        for s in range(3):
            t.step(*batch(rank, s))
        after = t.module[0].aux.weight.detach()
        got[name] = {"aux": after.tolist(), "moved": float((after - before).abs().max())}
        t.close()
    return got


def case_daso_unused(out):
    """2 ranks as one node of two: DASO averages the node's gradients every step, AdamW with
    weight decay. A parameter without a gradient is left alone, as AllReduce and plain
    PyTorch leave it (one node: the blocking averages round nothing to bf16); a sparse
    gradient is a ConfigError."""
    rank = int(os.environ["RANK"])
    moved = {}
    for name, sync in (("daso", myelin.DASO(node_size=2, epoch_steps=10)),
                       ("allreduce", myelin.AllReduce())):  # fmt: skip
        torch.manual_seed(0)
        model = _WithUnused()
        before = model.unused.weight.detach().clone()
        opt = functools.partial(torch.optim.AdamW, lr=0.1, weight_decay=0.5)
        t = myelin.Trainer(torch.nn.Sequential(model), opt, torch.nn.functional.mse_loss,
                           data_parallel=2, sync=sync, timeout=60)  # fmt: skip
        for s in range(3):
            t.step(*batch(rank, s))
        moved[name] = float((t.module[0].unused.weight.detach() - before).abs().max())
        t.close()
    torch.manual_seed(0)
    sparse = torch.nn.Sequential(
        torch.nn.Embedding(10, 3, sparse=True), torch.nn.Flatten(), torch.nn.Linear(6, 2)
    )
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    t = myelin.Trainer(sparse, opt, torch.nn.functional.cross_entropy, data_parallel=2,
                       sync=myelin.DASO(node_size=2, epoch_steps=10), timeout=60)  # fmt: skip
    try:
        t.step(torch.randint(0, 10, (4, 2)), torch.randint(0, 2, (4,)))
        error = None
    except myelin.MyelinError as exc:  # its own ConfigError, or a peer's that reached it first
        error = str(exc)
    t.close()
    return {"moved": moved, "sparse_error": error, "partly": _partly_used(rank)}


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
    )


def case_bn_buffers(out):
    """2 replicas of a BatchNorm model, each training on its own batches: under every
    strategy the model read (eval_step, evaluate, state_dict) holds one set of running
    statistics, replica 0's, so the mean evaluation loss is that of the model state_dict()
    gives, evaluated in one process on both replicas' batches."""
    rank = int(os.environ["RANK"])
    syncs = {
        "allreduce": myelin.AllReduce(),
        "easgd": myelin.EASGD(tau=2, alpha=0.1, mode="sync"),
        "daso": myelin.DASO(node_size=1, epoch_steps=10, warmup_epochs=0, downcast="fp32"),
    }
    res = {}
    for name, sync in syncs.items():
        opt = functools.partial(torch.optim.SGD, lr=0.05)
        t = myelin.Trainer(_bn_model(), opt, torch.nn.functional.mse_loss, data_parallel=2,
                           sync=sync, timeout=60)  # fmt: skip
        for s in range(3):
            t.step(*batch(rank, s))
        own = [b.clone() for b in t.module.buffers()]
        loss = t.eval_step(*batch(rank, 9))
        state = t.state_dict()
        got = {"eval": loss, "buffers": [b.tolist() for b in t.module.buffers()]}
        got["own_differ"] = any(not torch.equal(a, b) for a, b in zip(own, t.module.buffers()))
        if rank == 0:
            plain = _bn_model()
            plain.load_state_dict(state)
            plain.eval()
            with torch.no_grad():
                losses = [torch.nn.functional.mse_loss(plain(x), y).item()
                          for x, y in (batch(0, 9), batch(1, 9))]  # fmt: skip
            got["reference"] = sum(losses) / 2
            got["state_buffers"] = [state[k].tolist() for k in ("1.running_mean", "1.running_var")]
        res[name] = got
        t.close()
    return res


def case_save_in_view(out):
    """A save inside `model_view()` (the parameters hold the center, or DASO's synced
    ones) keeps this replica's own parameters as its state: a resume gets them back."""
    rank = int(os.environ["RANK"])
    syncs = {
        "easgd": myelin.EASGD(tau=1, alpha=0.2, mode="sync"),
        "daso": myelin.DASO(node_size=1, epoch_steps=2, warmup_epochs=0, cooldown_epochs=0,
                            total_epochs=10),  # fmt: skip
    }
    res = {}
    for name, sync in syncs.items():
        t = trainer(sync)
        for s in range(3):
            t.step(*batch(rank, s))
        own = flat(t.module)
        ckpt = os.path.join(out, f"in-view-{name}")
        with t.model_view():
            viewed = flat(t.module)
            t.save(ckpt)
        t.close()
        t = trainer(sync, resume=ckpt)
        resumed = flat(t.module)
        res[name] = {"differ": not torch.equal(own, viewed),
                     "resumed_own": torch.equal(resumed, own)}  # fmt: skip
        t.close()
    return res


def _bf16_reference(replicas, steps, alpha, lr=0.05):
    """Sync EASGD (tau = 1) under bf16 in one process: each replica's fp32 masters step by
    SGD on the fp32 sum of its bf16 model's gradients, the elastic pull moves the masters,
    and the bf16 model is the masters rounded. Returns each replica's masters, the center."""
    models = [build().to(torch.bfloat16) for _ in range(replicas)]
    masters = [[p.detach().float().clone() for p in build().parameters()] for _ in models]
    center = torch.cat([m.reshape(-1) for m in masters[0]])
    last = None  # the previous round's sum of x_i, taken into the center at the next one

    def cat(ms):
        return torch.cat([m.reshape(-1) for m in ms])

    for s in range(steps):
        if last is not None:
            center = center + alpha * (last - replicas * center)
        xs = [cat(ms) for ms in masters]
        last = xs[0].clone()
        for x in xs[1:]:
            last = last + x
        for r, (model, ms) in enumerate(zip(models, masters)):
            x, y = batch(r, s)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            pull = alpha * (xs[r] - center)
            for p, m in zip(model.parameters(), ms):
                m.sub_(p.grad.float(), alpha=lr)
            flat_x = cat(ms).sub_(pull)
            offset = 0
            with torch.no_grad():
                for p, m in zip(model.parameters(), ms):
                    m.copy_(flat_x[offset : offset + m.numel()].view_as(m))
                    p.copy_(m)
                    offset += m.numel()
    center = center + alpha * (last - replicas * center)  # the last round, as `center` reads
    return [cat(ms) for ms in masters], center


def case_half(out):
    """bf16 (and fp16 without momentum): sync EASGD's pulls move the fp32 masters, which
    the bf16 model follows, exactly as a one-process reference; DASO's blocking averages
    leave every replica's masters equal (before, both strategies refused half precision).
    """
    rank = int(os.environ["RANK"])
    res = {}
    opt = functools.partial(torch.optim.SGD, lr=0.05)

    def made(sync, precision="bf16"):
        return myelin.Trainer(build(), opt, torch.nn.functional.mse_loss, data_parallel=2,
                              sync=sync, timeout=60, precision=precision)  # fmt: skip

    t = made(myelin.EASGD(tau=1, alpha=0.2, mode="sync"))
    for s in range(4):
        t.step(*batch(rank, s))
    mine = flat(t.module).float()
    masters = torch.cat([m.reshape(-1) for m in t.updater.masters])
    want, center = _bf16_reference(2, 4, 0.2)
    res["easgd"] = {
        "masters_equal": torch.equal(masters, want[rank]),
        "model_is_masters_rounded": torch.equal(mine, masters.bfloat16().float()),
        "center_equal": torch.allclose(t.replicas.center, center, rtol=0, atol=1e-7),
        "replicas_differ": not torch.equal(want[0], want[1]),
    }
    with t.model_view():  # the model read is the center, rounded; the masters hold it
        viewed = flat(t.module).float()
    res["easgd"]["view_is_center"] = torch.equal(viewed, t.replicas.center.bfloat16().float())
    res["easgd"]["own_back"] = torch.equal(flat(t.module).float(), mine)
    t.close()
    daso = myelin.DASO(node_size=1, epoch_steps=2, warmup_epochs=0, cooldown_epochs=1,
                       total_epochs=2, downcast="fp32")  # fmt: skip
    t = made(daso)
    equal_at_sync = []
    for s in range(4):
        t.step(*batch(rank, s))
        if any(type(ev).__name__ == "Average" for ev in t.replicas.last_events):
            m = torch.cat([x.reshape(-1) for x in t.updater.masters])
            both = gather_list(m)
            equal_at_sync.append(torch.equal(both[0], both[1]))
    masters = torch.cat([x.reshape(-1) for x in t.updater.masters])
    rounded = torch.equal(flat(t.module).float(), masters.bfloat16().float())
    res["daso"] = {"equal_at_sync": equal_at_sync, "model_is_masters_rounded": rounded}
    t.close()
    try:
        made(myelin.EASGD(momentum=0.5), precision="fp16").close()
        res["fp16_momentum"] = "accepted"
    except myelin.ConfigError as exc:
        res["fp16_momentum"] = str(exc)
    return res
