"""Checking collectives across ranks: a collective cannot be re-run alone, but its result can be recomputed.

The k-th collective of a process group (matched by group name and ranks, then by call order) on each rank is the
same call. Its output on every rank must equal what the recorded inputs of all ranks imply: all-reduce and
reduce-scatter the float64 reduction (sum, avg, min, max, product) of the ranks' inputs (or of their chunks for this
rank), judged by the output dtype's tolerance (two ranks sum bitwise; more ranks differ by about (world-1)*eps, well
inside it); all-gather, broadcast and all-to-all the exact bytes of the rank each piece came from, and a wrong piece
names that peer. A rank whose output disagrees is divergent: a bad collective (wrong NCCL algorithm, corrupted
transfer) is named like any kernel. A reduction whose op could not be read is skipped with that reason, never
checked as a sum. Both the ``c10d`` (in place, with a Work) and the ``_c10d_functional`` forms are covered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from replaydiff import aten
from replaydiff.compare.verdict import judge
from replaydiff.replay.policy import ReplayOptions
from replaydiff.replay.result import OpResult, Status
from replaydiff.trace.reader import RankTrace, Trace
from replaydiff.trace.schema import OpRecord, TensorRef, iter_refs
from replaydiff.trace.sync import group_calls


class NotChecked(Exception):
    """The collective is left skipped, with this reason."""


# -- where each form keeps its tensors ---------------------------------------------------------------------------
# ("arg", i): argument i as recorded before the op; ("write", i|name): argument as written (after the wait);
# ("out", None): the op's outputs. Functional forms return their results; c10d forms fill their arguments.
@dataclass(frozen=True)
class Layout:
    kind: str  # all_reduce all_gather reduce_scatter broadcast all_to_all
    inputs: tuple  # where the inputs are (before the op)
    outputs: tuple  # where the results are
    splits: tuple[int, int] | None = None  # argument positions of (output split sizes, input split sizes)


_LAYOUTS: dict[tuple[str, str], Layout] = {
    ("c10d", "allreduce_"): Layout("all_reduce", ("arg", 0), ("write", 0)),
    ("c10d", "allreduce_coalesced_"): Layout("all_reduce", ("arg", 0), ("write", 0)),
    ("functional", "all_reduce"): Layout("all_reduce", ("arg", 0), ("out", None)),
    ("functional", "all_reduce_"): Layout("all_reduce", ("arg", 0), ("out", None)),
    ("functional", "all_reduce_coalesced"): Layout("all_reduce", ("arg", 0), ("out", None)),
    ("c10d", "allgather_"): Layout("all_gather_list", ("arg", 1), ("write", 0)),
    ("c10d", "_allgather_base_"): Layout("all_gather", ("arg", 1), ("write", 0)),
    ("c10d", "allgather_into_tensor_coalesced_"): Layout("all_gather", ("arg", 1), ("write", 0)),
    ("functional", "all_gather_into_tensor"): Layout("all_gather", ("arg", 0), ("out", None)),
    ("functional", "all_gather_into_tensor_out"): Layout("all_gather", ("arg", 0), ("write", "out")),
    ("functional", "all_gather_into_tensor_coalesced"): Layout("all_gather", ("arg", 0), ("out", None)),
    ("c10d", "reduce_scatter_"): Layout("reduce_scatter_list", ("arg", 1), ("write", 0)),
    ("c10d", "_reduce_scatter_base_"): Layout("reduce_scatter", ("arg", 1), ("write", 0)),
    ("c10d", "reduce_scatter_tensor_coalesced_"): Layout("reduce_scatter", ("arg", 1), ("write", 0)),
    ("functional", "reduce_scatter_tensor"): Layout("reduce_scatter", ("arg", 0), ("out", None)),
    ("functional", "reduce_scatter_tensor_coalesced"): Layout("reduce_scatter", ("arg", 0), ("out", None)),
    ("c10d", "broadcast_"): Layout("broadcast", ("arg", 0), ("write", 0)),
    ("functional", "broadcast"): Layout("broadcast", ("arg", 0), ("out", None)),
    ("functional", "broadcast_"): Layout("broadcast", ("arg", 0), ("out", None)),
    ("c10d", "alltoall_"): Layout("all_to_all_list", ("arg", 1), ("write", 0)),
    ("c10d", "alltoall_base_"): Layout("all_to_all", ("arg", 1), ("write", 0), splits=(3, 4)),
    ("functional", "all_to_all_single"): Layout("all_to_all", ("arg", 0), ("out", None), splits=(1, 2)),
}


def layout(name: str) -> Layout | None:
    ns = aten.namespace(name)
    form = "c10d" if ns == "c10d" else "functional" if ns in ("_c10d_functional", "c10d_functional") else ns
    return _LAYOUTS.get((form, aten.packet(name)))


def tensors_at(op: OpRecord, place: tuple) -> Any:
    """The value a Layout place names in one record (``Layout.inputs`` or ``Layout.outputs``)."""
    kind, key = place
    if kind == "arg":
        return op.args[key] if key < len(op.args) else None
    if kind == "out":
        return op.outputs
    for path, after in op.writes:
        if path.key == key and path.kind == ("arg" if isinstance(key, int) else "kwarg"):
            return after
    raise NotChecked("collective: its results were not recorded")


def _reduce(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    stack = torch.stack([x.to(torch.float64) if x.is_floating_point() else x for x in xs])
    if op == "sum":
        return stack.sum(0)
    if op == "avg" and stack.is_floating_point():
        return stack.sum(0) / len(xs)
    if op == "max":
        return stack.amax(0)
    if op == "min":
        return stack.amin(0)
    if op == "product":
        return stack.prod(0)
    raise NotChecked(f"collective: reduce op {op} is not checked")


def _splits(v: Any, total: int, parts: int) -> list[int]:
    """All-to-all split sizes along dim 0: as recorded, or equal chunks when none were given."""
    if isinstance(v, (list, tuple)) and len(v) > 0:
        return [int(x) for x in v]
    return [total // parts] * parts


class CollectiveChecker:
    def __init__(self, trace: Trace, opts: ReplayOptions) -> None:
        self.trace = trace
        self.opts = opts

    @staticmethod
    def calls(rt: RankTrace) -> dict[tuple, list[OpRecord]]:
        """Collective records of one rank, per process group (by name and ranks), in call order."""
        return {key: [rt[i] for i in indices] for key, indices in group_calls(rt).items()}

    def check(self, results: dict[tuple[int, int], OpResult]) -> None:
        """Replace the 'skipped' results of collectives with the outcome of the cross-rank check."""
        calls = {r: self.calls(self.trace.rank(r)) for r in self.trace.ranks}
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
                    short = [g for g, p in zip(group, peers) if len(p) <= k]
                    cut = [g for g in short if not self.trace.rank(g).complete]
                    if cut:  # a crash-cut trace: the call may have happened after its recording stopped
                        res.reason = f"collective: the trace of rank(s) {cut} ends before call {k} of this group"
                        continue
                    if short:
                        res.status, res.reason = Status.DIVERGENT, \
                            f"collective: rank(s) {short} of its group never made call {k} of this group"
                        continue
                    if any(p[k].name != op.name for p in peers):
                        res.status, res.reason = Status.DIVERGENT, "collective: the ranks of its group called " \
                                                                   "different collectives here (mismatched order)"
                        continue
                    try:
                        self._check_one(op, [p[k] for p in peers], group, res)
                    except NotChecked as why:
                        res.status, res.reason, res.verdict = Status.SKIPPED, str(why), None
                    except Exception as exc:
                        res.status, res.reason = Status.ERROR, \
                            f"cross-rank check failed: {type(exc).__name__}: {exc}"

    def _tensor(self, rank: int, ref: TensorRef) -> torch.Tensor:
        if not ref.stored:
            raise NotChecked("collective: inputs not stored in the trace")
        return self.trace.rank(rank).tensor(ref)

    def _judge(self, res: OpResult, got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
        if got.shape != want.shape:
            got, want = got.reshape(-1), want.reshape(-1)
        v = judge(got, want, self.opts.tolerances, 1, exact=exact or not got.is_floating_point())
        if v.divergent and res.status is not Status.DIVERGENT:
            res.status, res.reason, res.verdict = Status.DIVERGENT, f"collective: {what} ({v.reason})", v
        elif res.status is not Status.DIVERGENT:
            res.status, res.reason, res.verdict = Status.OK, f"collective checked across ranks: {what}", v

    def _check_one(self, op: OpRecord, peers: list[OpRecord], group: tuple, res: OpResult) -> None:
        lay = layout(op.name)
        if lay is None:
            raise NotChecked(f"collective {aten.packet(op.name)}: no cross-rank check for this kind yet")
        me = group.index(res.rank)
        width = len(group)
        outs = list(iter_refs(tensors_at(op, lay.outputs)))
        ins = [list(iter_refs(tensors_at(p, lay.inputs))) for p in peers]  # ins[n]: refs of group rank n
        load: Callable[[int, TensorRef], torch.Tensor] = lambda n, ref: self._tensor(group[n], ref)
        kind = lay.kind
        if kind in ("all_reduce", "reduce_scatter", "reduce_scatter_list"):
            reduce_op = op.collective.reduce_op
            if reduce_op is None or reduce_op == "unknown":
                raise NotChecked("collective: its reduce op could not be read when recording, so it is not checked")
            if kind == "all_reduce":
                for j, out_ref in enumerate(outs):
                    want = _reduce(reduce_op, [load(n, ins[n][j]) for n in range(width)])
                    self._judge(res, self._tensor(res.rank, out_ref), want, False,
                                f"output vs the float64 {reduce_op} of all ranks' inputs")
            elif kind == "reduce_scatter":
                for j, out_ref in enumerate(outs):
                    parts = [load(n, ins[n][j]).reshape(width, -1)[me] for n in range(width)]
                    self._judge(res, self._tensor(res.rank, out_ref).reshape(-1), _reduce(reduce_op, parts), False,
                                f"output vs the float64 {reduce_op} of every rank's chunk {me}")
            else:  # reduce_scatter_: input_tensors[0][n] of every rank goes to rank n
                want = _reduce(reduce_op, [load(n, ins[n][me]) for n in range(width)])
                self._judge(res, self._tensor(res.rank, outs[0]), want, False,
                            f"output vs the float64 {reduce_op} of every rank's chunk {me}")
        elif kind == "all_gather_list":  # output_tensors[0][n] is rank n's input
            for n in range(width):
                self._judge(res, self._tensor(res.rank, outs[n]), load(n, ins[n][0]), True,
                            f"gathered slot {n} vs rank {group[n]}'s input")
        elif kind == "all_gather":
            for j, out_ref in enumerate(outs):
                got = self._tensor(res.rank, out_ref).reshape(width, -1)
                for n in range(width):
                    self._judge(res, got[n], load(n, ins[n][j]).reshape(-1), True,
                                f"gathered chunk {n} vs rank {group[n]}'s input")
        elif kind == "broadcast":
            # Both forms hand the process group its root as a rank within the group (c10d's Python API has
            # already mapped src to group_src), which is what ProcessGroup::broadcast reads.
            root_n = op.collective.root
            if root_n is None or not 0 <= root_n < width:
                raise NotChecked(f"collective: its root ({root_n}) is not a rank of its group of {width}")
            for j, out_ref in enumerate(outs):
                self._judge(res, self._tensor(res.rank, out_ref), load(root_n, ins[root_n][j]), True,
                            f"output vs rank {group[root_n]}'s input")
        elif kind in ("all_to_all", "all_to_all_list"):
            pairs = []  # (received chunk, the chunk the peer sent, what) per peer
            if kind == "all_to_all_list":  # output_tensors[n] comes from rank n's input_tensors[me]
                for n in range(width):
                    pairs.append((self._tensor(res.rank, outs[n]), load(n, ins[n][me]), f"its input chunk {me}"))
            else:  # one tensor cut along dim 0 by the recorded split sizes (equal chunks when none were given)
                got = self._tensor(res.rank, outs[0])
                out_splits = _splits(op.args[lay.splits[0]], got.shape[0], width)
                start = 0
                for n in range(width):
                    src = load(n, ins[n][0])
                    in_splits = _splits(peers[n].args[lay.splits[1]], src.shape[0], width)
                    lo = sum(in_splits[:me])
                    pairs.append((got.narrow(0, start, out_splits[n]), src.narrow(0, lo, in_splits[me]),
                                  f"its input rows {lo}:{lo + in_splits[me]}"))
                    start += out_splits[n]
            wrong = []
            for n, (got_n, want_n, what) in enumerate(pairs):
                v = judge(got_n, want_n, self.opts.tolerances, 1, exact=True)
                if v.divergent:
                    wrong.append((group[n], what, v))
            if wrong:
                peer, what, v = wrong[0]
                res.status, res.verdict = Status.DIVERGENT, v
                res.reason = (f"collective: the chunk(s) received from rank(s) {[w[0] for w in wrong]} differ from "
                              f"what they sent (rank {peer}: {what}; {v.reason})")
            else:
                res.status, res.reason, res.verdict = Status.OK, \
                    "collective checked across ranks: every chunk vs what its peer sent", None
