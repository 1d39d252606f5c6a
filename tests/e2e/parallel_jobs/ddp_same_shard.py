"""A bug: torch's DistributedDataParallel fed by a DistributedSampler that is given rank 0 on every rank, so each
rank reads the same shard and half of the global batch is never seen (twice the other half instead)."""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import jobkit

world, rank = jobkit.init()
torch.manual_seed(0)
model = jobkit.TinyLM()
ddp = DistributedDataParallel(model) if world > 1 else model
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
rows = torch.cat([ids for ids, _ in jobkit.token_batches(padded=False)])
data = TensorDataset(rows, rows.roll(-1, dims=1))
sampler = DistributedSampler(data, num_replicas=world, rank=0, shuffle=False)  # BUG: rank 0's shard on every rank
log = jobkit.BatchLog()
for step, (ids, labels) in enumerate(DataLoader(data, batch_size=jobkit.ROWS // world, sampler=sampler)):
    log.add(step, ids)
    F.cross_entropy(ddp(ids).flatten(0, 1), labels.flatten()).backward()
    opt.step()
    opt.zero_grad()
jobkit.finish(model.named_parameters(), log, world, rank)
