"""Where the ranks of a trace meet: each process group's collectives, in call order, on every rank.

The k-th collective of a process group is one call made together by every rank of the group. That is the only
order there is between ops of different ranks: an op before the k-th collective of a group on its rank precedes
every op after the k-th collective on any rank of that group. Two uses: the hang report (``arrivals``: which ranks
entered the k-th collective of a group and which never did, what each rank completed last) and the order of the
earliest divergent op of each rank (``earliest``), where two candidates with no collective between them cannot be
ordered at all.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from replaydiff import aten
from replaydiff.trace.damage import MissingOps
from replaydiff.trace.reader import RankTrace, Trace
from replaydiff.trace.schema.ops import OpRecord

GroupKey = tuple  # (group name, ranks): CollectiveInfo.group_key


def group_calls(rt: RankTrace) -> dict[GroupKey, list[int]]:
    """Op numbers of the completed group collective calls of one rank, per process group, in call order (read from the
    index; only collectives are decoded, for their group). Point-to-point ops are not among them: each pairs with its
    peer's op, not with the k-th call of every rank. Collectives whose records are missing from a damaged trace are
    left out: their group is unknown, so from ``calls_unknown_from`` on the k-th call of a group may not be the k-th
    listed."""
    out: dict[GroupKey, list[int]] = {}
    idx = rt.index
    for i in range(len(idx)):
        if idx.collective[i] and idx.recorded[i] and not aten.is_wait_only(idx.name[i]) \
                and not aten.is_point_to_point(idx.name[i]) and rt.missing_at(i) is None:
            c = rt[i].collective
            if c is not None:
                out.setdefault(c.group_key, []).append(i)
    return out


def point_to_point_calls(rt: RankTrace) -> list[int]:
    """Op numbers of the completed point-to-point ops (send, receive) of one rank, in call order."""
    idx = rt.index
    return [i for i in range(len(idx)) if idx.collective[i] and idx.recorded[i]
            and aten.is_point_to_point(idx.name[i]) and rt.missing_at(i) is None]


def calls_unknown_from(rt: RankTrace) -> MissingOps | None:
    """The first run of missing ops of ``rt`` that holds a collective (or may: an index rebuilt from what is on disk
    does not say what a missing op was), or None. From there on, which call of its group a collective is is unknown."""
    idx = rt.index
    for m in rt.missing_ops:
        if any(not idx.recorded[i] or idx.collective[i] for i in range(m.first, min(m.last + 1, len(idx)))):
            return m
    return None


@dataclass
class GroupArrival:
    """The first call of a process group that not every rank completed."""

    group_name: str | None
    ranks: tuple[int, ...]
    call: int  # k: the group's k-th collective (from 0)
    op: str | None  # its name, as the ranks that reached it called it
    entered: list[int] = field(default_factory=list)  # ranks that entered it (waiting in it, or past it)
    waiting: dict[int, int] = field(default_factory=dict)  # rank -> op number it was waiting in
    never: list[int] = field(default_factory=list)  # ranks of the trace that never entered it
    not_in_trace: list[int] = field(default_factory=list)  # ranks of the group with no trace here

    def to_json(self) -> dict:
        return {"group_name": self.group_name, "ranks": list(self.ranks), "call": self.call, "op": self.op,
                "entered": self.entered, "waiting": {str(k): v for k, v in self.waiting.items()},
                "never": self.never, "not_in_trace": self.not_in_trace}


@dataclass
class RankProgress:
    rank: int
    complete: bool
    last_op: OpRecord | None  # the last op with a full record (completed)
    entered: OpRecord | None  # the collective it was inside, not completed (a stub record)


def progress(rt: RankTrace) -> RankProgress:
    last = None
    if rt.last_index is not None:
        i = rt.last_index
        while i >= 0 and last is None:
            gone = rt.missing_at(i)
            if gone is not None:  # a damaged trace: the last op that is there
                i = gone.first - 1
                continue
            op = rt.op(i)
            last = op if op.recorded else None
            i -= 1
    return RankProgress(rt.rank, rt.complete, last, rt.entered)


def arrivals(trace: Trace) -> list[GroupArrival]:
    """For every process group whose ranks did not all complete the same collectives: its first open call, who
    entered it and who never did (the "who didn't arrive" answer that hang debugging starts with)."""
    calls = {r: group_calls(trace.rank(r)) for r in trace.ranks}
    entered = {r: trace.rank(r).entered for r in trace.ranks}
    keys: dict[GroupKey, None] = {}
    for r in trace.ranks:
        keys.update(dict.fromkeys(calls[r]))
        if entered[r] is not None and entered[r].collective is not None:
            keys[entered[r].collective.group_key] = None
    out = []
    for key in keys:
        name, ranks = key
        present = [g for g in ranks if g in calls] or [r for r in trace.ranks if key in calls[r]]
        count = {g: len(calls[g].get(key, [])) for g in present}
        stuck = {g: entered[g] for g in present
                 if entered[g] is not None and entered[g].collective is not None
                 and entered[g].collective.group_key == key}
        k = min(count.values()) if count else 0
        if all(c == k for c in count.values()) and not stuck:
            continue  # every rank completed the same calls and nobody is inside one
        reached = [g for g in present if count[g] > k or g in stuck]
        op = None
        for g in reached:
            op = stuck[g].name if count[g] == k else trace.rank(g)[calls[g][key][k]].name
            break
        out.append(GroupArrival(name, tuple(ranks), k, op, reached,
                                {g: stuck[g].index for g in stuck if count[g] == k},
                                [g for g in present if g not in reached],
                                [g for g in ranks if g not in calls]))
    return out


class Order:
    """The partial order of ops across ranks that the collectives of a trace establish."""

    def __init__(self, trace: Trace) -> None:
        self.calls = {r: group_calls(trace.rank(r)) for r in trace.ranks}

    def precedes(self, a: tuple[int, int], b: tuple[int, int]) -> bool:
        """Op ``a`` = (rank, index) certainly ran before op ``b``: same rank and earlier, or a group of both ranks
        has a call that ``a`` is not past and ``b`` is (a collective itself counts as before its own call)."""
        (ra, ia), (rb, ib) = a, b
        if ra == rb:
            return ia < ib
        ca, cb = self.calls.get(ra, {}), self.calls.get(rb, {})
        for key in ca.keys() & cb.keys():
            if ra in key[1] and rb in key[1] and bisect.bisect_left(ca[key], ia) < bisect.bisect_left(cb[key], ib):
                return True
        return False


def earliest(trace: Trace, candidates: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The candidates (rank, index) that no other candidate is known to precede (through any chain of
    candidates): one when the order decides the culprit, several when it cannot (no collective between them)."""
    order = Order(trace)
    n = len(candidates)
    before = [[order.precedes(candidates[i], candidates[j]) for j in range(n)] for i in range(n)]
    for m in range(n):  # transitive closure: a before b before c
        for i in range(n):
            if before[i][m]:
                for j in range(n):
                    if before[m][j]:
                        before[i][j] = True
    return [candidates[j] for j in range(n) if not any(before[i][j] and not before[j][i] for i in range(n) if i != j)]
