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

from replaydiff.compare.metrics import tensor_metrics
from replaydiff.record.encode import iter_tensor_refs
from replaydiff.replay.policy import ReplayOptions
from replaydiff.replay.result import OpResult
from replaydiff.replay.runner import op_packet
from replaydiff.trace.reader import RankReader, TraceReader

_NOT_COLLECTIVES = {"_wrap_tensor_autograd", "wait_tensor"}


def _written(rec: dict, arg: int) -> Any:
    for path, after in rec.get("w") or []:
        if path == ["a", arg]:
            return after
    return None


def _reduce(op: str | None, xs: list[torch.Tensor]) -> torch.Tensor | None:
    stack = torch.stack([x.to(torch.float64) if x.is_floating_point() else x for x in xs])
    if op in (None, "sum"):
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
    def __init__(self, trace: TraceReader, opts: ReplayOptions) -> None:
        self.trace = trace
        self.opts = opts

    def _calls(self, reader: RankReader) -> dict[tuple, list[dict]]:
        """Collective records of one rank, per group (by its ranks), in call order."""
        out: dict[tuple, list[dict]] = {}
        for rec in reader:
            coll = rec.get("coll")
            if coll is None or op_packet(rec["op"]) in _NOT_COLLECTIVES:
                continue
            out.setdefault(tuple(coll.get("ranks") or ()), []).append(rec)
        return out

    def check(self, results: dict[tuple[int, int], OpResult]) -> None:
        """Replace the 'skipped' results of collectives with the outcome of the cross-rank check."""
        calls = {r: self._calls(rd) for r, rd in self.trace.ranks.items()}
        for rank, groups in calls.items():
            for group, recs in groups.items():
                missing = [g for g in group if g not in calls]
                for k, rec in enumerate(recs):
                    res = results.get((rank, rec["i"]))
                    if res is None:
                        continue
                    if not group:
                        res.reason = "collective: its process group is unknown, so it cannot be checked"
                        continue
                    if missing:
                        res.reason = f"collective: ranks {missing} of its group are not in the trace"
                        continue
                    peers = [calls[g].get(group, []) for g in group]
                    if any(len(p) <= k or p[k]["op"] != rec["op"] for p in peers):
                        res.status, res.reason = "divergent", "collective: the ranks of its group called " \
                                                              "different collectives here (mismatched order)"
                        continue
                    try:
                        self._check_one(rec, [p[k] for p in peers], group, res)
                    except Exception as exc:
                        res.status, res.reason = "error", f"cross-rank check failed: {type(exc).__name__}: {exc}"

    def _tensor(self, rank: int, ref: dict) -> torch.Tensor:
        return self.trace.rank(rank).tensor(ref)

    def _judge(self, res: OpResult, got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
        m = tensor_metrics(got, want, exact=exact or not got.is_floating_point())
        bad, why = self.opts.tolerances.diverges(m, got.dtype, 1)
        if bad and res.status != "divergent":
            res.status, res.reason, res.metrics = "divergent", f"collective: {what} ({why})", m
        elif res.status != "divergent":
            res.status, res.reason, res.metrics = "ok", f"collective checked across ranks: {what}", m

    def _check_one(self, rec: dict, peers: list[dict], group: tuple, res: OpResult) -> None:
        packet = op_packet(rec["op"])
        coll = rec["coll"]
        rank = res.rank
        if packet in ("allreduce_", "all_reduce", "all_reduce_"):
            functional = not packet.endswith("_") or rec["op"].startswith("_c10d_functional")
            ins = [list(iter_tensor_refs(p["a"][0])) for p in peers]
            outs = list(iter_tensor_refs(rec.get("o") if functional else _written(rec, 0)))
            for j, out_ref in enumerate(outs):
                want = _reduce(coll.get("reduce_op"), [self._tensor(g, ins[n][j]) for n, g in enumerate(group)])
                if want is None:
                    res.reason = f"collective: reduce op {coll.get('reduce_op')} is not checked"
                    return
                self._judge(res, self._tensor(rank, out_ref), want, False,
                            f"output vs the float64 {coll.get('reduce_op') or 'sum'} of all ranks' inputs")
        elif packet == "allgather_":
            outs = list(iter_tensor_refs(_written(rec, 0)))
            for n, g in enumerate(group):
                src = next(iter_tensor_refs(peers[n]["a"][1]))
                self._judge(res, self._tensor(rank, outs[n]), self._tensor(g, src), True,
                            f"gathered slot {n} vs rank {g}'s input")
        elif packet in ("_allgather_base_", "all_gather_into_tensor", "all_gather_into_tensor_out"):
            out_ref = next(iter_tensor_refs(_written(rec, 0) if packet.endswith("_") else rec.get("o")))
            src_arg = 1 if packet == "_allgather_base_" else 0
            want = torch.cat([self._tensor(g, next(iter_tensor_refs(peers[n]["a"][src_arg]))).reshape(-1)
                              for n, g in enumerate(group)])
            self._judge(res, self._tensor(rank, out_ref).reshape(-1), want, True, "gathered tensor vs all inputs")
        elif packet == "broadcast_" or packet == "broadcast":
            root = coll.get("root_rank", coll.get("src", 0))
            root_n = group.index(root) if root in group else root
            src = list(iter_tensor_refs(peers[root_n]["a"][0]))
            outs = list(iter_tensor_refs(_written(rec, 0) if packet.endswith("_") else rec.get("o")))
            for j, out_ref in enumerate(outs):
                self._judge(res, self._tensor(rank, out_ref), self._tensor(group[root_n], src[j]), True,
                            f"output vs rank {group[root_n]}'s input")
        else:
            res.reason = f"collective {packet}: no cross-rank check for this kind yet"
