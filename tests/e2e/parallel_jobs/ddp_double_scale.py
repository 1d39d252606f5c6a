"""A bug: ddp_tokens.py's compensated DDP job with the loss scaled by the world size once more. The token-count
normalisation already multiplies by the world size to cancel the gradients' division; the extra factor makes every
gradient 2x on 2 ranks."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import jobkit

world, rank = jobkit.init()
torch.manual_seed(0)
model = jobkit.TinyLM()
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
    loss = loss * world  # BUG: the loss scaled by the world size once more than the averaging compensates
    loss.backward()
    for p in model.parameters():
        if world > 1:
            dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
