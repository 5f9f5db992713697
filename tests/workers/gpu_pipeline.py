"""GPU cases: myelin on CUDA against one process training the same model the same way.

Run by tests/gpu/test_gpu_pipeline.py (and test_gpu_nccl.py) as
`myelin run -n N gpu_pipeline.py --out DIR [options] CASE...`, where CASE is
model:stages:data_parallel:precision:offload:schedule, e.g. `gpt:2:1:fp32:none:1f1b` or
`hf:2:1:bf16:both:gpipe` (model gpt or hf, GPT-2 with its tied embedding; offload one of
OFFLOAD's keys). Every case must use all N processes. Options:

--pg gloo          create the default process group with gloo before the Trainer, as a
                   script may; "myelin" (default) leaves it to the Trainer. NCCL refuses
                   two ranks on one GPU, so ranks sharing a GPU need gloo.
--deterministic    deterministic algorithms, the math attention kernel, no TF32: kernels
                   that give the same bits on every run (CUBLAS_WORKSPACE_CONFIG is set
                   before torch is imported).
--poison-send      fill every outgoing message's pinned staging buffer with NaN before its
                   device-to-host copy is queued, and hold the copy stream back first: a
                   message sent before its copy finished carries NaN.
--break-events     CUDA events claim at once that they are done (the check that
                   --poison-send can catch a send that does not wait).
--count-pins       count pinned-memory allocations after the first step.
--profile          profile every case; record whether every span resolved.

Each rank writes out/rank{r}.json: per case the losses and the reference's, whether this
rank's parameters equal the reference's bit for bit and their largest difference, a digest
of them, memory stats, pin counts, and the CUDA devices this process holds a context on.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import myelin  # noqa: E402
from myelin.models import GPT, GPTConfig, lm_loss  # noqa: E402
from myelin.partition import layers_of  # noqa: E402
from myelin.precision import DTYPES  # noqa: E402
from myelin.profile.report import ProfileConfig  # noqa: E402
from myelin.runtime.messages import tensor_frame  # noqa: E402

STEPS, MICROBATCHES, ROWS, LR = 5, 4, 4, 3e-3
DELAY_CYCLES = 20_000_000  # about 10 ms of GPU time at 2 GHz

OFFLOAD = {
    "none": None,
    "act": myelin.OffloadConfig(activations=True, min_bytes=0),
    "host": myelin.OffloadConfig(optimizer="host", bucket_bytes="64KiB"),
    "stream": myelin.OffloadConfig(optimizer="stream", bucket_bytes="64KiB"),
    "both": myelin.OffloadConfig(activations=True, optimizer=True, min_bytes=0),
    "bothhost": myelin.OffloadConfig(activations=True, optimizer="host", min_bytes=0),
}


def build(name):
    torch.manual_seed(0)
    if name == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=128, n_positions=64, n_embd=128, n_layer=4, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(cfg)
    return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, d_model=128))


def logits(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def batch(step, replica):
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randint(0, 128, (ROWS * MICROBATCHES, 65), generator=g)
    return x[:, :-1], x[:, 1:]


def reference(name, precision, replicas, device):
    """One process, gradient accumulation, the Trainer's recipe: half-precision weights and
    activations with fp32 masters (from the fp32 initial weights) under bf16/fp16."""
    model = build(name).to(device)
    dtype = DTYPES[precision]
    params = list(model.parameters())
    masters = params
    if dtype != torch.float32:
        masters = [torch.nn.Parameter(p.detach().clone()) for p in params]
        model.to(dtype)
    opt = torch.optim.AdamW(masters, lr=LR)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for r in range(replicas):
            x, y = batch(step, r)
            for xi, yi in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
                out = logits(model, xi.to(device))
                loss = lm_loss(out.float() if dtype != torch.float32 else out, yi.to(device))
                (loss.reshape(()) / (MICROBATCHES * replicas)).backward()
                total += loss.item()
        if masters is not params:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.grad = None
                m.grad = None
                if m is not p:
                    p.copy_(m)
        losses.append(total / (MICROBATCHES * replicas))
    with torch.no_grad():
        x, y = batch(STEPS, 0)
        evals = [
            lm_loss(logits(model, xi.to(device)).float(), yi.to(device)).item()
            for xi, yi in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))
        ]
    return model, losses + [sum(evals) / len(evals)]


# -- hooks that poison or break the send path -------------------------------------------------


def poison_sends(trainer):
    """NaN in every staging buffer before its copy is queued; the copy stream held back."""
    box = trainer.loop.outbox
    if box._copy_stream is None:
        return
    send, empty = box.send, box._staging.empty

    def slow_send(*args, **kwargs):
        with torch.cuda.stream(box._copy_stream):
            torch.cuda._sleep(DELAY_CYCLES)
        return send(*args, **kwargs)

    def poisoned_empty(shape, dtype, what=""):
        buf = empty(shape, dtype, what=what)
        if buf.numel():
            buf.view(torch.uint8).fill_(0xFF)  # NaN in every float format; -1 in integers
        return buf

    box.send = slow_send
    box._staging.empty = poisoned_empty


def break_events():
    torch.cuda.Event.query = lambda self: True


class PinCounter:
    """Pinned host allocations asked for from the moment it starts: calls that pin
    (Tensor.pin_memory, factories with pin_memory=True), torch's pinned allocator's own
    counts, and the growth of myelin's pools."""

    FACTORIES = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "empty_strided")

    def __init__(self):
        self.calls = 0
        self.where = []

    def start(self, trainer):
        self.trainer = trainer
        self.pools0 = self._pools()
        self.host0 = _host_stats()
        counter = self

        def wrap(fn, name):
            def pinning(*args, **kwargs):
                if kwargs.get("pin_memory"):
                    counter.calls += 1
                    counter.where.append(name)
                return fn(*args, **kwargs)

            return pinning

        for name in self.FACTORIES:
            setattr(torch, name, wrap(getattr(torch, name), f"torch.{name}(pin_memory=True)"))
        pin = torch.Tensor.pin_memory

        def pin_memory(t, *args, **kwargs):
            counter.calls += 1
            counter.where.append("Tensor.pin_memory()")
            return pin(t, *args, **kwargs)

        torch.Tensor.pin_memory = pin_memory

    def _pools(self):
        t = self.trainer
        staging = t.loop.outbox._staging
        return {
            "pool_grows": t.pool.grows if t.pool is not None else 0,
            "staging_grows": staging.grows if staging is not None else 0,
        }

    def result(self):
        host = _host_stats()
        pools = self._pools()
        return {
            "pinning_calls": self.calls,
            "pinning_where": sorted(set(self.where)),
            "pool_growth": {k: pools[k] - self.pools0[k] for k in pools},
            "host_allocator": {k: host.get(k, 0) - self.host0.get(k, 0) for k in host},
        }


def _host_stats():
    """torch's pinned allocator: blocks created with cudaHostAlloc, and every request."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return {}
    got = stats()
    keys = ("num_host_alloc", "allocated_bytes.allocated", "active_requests.allocated")
    return {k: got[k] for k in keys if k in got}


def contexts():
    """The CUDA devices this process holds a primary context on."""
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has is None:
        return None
    return [i for i in range(torch.cuda.device_count()) if has(i)]


# -- one case ----------------------------------------------------------------------------------


def run_case(case, args):
    name, stages, dp, precision, offload, schedule = case.split(":")
    stages, dp = int(stages), int(dp)
    trainer = myelin.Trainer(
        build(name),
        optimizer=functools.partial(torch.optim.AdamW, lr=LR),
        loss_fn=lm_loss,
        stages=stages,
        data_parallel=dp,
        microbatches=MICROBATCHES,
        schedule=schedule,
        timeout=120,
        offload=OFFLOAD[offload],
        precision=precision,
        profile=ProfileConfig(print_summary=False) if args.profile else False,
    )
    pins = PinCounter() if args.count_pins else None
    with trainer:
        if args.poison_send:
            poison_sends(trainer)
        losses = []
        for s in range(STEPS):
            losses.append(trainer.step(*batch(s, trainer.replica)))
            if s == 0 and pins is not None:
                pins.start(trainer)
        losses.append(trainer.eval_step(*batch(STEPS, 0)))
        device = trainer.world.device
        ref_model, ref_losses = reference(name, precision, dp, device)
        mine = list(trainer.module.parameters())
        if stages == 1:  # the whole model, as built
            theirs = list(ref_model.parameters())
        else:
            first = trainer.module.first_layer
            ref_layers = layers_of(ref_model)[first : first + len(trainer.module)]
            theirs = [p for layer in ref_layers for p in layer.parameters()]
        assert len(mine) == len(theirs), (len(mine), len(theirs))
        diff = max(float((a - b).detach().float().abs().max()) for a, b in zip(mine, theirs))
        equal = all(torch.equal(a, b) for a, b in zip(mine, theirs))
        digest = hashlib.sha256(b"".join(bytes(tensor_frame(p.detach().cpu())) for p in mine))
        full = trainer.state_dict()
        spans = None
        if args.profile:
            spans = len(trainer.timeline.spans)  # resolves every pending CUDA-event timing
        return {
            "rank": trainer.rank,
            "stage": trainer.stage,
            "replica": trainer.replica,
            "device": str(device),
            "losses": losses,
            "ref_losses": ref_losses,
            "param_diff": diff,
            "param_equal": equal,
            "digest": digest.hexdigest(),
            "finite": all(bool(torch.isfinite(p.float()).all()) for p in mine),
            "state_dict_keys": None if full is None else len(full),
            "memory": trainer.memory_stats(),
            "pins": pins.result() if pins is not None else None,
            "spans": spans,
            "busy_s": trainer.timeline.busy_s,
            "contexts": contexts(),
        }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pg", choices=("myelin", "gloo"), default="myelin")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--poison-send", action="store_true")
    parser.add_argument("--break-events", action="store_true")
    parser.add_argument("--count-pins", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
    if args.break_events:
        break_events()
    if args.pg == "gloo":
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    results = {}
    for case in args.cases:
        results[case] = run_case(case, args)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if dist.is_initialized() and args.pg == "gloo":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
