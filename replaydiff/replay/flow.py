"""Where NaN/Inf go once made: followed forward through the ops that read them, to tell values the model uses from
values it computes and then throws away.

Models make NaN/Inf on purpose and select them away: T5's relative-position bucketing takes ``log(0)`` and a
``where`` then picks other values; an additive ``-inf`` attention mask goes through a softmax, whose output is finite.
Such values are made and discarded: no fault. Only NaN/Inf that reach the loss, a gradient, a parameter or an
output of the step are an origin to report.

The walk uses the trace's consumer edges (trace/index.py) and the recorded outputs of each reader: a reader whose
recorded outputs hold NaN/Inf passed them on, and the walk goes on from there; a reader whose outputs are finite
ended them (a where, masked_fill, index, clamp, softmax, a cast to an integer). NaN/Inf held in a tensor that no op of
the trace reads leave the step: the loss (read only by the ``ones_like`` that starts its backward, which reads no
value), a gradient or parameter written for the step after, an output the user's code keeps, a value handed to
Python (``loss.item()``). Whatever the walk cannot tell (a reader whose values the trace does not hold) counts as
kept: the walk may call a discarded value kept, never a kept one discarded.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from replaydiff import aten
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.schema.values import TensorRef

# Ops visited by one walk before it gives up and counts the values as kept: a NaN that reaches the loss is found
# within the forward pass; discarded values end within a few ops.
MAX_VISITS = 20_000

# Output positions of an op that hold NaN/Inf (empty: none); None when the trace cannot tell.
NonfiniteSlots = Callable[[OpRecord], "set[int] | None"]


@dataclass(frozen=True)
class Flow:
    """Where the NaN/Inf an op made (or let into the step) went. ``kept_at``: the first op found holding them in an
    output that leaves the step (or whose outputs the trace cannot tell), None when no op keeps them;
    ``ended_at``: the ops that read them and made only finite values, in op order."""

    kept_at: int | None
    ended_at: tuple[int, ...] = ()

    @property
    def discarded(self) -> bool:
        return self.kept_at is None


def data_slots(trace: RankTrace) -> NonfiniteSlots:
    """The output positions holding NaN/Inf, read from the stored tensor data (a tensor stored as statistics only:
    from their NaN and Inf counts)."""
    def slots(op: OpRecord) -> set[int] | None:
        return _held_slots(op, trace)
    return slots


def stats_slots(op: OpRecord) -> set[int] | None:
    """The output positions holding NaN/Inf, from the recorded statistics (``--tensors stats``)."""
    return _held_slots(op, None)


def _held_slots(op: OpRecord, trace: RankTrace | None) -> set[int] | None:
    """The floating output positions holding NaN/Inf: from the stored tensor where ``trace`` is given and holds it,
    else from the statistics; None when an output has neither (the trace cannot tell)."""
    out: set[int] = set()
    for k, ref in enumerate(op.outputs_refs()):
        if not aten.floating_dtype(ref.dtype) or ref.uninitialised or ref.zero:
            continue
        if trace is not None and ref.stored and not ref.meta:
            if not bool(torch.isfinite(trace.tensor(ref)).all()):
                out.add(k)
            continue
        s = ref.stats
        if s is None:
            return None
        if s.nan or s.inf:
            out.add(k)
    return out


def _python_nonfinite(v: Any) -> bool:
    """A non-finite number among an op's outputs that are not tensors (``loss.item()`` of a NaN loss)."""
    if isinstance(v, (list, tuple)):
        return any(_python_nonfinite(x) for x in v)
    return isinstance(v, float) and not math.isfinite(v)


def _same_view(op: OpRecord) -> bool:
    """Every output of ``op`` is one of its inputs, the very same view (``detach``, ``alias``): it computes nothing,
    and the trace lists the readers of that tensor under the op that first handed it out, not under this one."""
    ins = {r.geometry for r in op.inputs()}
    outs = op.outputs_refs()
    return bool(outs) and all(r.geometry in ins for r in outs)


def remembered(nonfinite_slots: NonfiniteSlots) -> NonfiniteSlots:
    """``nonfinite_slots`` reading each op's outputs once: walks from several ops of one trace (every op that reads a
    NaN parameter lets it in) cross the same readers."""
    memo: dict[int, set[int] | None] = {}

    def slots(op: OpRecord) -> set[int] | None:
        if op.index not in memo:
            memo[op.index] = nonfinite_slots(op)
        return memo[op.index]
    return slots


def follow_nonfinite(trace: RankTrace, start: int, nonfinite_slots: NonfiniteSlots,
                     kept: set[int] | None = None) -> Flow:
    """Follow the NaN/Inf in op ``start``'s recorded outputs forward to an output that leaves the step, or to the ops
    that end them (see the module docstring). ``kept``: ops whose NaN/Inf earlier walks over the same trace found
    kept; a walk that reaches one stops there, and adds the ops on its own way to what it found kept."""
    first = nonfinite_slots(trace[start])
    if not first:
        return Flow(start)  # none to follow (or the trace cannot tell): nothing shows them discarded
    frontier: list[tuple[int, frozenset[int]]] = [(start, frozenset(first))]
    came_from: dict[int, int | None] = {start: None}
    ended: list[int] = []

    def found(at: int) -> Flow:
        if kept is not None:
            step: int | None = at
            while step is not None:  # every op between start and ``at`` passes the NaN/Inf on to where they stay
                kept.add(step)
                step = came_from.get(step)
        return Flow(at, tuple(sorted(ended)))

    while frontier:
        i, slots = heapq.heappop(frontier)
        readers = trace.consumers(i)
        for slot in sorted(slots):
            # the ops that compute from these values (an alias of the tensor computes nothing: its readers are
            # this tensor's own)
            names = trace.index.name
            if any(trace.missing_at(c) is not None for c in readers.get(slot, []) if aten.reads_values(names[c])):
                return found(i)  # a reader is missing from a damaged trace: nothing shows them discarded
            computing = [(c, trace[c]) for c in readers.get(slot, []) if aten.reads_values(names[c])]
            computing = [(c, reader) for c, reader in computing if not _same_view(reader)]
            if not computing:
                return found(i)  # read by no op of the step: it leaves the step
            for c, reader in computing:
                if c in came_from:
                    continue
                came_from[c] = i
                if len(came_from) > MAX_VISITS:
                    return found(c)
                if _python_nonfinite(reader.outputs):
                    return found(c)  # handed to Python: the user's code sees them
                held = nonfinite_slots(reader)
                if held is None:
                    return found(c)
                if held and kept is not None and c in kept:
                    return found(c)
                if held:
                    heapq.heappush(frontier, (c, frozenset(held)))
                else:
                    ended.append(c)
    return Flow(None, tuple(sorted(ended)))
