"""torch's DistributedDataParallel with token-count normalisation (correct; what transformers.Trainer does with
average_tokens_across_devices): each rank's loss is its sum over valid tokens divided by the valid-token count over
every rank, times the world size; DDP divides the gradients by the world size as it all-reduces them. The two
scales cancel."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import jobkit

world, rank = jobkit.init()
torch.manual_seed(0)
model = jobkit.TinyLM()
ddp = DistributedDataParallel(model) if world > 1 else model
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
log = jobkit.BatchLog()
for step, (ids, labels) in enumerate(jobkit.token_batches()):
    ids, labels = jobkit.shard(ids, world, rank), jobkit.shard(labels, world, rank)
    log.add(step, ids)
    count = (labels != -100).sum()
    if world > 1:
        dist.all_reduce(count)
    logits = ddp(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count * world
    loss.backward()
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
