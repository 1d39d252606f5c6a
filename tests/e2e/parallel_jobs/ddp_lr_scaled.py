"""A bug: torch's DistributedDataParallel, correct but for the learning rate, multiplied by the world size in the
parallel run (a linear scaling rule applied where the global batch did not grow)."""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import jobkit

world, rank = jobkit.init()
torch.manual_seed(0)
model = jobkit.TinyLM()
ddp = DistributedDataParallel(model) if world > 1 else model
opt = torch.optim.SGD(model.parameters(), lr=0.1 * world, momentum=0.9)  # BUG: the learning rate times the world size
log = jobkit.BatchLog()
for step, (ids, labels) in enumerate(jobkit.token_batches(padded=False)):
    ids, labels = jobkit.shard(ids, world, rank), jobkit.shard(labels, world, rank)
    log.add(step, ids)
    F.cross_entropy(ddp(ids).flatten(0, 1), labels.flatten()).backward()
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
