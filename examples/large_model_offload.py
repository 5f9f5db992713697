"""A GPT that does not fit its device memory budget trains anyway, by paging to host memory.

myelin run -n 2 examples/large_model_offload.py                  # offload on: trains
myelin run -n 2 examples/large_model_offload.py --no-offload     # DeviceMemoryError
torchrun --nproc-per-node 2 examples/large_model_offload.py --device-memory-limit 6GiB
python examples/large_model_offload.py --one-process             # one device: trains
python examples/large_model_offload.py --one-process --no-offload  # DeviceMemoryError

The model is built on the meta device, so no rank ever holds all of it: each one
materialises only its own stage. On 2 stages GPipe keeps all 8 microbatches in flight, so
saved activations dominate; with offload each rank keeps about one microbatch of them on
the device. With --one-process the whole 8-layer model is on one device and each backward
follows its forward at once: offload pages each microbatch's activations out layer by
layer as the forward makes them and brings them back a layer ahead of the backward, so
the device holds about one layer of them. Either way the optimizer's fp32 state and master
weights live in the host pool. On a GPU `--device-memory-limit` caps torch's allocator; on
a CPU myelin accounts the bytes.
"""

import argparse
import functools

import torch

import myelin
from myelin.data import Batches, load_stdlib_text
from myelin.models import GPT, GPTConfig, lm_loss

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--one-process", action="store_true", help="the whole model on one device")
parser.add_argument("--device-memory-limit", help="per rank, e.g. 6GiB (32MiB; one process 40MiB)")
parser.add_argument("--no-offload", action="store_true", help="show that it does not fit")
parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
parser.add_argument("--d-model", type=int, default=128)
parser.add_argument("--n-layer", type=int, help="layers (4; one process 8)")
args = parser.parse_args()

if args.one_process:  # one stage: each backward right after its forward
    stages, microbatches, schedule, n_layer, limit = 1, 2, "message-driven", 8, "40MiB"
else:  # GPipe: every microbatch's activations in flight before the first backward
    stages, microbatches, schedule, n_layer, limit = 2, 8, "gpipe", 4, "32MiB"
limit = args.device_memory_limit or limit
config = GPTConfig(block_size=256, n_layer=args.n_layer or n_layer, n_head=4, d_model=args.d_model)
with myelin.init_empty():  # parameters on the meta device: nothing allocated yet
    model = GPT(config)
offload = None if args.no_offload else myelin.OffloadConfig(activations=True, optimizer=True)
data = load_stdlib_text(max_bytes=2 << 20)
with myelin.Trainer(
    model,
    optimizer=functools.partial(torch.optim.AdamW, lr=2e-3),
    loss_fn=lm_loss,
    stages=stages,
    microbatches=microbatches,
    schedule=schedule,
    offload=offload,
    precision=args.precision,
    device_memory_limit=limit,
) as trainer:
    batches = Batches(data.train, config.block_size, batch_size=16, seed=0, stream="train")
    for step in range(args.steps):
        loss = trainer.step(*batches.get(step))
        if trainer.rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss:.3f}", flush=True)
    m = trainer.memory_stats()
    mib = 1 << 20
    print(
        f"rank {trainer.rank}: device peak {m['device_peak_bytes'] / mib:.1f} MiB "
        f"(limit {limit}, {m['device_peak_measured_by']}); host pool peak "
        f"{m['host_pool_peak_bytes'] / mib:.1f} MiB; activations paged out per step "
        f"{m['activations_offloaded_bytes'] / mib:.1f} MiB; prefetch hits {m['prefetch_hits']}, "
        f"misses {m['prefetch_misses']}",
        flush=True,
    )
