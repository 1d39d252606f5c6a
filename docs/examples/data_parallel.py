"""One data-parallel training step, recorded: run it once as one process and once under torchrun, then diff.

    python docs/examples/data_parallel.py single/
    torchrun --nproc-per-node 2 docs/examples/data_parallel.py ddp/
    replaydiff diff single/ ddp/                  # agree: exit 0

    python docs/examples/data_parallel.py single-double/ --mode double
    torchrun --nproc-per-node 2 docs/examples/data_parallel.py double/ --mode double
    replaydiff diff single-double/ double/        # the loss scaled twice: named at its line, exit 1

    python docs/examples/data_parallel.py single-sum/ --mode sum
    torchrun --nproc-per-node 2 docs/examples/data_parallel.py sum/ --mode sum
    replaydiff diff single-sum/ sum/              # a summed loss the gradients' division cancels: agree, exit 0

    python docs/examples/data_parallel.py single-lr/ --mode lr
    torchrun --nproc-per-node 2 docs/examples/data_parallel.py lr/ --mode lr
    replaydiff diff single-lr/ lr/                # the lr multiplied by the world size: named at the update, exit 1

What is held equal between the two runs, and why the single process is the reference: the same seed (so the same
initial weights), the same global batch of 8 (each rank takes its slice of it, as a DistributedSampler would), the
same optimizer. The script is the same: world size 1 is the single process.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import replaydiff

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--mode", choices=("correct", "double", "sum", "lr"), default="correct")
args = p.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
if world > 1:
    dist.init_process_group("gloo")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
if world > 1:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1 * (world if args.mode == "lr" else 1), momentum=0.9)  # lr: a bug
g = torch.Generator().manual_seed(1)
x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)  # the global batch
xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]  # this rank's slice

with replaydiff.record(args.out):
    loss = F.mse_loss(model(xs), ys)
    if args.mode == "double":
        loss = loss * world  # the bug: DDP already averages the gradients over the ranks
    if args.mode == "sum" and world > 1:
        loss = loss * ys.numel()  # each rank's sum over its values: the gradients are divided below
    loss.backward()
    if args.mode == "sum" and world > 1:
        for p in model.parameters():
            p.grad /= y.numel() / world  # with DDP's average over the ranks: the mean over the global batch
    opt.step()
    opt.zero_grad()

if world > 1:
    dist.barrier()
    dist.destroy_process_group()
