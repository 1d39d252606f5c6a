"""Expert parallelism: the ops one rank runs for the expert it holds, and the rows the ranks route to experts.

Under expert parallelism (a mixture-of-experts layer whose experts sit on different ranks) each rank groups its
tokens by the rank that holds their expert, sends each group there with an all-to-all (``all_to_all_single`` with
split sizes), runs its own experts on the rows it receives, and sends the results back the same way. The single
process holds every expert and runs them one after the other. So the reference's ops of an expert's module (its
forward and backward, and the optimizer's update of its parameters) have a counterpart on one rank only, which holds
the whole value: the rows from every rank routed to that expert, in rank order, are the single process's rows for it
when each rank keeps its tokens in order within a group (a stable sort). Those ops are held by that rank
(``LayoutKind.HELD``). The rows before the exchange (and their gradients after the exchange back) are routed
(``LayoutKind.ROUTED``): each rank's blocks, one per destination rank, with the all-to-all's split sizes, and the
reference's the same blocks taken over every rank in turn. The split sizes come from the all-to-alls the ranks ran
(``trace.exchange``), which replay checks chunk by chunk with the same reading.

With several experts on a rank, a rank's rows are grouped by expert within each destination, and the reference's
are grouped by expert over every rank: the routed blocks are one per expert, sized by the counts the ranks exchange
before the rows (an all-to-all of each rank's count per expert, whose sums per destination are the rows' split
sizes). Each rank regroups what it receives (by source rank, then expert) by expert and runs each of its experts on
its rows from every rank: the reference's per-expert pieces (an op's output per expert, the slice of a gradient one
expert reads) are held by the expert's rank, and a value of every expert's rows in expert order (the experts'
outputs joined, or one grouped GEMM over a stack of every expert's weights) is sharded on the expert dimension, the
rank's experts being consecutive. The offsets of a grouped GEMM (a cumulative sum of each expert's count) are each
rank's own, into its own rows: not compared (``own_rows_index``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from replaydiff import aten
from replaydiff.compare.layout import Layout, LayoutKind, Splits, infer_layouts
from replaydiff.diff.align import module_key
from replaydiff.diff.parallel.alignment import Side
from replaydiff.diff.parallel.mapping import close_for, map_tensor, rel_l2
from replaydiff.diff.parallel.paths import collective_behind, op_words, own_producer
from replaydiff.diff.parallel.result import Mapped
from replaydiff.trace.exchange import Exchange, exchange_of
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord, TensorRef


def held_modules(r_side: Side, t_sides: list[Side]) -> dict[str, int]:
    """{module path: the one rank that runs it} for the reference's modules that exactly one rank runs (an expert
    on the rank that holds it); empty unless at least two ranks each run a module no other rank runs."""
    runs: dict[str, set[int]] = {}
    for rank, side in enumerate(t_sides):
        for op in side.ops.values():
            key = module_key(op.module)
            if key:
                runs.setdefault(key, set()).add(rank)
    ours = {module_key(op.module) for op in r_side.ops.values()}
    held = {key: next(iter(ranks)) for key, ranks in runs.items() if len(ranks) == 1 and key in ours}
    return held if len(set(held.values())) > 1 else {}


def experts_of(ref: RankTrace, r_side: Side, t_sides: list[Side]) -> dict[int, int]:
    """{reference op: the rank that holds it} for expert parallelism: the ops of a module one rank alone runs, the
    ops that read what such ops made, of one rank's experts and of no other rank's (an expert's gradient, the
    optimizer's update of its parameters, in the reference's order), and the backward ops that only one rank's
    expert ops read. Empty when every rank runs every module."""
    modules = held_modules(r_side, t_sides)
    if not modules:
        return {}
    held: dict[int, int] = {}
    for i in sorted(r_side.ops):
        if i in r_side.skipped:
            continue
        key = module_key(r_side.ops[i].module)
        if key in modules:
            held[i] = modules[key]
            continue
        ranks = {held[p] for p in ref.producers(i).values() if p is not None and p in held}
        if len(ranks) == 1 and r_side.ops[i].phase in ("backward", "optimizer"):
            held[i] = ranks.pop()
    # and a backward op whose outputs only one rank's experts read (the slice of a gradient for one expert's rows,
    # cut from the gradient of every expert's rows joined): that rank runs it for its expert, no other rank does
    for i in sorted(r_side.ops, reverse=True):
        if i in held or i in r_side.skipped or r_side.ops[i].phase != "backward":
            continue
        readers = {j for js in ref.consumers(i).values() for j in js}
        ranks = {held.get(j) for j in readers}
        if readers and len(ranks) == 1 and None not in ranks:
            held[i] = ranks.pop()
    return held


def follow_experts(ref: RankTrace, r_side: Side, side: Side, pairs: dict[int, int], held: dict[int, int],
                   rank: int) -> dict[int, int]:
    """The alignment of ``rank`` corrected around its experts: a reference op (no expert's own) that reads what
    this rank's expert ops make, or makes what they read, is paired with the rank's one op of its name and phase
    that reads (or makes) what their counterparts do, at whatever input position (the reference joins every
    expert's outputs, the rank its own experts': the cat that the alignment by position pairs with the rank's
    regrouping of the rows it received, also a cat)."""
    mine = {p for p, r in held.items() if r == rank and p in pairs}
    if not mine:
        return pairs
    owner = {j: c for c, j in pairs.items()}
    for c in sorted(r_side.ops):
        if c in held or c in r_side.skipped:
            continue
        rop = r_side.ops[c]
        before = {pairs[p] for p in ref.producers(c).values() if p in mine}
        after = {pairs[q] for qs in ref.consumers(c).values() for q in qs if q in mine}
        if not before and not after:
            continue
        near = {j for b in before for js in side.trace.consumers(b).values() for j in js} if before else \
            {j for a in after for j in side.trace.producers(a).values() if j is not None}
        found = [j for j in sorted(near) if side.ops.get(j) is not None and side.ops[j].name == rop.name and
                 side.ops[j].phase == rop.phase and before <= set(side.trace.producers(j).values()) and
                 after <= {q for qs in side.trace.consumers(j).values() for q in qs}]
        if len(found) != 1 or pairs.get(c) == found[0]:
            continue
        j, old = found[0], pairs.get(c)
        other = owner.pop(j, None)
        if other is not None:  # the op that held it takes what this one held (or nothing)
            if old is not None:
                pairs[other], owner[old] = old, other
            else:
                del pairs[other]
        elif old is not None:
            del owner[old]
        pairs[c], owner[j] = j, c
    return pairs


def expert_outputs(rop: OpRecord, tops: list[OpRecord]) -> dict[int, tuple[int, int]]:
    """{reference output: (rank, the rank's output)} for an op that makes one output per expert (the rows of each,
    split apart) where each rank's counterpart makes one per expert it holds: the reference's output e is output
    e - r*k of rank r = e // k (k experts on a rank, rank r holding the r-th run of them), of the same shape. Empty
    for any other op."""
    outs, theirs = rop.outputs_refs(), [t.outputs_refs() for t in tops]
    k = len(theirs[0]) if theirs else 0
    if len(outs) < 2 or k == 0 or any(len(t) != k for t in theirs) or len(outs) != k * len(tops):
        return {}
    pieces = {e: (e // k, e % k) for e in range(len(outs))}
    if any(tuple(theirs[r][q].shape) != tuple(outs[e].shape) for e, (r, q) in pieces.items()):
        return {}
    return pieces


def expert_output(ref: RankTrace, tgts: list[RankTrace], rop: OpRecord, tops: list[OpRecord], pos: int,
                  piece: tuple[int, int], world: int, reads: float | None) -> Mapped | None:
    """Output ``pos`` of the reference (one expert's, ``expert_outputs``) against the output of the rank that holds
    the expert, said as held there."""
    rank, at = piece
    return held_tensor(map_tensor(ref, [tgts[rank]], rop.outputs_refs()[pos], [tops[rank].outputs_refs()[at]],
                                  "out", pos, 1, rop=rop, reads=reads), world, rank)


def exchanges_of(t_sides: list[Side]) -> tuple[Splits, ...]:
    """The split sizes of the ranks' all-to-alls over every rank, each call's on every rank (the k-th call of each
    rank together): what each rank sends, then what each receives; distinct, in call order. Then, where the ranks
    exchange their counts per expert before the rows they size (``expert_counts``), those counts: the blocks of
    each rank's rows by expert."""
    world = len(t_sides)
    per_rank = [[e for op in side.ops.values() if (e := exchange_of(op, world)) is not None] for side in t_sides]
    calls = list(zip(*per_rank))
    out: dict[Splits, None] = {}
    for call in calls:
        out[tuple(c.sends for c in call)] = None
        out[tuple(c.receives for c in call)] = None
    for k, call in enumerate(calls):
        counts = expert_counts([side.trace for side in t_sides], call, calls[k + 1:])
        if counts is not None:
            out[counts] = None
    return tuple(out)


def expert_counts(tgts: list[RankTrace], call: tuple[Exchange, ...], later: list[tuple[Exchange, ...]]
                  ) -> Splits | None:
    """Each rank's count of rows per expert, when ``call`` (one all-to-all on every rank) sends them: a 1-D integer
    tensor of world x k counts (k experts on a rank) whose sums over each destination's k are, on every rank, what
    a later all-to-all sends (the rows they count); None for any other exchange."""
    world = len(tgts)
    counts = []
    for tgt, c in zip(tgts, call):
        src = c.source
        if len(src.shape) != 1 or src.torch_dtype.is_floating_point or src.torch_dtype == torch.bool or \
                not src.stored or int(src.shape[0]) % world or not src.shape[0]:
            return None
        counts.append(tuple(int(v) for v in tgt.tensor(src).tolist()))
    if len({len(x) for x in counts}) != 1:
        return None
    per = len(counts[0]) // world
    sums = [tuple(sum(x[d * per:(d + 1) * per]) for d in range(world)) for x in counts]
    if any(all(c.sends == s for c, s in zip(rows, sums)) for rows in later):
        return tuple(counts)
    return None


def held_tensor(m: Mapped | None, world: int, rank: int) -> Mapped | None:
    """A tensor mapped from the one rank that holds it (``map_tensor`` over that rank alone), said as held there."""
    if m is None:
        return None

    def held(f: Layout) -> Layout:
        return Layout(LayoutKind.HELD, world, factor=f.factor, holder=rank)

    fits = tuple(held(f) for f in m.fits)
    return dataclasses.replace(m, layout=None if m.layout is None else held(m.layout), fits=fits, off=(),
                               offsets=None, sizes=None, alike=False)


def routed_tensor(ref: RankTrace, tgts: list[RankTrace], rref: TensorRef, trefs: list[TensorRef], m: Mapped,
                  exchanges: tuple[Splits, ...]) -> Mapped:
    """A tensor that fits no layout of its shapes, tried as rows routed by the ranks' all-to-alls: the routed
    layout that fits (at the simple factor that brings it closest), or ``m`` as it was."""
    if m.layout is not None or not exchanges:
        return m
    r = ref.tensor(rref)
    parts = [t.tensor(x) for t, x in zip(tgts, trefs)]
    fits = [f for f in infer_layouts(r, parts, close_for(r.dtype), exchanges) if f.kind is LayoutKind.ROUTED]
    if not fits:
        return m
    eps = torch.finfo(r.dtype).eps if r.dtype.is_floating_point else 1.0
    return dataclasses.replace(m, layout=fits[0], fits=tuple(fits), error=rel_l2(fits[0], parts, r) / eps, off=(),
                               offsets=None, sizes=None, alike=False)


def own_rows_index(tops: list[OpRecord], tgts: list[RankTrace], rop: OpRecord, ref: RankTrace) -> bool:
    """An integer output each rank computes as an order of its own rows (argsort of its tokens' experts): on every
    rank a permutation of its input's positions, where the reference's input is longer than any rank's: each rank's
    index of its own values, not a piece of the reference's. (An expert choice, a count, a label is no permutation,
    and stays compared.) Or each rank's offsets into its own rows (``own_offsets``)."""
    if own_offsets(tops, tgts, rop, ref):
        return True
    outs = rop.outputs_refs()
    if not outs or outs[-1].torch_dtype.is_floating_point or not rop.inputs() or aten.namespace(rop.name) != "aten":
        return False
    most = 0
    for t, tgt in zip(tops, tgts):
        ins, o = t.inputs(), t.outputs_refs()
        if not ins or not o or not o[-1].stored or o[-1].torch_dtype.is_floating_point or len(o[-1].shape) != 1:
            return False
        x = tgt.tensor(o[-1])
        if not torch.equal(x.sort().values, torch.arange(x.numel(), dtype=x.dtype)) or \
                x.numel() != math.prod(ins[0].shape):
            return False
        most = max(most, x.numel())
    return math.prod(rop.inputs()[0].shape) > most


def own_offsets(tops: list[OpRecord], tgts: list[RankTrace], rop: OpRecord, ref: RankTrace) -> bool:
    """An integer output that is, on each rank, the reference's sharded along dim 0 less the reference's value
    before the rank's slice: where each of the rank's experts' rows end in its own rows (a cumulative sum of its
    experts' counts, the offsets of a grouped GEMM), as the reference's are where every expert's rows end in all of
    them."""
    outs = rop.outputs_refs()
    if not outs or len(outs[-1].shape) != 1 or outs[-1].torch_dtype.is_floating_point or not outs[-1].stored:
        return False
    theirs = [t.outputs_refs() for t in tops]
    if any(not o or len(o[-1].shape) != 1 or not o[-1].stored for o in theirs) or \
            sum(int(o[-1].shape[0]) for o in theirs) != int(outs[-1].shape[0]):
        return False
    whole = ref.tensor(outs[-1]).to(torch.int64)
    at = 0
    for tgt, o in zip(tgts, theirs):
        n = int(o[-1].shape[0])
        before = int(whole[at - 1]) if at else 0
        if not torch.equal(tgt.tensor(o[-1]).to(torch.int64), whole[at:at + n] - before):
            return False
        at += n
    return True


def same_rows(ref: torch.Tensor, rows: torch.Tensor, close: Callable[[torch.Tensor, torch.Tensor], bool]) -> bool:
    """Whether ``rows`` are the rows (dim 0) of ``ref`` in some order, as a multiset: both sorted by their
    projection on one fixed direction in general position (rows that tie there are equal, as tokens of one id are),
    then close row for row."""
    if ref.dim() < 2 or tuple(rows.shape) != tuple(ref.shape) or not ref.shape[0]:
        return False
    a, b = rows.to(torch.float64).flatten(1), ref.to(torch.float64).flatten(1)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    direction = torch.randn(a.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return close(a[(a @ direction).argsort()], b[(b @ direction).argsort()])


def misrouted(ref: RankTrace, tgts: list[RankTrace], rop: OpRecord, tops: list[OpRecord], m: Mapped,
              side: Side, aligned: dict[int, int]) -> str | None:
    """Why an op's output parts where, joined over the ranks, it holds the reference's rows in another order and it
    reads (on ``side``'s rank, through the rank's own ops) rows an all-to-all brought back from the experts' ranks:
    the experts' results went back to other tokens than theirs. It names the rank's own op that made what the
    all-to-all sent (where the rank put its experts' results back in the order the rows came in). None otherwise."""
    outs = rop.outputs_refs()
    if m.kind != "out" or m.position >= len(outs) or not outs[m.position].stored or \
            not outs[m.position].torch_dtype.is_floating_point:
        return None
    theirs = [t.outputs_refs() for t in tops]
    if any(m.position >= len(o) or not o[m.position].stored for o in theirs):
        return None
    whole = ref.tensor(outs[m.position])
    parts = [tgt.tensor(o[m.position]) for tgt, o in zip(tgts, theirs)]
    if any(p.dim() != whole.dim() for p in parts) or \
            not same_rows(whole, torch.cat(parts), close_for(whole.dtype)):
        return None
    behind = collective_behind(side, aligned, tops[0].index)
    ex = None if behind is None else exchange_of(side.ops[behind[0]], len(tgts))
    if ex is None:
        return None
    sent = next((p for p in side.trace.producers(behind[0]).values()
                 if p is not None and p in side.ops and
                 any(o.version == ex.source.version for o in side.ops[p].outputs_refs())), None)
    if sent is not None and aten.is_cheap(side.ops[sent].name):
        sent = own_producer(side, aligned, sent, lambda op: not aten.is_cheap(op.name))
    rank = side.trace.rank
    line = side.ops[behind[0]].source
    made = "" if sent is None else f", which the ranks sent from what {op_words(side, sent)} made"
    return (f"output {m.position} ({m.describe}) maps onto the reference's under no layout, but the ranks hold the "
            f"reference's rows between them in another order: tokens got other tokens' expert results. On the "
            f"ranks it reads the rows {behind[1]} (#{behind[0]} on rank {rank}{', ' + line if line else ''}) brought "
            f"back from the experts' ranks{made}: the rows an expert's rank sends back must be in the order they "
            f"came in (by source rank, then expert), each expert's results cut by its own counts")


def experts_sharded(rop: OpRecord, tops: list[OpRecord], m: Mapped) -> bool:
    """Whether each rank's tensor is its piece of the reference's along dim 0, every other dim alike (the experts'
    weights stacked on the ranks, each rank holding its own experts': what a grouped GEMM reads)."""
    whole = (rop.outputs_refs() if m.kind == "out" else rop.inputs())
    theirs = [t.outputs_refs() if m.kind == "out" else t.inputs() for t in tops]
    if m.position >= len(whole) or any(m.position >= len(x) for x in theirs):
        return False
    shape = tuple(whole[m.position].shape)
    shapes = [tuple(x[m.position].shape) for x in theirs]
    return len(shape) > 1 and all(len(s) == len(shape) and s[1:] == shape[1:] and s[0] < shape[0] for s in shapes) \
        and sum(s[0] for s in shapes) == shape[0]


def expert_reduced(m: Mapped, holder: int | None, index: int, name: str, line: str | None, rank: int) -> str:
    """Why an expert's value parts where the rank that holds it (``holder``; None: each rank holds its experts' part
    of the reference's, ``experts_sharded``) reads what an all-reduce made: a gradient summed over ranks that hold
    other experts."""
    at = f"#{index} on rank {rank}{', ' + line if line else ''}"
    if holder is None:
        return (f"output {m.position} ({m.describe}), each rank holding its own experts' part (dim 0), maps onto "
                f"the reference's under no layout: on rank {rank} it reads what {name} ({at}) made: an all-reduce "
                f"over ranks that hold different experts sums their experts' gradients with this rank's; each "
                f"rank's experts' gradient is whole on its rank already (the all-to-all's backward brought it every "
                f"token's share): leave the experts' parameters out of the all-reduce")
    return (f"output {m.position} ({m.describe}), held by rank {holder} alone (the rank that holds this expert), maps "
            f"onto the reference's under no layout: on rank {holder} it reads what {name} ({at}) made: an all-reduce "
            f"over ranks that hold different experts sums this expert's gradient with theirs; an expert's gradient is "
            f"whole on its rank already (the all-to-all's backward brought it every token's share): leave the "
            f"experts' parameters out of the all-reduce")
