"""torch's DistributedDataParallel with gradient accumulation on both sides (correct): the global batch is 4
micro-batches; the single process runs all 4 and each of 2 ranks the 2 of its share (all but the last under
no_sync(), so gradients are all-reduced once), each loss a mean over its micro-batch divided by the number of
micro-batches the process runs."""
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import jobkit

MICRO_BATCHES = 4  # over the global batch

world, rank = jobkit.init()
torch.manual_seed(0)
model = jobkit.TinyLM()
ddp = DistributedDataParallel(model) if world > 1 else model
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
log = jobkit.BatchLog()
passes = MICRO_BATCHES // world
for step, (ids, labels) in enumerate(jobkit.token_batches(padded=False)):
    ids, labels = jobkit.shard(ids, world, rank), jobkit.shard(labels, world, rank)
    log.add(step, ids)
    for k, (x, y) in enumerate(zip(ids.chunk(passes), labels.chunk(passes))):
        # gradients accumulate on the rank; the last micro-batch's backward all-reduces them
        with ddp.no_sync() if world > 1 and k < passes - 1 else nullcontext():
            (F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()) / passes).backward()
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
