"""FSDP2 + AdamW + clip_grad_norm_ on the DTensor parameters (correct; run on 4 ranks): the loss normalised by the
valid-token count over every rank, times the world size, which fully_shard's gradient averaging cancels; the gradient
norm is taken over every shard (a DTensor norm), and clips."""
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
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
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
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)  # the norm over every shard
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
