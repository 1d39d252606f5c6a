"""FSDP2 with token-count normalisation (correct): each rank's loss is its sum over valid tokens divided by the
valid-token count over every rank, times the world size; fully_shard averages the gradients over the ranks, which
cancels the factor."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import jobkit

world, rank = jobkit.init()
torch.manual_seed(0)
model = jobkit.TinyLM()
if world > 1:
    for layer in (model.embed, model.up, model.down, model.head):
        fully_shard(layer)
    fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
log = jobkit.BatchLog()
for step, (ids, labels) in enumerate(jobkit.token_batches()):
    ids, labels = jobkit.shard(ids, world, rank), jobkit.shard(labels, world, rank)
    log.add(step, ids)
    count = (labels != -100).sum()
    if world > 1:
        dist.all_reduce(count)
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count * world
    loss.backward()
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
