"""A bug: DDP by hand where each rank takes the mean over its own valid tokens, and ranks hold different token counts:
the average of the ranks' means is not the mean over the global batch (ddp_tokens.py is the right way)."""
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
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # BUG: a per-rank mean over this rank's tokens
    loss.backward()
    for p in model.parameters():
        if world > 1:
            dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
