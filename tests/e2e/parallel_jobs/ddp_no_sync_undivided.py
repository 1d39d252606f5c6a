"""torch's DistributedDataParallel with gradient accumulation, and a bug: each rank runs 2 micro-batches of its share
(the first under no_sync(), so gradients are all-reduced once) and sums their gradients, but each micro-batch's loss,
a mean over that micro-batch, is not divided by the number of micro-batches: every rank's gradient is twice the mean
over its share. The single process runs the global batch at once."""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import jobkit

world, rank = jobkit.init()
torch.manual_seed(0)
model = jobkit.TinyLM()
ddp = DistributedDataParallel(model) if world > 1 else None
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
log = jobkit.BatchLog()
for step, (ids, labels) in enumerate(jobkit.token_batches(padded=False)):
    ids, labels = jobkit.shard(ids, world, rank), jobkit.shard(labels, world, rank)
    log.add(step, ids)
    if ddp is None:
        F.cross_entropy(model(ids).flatten(0, 1), labels.flatten()).backward()
    else:
        for k, (x, y) in enumerate(zip(ids.chunk(2), labels.chunk(2))):
            if k == 0:
                with ddp.no_sync():  # gradients accumulate on the rank; the next backward all-reduces them
                    F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()  # BUG: not divided by 2
            else:
                F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()  # BUG: not divided by 2
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
