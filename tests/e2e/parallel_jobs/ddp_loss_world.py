"""A bug: torch's DistributedDataParallel, correct but for the loss multiplied by the world size in the parallel run
(as if DDP summed the ranks' gradients; it averages them), so every gradient is the world size times the single
process's."""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import jobkit

world, rank = jobkit.init()
torch.manual_seed(0)
model = jobkit.TinyLM()
ddp = DistributedDataParallel(model) if world > 1 else model
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
log = jobkit.BatchLog()
for step, (ids, labels) in enumerate(jobkit.token_batches(padded=False)):
    ids, labels = jobkit.shard(ids, world, rank), jobkit.shard(labels, world, rank)
    log.add(step, ids)
    loss = F.cross_entropy(ddp(ids).flatten(0, 1), labels.flatten())
    if world > 1:
        loss = loss * world  # BUG: the loss times the world size, where DDP averages the gradients
    loss.backward()
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
