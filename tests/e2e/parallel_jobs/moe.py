"""What the mixture-of-experts jobs share and is no part of what they test: a layer of ``EXPERTS`` experts spread
evenly over the ranks (expert parallelism by hand), and its training loop.

Each rank routes its share of the batch's tokens (top-1 of a softmax gate), groups them by expert (a stable sort:
in token order within an expert, and the experts of a rank are consecutive, so grouped by the rank that holds them
too), tells every rank how many of its tokens go to each of that rank's experts (an all-to-all of the counts), sends
each rank its tokens with ``all_to_all_single`` (split sizes per rank), regroups what it receives (blocks by source
rank, then expert) by expert (blocks by expert, then source rank), runs its experts on them, puts the results back
in the order they came and sends them back the same way; the gate scales each token's expert output. The single
process holds every expert and runs them on the tokens routed to each.

How a job holds its experts is the subclass's: ``Looped`` (one ``nn.Linear`` per expert, run one after the other)
or ``Fused`` (every local expert's weight stacked, run in one ``torch._grouped_mm``). The loss is the sum over valid
tokens divided by the valid-token count over every rank; after ``backward()`` the job's ``reduce`` all-reduces the
gradients of what every rank holds (embedding, gate, head): an expert's gradient stays on its rank (the
all-to-all's backward has brought it every token's share already). A job is ``main(kind, experts)``, with what it
does otherwise (its bug) in its own file.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import jobkit

WIDTH = 16


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
    """Embedding, a top-1 mixture of ``experts`` experts (``experts // world`` on each rank, rank r holding the r-th
    run of them), a vocabulary head: token ids (B, T) -> logits (B*T, VOCAB)."""

    def __init__(self, world: int, rank: int, experts: int):
        super().__init__()
        self.world, self.rank, self.experts_n = world, rank, experts
        self.local = experts // world  # experts per rank
        self.embed = nn.Embedding(jobkit.VOCAB, WIDTH)
        self.gate = nn.Linear(WIDTH, experts)
        self.head = nn.Linear(WIDTH, jobkit.VOCAB)

    def mine(self) -> list[int]:
        """The experts this rank holds (every one in the single process)."""
        return list(range(self.rank * self.local, (self.rank + 1) * self.local))

    def shared(self) -> list[nn.Parameter]:
        """The parameters every rank holds whole (their gradients are all-reduced)."""
        return [*self.embed.parameters(), *self.gate.parameters(), *self.head.parameters()]

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's experts' parameters."""
        raise NotImplementedError

    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each of this rank's experts on its rows of ``x`` (grouped by expert, ``counts`` rows each), in order."""
        raise NotImplementedError

    def gathered(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter whole (every expert's), on rank 0, for the report: called on every rank."""
        raise NotImplementedError

    def by_expert(self, x: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
        """Received rows in blocks by (source rank, expert) -> by (expert, source rank): each expert's rows in
        token order (rank 0's tokens come first in the global batch)."""
        blocks = x.split(got.tolist())
        return torch.cat([blocks[s * self.local + e] for e in range(self.local) for s in range(self.world)])

    def by_source(self, y: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
        """The inverse of ``by_expert``: rows by (expert, source rank) back to (source rank, expert), the order they
        came in."""
        blocks = y.split(got.view(self.world, self.local).t().flatten().tolist())
        return torch.cat([blocks[e * self.world + s] for s in range(self.world) for e in range(self.local)])

    def forward(self, ids):
        h = self.embed(ids).flatten(0, 1)  # (N, D): this rank's tokens
        weight, choice = F.softmax(self.gate(h), dim=-1).max(dim=-1)
        order = torch.argsort(choice, stable=True)  # tokens grouped by expert, in token order within each
        counts = torch.bincount(choice, minlength=self.experts_n)
        x = h[order]
        if self.world > 1:
            got = torch.empty_like(counts)  # (source rank, my expert): how many rows each rank sends each of mine
            dist.all_to_all_single(got, counts)
            sends = counts.view(self.world, -1).sum(1).tolist()  # tokens for each rank's experts
            receives = got.view(self.world, -1).sum(1).tolist()
            x = Exchange.apply(x, sends, receives)  # rank r's tokens for my experts, r = 0, 1, ...
            if self.local > 1:
                x = self.by_expert(x, got)
            y = self.run_experts(x, got.view(self.world, self.local).sum(0).tolist())
            if self.local > 1:
                y = self.by_source(y, got)
            y = Exchange.apply(y, receives, sends)  # my tokens' results, grouped by expert
        else:
            y = self.run_experts(x, counts.tolist())
        out = torch.empty_like(y).index_copy(0, order, y)  # back to token order
        return self.head(out * weight[:, None])


class Looped(MoE):
    """One ``nn.Linear`` per expert (``experts.e``: every rank builds all, from the same seed, and runs its own)."""

    def __init__(self, world: int, rank: int, experts: int):
        super().__init__(world, rank, experts)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(experts))

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for e in self.mine() for p in self.experts[e].parameters()]

    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return torch.cat([self.experts[e](part) for e, part in zip(self.mine(), x.split(counts))])

    def gathered(self) -> list[tuple[str, torch.Tensor]]:
        if self.world > 1:
            for e in range(self.experts_n):
                for p in self.experts[e].parameters():
                    dist.broadcast(p.data, e // self.local)
        return list(self.named_parameters())


class Fused(MoE):
    """The local experts' weights stacked, (experts on this rank, D, D), the rank's slice of the whole stack (built
    whole from the same seed on every rank), run in one grouped GEMM over the rows grouped by expert."""

    def __init__(self, world: int, rank: int, experts: int):
        super().__init__(world, rank, experts)
        whole = torch.randn(experts, WIDTH, WIDTH) / WIDTH ** 0.5
        self.weight = nn.Parameter(whole[self.mine()].clone())

    def expert_parameters(self) -> list[nn.Parameter]:
        return [self.weight]

    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)  # where each expert's rows end
        return torch._grouped_mm(x, self.weight, offs=ends)

    def gathered(self) -> list[tuple[str, torch.Tensor]]:
        whole = self.weight.data
        if self.world > 1:
            parts = [torch.empty_like(whole) for _ in range(self.world)]
            dist.all_gather(parts, whole)
            whole = torch.cat(parts)
        return [(n, whole if n == "weight" else p) for n, p in self.named_parameters()]


def reduce_shared(model: MoE) -> None:
    """All-reduce the gradients of what every rank holds whole; each expert's is whole on its rank already."""
    for p in model.shared():
        dist.all_reduce(p.grad)


def main(kind: type[MoE], experts: int, reduce: Callable[[MoE], None] = reduce_shared) -> None:
    """The job: the model built from the same seed on every rank, its steps (SGD with momentum over what this rank
    holds), ``reduce(model)`` after each backward on more than one rank, then the report (``jobkit.finish``)."""
    world, rank = jobkit.init()
    torch.manual_seed(0)
    model = kind(world, rank, experts)
    opt = torch.optim.SGD(model.shared() + model.expert_parameters(), lr=0.5, momentum=0.9)
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
            reduce(model)
        opt.step()
        opt.zero_grad()
    jobkit.finish(model.gathered(), log, world, rank)
