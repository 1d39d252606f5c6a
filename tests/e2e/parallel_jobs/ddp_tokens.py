"""DDP by hand with token-count normalisation (correct): each rank's loss is its sum over valid tokens divided by the
valid-token count over every rank, times the world size; the gradients are all-reduced and divided by the world
size. The two scales cancel (transformers.Trainer's average_tokens_across_devices does the same)."""
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
    loss.backward()
    for p in model.parameters():
        if world > 1:
            dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
