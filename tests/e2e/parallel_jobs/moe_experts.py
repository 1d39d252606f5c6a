"""Expert parallelism by hand (correct): a mixture-of-experts layer with one expert per rank. Each rank routes its
share of the batch's tokens (top-1 of a softmax gate), sends each expert's tokens to the rank that holds it with
all_to_all_single (split sizes exchanged first), runs its own expert on what it receives, and sends the results back
the same way; the gate scales each token's expert output. The loss is the sum over valid tokens divided by the
valid-token count over every rank; the gradients of what every rank holds (embedding, gate, head) are all-reduced,
each expert's gradient stays on its rank (the all_to_all's backward has brought it every token's share already).
The single process holds every expert and runs them one after the other on the tokens routed to each."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import jobkit

EXPERTS, WIDTH = 2, 16


class Exchange(torch.autograd.Function):
    """all_to_all_single with split sizes, differentiable: the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, sends, receives):
        ctx.sends, ctx.receives = sends, receives
        out = x.new_empty((sum(receives), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receives, sends)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.sends), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.sends, ctx.receives)
        return back, None, None


class MoE(nn.Module):
    def __init__(self, world: int, rank: int):
        super().__init__()
        self.world, self.rank = world, rank
        self.embed = nn.Embedding(jobkit.VOCAB, WIDTH)
        self.gate = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.head = nn.Linear(WIDTH, jobkit.VOCAB)

    def mine(self) -> list[int]:
        """The experts this rank holds (every one in the single process)."""
        per = EXPERTS // self.world
        return list(range(self.rank * per, (self.rank + 1) * per))

    def forward(self, ids):
        h = self.embed(ids).flatten(0, 1)  # (N, D): this rank's tokens
        weight, choice = F.softmax(self.gate(h), dim=-1).max(dim=-1)
        order = torch.argsort(choice, stable=True)  # tokens grouped by expert, in token order within each
        counts = torch.bincount(choice, minlength=EXPERTS)
        x = h[order]
        if self.world > 1:
            sends = counts.view(self.world, -1).sum(1)  # tokens for each rank's experts
            receives = torch.empty_like(sends)
            dist.all_to_all_single(receives, sends)
            sends, receives = sends.tolist(), receives.tolist()
            x = Exchange.apply(x, sends, receives)  # rank r's tokens for my expert, r = 0, 1, ...
            y = self.experts[self.rank](x)
            y = Exchange.apply(y, receives, sends)  # my tokens' results, grouped by expert
        else:
            y = torch.cat([self.experts[e](part) for e, part in enumerate(x.split(counts.tolist()))])
        out = torch.empty_like(y).index_copy(0, order, y)  # back to token order
        return self.head(out * weight[:, None])


world, rank = jobkit.init()
torch.manual_seed(0)
model = MoE(world, rank)
shared = [p for n, p in model.named_parameters() if not n.startswith("experts.")]
local = shared + [p for e in model.mine() for p in model.experts[e].parameters()]
opt = torch.optim.SGD(local, lr=0.5, momentum=0.9)
log = jobkit.BatchLog()
for step, (ids, labels) in enumerate(jobkit.token_batches()):
    ids, labels = jobkit.shard(ids, world, rank), jobkit.shard(labels, world, rank)
    log.add(step, ids)
    count = (labels != -100).sum()
    if world > 1:
        dist.all_reduce(count)
    logits = model(ids)
    loss = F.cross_entropy(logits, labels.flatten(), reduction="sum") / count
    loss.backward()
    if world > 1:
        for p in shared:
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
if world > 1:  # every expert's parameters to rank 0, which reports them
    for e in range(EXPERTS):
        for p in model.experts[e].parameters():
            dist.broadcast(p.data, e // (EXPERTS // world))
jobkit.finish(model.named_parameters(), log, world, rank)
