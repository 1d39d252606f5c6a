"""Pairing each rank's ops with the single process's: keys that hold across layouts, micro-batches, and the
alignment corrected by the data flow."""
from __future__ import annotations

import functools

from replaydiff import aten
from replaydiff.diff.align import OpKeys, align, op_keys
from replaydiff.errors import UsageError
from replaydiff.trace.placements import read_notes
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord


def makes_layout(name: str) -> bool:
    """A collective: how a parallel run makes and rejoins its layouts."""
    return aten.is_collective(name)


def layout_keys(op: OpRecord) -> OpKeys:
    """Alignment keys that hold across layouts: the strict key has each tensor's number of dimensions where
    ``op_keys`` has its shape (a rank's shard and the single process's whole tensor differ in shape, and a square
    shard would pair with an unrelated op of that square shape)."""
    k = op_keys(op)
    ins = tuple(len(r.shape) for r in op.inputs())
    outs = tuple(len(r.shape) for r in op.outputs_refs())
    return OpKeys(k.index, (*k.loose, ins, outs), k.loose)


class Side:
    """One rank's recorded ops and their alignment keys, read once. ``skip_collectives``: a reference that is a
    parallel run itself, whose collectives rejoin its own layout and have no counterpart in the target's."""

    def __init__(self, trace: RankTrace, skip_collectives: bool = False) -> None:
        self.trace = trace
        self.ops: dict[int, OpRecord] = {}
        self.keys: list[OpKeys] = []
        self.skipped: set[int] = set()
        for op in trace:
            self.ops[op.index] = op
            # profiler markers compute nothing, and as anchors they pair FSDP's and DDP's record_function ranges with
            # the single process's few, pulling the ops between them apart: they are left out of the alignment
            if aten.is_marker(op.name) or (skip_collectives and makes_layout(op.name)):
                self.skipped.add(op.index)
            else:
                self.keys.append(layout_keys(op))

    @functools.cached_property
    def notes(self) -> list:
        """DTensor's placements as the recorder noted them on this rank, read once (the layouts and the mesh use
        them)."""
        return read_notes(self.trace.root)


def backward_passes(side: Side) -> list[int]:
    """The last op of each run of backward ops, in order: one per forward-backward pass (micro-batch)."""
    ends: list[int] = []
    inside = False
    for k in side.keys:
        back = side.ops[k.index].phase == "backward"
        if back:
            if inside:
                ends[-1] = k.index
            else:
                ends.append(k.index)
        inside = back
    return ends


def micro_batches_of(r_side: Side, t_sides: list[Side]) -> dict[int, int]:
    """When the single process runs the global batch as gradient-accumulation micro-batches, world x k of them, and
    each rank k passes (k = 1: one micro-batch per rank; k > 1: each rank accumulates too): {op of micro-batch m:
    m // k} for every op up to the last backward (a micro-batch's ops run from the end of the previous one's backward
    to the end of its own), micro-batch m standing for pass m % k of rank m // k (the global batch's rows in order);
    the ops after it (the optimizer step) are every rank's. The ops micro-batch 0 runs before its first op that
    micro-batch 1 runs too (the whole batch taken, before it is cut into micro-batches) are no rank's: -1. Empty when
    the reference runs as many passes as each rank, or fewer. A UsageError for any other count."""
    ends = backward_passes(r_side)
    theirs = {len(backward_passes(t)) for t in t_sides}
    if len(ends) <= 1 or theirs == {len(ends)} or len(ends) < max(theirs):
        return {}
    world = len(t_sides)
    per = min(theirs)
    if len(theirs) != 1 or len(ends) != world * per:
        raise UsageError(
            f"the single process runs {len(ends)} forward-backward passes (gradient-accumulation micro-batches) and "
            f"each of the {world} ranks {'/'.join(map(str, sorted(theirs)))}: the ranks' passes are mapped onto "
            f"micro-batches only when there are as many micro-batches as ranks times each rank's passes, every rank "
            f"running as many; diff one rank op by op with --rank N")
    micro: dict[int, int] = {}
    m = 0
    for k in r_side.keys:
        if k.index > ends[-1]:
            break
        micro[k.index] = m
        if k.index == ends[m]:
            m += 1
    # by shapes: the micro-batches' ops have the same ones, which the whole batch's do not
    keys = [[op_keys(r_side.ops[k.index]) for k in r_side.keys if micro.get(k.index) == m] for m in (0, 1)]
    common = align(keys[0], keys[1]).pairs
    start = min((a for a, _ in common), default=keys[0][0].index)
    return {i: -1 if m == 0 and i < start else m // per for i, m in micro.items()}


def rank_passes(r_side: Side, t_sides: list[Side]) -> int:
    """k when the reference runs the global batch as one forward-backward pass and every rank runs its share of it
    as the same k > 1 passes (gradient accumulation on the ranks: ``no_sync()`` over k micro-batches); 1 otherwise.
    """
    theirs = {len(backward_passes(t)) for t in t_sides}
    return theirs.pop() if len(backward_passes(r_side)) == 1 and len(theirs) == 1 and min(theirs) > 1 else 1


def pass_keys(side: Side) -> list[list[OpKeys]]:
    """A rank's alignment keys cut into its forward-backward passes: pass j runs from the end of pass j-1's backward
    to the end of its own (the first pass from the rank's first op); what runs after the last backward (the
    optimizer step) is in none."""
    ends = backward_passes(side)
    out: list[list[OpKeys]] = [[] for _ in ends]
    j = 0
    for k in side.keys:
        if j == len(ends):
            break
        out[j].append(k)
        if k.index == ends[j]:
            j += 1
    return out


def follow_data(ref: RankTrace, r_side: Side, side: Side, pairs: dict[int, int],
                 free: set[int] = frozenset()) -> dict[int, int]:
    """The alignment corrected by the data flow: when the op a rank's counterpart of reference op ``c`` reads an
    input from is not the counterpart of the reference's producer of that input, but an op of the same name the
    rank runs on its own, that op is the counterpart. A rank that splits the batch into every rank's piece
    (``tensor_split(x, world)[rank]``) runs one slice per rank; the one it reads is its counterpart of the single
    process's slice, which the alignment by position alone pairs with the first. An op of ``free`` the alignment
    left unpaired is paired the same way (a micro-batch's slice of the labels, taken where the rank takes its slices
    of the whole batch before the forward)."""
    taken = set(pairs.values())
    for _ in range(4):  # to a fixed point: a correction can free the op an earlier one wanted
        moved = False
        for c in sorted(pairs):
            rp = ref.producers(c)
            tp = side.trace.producers(pairs[c])
            for pos, p in rp.items():
                q = tp.get(pos)
                if p is None or q is None or pairs.get(p) == q or q in taken or (p not in pairs and p not in free):
                    continue
                if side.ops.get(q) is None or side.ops[q].name != r_side.ops[p].name:
                    continue
                taken.discard(pairs.get(p))
                pairs[p] = q
                taken.add(q)
                moved = True
        moved = follow_readers(ref, r_side, side, pairs, taken) or moved
        if not moved:
            break
    return pairs


def follow_readers(ref: RankTrace, r_side: Side, side: Side, pairs: dict[int, int], taken: set[int]) -> bool:
    """The same correction from the other end: a reference op whose counterpart does not read the counterparts of
    what it reads (or that has none) is paired with the one op of its name and phase that does, read for read; if
    another reference op held that op without reading as it does, the two swap. The backward of a Linear with its
    bias runs as one ``addmm``'s on one process and as ``mm``'s then the bias's on each rank (a row-parallel layer):
    the same ``t`` and ``mm`` ops in another order, which the alignment by position pairs crosswise (the weight's
    transpose with the gradient's, both of one shape)."""
    owner = {j: c for c, j in pairs.items()}

    def known(c: int) -> list[tuple[int, int]]:
        """(input position, the counterpart of its producer) for each input of ``c`` whose producer is paired."""
        return [(pos, pairs[p]) for pos, p in ref.producers(c).items() if p is not None and p in pairs]

    def reads_as(j: int, reads: list[tuple[int, int]]) -> bool:
        """Whether ``j`` reads what ``reads`` says (at least one input known, none other)."""
        tp = side.trace.producers(j)
        return bool(reads) and all(tp.get(pos) == q for pos, q in reads)

    moved = False
    for c in sorted(r_side.ops):
        rop = r_side.ops[c]
        reads = known(c)
        if c in r_side.skipped or not reads or (c in pairs and reads_as(pairs[c], reads)):
            continue
        found = {j for _, q in reads for readers in side.trace.consumers(q).values() for j in readers
                 if side.ops.get(j) is not None and side.ops[j].name == rop.name and side.ops[j].phase == rop.phase
                 and reads_as(j, reads)}
        if len(found) != 1:
            continue
        j = found.pop()
        other = owner.get(j)
        if other is not None and reads_as(j, known(other)):
            continue  # held by the op it belongs to
        mine = pairs.get(c)
        if other is not None:  # the other takes what this one held (or nothing); it is checked again next pass
            if mine is not None:
                pairs[other] = mine
                owner[mine] = other
            else:
                del pairs[other]
        elif mine is not None:
            taken.discard(mine)
            del owner[mine]
        taken.add(j)
        pairs[c] = j
        owner[j] = c
        moved = True
    return moved
