"""Data-parallel replicas must agree: where do the ranks' copies of the model first stop agreeing?

After the gradient all-reduce every rank of a DDP job holds the same gradients and, after the optimizer step, the
same parameters; under FSDP2 every rank's all-gather yields the same unsharded parameters. So across ranks:

- the result of an all-reduce, all-gather or broadcast is bit for bit the same on every rank of its group;
- an optimizer op fed bitwise-equal inputs on two ranks gives bitwise-equal outputs (same kernels, same data).

The first op (in the first rank's order) where either fails is where the replicas stop agreeing, named with the op
on both ranks. An op whose inputs already differ between the ranks (FSDP2's shards, or a difference inherited from
earlier) says nothing and is passed over. Only recorded bytes are read: nothing is replayed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from replaydiff.replay.collectives import CollectiveChecker, layout, tensors_at
from replaydiff.trace.reader import RankTrace, Trace
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.schema.values import TensorRef, iter_refs

_SAME_RESULT = ("all_reduce", "all_gather", "all_gather_list", "broadcast")


@dataclass(frozen=True)
class ReplicaBreak:
    """Two ranks' copies disagree from this op on: ``index`` on ``rank`` and ``other_index`` on ``other_rank``."""

    rank: int
    index: int
    other_rank: int
    other_index: int
    op: str
    what: str

    def to_json(self) -> dict:
        return {"rank": self.rank, "index": self.index, "other_rank": self.other_rank,
                "other_index": self.other_index, "op": self.op, "what": self.what}

    def describe(self) -> str:
        return (f"replicas stop agreeing at {self.op}: rank {self.rank} op #{self.index} vs rank {self.other_rank} "
                f"op #{self.other_index} ({self.what})")


def _load(rt: RankTrace, refs: list[TensorRef]) -> list[torch.Tensor] | None:
    if not all(r.stored for r in refs):
        return None
    return [rt.tensor(r) for r in refs]


def _same(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool | None:
    """Bitwise equal (NaN equal to NaN); None when either side is unknown."""
    if a is None or b is None:
        return None
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and
                                    torch.equal(x.reshape(-1).view(torch.uint8) if x.numel() else x,
                                                y.reshape(-1).view(torch.uint8) if y.numel() else y)
                                    for x, y in zip(a, b))


def _results(op: OpRecord) -> list[TensorRef]:
    return list(iter_refs([op.outputs, [after for _, after in op.writes]]))


def _collective_break(t0: RankTrace, t1: RankTrace) -> ReplicaBreak | None:
    c0, c1 = CollectiveChecker.calls(t0), CollectiveChecker.calls(t1)
    for key, ops0 in c0.items():
        if t0.rank not in key[1] or t1.rank not in key[1]:
            continue
        for a, b in zip(ops0, c1.get(key, [])):
            lay = layout(a.name)
            if lay is None or lay.kind not in _SAME_RESULT or a.name != b.name:
                continue
            if _same(_load(t0, list(iter_refs(tensors_at(a, lay.outputs)))),
                     _load(t1, list(iter_refs(tensors_at(b, lay.outputs))))) is False:
                return ReplicaBreak(t0.rank, a.index, t1.rank, b.index, a.name,
                                    "the collective's result differs between the ranks")
    return None


def _optimizer_break(t0: RankTrace, t1: RankTrace) -> ReplicaBreak | None:
    def steps(rt: RankTrace) -> list[int]:
        idx = rt.index
        return [i for i in range(len(idx)) if idx.recorded[i] and idx.phase[i] == "optimizer"]

    s0, s1 = steps(t0), steps(t1)
    if [t0.index.name[i] for i in s0] != [t1.index.name[i] for i in s1]:
        return None  # not the same optimizer program on both ranks: not replicas
    for i, j in zip(s0, s1):
        a, b = t0[i], t1[j]
        if _same(_load(t0, a.inputs()), _load(t1, b.inputs())) is not True:
            continue  # shards, or a difference from earlier: this op cannot be blamed
        if _same(_load(t0, _results(a)), _load(t1, _results(b))) is False:
            return ReplicaBreak(t0.rank, i, t1.rank, j, a.name, "same inputs on both ranks, different results")
    return None


def first_replica_break(trace: Trace) -> ReplicaBreak | None:
    """The earliest op (in the lowest rank's order) at which another rank's replica stops agreeing with it."""
    ranks = trace.ranks
    if len(ranks) < 2:
        return None
    base = trace.rank(ranks[0])
    found = []
    for r in ranks[1:]:
        other = trace.rank(r)
        for b in (_collective_break(base, other), _optimizer_break(base, other)):
            if b is not None:
                found.append(b)
    return min(found, key=lambda b: (b.index, b.other_rank)) if found else None
