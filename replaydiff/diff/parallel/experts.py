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
"""
from __future__ import annotations

import dataclasses
import math

import torch

from replaydiff import aten
from replaydiff.compare.layout import Layout, LayoutKind, Splits, infer_layouts
from replaydiff.diff.align import module_key
from replaydiff.diff.parallel.alignment import Side
from replaydiff.diff.parallel.mapping import close_for, rel_l2
from replaydiff.diff.parallel.result import Mapped
from replaydiff.trace.exchange import exchange_of
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
    """{reference op: the rank that holds it} for expert parallelism: the ops of a module one rank alone runs, and
    the ops that read what such ops made, of one rank's experts and of no other rank's (an expert's gradient, the
    optimizer's update of its parameters, in the reference's order). Empty when every rank runs every module."""
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
    return held


def exchanges_of(t_sides: list[Side]) -> tuple[Splits, ...]:
    """The split sizes of the ranks' all-to-alls over every rank, each call's on every rank (the k-th call of each
    rank together): what each rank sends, then what each receives; distinct, in call order."""
    world = len(t_sides)
    per_rank = [[e for op in side.ops.values() if (e := exchange_of(op, world)) is not None] for side in t_sides]
    out: dict[Splits, None] = {}
    for calls in zip(*per_rank):
        out[tuple(c.sends for c in calls)] = None
        out[tuple(c.receives for c in calls)] = None
    return tuple(out)


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


def own_rows_index(tops: list[OpRecord], tgts: list[RankTrace], rop: OpRecord) -> bool:
    """An integer output each rank computes as an order of its own rows (argsort of its tokens' experts): on every
    rank a permutation of its input's positions, where the reference's input is longer than any rank's: each rank's
    index of its own values, not a piece of the reference's. (An expert choice, a count, a label is no permutation,
    and stays compared.)"""
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


def expert_reduced(m: Mapped, holder: int, index: int, name: str, line: str | None) -> str:
    """Why an expert's value parts where the rank that holds it reads what an all-reduce made: a gradient summed over
    ranks that hold other experts."""
    return (f"output {m.position} ({m.describe}), held by rank {holder} alone (the rank that holds this expert), maps "
            f"onto the reference's under no layout: on rank {holder} it reads what {name} (#{index} on rank {holder}"
            f"{', ' + line if line else ''}) made: an all-reduce over ranks that hold different experts sums this "
            f"expert's gradient with theirs; an expert's gradient is whole on its rank already (the all-to-all's "
            f"backward brought it every token's share): leave the experts' parameters out of the all-reduce")
