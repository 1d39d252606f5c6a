"""torch's DistributedDataParallel with gradient accumulation, and a bug: every micro-batch's backward runs under
no_sync(), the last one too, so DDP never all-reduces the gradients: each rank steps with the gradient of its own
share. The single process runs the global batch at once."""
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
        for x, y in zip(ids.chunk(2), labels.chunk(2)):
            with ddp.no_sync():  # the last micro-batch's backward too, so DDP never all-reduces the gradients
                loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()) / 2
                loss.backward()  # BUG: the last micro-batch's backward, under no_sync(): no all-reduce follows
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
