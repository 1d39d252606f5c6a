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
from typing import Any, Callable, Iterable, TypeVar

import torch

from replaydiff import aten
from replaydiff.compare.tolerance import Tolerances
from replaydiff.compare.verdict import Verdict, judge
from replaydiff.replay.notes import (CheckFailed, ChunksDiffer, CollectiveDiffers, CollectiveOk, Judgement, MissedCall,
                                     RanksMissing, RecordsMissing, ReplayFact, Skipped, TraceEndsBefore,
                                     render)
from replaydiff.replay.policy import ReplayOptions
from replaydiff.replay.result import OpResult, Status
from replaydiff.trace.damage import MissingOps
from replaydiff.trace.exchange import split_positions, split_sizes
from replaydiff.trace.reader import RankTrace, Trace
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.schema.values import TensorRef, iter_refs
from replaydiff.trace.sync import calls_unknown_from, group_calls, point_to_point_calls


class NotChecked(Exception):
    """The collective is left skipped, with this reason."""


F = TypeVar("F", bound=Callable)


# -- where each form keeps its tensors ---------------------------------------------------------------------------
# ("arg", i): argument i as recorded before the op; ("write", i|name): argument as written (after the wait);
# ("out", None): the op's outputs. Functional forms return their results; c10d forms fill their arguments.
@dataclass(frozen=True)
class Layout:
    kind: str  # all_reduce all_gather reduce_scatter broadcast all_to_all
    inputs: tuple  # where the inputs are (before the op)
    outputs: tuple  # where the results are


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
    ("c10d", "alltoall_base_"): Layout("all_to_all", ("arg", 1), ("write", 0)),
    ("functional", "all_to_all_single"): Layout("all_to_all", ("arg", 0), ("out", None)),
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


@dataclass(frozen=True)
class Call:
    """One collective call on one rank, as a kind's check reads it: its record, the same call on every rank of its
    group (in group order) and where the layout puts their tensors."""

    op: OpRecord
    peers: list[OpRecord]  # peers[n]: the call on group rank n
    group: tuple[int, ...]
    me: int  # this rank's position in the group
    outs: list[TensorRef]  # this rank's results
    ins: list[list[TensorRef]]  # ins[n]: the inputs of group rank n
    output: Callable[[TensorRef], torch.Tensor]  # one of this rank's recorded tensors
    load: Callable[[int, TensorRef], torch.Tensor]  # one of group rank n's recorded tensors
    tolerances: Tolerances

    @property
    def width(self) -> int:
        return len(self.group)

    def reduce_op(self) -> str:
        reduce_op = self.op.collective.reduce_op
        if reduce_op is None or reduce_op == "unknown":
            raise NotChecked("collective: its reduce op could not be read when recording, so it is not checked")
        return reduce_op


Check = Callable[[Call], Judgement]
# What each kind of collective (``Layout.kind``) must produce, registered per kind with ``@checks`` (as
# ``torch.utils.flop_counter`` registers a formula per op): a kind without one is left skipped, saying so.
_CHECKS: dict[str, Check] = {}


def checks(*kinds: str) -> Callable[[F], F]:
    """Register ``fn`` as the cross-rank check of the collectives of ``kinds`` (one check per kind)."""
    def register(fn: F) -> F:
        for kind in kinds:
            if kind in _CHECKS:
                raise ValueError(f"collective kind {kind!r} already has a check ({_CHECKS[kind].__qualname__})")
            _CHECKS[kind] = fn
        return fn
    return register


def check_for(kind: str) -> Check:
    """The check registered for collectives of ``kind``; NotChecked (the collective stays skipped) if none is."""
    check = _CHECKS.get(kind)
    if check is None:
        raise NotChecked(f"collective: no cross-rank check for collectives of kind {kind!r}")
    return check


def checked_kinds() -> frozenset[str]:
    return frozenset(_CHECKS)


def judge_pieces(pieces: Iterable[tuple[torch.Tensor, torch.Tensor, bool, str]], tol: Tolerances) -> Judgement:
    """Each (received, expected, exact, what) piece judged: the first divergent piece decides; when none is, the
    last one's verdict stands. Every piece is loaded and judged, so one that cannot be read leaves the call
    unchecked even after a divergent one."""
    found: Judgement | None = None
    last: Judgement | None = None
    for got, want, exact, what in pieces:
        if got.shape != want.shape:
            got, want = got.reshape(-1), want.reshape(-1)
        v = judge(got, want, tol, 1, exact=exact or not got.is_floating_point())
        if v.divergent and found is None:
            found = Judgement(Status.DIVERGENT, v, (CollectiveDiffers(what, v.reason),))
        elif found is None:
            last = Judgement(Status.OK, v, (CollectiveOk(what),))
    return found or last or Judgement(Status.SKIPPED, notes=(ReplayFact.COLLECTIVE,))


# -- the checks, per kind -------------------------------------------------------------------------------------------
@checks("all_reduce")
def _all_reduce(c: Call) -> Judgement:
    reduce_op = c.reduce_op()

    def pieces():
        for j, out_ref in enumerate(c.outs):
            want = _reduce(reduce_op, [c.load(n, c.ins[n][j]) for n in range(c.width)])
            yield c.output(out_ref), want, False, f"output vs the float64 {reduce_op} of all ranks' inputs"
    return judge_pieces(pieces(), c.tolerances)


@checks("reduce_scatter")
def _reduce_scatter(c: Call) -> Judgement:
    reduce_op, me = c.reduce_op(), c.me
    return judge_pieces(((c.output(out_ref).reshape(-1),
                          _reduce(reduce_op, [c.load(n, c.ins[n][j]).reshape(c.width, -1)[me] for n in range(c.width)]),
                          False, f"output vs the float64 {reduce_op} of every rank's chunk {me}")
                         for j, out_ref in enumerate(c.outs)), c.tolerances)


@checks("reduce_scatter_list")
def _reduce_scatter_list(c: Call) -> Judgement:
    """reduce_scatter_: input_tensors[0][n] of every rank goes to rank n."""
    reduce_op, me = c.reduce_op(), c.me
    want = _reduce(reduce_op, [c.load(n, c.ins[n][me]) for n in range(c.width)])
    return judge_pieces([(c.output(c.outs[0]), want, False,
                          f"output vs the float64 {reduce_op} of every rank's chunk {me}")], c.tolerances)


@checks("all_gather_list")
def _all_gather_list(c: Call) -> Judgement:
    """output_tensors[0][n] is rank n's input."""
    return judge_pieces(((c.output(c.outs[n]), c.load(n, c.ins[n][0]), True,
                          f"gathered slot {n} vs rank {c.group[n]}'s input") for n in range(c.width)), c.tolerances)


@checks("all_gather")
def _all_gather(c: Call) -> Judgement:
    def pieces():
        for j, out_ref in enumerate(c.outs):
            got = c.output(out_ref).reshape(c.width, -1)
            for n in range(c.width):
                yield (got[n], c.load(n, c.ins[n][j]).reshape(-1), True,
                       f"gathered chunk {n} vs rank {c.group[n]}'s input")
    return judge_pieces(pieces(), c.tolerances)


@checks("broadcast")
def _broadcast(c: Call) -> Judgement:
    # Both forms hand the process group its root as a rank within the group (c10d's Python API has already mapped
    # src to group_src), which is what ProcessGroup::broadcast reads.
    root_n = c.op.collective.root
    if root_n is None or not 0 <= root_n < c.width:
        raise NotChecked(f"collective: its root ({root_n}) is not a rank of its group of {c.width}")
    return judge_pieces(((c.output(out_ref), c.load(root_n, c.ins[root_n][j]), True,
                          f"output vs rank {c.group[root_n]}'s input") for j, out_ref in enumerate(c.outs)),
                        c.tolerances)


@checks("all_to_all_list")
def _all_to_all_list(c: Call) -> Judgement:
    """output_tensors[n] comes from rank n's input_tensors[me]."""
    return _exchanged([(c.output(c.outs[n]), c.load(n, c.ins[n][c.me]), f"its input chunk {c.me}")
                       for n in range(c.width)], c)


@checks("all_to_all")
def _all_to_all(c: Call) -> Judgement:
    """One tensor cut along dim 0 by the recorded split sizes (equal chunks when none were given)."""
    got = c.output(c.outs[0])
    out_at, in_at = split_positions(c.op.name) or (None, None)
    if out_at is None:
        raise NotChecked(f"collective {aten.packet(c.op.name)}: its split sizes' place is not known")
    out_splits = split_sizes(c.op.args[out_at], got.shape[0], c.width)
    pieces, start = [], 0
    for n in range(c.width):
        src = c.load(n, c.ins[n][0])
        in_splits = split_sizes(c.peers[n].args[in_at], src.shape[0], c.width)
        lo = sum(in_splits[:c.me])
        pieces.append((got.narrow(0, start, out_splits[n]), src.narrow(0, lo, in_splits[c.me]),
                       f"its input rows {lo}:{lo + in_splits[c.me]}"))
        start += out_splits[n]
    return _exchanged(pieces, c)


def _exchanged(pieces: list[tuple[torch.Tensor, torch.Tensor, str]], c: Call) -> Judgement:
    """All-to-all: every chunk received, (received, what the peer sent, what), judged bit for bit; the peers whose
    chunks differ are named."""
    wrong: list[tuple[int, str, Verdict]] = []
    for n, (got_n, want_n, what) in enumerate(pieces):
        v = judge(got_n, want_n, c.tolerances, 1, exact=True)
        if v.divergent:
            wrong.append((c.group[n], what, v))
    if not wrong:
        return Judgement(Status.OK, None, (ReplayFact.EVERY_CHUNK_OK,))
    peer, what, v = wrong[0]
    return Judgement(Status.DIVERGENT, v, (ChunksDiffer(tuple(w[0] for w in wrong), peer, what, v.reason),))


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
        for key, judgement in self.judgements(results).items():
            settle(results[key], judgement)

    def judgements(self, results: dict[tuple[int, int], OpResult]) -> dict[tuple[int, int], Judgement]:
        """The cross-rank judgement of each collective in ``results`` (keyed by (rank, op number))."""
        calls = {r: self.calls(self.trace.rank(r)) for r in self.trace.ranks}
        gaps = {r: g for r in self.trace.ranks if (g := calls_unknown_from(self.trace.rank(r))) is not None}
        found = {}
        for rank, groups in calls.items():
            for key, ops in groups.items():
                for k, op in enumerate(ops):
                    if (rank, op.index) in results:
                        found[(rank, op.index)] = self._unknown_call(calls, gaps, key, k) or \
                            self._judge_call(calls, rank, key, k, op)
        found.update(self._point_to_point(results, gaps))
        return found

    def _point_to_point(self, results: dict[tuple[int, int], OpResult],
                        gaps: dict[int, MissingOps]) -> dict[tuple[int, int], Judgement]:
        """Each send against the receive it pairs with: the k-th send from rank s to rank d with the k-th receive on d
        from s; what arrived must be exactly what was sent. A receive from any source is not paired (unchecked)."""
        sends: dict[tuple[int, int], list[OpRecord]] = {}
        recvs: dict[tuple[int, int], list[OpRecord]] = {}
        found: dict[tuple[int, int], Judgement] = {}
        for rank in self.trace.ranks:
            rt = self.trace.rank(rank)
            for i in point_to_point_calls(rt):
                op = rt[i]
                packet = aten.packet(op.name)
                peer = _peer(op)
                if packet == "send" and peer is not None:
                    sends.setdefault((rank, peer), []).append(op)
                elif packet == "recv_" and peer is not None:
                    recvs.setdefault((peer, rank), []).append(op)
                elif (rank, i) in results:
                    found[(rank, i)] = Judgement(Status.SKIPPED, notes=(Skipped(
                        "point-to-point: a receive from any source (or a peer not recorded) is not paired"),))
        for src, dst in set(sends) | set(recvs):
            sent, got = sends.get((src, dst), []), recvs.get((src, dst), [])
            for k in range(max(len(sent), len(got))):
                if not ((k < len(sent) and (src, sent[k].index) in results)
                        or (k < len(got) and (dst, got[k].index) in results)):
                    continue  # neither side is among the ops replayed
                j = self._judge_pair(src, dst, k, sent, got, gaps)
                if k < len(got):
                    found[(dst, got[k].index)] = j
                if k < len(sent):
                    # what arrived differs from what left: the receive is where the run went wrong
                    found[(src, sent[k].index)] = j if j.status is not Status.DIVERGENT or k >= len(got) else \
                        Judgement(Status.SKIPPED, notes=(Skipped(
                            f"point-to-point: what arrived differs from what this send sent; judged at the receive, "
                            f"rank {dst} #{got[k].index}"),))
        return {key: j for key, j in found.items() if key in results}

    def _judge_pair(self, src: int, dst: int, k: int, sent: list[OpRecord], got: list[OpRecord],
                    gaps: dict[int, MissingOps]) -> Judgement:
        """The k-th send from ``src`` to ``dst`` against the k-th receive on ``dst`` from ``src``, once for both."""
        if src not in self.trace.ranks or dst not in self.trace.ranks:
            return Judgement(Status.SKIPPED, notes=(RanksMissing(tuple(r for r in (src, dst)
                                                                       if r not in self.trace.ranks)),))
        # past a run of missing records on either side, which send or receive is the k-th is unknown
        gone = [gaps[r].describe(with_rank=True) for r, ops in ((src, sent), (dst, got))
                if r in gaps and k >= sum(op.index < gaps[r].first for op in ops)]
        if gone:
            return Judgement(Status.SKIPPED, notes=(RecordsMissing(tuple(gone)),))
        if k >= len(sent) or k >= len(got):
            short = (src,) if k >= len(sent) else (dst,)
            cut = tuple(r for r in short if not self.trace.rank(r).complete)
            return Judgement(Status.SKIPPED, notes=(TraceEndsBefore(cut, k),)) if cut else \
                Judgement(Status.DIVERGENT, notes=(MissedCall(short, k),))
        try:
            want = [self._tensor(src, r) for r in iter_refs(tensors_at(sent[k], ("arg", 0)))]
            have = [self._tensor(dst, r) for r in iter_refs(tensors_at(got[k], ("write", 0)))]
            if len(want) != len(have):
                raise NotChecked("point-to-point: the send and its receive hold different tensor counts")
            return judge_pieces(((h, w, True, f"received on rank {dst} vs sent by rank {src}")
                                 for h, w in zip(have, want)), self.opts.tolerances)
        except NotChecked as why:
            return Judgement(Status.SKIPPED, notes=(Skipped(str(why)),))
        except Exception as exc:
            return Judgement(Status.ERROR, notes=(CheckFailed(type(exc).__name__, str(exc)),))

    @staticmethod
    def _unknown_call(calls: dict[int, dict[tuple, list[OpRecord]]], gaps: dict[int, MissingOps], key: tuple,
                      k: int) -> Judgement | None:
        """Not checked when, on some rank of the group, call ``k`` lies past collectives whose records are missing:
        which of its calls is the k-th is unknown there."""
        gone = []
        for g in key[1] or ():
            gap = gaps.get(g)
            if gap is not None and k >= sum(op.index < gap.first for op in calls.get(g, {}).get(key, [])):
                gone.append(gap.describe(with_rank=True))
        return Judgement(Status.SKIPPED, notes=(RecordsMissing(tuple(gone)),)) if gone else None

    def _judge_call(self, calls: dict[int, dict[tuple, list[OpRecord]]], rank: int, key: tuple, k: int,
                    op: OpRecord) -> Judgement:
        """Call ``k`` of process group ``key`` on ``rank``, against the same call on every rank of the group."""
        group = key[1]
        if not group:
            return Judgement(Status.SKIPPED, notes=(ReplayFact.GROUP_UNKNOWN,))
        missing = [g for g in group if g not in calls]
        if missing:
            return Judgement(Status.SKIPPED, notes=(RanksMissing(tuple(missing)),))
        peers = [calls[g].get(key, []) for g in group]
        short = [g for g, p in zip(group, peers) if len(p) <= k]
        cut = [g for g in short if not self.trace.rank(g).complete]
        if cut:  # a crash-cut trace: the call may have happened after its recording stopped
            return Judgement(Status.SKIPPED, notes=(TraceEndsBefore(tuple(cut), k),))
        if short:
            return Judgement(Status.DIVERGENT, notes=(MissedCall(tuple(short), k),))
        if any(p[k].name != op.name for p in peers):
            return Judgement(Status.DIVERGENT, notes=(ReplayFact.MISMATCHED_ORDER,))
        try:
            return self._check_one(op, [p[k] for p in peers], group, rank)
        except NotChecked as why:
            return Judgement(Status.SKIPPED, notes=(Skipped(str(why)),))
        except Exception as exc:
            return Judgement(Status.ERROR, notes=(CheckFailed(type(exc).__name__, str(exc)),))

    def _tensor(self, rank: int, ref: TensorRef) -> torch.Tensor:
        if not ref.stored:
            raise NotChecked("collective: inputs not stored in the trace")
        return self.trace.rank(rank).tensor(ref)

    def _check_one(self, op: OpRecord, peers: list[OpRecord], group: tuple, rank: int) -> Judgement:
        lay = layout(op.name)
        if lay is None:
            raise NotChecked(f"collective {aten.packet(op.name)}: no cross-rank check for this kind yet")
        check = check_for(lay.kind)
        return check(Call(op, peers, group, group.index(rank), list(iter_refs(tensors_at(op, lay.outputs))),
                          [list(iter_refs(tensors_at(p, lay.inputs))) for p in peers],
                          lambda ref: self._tensor(rank, ref), lambda n, ref: self._tensor(group[n], ref),
                          self.opts.tolerances))


def _peer(op: OpRecord) -> int | None:
    """The global rank a send goes to or a receive comes from: its third argument is a rank of its group."""
    n = op.args[2] if len(op.args) > 2 else None
    ranks = op.collective.ranks if op.collective is not None else ()
    if not isinstance(n, int):
        return None
    return ranks[n] if ranks and 0 <= n < len(ranks) else n


def settle(res: OpResult, j: Judgement) -> None:
    """Write a collective's cross-rank judgement onto its result: the one place a result is changed after it is
    made (the engine holds the replay's results in a list, the checked collectives among them)."""
    res.status, res.verdict, res.reason = j.status, j.verdict, render(j.notes)
