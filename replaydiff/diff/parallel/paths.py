"""Walks along a rank's data flow: the collective or own op a value passed through, partial inputs, draws alike on
every rank, and ops that only amplify their inputs' rounding."""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

import torch

from replaydiff import aten
from replaydiff.compare.layout import Layout, LayoutKind, ratio_text
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord
from replaydiff.diff.parallel.alignment import Side
from replaydiff.diff.parallel.mapping import map_tensor
from replaydiff.diff.parallel.arguments import differing_arguments
from replaydiff.diff.parallel.result import Mapped, MappedOp, RanksOnlyScale


def own_producer(side: Side, aligned: dict[int, int], index: int, stop: Callable[[OpRecord], bool],
                  limit: int = 32, ahead: bool = False) -> int | None:
    """The nearest op matching ``stop`` that a rank's op reads from through ops the single process does not run (its
    inputs' producers, walked back breadth first while they are the rank's own ops). ``ahead``: the nearest that
    reads the op's output instead, walked forward through the rank's own ops, views and copies (a clone before an
    in-place all-reduce)."""
    mine = set(side.ops) - set(aligned.values())
    todo, seen = [index], {index}
    while todo and len(seen) <= limit:
        i = todo.pop(0)
        near = [j for readers in side.trace.consumers(i).values() for j in readers] if ahead else \
            side.trace.producers(i).values()
        for p in near:
            if p is None or p in seen or p not in side.ops or (not ahead and p not in mine):
                continue
            if stop(side.ops[p]):
                return p
            if p in mine or (ahead and (aten.is_cheap(side.ops[p].name) or side.ops[p].name in COPIES)):
                seen.add(p)
                todo.append(p)
    return None


COPIES = frozenset({"aten.clone.default", "aten._to_copy.default", "aten.copy_.default"})


def collective_ahead(side: Side, aligned: dict[int, int], index: int) -> tuple[int, str] | None:
    """The nearest collective that reduces what a rank's op made, through views, copies and the rank's own ops."""
    c = own_producer(side, aligned, index, lambda op: aten.is_collective(op.name), limit=8, ahead=True)
    return None if c is None else (c, side.ops[c].name)


def collective_behind(side: Side, aligned: dict[int, int], index: int) -> tuple[int, str] | None:
    """The nearest collective a rank's op reads from through ops the single process does not run."""
    p = own_producer(side, aligned, index, lambda op: aten.is_collective(op.name))
    return None if p is None else (p, side.ops[p].name)


def collective_through(side: Side, aligned: dict[int, int], index: int, collective: int) -> list[int]:
    """The input positions of a rank's op through which it reads what ``collective`` made: the input is that
    collective's output, or made from it by ops the single process does not run."""
    mine = set(side.ops) - set(aligned.values())
    out = []
    for pos, p in sorted(side.trace.producers(index).items()):
        if p == collective or (p is not None and p in mine and p in side.ops and
                               own_producer(side, aligned, p, lambda op: op.index == collective) is not None):
            out.append(pos)
    return out


def _computes(op: OpRecord) -> bool:
    return not aten.is_cheap(op.name) and not aten.is_collective(op.name)


def computing_behind(side: Side, aligned: dict[int, int], index: int) -> str | None:
    """The nearest op that computes (not a view or copy) a rank's op reads from through ops the single process does
    not run, as 'name (#N on rank R, line)' (a backward op: the line of the forward op it belongs to)."""
    p = own_producer(side, aligned, index, _computes)
    return None if p is None else op_words(side, p)


def own_computing(side: Side, aligned: dict[int, int], index: int, limit: int = 32) -> list[int]:
    """Every op that computes among the ops a rank's op reads from through ops the single process does not run,
    nearest first (``own_producer``'s walk, not stopping at the first)."""
    mine = set(side.ops) - set(aligned.values())
    todo, seen, found = [index], {index}, []
    while todo and len(seen) <= limit:
        for p in side.trace.producers(todo.pop(0)).values():
            if p is None or p in seen or p not in mine:
                continue
            seen.add(p)
            todo.append(p)
            if _computes(side.ops[p]):
                found.append(p)
    return found


def op_words(side: Side, p: int) -> str:
    """A rank's op as 'name (#N on rank R, line)' (a backward op: 'the backward of' its forward op's line)."""
    op = side.ops[p]
    fwd = side.ops.get(op.forward_index) if op.phase == "backward" and op.forward_index is not None else None
    line = fwd.source if fwd is not None and fwd.source else op.source
    where = "" if not line else f", {'the backward of ' if fwd is not None else ''}{line}"
    return f"{op.name} (#{p} on rank {side.trace.rank}{where})"


def _uniform_scale(trace: RankTrace, op: OpRecord) -> Fraction | None:
    """The simple factor k (a ratio of small integers, not 1) with output 0 = k x one of the op's floating-point
    tensor inputs of its shape, element for element up to the dtype's rounding, as recorded; None when no input is
    so scaled (or the tensors are not stored)."""
    outs = op.outputs_refs()
    if not outs or not outs[0].stored or outs[0].meta or outs[0].uninitialised or \
            not outs[0].torch_dtype.is_floating_point or math.prod(outs[0].shape) == 0:
        return None
    out = trace.tensor(outs[0]).to(torch.float64)
    size = float(torch.linalg.vector_norm(out))
    eps = torch.finfo(outs[0].torch_dtype).eps
    for r in op.inputs():
        if not r.stored or r.meta or r.uninitialised or not r.torch_dtype.is_floating_point or \
                tuple(r.shape) != tuple(outs[0].shape):
            continue
        x = trace.tensor(r).to(torch.float64)
        den = float((x * x).sum())
        if den == 0:
            continue
        k = Fraction(float((out * x).sum()) / den).limit_denominator(64)
        if k > 0 and k != 1 and float(torch.linalg.vector_norm(out - float(k) * x)) <= 8 * eps * size:
            return k
    return None


def scale_behind(side: Side, aligned: dict[int, int], index: int, factor: Fraction | None,
                 world: int) -> RanksOnlyScale | None:
    """The nearest op that computes, among those a rank's op reads from through ops the single process does not
    run, when it multiplies its input by exactly ``factor`` (the factor the op parts by; None: by any simple
    factor, found on the rank's tensors): where that factor enters, named by the forward op it belongs to where it is
    a backward op; None otherwise."""
    p = own_producer(side, aligned, index, lambda op: not aten.is_cheap(op.name) and not aten.is_collective(op.name))
    if p is None:
        return None
    op = side.ops[p]
    k = _uniform_scale(side.trace, op)
    if k is None or (factor is not None and k != factor):
        return None
    fwd = side.ops.get(op.forward_index) if op.phase == "backward" and op.forward_index is not None else None
    at = fwd if fwd is not None and fwd.index not in set(aligned.values()) else op
    outs = at.outputs_refs()
    of_loss = at.phase == "forward" and fwd is not None and bool(outs) and math.prod(outs[0].shape) == 1
    return RanksOnlyScale(side.trace.rank, at.index, at.name, at.phase, at.source or (fwd or op).source, k, world,
                          of_loss)


def loss_scales(side: Side, aligned: dict[int, int], index: int, ref: RankTrace, passes: int = 1) -> str | None:
    """The scales a rank applies to its loss (the one-element forward value ``index`` the backward differentiates),
    found along the forward ops around it (what made it and what reads it): each op only the ranks run that
    multiplies by a plain factor, and each op both run whose factor on the rank is not the single process's (a
    division by a micro-batch count of 2 where the single process divides by 1), as 'name (#N on rank R, line):
    1/2' ('... where the single process's is 1'; the first over ``passes``, a rank's micro-batches, is said to be
    that count's), joined by '; '; None when there is none."""
    mine = set(side.ops) - set(aligned.values())
    theirs = {j: i for i, j in aligned.items()}
    todo, seen, said = [index], set(), []
    while todo and len(seen) <= 16:
        at = todo.pop(0)
        near = [p for readers in side.trace.consumers(at).values() for p in readers] + \
            [p for p in side.trace.producers(at).values() if p is not None]
        for p in [at] + near:
            if p in seen or p not in side.ops or side.ops[p].phase != "forward":
                continue
            seen.add(p)
            todo.append(p)
            op = side.ops[p]
            if not _computes(op) or math.prod(op.outputs_refs()[0].shape if op.outputs_refs() else (0,)) != 1:
                continue
            k = _uniform_scale(side.trace, op)
            if k is None:
                continue
            if p in mine:
                said.append((p, f"{op_words(side, p)}: {ratio_text(k)}"))
            elif p in theirs and (k_ref := _uniform_scale(ref, ref.op(theirs[p])) or Fraction(1)) != k:
                said.append((p, f"{op_words(side, p)}: {ratio_text(k)} where the single process's is "
                                f"{ratio_text(k_ref)}"))
    said.sort()
    count = next((k for k, (p, _) in enumerate(said) if passes > 1 and
                  _uniform_scale(side.trace, side.ops[p]) == Fraction(1, passes)), None)
    return "; ".join(w + (f" (1 over the {passes} micro-batches a rank accumulates)" if k == count else "")
                     for k, (_, w) in enumerate(said)) or None


def reduced_at(pos: int, rop: OpRecord, tops: list[OpRecord], tgts: list[RankTrace], side: Side,
                aligned: dict[int, int], ref: RankTrace, world: int, micro: int | None,
                mesh) -> tuple[tuple[int, str, str | None], Fraction] | None:
    """For an optimizer op's input that is partial as the reference's producer made it: when on the ranks it went
    through a collective (an all-reduce of the rank's own ops) and is whole on every rank at a factor other than 1,
    ((the collective's op number on the first rank, its name, its line), how many times the reference's it holds);
    else None."""
    p = tgts[0].producers(tops[0].index).get(pos)
    if p is None or p in set(aligned.values()):
        return None
    op = side.ops.get(p)
    found = (p, op.name) if op is not None and aten.is_collective(op.name) else collective_behind(side, aligned, p)
    if found is None or micro is not None:
        return None
    rref, trefs = rop.inputs()[pos], [t.inputs()[pos] for t in tops]
    m = map_tensor(ref, tgts, rref, trefs, "in", pos, world, None, None, mesh)
    if m is None or m.layout is None or m.layout.kind is not LayoutKind.REPLICATED or m.layout.factor == 1:
        return None
    return (found[0], found[1], side.ops[found[0]].source), 1 / m.layout.factor


def same_draws_of(ref: RankTrace, rop: OpRecord, tops: list[OpRecord], ranks: list[RankTrace]) -> bool:
    """Whether a random op's draws are the same on every rank where each rank holds a piece of the reference's
    (its shape is not the reference's): the same seed on every rank."""
    if len(tops) < 2:
        return False
    for pos, rref in enumerate(rop.outputs_refs()):
        trefs = [t.outputs_refs()[pos] if pos < len(t.outputs_refs()) else None for t in tops]
        if any(t is None or not t.stored or t.meta or t.uninitialised for t in trefs):
            continue
        if all(tuple(t.shape) == tuple(rref.shape) for t in trefs):
            continue  # every rank holds the whole draw: alike is right
        first = ranks[0].tensor(trefs[0])
        if first.numel() and all(tuple(t.shape) == tuple(first.shape) and torch.equal(r.tensor(t), first)
                                 for r, t in zip(ranks[1:], trefs[1:])):
            return True
    return False


def made_apart(producers: dict[int, int | None], top: OpRecord, rank: RankTrace, side: Side,
                aligned: dict[int, int], r_side: Side, not_aligned: set[int]) -> tuple[int, str, str] | None:
    """The first input of an op that the reference makes with a computing op the ranks do not run, and the first
    rank makes with computing ops of its own, no collective among them (a row-parallel Linear run as one addmm on
    one process and as mm then the bias on each rank, its sum never reduced): (position, the rank's last op that
    computes it as 'name (#N on rank R, line)', the reference's as '#N name'); None otherwise."""
    mine = rank.producers(top.index)
    for pos, p in sorted(producers.items()):
        q = mine.get(pos)
        if p is None or q is None or p not in not_aligned or aten.is_cheap(r_side.ops[p].name):
            continue
        if q in set(aligned.values()) or aten.is_collective(side.ops[q].name) or \
                collective_behind(side, aligned, q) is not None:
            continue
        op = side.ops[q]
        if aten.is_cheap(op.name):
            continue
        where = f", {op.source}" if op.source else ""
        return pos, f"{op.name} (#{q} on rank {side.trace.rank}{where})", f"#{p} {r_side.ops[p].name}"
    return None


def partial_input(producers: dict[int, int | None],
                   by_ref: dict[int, MappedOp]) -> tuple[int, Layout, int] | None:
    """The first input of an op that a partial output of an earlier aligned op feeds: (position, layout, op)."""
    for pos, p in sorted(producers.items()):
        if p is None or p not in by_ref:
            continue
        for t in by_ref[p].tensors:
            if t.kind == "out" and t.layout is not None and t.layout.kind is LayoutKind.PARTIAL:
                return pos, t.layout, p
    return None


def amplifies(rop: OpRecord, tops: list[OpRecord], tensors: list[Mapped], producers: dict[int, int | None],
               by_ref: dict[int, MappedOp], ranks: list[RankTrace], amplified: set[int],
               aligned: list[dict[int, int]]) -> bool:
    """Whether an op's outputs part from the reference's only by amplifying a rounding difference of its inputs:
    every input it reads is replicated at factor 1 (as mapped: from an earlier aligned op, or from outside the step),
    every rank's outputs have the reference's shapes, and every rank's op, replayed alone from its own recorded
    inputs, is right. Then each rank computed the reference's op from the reference's values up to rounding.
    ``aligned``: each of ``tops``' counterpart of every reference op."""
    theirs = [r.producers(top.index) for r, top in zip(ranks, tops)]
    for pos, p in producers.items():
        if any(mine.get(pos) != (None if p is None else a.get(p)) for mine, a in zip(theirs, aligned)):
            # on some rank the input comes from an op of its own (a collective, a scale one rank alone applies):
            # not the reference's value
            return False
        if p is None or p in amplified:  # an amplified value: every rank holds it alike, as its maker made sure
            continue
        made = by_ref.get(p)
        lay = None if made is None else next((t.layout for t in made.tensors if t.kind == "out"), None)
        if lay is None or lay.kind is not LayoutKind.REPLICATED or lay.factor != 1:
            return False
    if any(t.kind == "in" and (t.layout is None or t.layout.kind is not LayoutKind.REPLICATED or t.layout.factor != 1)
           for t in tensors):
        return False
    if differing_arguments(rop, tops):
        return False  # the ranks run it otherwise (another lr): right given its own arguments, not the reference's
    shapes = [r.shape for r in rop.outputs_refs()]
    if any([r.shape for r in top.outputs_refs()] != shapes for top in tops):
        return False  # a rank holds a part of the reference's value, not all of it
    from replaydiff.replay.policy import ReplayOptions
    from replaydiff.replay.result import Status
    from replaydiff.replay.runner import OpReplayer

    opts = ReplayOptions(device="cpu", precision="fp64")
    try:
        return all(OpReplayer(rt, opts).replay(top).status is Status.OK for rt, top in zip(ranks, tops))
    except Exception:  # an op replay cannot run: no evidence that it is right
        return False
