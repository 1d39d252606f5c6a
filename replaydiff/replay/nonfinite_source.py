"""Where NaN/Inf that a replayed op reads from an op replay did not run were first recorded: walked back through the
ops the recording kept with statistics only.

A zoom-in (``record --module``/``--op``) replays a few ops; the others keep the statistics of their tensors (NaN and
Inf counts among them). The first replayed op to read NaN/Inf that no replayed op computed may sit far downstream of
where they appeared: a ``mm`` of the backward reads them from ``native_layer_norm_backward``, which read them from
the forward's ``native_layer_norm``, which made them from an input of 1e36. Naming the backward op that handed them
over says where replay met them, not where they came from. So the walk goes back from that op through every input
whose recorded statistics (or stored data) hold NaN/Inf, to the op that computed it (through views, which compute
nothing), as long as that op was not replayed either (a replayed one's own result says where its NaN/Inf came
from), and names the earliest op it reaches, in the order ops ran: the first whose recorded output holds them. That
op made them from inputs that hold none, or took them in through an input written outside the trace.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from replaydiff import aten
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import TensorRef

# Ops visited by one walk back before it stops (and names the earliest reached so far): NaN that spread through a
# large backward pass touch many ops, and the earliest is found long before the walk runs out.
MAX_VISITS = 20_000


def computed_by(trace: RankTrace, producer: int | None) -> int | None:
    """The op that computed the value op ``producer`` wrote: ops that compute no new value (a view, ``detach``,
    ``lift_fresh`` of a tensor made outside the dispatcher) are followed back to what they read. None: the value was
    written outside the trace."""
    while producer is not None and aten.is_cheap(trace[producer].name):
        producer = trace.producers(producer).get(0)
    return producer


@dataclass(frozen=True)
class NonfiniteSource:
    """Op ``index``, not replayed, is the earliest (in the order ops ran) whose recorded outputs hold the NaN/Inf a
    replayed op read: ``nan`` and ``inf`` of them. ``position``: its input that held them already, written outside
    the trace; None with ``made`` where its inputs hold none (it made them), or with ``argument`` where it was passed
    them as a number; none of these where it read them from a replayed op or the trace cannot tell what its inputs
    held."""

    index: int
    nan: int
    inf: int
    position: int | None = None
    made: bool = False
    argument: str | None = None  # a NaN/Inf number it was passed ("inf": fill_(inf)), its inputs holding none


def nonfinite_counts_of(trace: RankTrace, ref: TensorRef) -> tuple[int, int] | None:
    """(NaN, Inf) in a recorded floating tensor: from its stored data, else its statistics; None where the trace
    holds neither (or it is no floating tensor, or uninitialised memory)."""
    if not aten.floating_dtype(ref.dtype) or ref.uninitialised or ref.zero:
        return None
    if ref.stored and not ref.meta:
        t = trace.tensor(ref)
        nan = int(torch.isnan(t).sum())
        return nan, int((~torch.isfinite(t)).sum()) - nan
    s = ref.stats
    return None if s is None else (int(s.nan or 0), int(s.inf or 0))


def _held(counts: tuple[int, int] | None) -> bool:
    return counts is not None and (counts[0] > 0 or counts[1] > 0)


def first_recorded(trace: RankTrace, start: int, memo: dict[int, int] | None = None) -> NonfiniteSource | None:
    """Walk back from op ``start`` (not replayed, its output holds NaN/Inf a replayed op read) to the earliest op,
    not replayed, whose recorded output holds them (see the module docstring). None when ``start`` was replayed.
    ``memo``: op -> the earliest op its NaN/Inf came through, kept across the walks over one trace (every op of a
    backward pass that reads them asks, and their walks cross the same ops)."""
    if trace[start].data_left_out is None:
        return None
    first = _earliest(trace, start, {} if memo is None else memo)
    nan = inf = 0
    for ref in trace[first].outputs_refs():
        counts = nonfinite_counts_of(trace, ref)
        if counts is not None:
            nan, inf = nan + counts[0], inf + counts[1]
    position, unclear = None, False
    producers = trace.producers(first)
    for k, ref in enumerate(trace[first].inputs()):
        counts = nonfinite_counts_of(trace, ref)
        if counts is None:
            unclear = unclear or (aten.floating_dtype(ref.dtype) and not ref.uninitialised and not ref.zero)
            continue
        if not _held(counts):
            continue
        p = computed_by(trace, producers.get(k))
        if p is None:
            position = k if position is None else position
        else:
            unclear = True  # from a replayed op (its own result says where they came from), or past the walk's end
    op = trace[first]
    argument = next((repr(x) for x in (*op.args, *op.kwargs.values()) if isinstance(x, float) and not math.isfinite(x)),
                    None)
    if argument is not None and position is None and not unclear:  # fill_(inf): passed in as a number, not made
        return NonfiniteSource(first, nan, inf, argument=argument)
    return NonfiniteSource(first, nan, inf, position, made=position is None and not unclear)


def _sources(trace: RankTrace, i: int) -> list[int]:
    """The ops replay did not run that computed the inputs of op ``i`` holding NaN/Inf."""
    out = []
    producers = trace.producers(i)
    for k, ref in enumerate(trace[i].inputs()):
        if not _held(nonfinite_counts_of(trace, ref)):
            continue
        p = computed_by(trace, producers.get(k))
        if p is not None and trace[p].data_left_out is not None:
            out.append(p)
    return out


def _earliest(trace: RankTrace, start: int, memo: dict[int, int]) -> int:
    """The earliest op reached from ``start`` through ``_sources`` (``start`` itself where none), each op's answer
    kept in ``memo``. Writers come before readers, so the walk has no cycle; it is iterative (a backward pass is
    deep)."""
    sources: dict[int, list[int]] = {}
    todo = [start]
    while todo:
        i = todo[-1]
        if i in memo:
            todo.pop()
            continue
        if i not in sources:  # first visit: look at its inputs, then at theirs before answering for it
            sources[i] = _sources(trace, i) if len(sources) < MAX_VISITS else []
            todo.extend(p for p in sources[i] if p not in memo)
            continue
        todo.pop()
        memo[i] = min([i, *(memo.get(p, p) for p in sources[i])])
    return memo[start]
