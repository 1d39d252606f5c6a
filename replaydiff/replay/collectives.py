"""Checking collectives across ranks: a collective cannot be re-run alone, but its result can be recomputed.

The k-th collective of a process group on each rank is the same call. Its output on every rank must equal what the
recorded inputs of all ranks imply: for all-reduce the float64 reduction (sum, avg, min, max, product) of every
rank's input, judged by the output dtype's tolerance (two ranks sum bitwise; more ranks differ by about
(world-1)*eps, well inside it); for all-gather and broadcast the exact bytes of the source rank. A rank whose output
disagrees is divergent: a bad collective (wrong NCCL algorithm, corrupted transfer) is named like any kernel.
"""
from __future__ import annotations

from typing import Any

import torch

from replaydiff import aten
from replaydiff.compare.verdict import judge
from replaydiff.replay.policy import ReplayOptions
from replaydiff.replay.result import OpResult, Status
from replaydiff.trace.reader import RankTrace, Trace
from replaydiff.trace.schema import OpRecord, TensorRef, iter_refs


def _written(op: OpRecord, arg: int) -> Any:
    for path, after in op.writes:
        if path.kind == "arg" and path.key == arg:
            return after
    return None


def _reduce(op: str, xs: list[torch.Tensor]) -> torch.Tensor | None:
    stack = torch.stack([x.to(torch.float64) if x.is_floating_point() else x for x in xs])
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.sum(0) / len(xs)
    if op == "max":
        return stack.amax(0)
    if op == "min":
        return stack.amin(0)
    if op == "product":
        return stack.prod(0)
    return None


class CollectiveChecker:
    def __init__(self, trace: Trace, opts: ReplayOptions) -> None:
        self.trace = trace
        self.opts = opts

    @staticmethod
    def _calls(rt: RankTrace) -> dict[tuple, list[OpRecord]]:
        """Collective records of one rank, per process group (by name and ranks), in call order."""
        out: dict[tuple, list[OpRecord]] = {}
        idx = rt.index
        for i in range(len(idx)):
            if not idx.collective[i] or aten.is_wait_only(idx.name[i]):
                continue
            op = rt[i]
            out.setdefault(op.collective.group_key, []).append(op)
        return out

    def check(self, results: dict[tuple[int, int], OpResult]) -> None:
        """Replace the 'skipped' results of collectives with the outcome of the cross-rank check."""
        calls = {r: self._calls(self.trace.rank(r)) for r in self.trace.ranks}
        for rank, groups in calls.items():
            for key, ops in groups.items():
                group = key[1]
                missing = [g for g in group if g not in calls]
                for k, op in enumerate(ops):
                    res = results.get((rank, op.index))
                    if res is None:
                        continue
                    if not group:
                        res.reason = "collective: its process group is unknown, so it cannot be checked"
                        continue
                    if missing:
                        res.reason = f"collective: ranks {missing} of its group are not in the trace"
                        continue
                    peers = [calls[g].get(key, []) for g in group]
                    if any(len(p) <= k or p[k].name != op.name for p in peers):
                        res.status, res.reason = Status.DIVERGENT, "collective: the ranks of its group called " \
                                                                   "different collectives here (mismatched order)"
                        continue
                    try:
                        self._check_one(op, [p[k] for p in peers], group, res)
                    except Exception as exc:
                        res.status, res.reason = Status.ERROR, \
                            f"cross-rank check failed: {type(exc).__name__}: {exc}"

    def _tensor(self, rank: int, ref: TensorRef) -> torch.Tensor:
        return self.trace.rank(rank).tensor(ref)

    def _judge(self, res: OpResult, got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
        v = judge(got, want, self.opts.tolerances, 1, exact=exact or not got.is_floating_point())
        if v.divergent and res.status is not Status.DIVERGENT:
            res.status, res.reason, res.verdict = Status.DIVERGENT, f"collective: {what} ({v.reason})", v
        elif res.status is not Status.DIVERGENT:
            res.status, res.reason, res.verdict = Status.OK, f"collective checked across ranks: {what}", v

    def _check_one(self, op: OpRecord, peers: list[OpRecord], group: tuple, res: OpResult) -> None:
        packet = aten.packet(op.name)
        coll = op.collective
        rank = res.rank
        if packet in ("allreduce_", "all_reduce", "all_reduce_"):
            reduce_op = coll.reduce_op
            if reduce_op is None or reduce_op == "unknown":
                res.reason = "collective: its reduce op could not be read when recording, so it is not checked"
                return
            functional = not packet.endswith("_") or op.name.startswith("_c10d_functional")
            ins = [list(iter_refs(p.args[0])) for p in peers]
            outs = list(iter_refs(op.outputs if functional else _written(op, 0)))
            for j, out_ref in enumerate(outs):
                want = _reduce(reduce_op, [self._tensor(g, ins[n][j]) for n, g in enumerate(group)])
                if want is None:
                    res.reason = f"collective: reduce op {reduce_op} is not checked"
                    return
                self._judge(res, self._tensor(rank, out_ref), want, False,
                            f"output vs the float64 {reduce_op} of all ranks' inputs")
        elif packet == "allgather_":
            outs = list(iter_refs(_written(op, 0)))
            for n, g in enumerate(group):
                src = next(iter_refs(peers[n].args[1]))
                self._judge(res, self._tensor(rank, outs[n]), self._tensor(g, src), True,
                            f"gathered slot {n} vs rank {g}'s input")
        elif packet in ("_allgather_base_", "all_gather_into_tensor", "all_gather_into_tensor_out"):
            out_ref = next(iter_refs(_written(op, 0) if packet.endswith("_") else op.outputs))
            src_arg = 1 if packet == "_allgather_base_" else 0
            want = torch.cat([self._tensor(g, next(iter_refs(peers[n].args[src_arg]))).reshape(-1)
                              for n, g in enumerate(group)])
            self._judge(res, self._tensor(rank, out_ref).reshape(-1), want, True, "gathered tensor vs all inputs")
        elif packet == "broadcast_" or packet == "broadcast":
            root = coll.root if coll.root is not None else 0
            root_n = group.index(root) if root in group else root
            src = list(iter_refs(peers[root_n].args[0]))
            outs = list(iter_refs(_written(op, 0) if packet.endswith("_") else op.outputs))
            for j, out_ref in enumerate(outs):
                self._judge(res, self._tensor(rank, out_ref), self._tensor(group[root_n], src[j]), True,
                            f"output vs rank {group[root_n]}'s input")
        else:
            res.reason = f"collective {packet}: no cross-rank check for this kind yet"
