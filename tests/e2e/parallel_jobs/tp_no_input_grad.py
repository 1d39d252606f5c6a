"""A bug: a hand-written tensor-parallel MLP (Megatron's pair: column-parallel up, row-parallel down) whose entry
Function does not all-reduce the input's gradient in backward. Each rank's gradient of the MLP's input holds only
its columns' share, so the embedding below it learns from a partial gradient. Every rank sees the whole batch."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import jobkit


class ToParallel(torch.autograd.Function):
    """Forward: the replicated input as it is. Backward: its gradient should be summed over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g  # BUG: the input's gradient is not all-reduced over the ranks


class FromParallel(torch.autograd.Function):
    """Forward: the row-parallel layer's partial sums all-reduced. Backward: the gradient as it is (replicated)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        if world > 1:
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


world, rank = jobkit.init()
torch.manual_seed(0)
full = jobkit.TinyLM()  # the weights every rank starts from; each keeps its shard of up and down
cols = slice(rank * full.up.out_features // world, (rank + 1) * full.up.out_features // world)
up_w = full.up.weight[cols].detach().clone().requires_grad_()
up_b = full.up.bias[cols].detach().clone().requires_grad_()
down_w = full.down.weight[:, cols].detach().clone().requires_grad_()
replicated = [full.embed.weight, full.down.bias, full.head.weight, full.head.bias]
opt = torch.optim.SGD(replicated + [up_w, up_b, down_w], lr=0.5, momentum=0.9)
log = jobkit.BatchLog()
for step, (ids, labels) in enumerate(jobkit.token_batches(padded=False)):
    if rank == 0:  # every tensor-parallel rank holds the whole batch: one of them writes it down
        log.add(step, ids)
    h = ToParallel.apply(full.embed(ids))  # BUG (its backward): the entry of the parallel pair
    h = FromParallel.apply(F.linear(F.gelu(F.linear(h, up_w, up_b)), down_w)) + full.down.bias
    loss = F.cross_entropy(full.head(h).flatten(0, 1), labels.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
jobkit.finish([(n, p) for n, p in full.named_parameters() if not n.startswith(("up.", "down.weight"))], log, world, rank)
