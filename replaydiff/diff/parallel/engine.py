"""The mapping of a parallel run onto the single process, op by op in the reference's order (see the package)."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from fractions import Fraction
from typing import Callable

from replaydiff import aten
from replaydiff.compare.layout import KINDS, LayoutKind, ratio_text
from replaydiff.diff.align import align
from replaydiff.errors import UsageError
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord, TensorRef
from replaydiff.diff.parallel.arguments import arguments_text, differing_arguments
from replaydiff.diff.parallel.rows import PICKS, rows_picked, same_rows_on_every_rank, same_rows_reordered
from replaydiff.diff.parallel.alignment import (Side, backward_passes, follow_data, makes_layout, micro_batches_of,
                                                pass_keys, rank_passes)
from replaydiff.diff.parallel.declared import declared_on, declared_output, mesh_of
from replaydiff.diff.parallel.experts import (exchanges_of, experts_of, expert_output, expert_outputs,
                                              expert_reduced, experts_sharded, follow_experts, held_tensor,
                                              misrouted, own_rows_index, routed_tensor)
from replaydiff.diff.parallel.factors import legit_factors, pick_legit
from replaydiff.diff.parallel.mapping import map_tensor, measured_reads, reordered_input
from replaydiff.diff.parallel.means import unequal_counts
from replaydiff.diff.parallel.paths import (amplifies, collective_ahead, collective_behind, collective_through,
                                            computing_behind, loss_scales, made_apart, op_words, own_computing,
                                            partial_input, reduced_at, same_draws_of, scale_behind)
from replaydiff.diff.parallel.refusals import refuse_point_to_point, refuse_sub_groups
from replaydiff.diff.parallel.result import Departure, Mapped, MappedOp, ParallelDeparture, ParallelDiff
from replaydiff.diff.parallel.settings import differing_settings
from replaydiff.diff.parallel.shards import same_shard_cause
from replaydiff.diff.parallel.sinks import departure_of, is_sink, restored_by
from replaydiff.diff.parallel.words import batch_warning_of, earlier_step, family, why_inputs, why_scaled


BETWEEN = "between backward and step"  # a MappedOp's phase for the work after backward(), before step()


def is_parallel_pair(ref_world: int, ref_ranks: list[int], target_world: int, target_ranks: list[int]) -> bool:
    """A single-process reference against every rank of a job of world size > 1: the case mapped here."""
    return ref_world <= 1 and len(ref_ranks) == 1 and target_world > 1 and target_ranks == list(range(target_world))


def diff_parallel(ref: RankTrace, targets: list[RankTrace],
                  progress: Callable[[int], None] | None = None, cut_short: bool = False,
                  full_world: int | None = None) -> ParallelDiff:
    """Map every rank of ``targets`` (rank order, world size ``len(targets)``) onto the single-process ``ref``;
    ``cut_short``: a side was cut short, so ops missing on the ranks are no sign of another program.
    ``full_world``: ``ref`` is one rank of a parallel run and ``targets`` the ranks of a run of this world size
    that stand for it (``diff_parallel_groups``)."""
    world = len(targets)
    r_side = Side(ref, skip_collectives=full_world is not None)
    t_sides = [Side(t) for t in targets]
    mesh = mesh_of(t_sides[0], world) if full_world is None else None  # a 2-D DeviceMesh DTensor declared
    refuse_sub_groups(t_sides[0], full_world or world, mesh)
    refuse_point_to_point([r_side, *t_sides])
    owner = micro_batches_of(r_side, t_sides)  # a micro-batch's op -> the rank whose ops it maps onto
    # expert parallelism: an expert's op -> the one rank that holds the expert; the all-to-alls' split sizes
    expert_ranks = experts_of(ref, r_side, t_sides) if not owner and full_world is None else {}
    exchanges = exchanges_of(t_sides) if not owner and full_world is None else ()
    reduced_with = frozenset(op.collective.reduce_op for side in t_sides for op in side.ops.values()
                             if op.collective is not None and op.collective.reduce_op)
    # Gradient accumulation on the ranks: each runs its share of the global batch as ``passes`` forward-backward
    # passes where the reference runs one. The reference's ops up to the end of its backward then stand for every
    # rank's every pass: one part per (rank, pass), rank-major, the order in which the passes' rows make the global
    # batch (a rank's share cut into its micro-batches in order); the gradient a rank accumulates over its passes is
    # their sum, so a partial value is the sum over all the parts. The ops after (the optimizer step) are every
    # rank's, as without accumulation.
    passes = 1 if owner or full_world is not None else rank_passes(r_side, t_sides)
    region_end = backward_passes(r_side)[-1] if passes > 1 else -1
    # maps[p]: part p's counterpart of each reference op; parts 0..world-1 are the ranks, then the (rank, pass) parts
    rank_of = list(range(world)) + ([r for r in range(world) for _ in range(passes)] if passes > 1 else [])
    maps: list[dict[int, int]] = []
    # the reference's micro-batches each rank's passes stand for (1 each, or k when the ranks accumulate too)
    per_rank = len(backward_passes(r_side)) // world if owner else 0
    out = ParallelDiff(world, len(r_side.keys), 0, 0, micro_batches=world * per_rank,
                       rank_micro_batches=passes if passes > 1 else 0)
    for rank, side in enumerate(t_sides):
        keys = [k for k in r_side.keys if owner.get(k.index, rank) == rank and
                expert_ranks.get(k.index, rank) == rank and k.index > region_end]
        theirs = side.keys if passes == 1 else [k for k in side.keys if k.index > backward_passes(side)[-1]]
        al = align(keys, theirs)
        maps.append(follow_data(ref, r_side, side, dict(al.pairs), {k.index for k in keys} if owner else set()))
        if expert_ranks:
            maps[-1] = follow_experts(ref, r_side, side, maps[-1], expert_ranks, rank)
    if passes > 1:
        region = [k for k in r_side.keys if k.index <= region_end]
        for side in t_sides:
            maps += [follow_data(ref, r_side, side, dict(align(region, keys).pairs)) for keys in pass_keys(side)]
    own_ops = []  # each rank's ops that stand for no reference op, by name
    for rank, side in enumerate(t_sides):
        mine = set().union(*(m.values() for p, m in enumerate(maps) if rank_of[p] == rank))
        own_ops.append(Counter(op.name for j, op in side.ops.items() if j not in mine and not aten.is_marker(op.name)))
        out.layout_ops.update(own_ops[-1])
    # what some ranks run and others do not (a scale one rank alone applies) is no layout's work, which every rank
    # does alike
    out.uneven_ops = {name: tuple(c[name] for c in own_ops) for name in out.layout_ops
                      if len({c[name] for c in own_ops}) > 1}

    def parts_of(i: int) -> list[int]:
        """The parts whose ops stand for reference op ``i``: a micro-batch's rank, every (rank, pass), or every
        rank."""
        if i in owner:
            return [owner[i]]
        if i in expert_ranks:
            return [expert_ranks[i]]
        return list(range(world, len(maps))) if i <= region_end else list(range(world))
    declared = [declared_on(side) for side in t_sides]  # DTensor's placements on each rank, where recorded
    departed: set[int] = set()  # reference ops that part from the reference, the first and what inherits it
    drawn: set[int] = set()  # random ops, and ops that part only because they read what random ops drew
    seen_inputs: set = set()
    outside: dict[int, float] = {}  # the error of each value from outside the step, by storage version, as mapped
    step_views: set[int] = set()
    first: tuple[MappedOp, Mapped, Departure, str] | None = None
    within: ParallelDeparture | None = None  # after inputs that differ: the first op that parts with agreeing inputs
    differing: set[int] = set()  # the versions of the step's inputs that map under no layout at factor 1
    carriers: set[int] = set()  # reference ops that read, through the data flow, what a differing step input made
    by_ref: dict[int, MappedOp] = {}  # the ops mapped so far, by reference op number
    coincident: set[int] = set()  # parted values held whole on every rank that fit as partial sums too (see below)
    shuffled: set[int] = set()  # ops that part only by reading a batch dealt out to the ranks in another order
    orders: dict[int, tuple[int, ...]] = {}  # the orders the ranks hold the step's batches in, by their rows
    inherited = 0
    # every op that parts reading nothing that parted before it (the first among them is ``first``), in order, and
    # for each op that parts the roots it descends from: a sink's parting is traced back to where it entered
    roots: list[tuple[MappedOp, Mapped, Departure, str]] = []
    origin: dict[int, frozenset[int]] = {}
    sinks: list[int] = []  # the compared ops whose values the job keeps (sinks.py)
    changes: list[tuple[MappedOp, Mapped, Departure, str]] = []  # ops that part reading what parted, at a factor
    applied: dict[int, Fraction] = {}  # the factor each root or change applies (what it reads over what it holds)
    via: dict[int, str | None] = {}  # the ranks' own computing op each root or change reads from (computing_behind)
    # The factor of the loss the backward differentiates: that of the last partial value the forward made before
    # it (a per-rank mean: 1/world; a summed loss: 1); none (a loss every rank computes whole): 1. Not simply the
    # last forward value: backward() makes the gradient's seed (ones_like) first, recorded in the forward.
    last_forward: Fraction | None = None
    loss: Fraction | None = None
    in_backward = False
    # the forward op whose factor the backward takes (``last_forward``'s), and the one of the backward begun last:
    # what the backward computes descends from that loss, and so does a sink's parting from a loss scaled there
    last_forward_op: int | None = None
    loss_op: int | None = None
    # the work between the last backward op and the optimizer's first (clipping, the gradients' division): the
    # recorder phases it forward, as any op outside backward() and step(); the diff says where it sits
    backward_ops = [i for i, op in r_side.ops.items() if op.phase == "backward"]
    optimizer_ops = [i for i, op in r_side.ops.items() if op.phase == "optimizer"]
    between = (max(backward_ops), min(optimizer_ops)) if backward_ops and optimizer_ops and \
        max(backward_ops) < min(optimizer_ops) else None
    # with micro-batches on both sides, the reference's gradient accumulated in place over micro-batches of several
    # ranks' shares (written into what another rank's micro-batch made) stands for no rank's: the ranks sum their
    # shares' in the all-reduce
    across: set[int] = set()
    for i in sorted(owner) if per_rank > 1 else ():
        p = ref.producers(i).get(0)
        if owner[i] >= 0 and r_side.ops[i].phase == "backward" and r_side.ops[i].writes and p is not None and \
                r_side.ops[p].phase == "backward" and (p in across or owner.get(p, -1) not in (owner[i], -1)):
            across.add(i)
    not_run = {i for i in r_side.ops if (owner[i] if i in owner else None) == -1 or i in across or
               not all(i in maps[p] for p in parts_of(i))}
    for n, i in enumerate(sorted(r_side.ops)):
        if progress is not None and n % 64 == 63:
            progress(64)
        if i in r_side.skipped or i in not_run:
            # not compared (a collective of a parallel reference, an op some rank does not run): what it makes
            # descends from what it reads, so that a sink is traced back through it
            came = frozenset().union(*(origin[p] for p in ref.producers(i).values() if p is not None and p in origin))
            if came:
                origin[i] = came
        if i in r_side.skipped:
            continue
        if differing:
            # it descends, through the reference's data flow, from a step input that differs (or an op that parted)
            made_by = ref.producers(i)
            if any(p is not None and (p in carriers or p in departed) for p in made_by.values()) or \
                    any(made_by.get(pos) is None and r.version in differing
                        for pos, r in enumerate(r_side.ops[i].inputs())):
                carriers.add(i)
        if i in not_run:
            out.not_aligned.append(i)
            continue
        own = parts_of(i)  # the parts whose ops stand for it
        out.aligned += 1
        rop = r_side.ops[i]
        tops = [t_sides[rank_of[p]].ops[maps[p][i]] for p in own]
        tgts = [targets[rank_of[p]] for p in own]
        # the first part's rank, side and counterparts: where the words look for a rank's own ops
        lead_rank, lead_side, lead_map = rank_of[own[0]], t_sides[rank_of[own[0]]], maps[own[0]]
        micro = owner.get(i)
        holder = expert_ranks.get(i)  # the one rank that holds this expert's op

        def mapped(rref: TensorRef, trefs: list[TensorRef], kind: str, pos: int, declared,
                   rop: OpRecord | None = None, reads: float | None = None) -> Mapped | None:
            """One tensor of the op through the layouts that fit: held by its expert's rank, or over the ranks (rows
            routed to experts when no layout of their shapes fits). ``rop``, ``reads``: an output's op and the
            error measured on what it reads, which its limit counts (mapping.map_tensor)."""
            if holder is not None:
                return held_tensor(map_tensor(ref, tgts, rref, trefs, kind, pos, 1, rop=rop, reads=reads), world,
                                   holder)
            m = map_tensor(ref, tgts, rref, trefs, kind, pos, world, micro, declared, mesh,
                           per_rank if micro is not None else len(own) // world, rop, reads, orders, reduced_with)
            if m is not None and m.layout is not None and m.layout.order is not None:
                orders.setdefault(len(m.layout.order), m.layout.order)
            return m if m is None or not exchanges else routed_tensor(ref, tgts, rref, trefs, m, exchanges)
        random = aten.draws(rop.name, rop.args, rop.kwargs)
        producers = ref.producers(i)
        # a view of the step's inputs or of a collective's buffer on a reference rank: ``tensor_split(x, world)``
        # cuts every rank's slice of the batch, which the target's ranks cut otherwise (and the trace's data flow
        # links each slice to the one before it): its inputs are compared, its outputs where an op that computes
        # reads them
        # (a batch drawn inside the step, by a random op every rank runs alike, is cut the same way)
        step_view = full_world is not None and aten.is_cheap(rop.name) and \
            all(p is None or p in step_views or p in r_side.skipped or aten.is_random(r_side.ops[p].name)
                for p in producers.values())
        if step_view:
            step_views.add(i)
        # a view of the batch (a step input, or a draw in the step) that no op of the reference reads
        # (``tensor_split(x, 1)[0]``: the single process's one piece is the whole tensor, and what reads it reads
        # that): a cut the ranks make otherwise, judged where an op that computes reads what the ranks cut
        unread_view = aten.is_cheap(rop.name) and not any(ref.consumers(i).values()) and \
            all(p is None or aten.is_random(r_side.ops[p].name) for p in producers.values())
        from_departed = [p for p in producers.values() if p is not None and p in departed]
        # what reads only the shape of a value that parted (backward()'s seed, ones_like of the loss) agrees, and
        # what it makes still descends from that value: the backward differentiates the loss
        seeded = frozenset().union(*(origin[p] for p in producers.values() if p is not None and p in origin))
        if from_departed and not aten.reads_values(rop.name):
            origin[i] = seeded
        from_drawn = [p for p in producers.values() if p is not None and p in drawn]
        tensors: list[Mapped] = []
        # the step's inputs this op reads first (parameters, the batch): each storage once
        r_ins, t_ins = rop.inputs(), [t.inputs() for t in tops]
        out_arg = rop.kwargs.get("out")  # a buffer the op writes without reading it (DDP's bucket)
        for pos, rref in enumerate(r_ins):
            if producers.get(pos) is not None or rref.version in seen_inputs or \
                    (isinstance(out_arg, TensorRef) and rref.version == out_arg.version):
                continue
            if any(pos >= len(ti) or tgts[k].producers(tops[k].index).get(pos) is not None
                   for k, ti in enumerate(t_ins)):
                # on some rank the op reads what a rank's own op made (a slice of the batch, a copy): judged where
                # what it made is read, unless the pieces are the batch's rows in another order
                m = None if any(pos >= len(ti) for ti in t_ins) or micro is not None else \
                    reordered_input(ref, tgts, rref, [ti[pos] for ti in t_ins], pos, len(own) // world)
                if m is not None:
                    seen_inputs.add(rref.version)
                    tensors.append(m)
                    outside[rref.version] = 0.0
                    orders.setdefault(len(m.layout.order), m.layout.order)
                continue
            seen_inputs.add(rref.version)
            m = mapped(rref, [ti[pos] for ti in t_ins], "in", pos, declared[lead_rank].get((tops[0].index, pos)))
            if m is not None:
                tensors.append(m)
                outside[rref.version] = m.error if m.error is not None else math.inf
        r_outs, t_outs = rop.outputs_refs(), [t.outputs_refs() for t in tops]
        reads = measured_reads(r_ins, producers, by_ref, outside)  # what its outputs' limits carry
        # one output per expert (the rows of each): the expert's rank holds it
        pieces = expert_outputs(rop, tops) if expert_ranks and holder is None and len(own) == world else {}
        for pos, rref in enumerate(r_outs):
            if pos in pieces:
                m = expert_output(ref, tgts, rop, tops, pos, pieces[pos], world, reads)
                if m is not None:
                    tensors.append(m)
                continue
            if step_view or unread_view or any(pos >= len(to) for to in t_outs):
                continue
            m = mapped(rref, [to[pos] for to in t_outs], "out", pos,
                       declared_output(lead_side, declared[lead_rank], tops[0].index, pos), rop, reads)
            if m is not None:
                tensors.append(m)
        fwd = r_side.ops.get(rop.forward_index) if rop.phase == "backward" and rop.forward_index is not None else None
        tfwd = lead_side.ops.get(tops[0].forward_index) \
            if tops[0].phase == "backward" and tops[0].forward_index is not None else None
        line = fwd.source if fwd is not None and fwd.source else rop.source
        tline = tfwd.source if tfwd is not None and tfwd.source else tops[0].source
        phase = BETWEEN if rop.phase == "forward" and between and between[0] < i < between[1] else rop.phase
        mop = MappedOp(i, tuple(t.index for t in tops), rop.name, rop.module, phase, line, tuple(tensors),
                       (micro,) if micro is not None else (holder,) if holder is not None else
                       tuple(rank_of[p] for p in own) if len(own) > world else (),
                       target_source=tline if tline != line else None)
        out.ops.append(mop)
        by_ref[i] = mop
        if random:
            out.random_ops += 1
            if not tensors or any(m.layout is None or m.layout.factor != 1 for m in tensors):
                # each rank drew its own numbers: what reads them is judged only if it maps anyway
                drawn.add(i)
                if micro is None and same_draws_of(ref, rop, tops, tgts):
                    out.same_draws.append(i)
                continue
            # every rank drew what the single process drew (one seed, a batch drawn in the step): compared as any op
        if not tensors:
            if r_outs and not any(r.stored for r in r_outs):
                out.not_stored += 1
            continue
        out.compared += 1
        if is_sink(rop, producers):
            sinks.append(i)
        if rop.phase == "backward" and not in_backward:
            in_backward, loss, loss_op = True, last_forward, last_forward_op
            if passes > 1 and loss == Fraction(1, world * passes):
                # each pass's loss is a mean over its micro-batch, one of world x passes parts: a rank sums its
                # passes' gradients, so a correct job divides each pass's loss by the number of passes (a division
                # the ranks run alone, no op of the reference's) and the backward holds a per-rank mean's gradient
                loss = Fraction(1, world)
        elif rop.phase == "forward" and aten.reads_values(rop.name):  # not ones_like: backward()'s seed
            in_backward = False
            # the op's value (its first output; others are auxiliary, such as nll_loss's count) if it is partial
            # (a value every rank holds whole, such as a loss of the whole batch, is replicated, though half of it
            # on each of 2 ranks would be a partial one as well)
            value = next((m for m in tensors if m.kind == "out"), None)
            if value is not None and value.fits and value.fits[0].factor == 1 and \
                    value.fits[0].kind is LayoutKind.REPLICATED:
                last_forward, last_forward_op = Fraction(1), i
            else:
                partial_fit = None if value is None else next(
                    (f for f in value.fits if f.kind is LayoutKind.PARTIAL), None)
                if partial_fit is not None:
                    last_forward, last_forward_op = partial_fit.factor, i
        tensors = [pick_legit(m, rop.phase if m.kind == "out" else None, loss) for m in tensors]
        mop = dataclasses.replace(mop, tensors=tuple(tensors))
        out.ops[-1] = by_ref[i] = mop
        bad = [m for m in tensors if m.layout is None or m.layout.factor not in legit_factors(
            m.layout, rop.phase if m.kind == "out" else None, loss)]
        if any(m.kind == "in" and m.layout is not None and m.layout.order is not None for m in tensors):
            # a batch the ranks hold in another order (a DistributedSampler's, dealt out before the step): the same
            # global batch; what reads it is mapped in that order (Layout.order), and where an op's output fits no
            # layout even so (an op that mixes the batch's rows otherwise), it parts by that order alone: judged at
            # the sinks (a sum or mean over the batch, and so every gradient, does not see the order)
            if out.rows_reordered is None:
                out.rows_reordered = i
            if bad and not from_departed and all(m.kind == "out" and m.layout is None for m in bad):
                departed.add(i)
                shuffled.add(i)
                origin[i] = seeded | frozenset({i})
                continue
        if bad and not rop.inputs() and all(m.kind == "out" and m.layout is None for m in bad) \
                and any(tuple(t.outputs_refs()[m.position].shape) != tuple(rop.outputs_refs()[m.position].shape)
                        for m in bad for t in tops):
            # a factory of no tensor (arange over the local batch, positions, a mask of local sizes): each rank's
            # index of its own values, not a piece of the single process's; what it indexes is judged where read
            out.per_rank_index.append(i)
            continue
        if exchanges and bad and all(m.kind == "out" for m in bad) and own_rows_index(tops, tgts, rop, ref):
            # positions into each rank's own rows (the order that groups its tokens by expert, where its experts' rows
            # end): its own index too
            out.per_rank_index.append(i)
            continue
        for m in tensors:
            if m.layout is not None and m.kind == "out":
                out.families.setdefault(rop.phase or "?", Counter())[family(m.layout, m not in bad)] += 1
            if m.error is not None and m.layout is not None and m not in bad and m.limit and \
                    (out.worst_limit is None or m.error / m.limit > out.worst / out.worst_limit):
                out.worst, out.worst_limit, out.worst_op = m.error, m.limit, i
        if not bad:
            if from_departed and any(m.layout is not None and KINDS[m.layout.kind].picks
                                     for m in tensors):
                # a min or max over the ranks fits what an op that reads a parted value makes (a ReLU of values one
                # rank got wrong: the other rank's are the reference's, and the smaller): the value still parts, and
                # what reads it descends from where it parted
                departed.add(i)
                origin[i] = seeded
            elif from_departed and _whole_made_partial(from_departed, tensors, by_ref, coincident) and \
                    not makes_layout(rop.name):
                # what every rank computes from parted values each holds whole (at a factor) is held whole too: that
                # it also fits as partial over the ranks (a clipping coefficient of a doubled norm is half the
                # reference's on each rank, and the halves add up to it) is the factor's coincidence, not a layout;
                # it parts, and what reads it descends from where the factor entered
                departed.add(i)
                coincident.add(i)
                origin[i] = seeded
            continue
        if from_drawn and not from_departed:  # it reads another rank's dropout mask than the reference's
            drawn.add(i)
            out.random_parted.append(i)
            continue
        # the step's inputs already differ (the first departure is of kind inputs): an op that parts reading none
        # of what they made, and no differing input itself, parts with agreeing inputs, as the rank-by-rank diff
        # names it; the first such is said as well
        with_agreeing = first is not None and first[2] is Departure.INPUTS and within is None and \
            i not in carriers and not any(m.kind == "in" for m in bad)
        for m in bad:
            if m.kind == "in":
                differing.add(r_ins[m.position].version)
                carriers.add(i)
        if not from_departed and (first is None or with_agreeing or first[2] is not Departure.INPUTS) and \
                all(m.layout is None for m in bad) and \
                amplifies(rop, tops, tensors, producers, by_ref, tgts, set(out.amplified), [maps[p] for p in own]):
            # every rank computes from the same inputs, right given them; they differ from the reference's by a
            # reordered sum's rounding, which this op amplifies (AdamW's first update of a near-zero gradient)
            out.amplified.append(i)
            continue
        departed.add(i)
        out.parted.add(i)
        if i in sinks and out.sink is None:
            out.sink = ParallelDeparture(mop, bad[0], Departure.NO_LAYOUT if bad[0].layout is None else
                                         Departure.SCALED, "", 0, step=rop.step)
        origin[i] = seeded or frozenset({i})
        if loss_op is not None and loss_op in departed and i > loss_op:
            origin[i] = origin[i] | origin[loss_op]  # it descends from the loss the backward differentiated
        # a root: an op that parts reading nothing that parted (after step inputs that differ, only one that reads
        # none of what they made: they are said first, and what descends from them inherits them)
        root = not from_departed and (first is None or with_agreeing or first[2] is not Departure.INPUTS)
        if not root:
            inherited += first is not None
            # a value on the way that parted already, held at another factor than what it reads: a factor site
            m = next((t for t in bad if t.kind == "out" and t.layout is not None), None)
            read = next((t.layout.factor for p in from_departed if p in by_ref for t in by_ref[p].tensors
                         if t.kind == "out" and t.layout is not None), None)
            if m is not None and read is not None and read != m.layout.factor:
                times = read / m.layout.factor
                extra = via[i] = computing_behind(lead_side, lead_map, tops[0].index)
                changes.append((mop, m, Departure.SCALED, (
                    f"{m.layout.describe()}: {ratio_text(times)}x what it reads (which parted already): a scale "
                    f"applied here" + ("" if extra is None else f", or in what it reads on the ranks from {extra}, "
                                                                f"which the reference does not run"))))
                applied[i] = times
            continue
        m = bad[0]
        counts = unequal_counts(ref, tgts, rop, tops, m)
        partial_in = None if counts is not None else partial_input(producers, by_ref)
        if partial_in is not None and rop.phase != "optimizer" and \
                (c := collective_behind(lead_side, lead_map, tops[0].index)) is not None and aten.reduces(c[1]):
            # on the ranks what it reads went through a reduction (FSDP's reduce-scatter before clipping): none
            # is missing, whatever the value's factor
            partial_in = None
        # some part (a rank, or a rank's micro-batch) holds its share of the reference, another does not
        one_off = bool(m.off) and len(m.off) < len(own) and micro is None and len(own) == len(tops) and \
            len(own) % world == 0
        alone: list[tuple[int, str]] = []  # (rank, what it alone computed that this op reads) where some rank has none
        if not one_off and micro is None and len(own) == world and len(tops) == world:
            behind_each = [computing_behind(t_sides[r], maps[r], tops[r].index) for r in range(world)]
            alone = [(r, b) for r, b in enumerate(behind_each) if b is not None]
            if not alone or len(alone) == world:
                alone = []
        if one_off or alone:
            # some rank holds the reference's part and another does not, or some rank alone computed what the op
            # reads: not a reduction every rank misses (an all-reduce missing leaves every rank's part off); said
            # below with the ranks that part
            partial_in = None
        other_args = differing_arguments(rop, tops)
        if m.alike and rop.phase == "forward":
            held = (t_ins if m.kind == "in" else t_outs)[0][m.position].shape  # every rank's piece is alike
            at = "" if m.offsets is None else f" (at offset {m.offsets[1][0]} of the reference's dim {m.offsets[0]})"
            kind, why = Departure.SAME_SHARD, (
                f"{'input' if m.kind == 'in' else 'output'} {m.position}: ranks "
                f"{', '.join(map(str, range(world - 1)))} and {world - 1} hold the same "
                f"{int(held[0]) if held else 1} rows{at}, where each should hold its own: each rank reads the same "
                f"shard; {same_shard_cause(tgts, m.kind == 'in')}")
        elif m.kind == "in" and m.offsets is None:
            kind, why = Departure.INPUTS, why_inputs(m, rop.step)
        elif other_args and partial_in is not None and m.layout is None and not from_departed and \
                rop.phase != "optimizer" and not aten.is_cheap(rop.name):
            # it reads a partial value (a per-rank loss) as a correct run does, and some rank gives it another
            # argument (a scale of its own): the argument is the difference, not a reduction (where its output
            # fits a layout at a factor, a scale on every rank, that layout is said first, the argument after it)
            kind, why = Departure.NO_LAYOUT, _other_arguments(m, other_args, world, own, rank_of)
        elif partial_in is not None and rop.phase == "optimizer" and \
                (over := reduced_at(partial_in[0], rop, tops, tgts, lead_side, lead_map, ref, world,
                                     micro, mesh)) is not None:
            # the gradient went through its all-reduce, and came out whole on every rank at a factor
            (c, name, at), times = over
            line = lead_side.ops[c].source
            if times > 1:
                cause = "a sum not divided by the world size, or a loss scaled twice"
            else:  # divided once too often: by the reduction (DDP averages) and by a scale of the ranks' own
                p = parts_of(loss_op)[0] if loss_op is not None else None
                also = None if p is None or loss_op not in maps[p] else \
                    loss_scales(t_sides[rank_of[p]], maps[p], maps[p][loss_op], ref, passes)
                cause = "divided by the world size twice: the all-reduce averages the ranks' gradients, and " + \
                    (f"the ranks scale their loss too ({also}): one scale too many" if also else
                     "they are scaled once more on the ranks")
            kind, why = Departure.SCALED, (
                f"input {partial_in[0]} (the gradient) is replicated at {ratio_text(times)}x the reference after "
                f"{name} #{c} (on rank {lead_rank}{', ' + line if line else ''}): {cause}")
        elif partial_in is not None and rop.phase == "optimizer":
            made = r_side.ops[partial_in[2]]
            line = by_ref[partial_in[2]].target_source or by_ref[partial_in[2]].source
            if line and made.phase == "backward":
                line = f"the backward of {line}"
            where = ", ".join(x for x in (made.module or "no module", made.phase, line) if x)
            kind, why = Departure.UNREDUCED, (
                f"input {partial_in[0]} is partial over {world} ranks (each rank's own gradient, made by "
                f"#{partial_in[2]} {made.name}, {where}) and reaches the optimizer without its all-reduce: each rank "
                f"steps with its own")
            if passes > 1:
                # accumulation on the ranks: the all-reduce belongs to the last micro-batch's backward (DDP reduces in
                # the backward that runs outside no_sync()), which is where the ranks' backward was called
                last = lead_side.ops[backward_passes(lead_side)[-1]].source
                why += f"; each rank accumulated it over its {passes} micro-batches and no all-reduce follows the " \
                       f"last one's backward{' (' + last + ')' if last else ''}: run that backward outside " \
                       f"no_sync(), or all-reduce the gradients after it"
        elif m.layout is not None and ((legit := legit_factors(m.layout, rop.phase, loss)) or not m.off):
            # (no factor is right for what the optimizer keeps, and some rank holds the reference's: said below)
            kind, why = Departure.SCALED, why_scaled(m.layout, legit)
            if other_args:
                why += f"; the ranks run this op with other arguments than the single process: " \
                       f"{arguments_text(other_args, world, [rank_of[p] for p in own] if len(own) > world else None)}"
        elif partial_in is not None and \
                (ahead := collective_ahead(lead_side, lead_map, tops[0].index)) is not None:
            # the reduction is there, after this op: what the op combines with the partial sums is summed too
            c, name = ahead
            line = lead_side.ops[c].source
            kind, why = Departure.UNREDUCED, (
                f"input {partial_in[0]} holds partial sums over {world} ranks (the reference is their "
                f"{'average' if partial_in[1].factor != 1 else 'sum'}, made by #{partial_in[2]}), and this op runs "
                f"on them before {name} #{c} (on rank {lead_rank}{', ' + line if line else ''}) reduces its result: it "
                f"needs the whole sum (a value every rank adds, such as a bias, is then summed {world} times); this op "
                f"belongs after the reduction")
        elif partial_in is not None:
            kind, why = Departure.UNREDUCED, (
                f"input {partial_in[0]} holds partial sums over {world} ranks (the reference is their "
                f"{'average' if partial_in[1].factor != 1 else 'sum'}, made by #{partial_in[2]}) and is used without "
                f"a reduction: an all-reduce is missing before this op")
        elif m.offsets is not None:
            dim, at = m.offsets
            spans = sorted(zip(at, m.sizes or ()))
            overlap = any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:]))
            what = "slices that overlap (some of it on two ranks, some on none)" if overlap else \
                "not in rank order: a shard taken at the wrong offset"
            kind, why = Departure.SHARD_OFFSET, (
                f"{'input' if m.kind == 'in' else 'output'} {m.position} ({m.describe}): each rank holds a slice of the "
                f"reference on dim {dim}, at offsets {', '.join(f'rank {r}: {o}' for r, o in enumerate(at))}: {what}")
        elif alone and not one_off and m.layout is None:
            others = [r for r in range(world) if r not in {a for a, _ in alone}]
            kind, why = Departure.NO_LAYOUT, (
                f"{'input' if m.kind == 'in' else 'output'} {m.position} ({m.describe}) maps onto the reference's "
                f"under no layout: on rank {alone[0][0]} it reads what {alone[0][1]} made, which neither the single "
                f"process nor rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} run"
                f"{'s' if len(others) == 1 else ''}")
        elif one_off and len(own) > world:
            # a rank's micro-batch: what it alone reads from the rank's own ops, beyond what every part that holds
            # its share reads (each divides its loss by the number of micro-batches), is where it parts
            kind, why = Departure.NO_LAYOUT, _part_off(m, own, rank_of, world, tops, t_sides, maps)
        elif one_off:
            held = [r for r in range(world) if r not in m.off]
            whole = all(tuple(t[m.position].shape) == tuple(rop.outputs_refs()[m.position].shape) for t in t_outs) \
                if m.kind == "out" else True
            what = "the reference's value" if whole else "its slice of the reference's value"
            # on a rank that parts, the op may read what that rank alone computed (a scale in its own branch)
            r0 = m.off[0]
            extra = computing_behind(t_sides[r0], maps[r0], tops[r0].index) if r0 < len(tops) else None
            kind, why = Departure.NO_LAYOUT, (
                f"output {m.position} ({m.describe}): rank{'s' if len(held) > 1 else ''} "
                f"{', '.join(map(str, held))} hold{'s' if len(held) == 1 else ''} {what}, rank"
                f"{'s' if len(m.off) > 1 else ''} {', '.join(map(str, m.off))} "
                f"{'do' if len(m.off) > 1 else 'does'} not: " +
                (f"on rank {r0} it reads what {extra} made, which the single process does not run" if extra else
                 "this op went wrong there"))
        elif (own_in := made_apart(producers, tops[0], tgts[0], lead_side, lead_map, r_side,
                                    set(out.not_aligned))) is not None:
            pos, made, theirs = own_in
            kind, why = Departure.NO_LAYOUT, (
                f"output {m.position} ({m.describe}) maps onto the reference's under no layout (replicated, sharded "
                f"on a dimension, or partial over {world} ranks, at any simple factor): input {pos} is made on the "
                f"ranks by ops of their own, last {made}, where the reference runs {theirs} (not run by every rank), "
                f"with no collective on the way: if the reference's value is a sum over the ranks (a row-parallel "
                f"layer's output), its all-reduce is missing there")
        elif (holder is not None or (exchanges and experts_sharded(rop, tops, m))) and \
                (reduced := collective_behind(lead_side, lead_map, tops[0].index)) is not None \
                and aten.is_all_reduce(reduced[1]):
            kind, why = Departure.NO_LAYOUT, expert_reduced(m, holder, reduced[0], reduced[1],
                                                            lead_side.ops[reduced[0]].source, lead_rank)
        elif exchanges and (rows := misrouted(ref, tgts, rop, tops, m, lead_side, lead_map)) is not None:
            kind, why = Departure.NO_LAYOUT, rows
        elif counts is not None:
            said = " and ".join(f"{c:g}" for c in counts[0])
            kind, why = Departure.NO_LAYOUT, (
                f"output {m.position} ({m.describe}) is a per-rank mean over each rank's own count, and the counts "
                f"differ ({said}, {counts[1]} of this op), where the single process's is the mean over all "
                f"{sum(counts[0]):g}: the ranks' means are averaged as if their counts were equal; sum on each rank "
                f"and divide by the count all-reduced over the ranks")
        elif other_args and not from_departed and not aten.is_cheap(rop.name):
            # its inputs map onto the reference's (it reads nothing that parted), its result does not: the
            # arguments the ranks give it are the difference (an optimizer's lr, a scale)
            kind, why = Departure.NO_LAYOUT, _other_arguments(m, other_args, world, own, rank_of)
        else:
            kind, why = Departure.NO_LAYOUT, (
                f"output {m.position} ({m.describe}) maps onto the reference's under no layout (replicated, sharded "
                f"on a dimension, or partial over {world} ranks, at any simple factor): the ranks compute something "
                f"else here (per-rank statistics that should be global, such as BatchNorm's without SyncBatchNorm or "
                f"means over shards of unequal size averaged as if equal; a different input)")
        if with_agreeing:
            within = ParallelDeparture(mop, m, kind, why, 0, step=rop.step)
            continue
        if first is not None:
            inherited += 1
        else:
            out.batch_warning = batch_warning_of(rop, m, kind, {k: None if owner.get(p) == -1 else p
                                                              for k, p in producers.items()})
        behind = collective_behind(lead_side, lead_map, tops[0].index)
        if behind is not None and not aten.reduces(behind[1]):
            # a collective that copies (DDP's broadcast of buffers at the start of forward, an all-gather of
            # parameters) computes nothing: where what it brought this op is what the single process holds there
            # (whole, or each rank its slice, at factor 1), it is no cause of what parts
            through = collective_through(lead_side, lead_map, tops[0].index, behind[0])
            if through and all(_delivers_reference(mapped, r_ins, t_ins, pos) for pos in through):
                behind = None
        if behind is not None and kind in (Departure.SCALED, Departure.NO_LAYOUT) and behind[1] not in why:
            said = lead_side.ops[behind[0]].source if behind[0] in lead_side.ops else None
            why += f"; on the ranks it reads what {behind[1]} (#{behind[0]} on rank {lead_rank}" \
                   f"{', ' + said if said else ''}) made, which the " \
                   f"single process does not run"
        elif kind is Departure.SCALED:
            # a scale the ranks apply in an op the reference does not run (a loss multiplied by the world size where
            # the reference divides by the micro-batch count, or multiplies by its own world size): its line
            extra = computing_behind(lead_side, lead_map, tops[0].index)
            if extra is not None:
                why += f"; on the ranks it reads what {extra} made, which the reference does not run"
        roots.append((mop, m, kind, why))
        via[i] = computing_behind(lead_side, lead_map, tops[0].index)
        if kind is Departure.SCALED and m.layout is not None:
            legit = legit_factors(m.layout, rop.phase if m.kind == "out" else None, loss)
            if legit:  # none: a sum over the ranks of what each should hold whole (see why_scaled), no factor
                applied[i] = min(legit, key=lambda f: abs(math.log(f / m.layout.factor))) / \
                    m.layout.factor
        if first is None:
            first = roots[0]
    if progress is not None:
        progress(len(r_side.ops) % 64)
    computing = [i for i in out.not_aligned if not aten.is_cheap(r_side.ops[i].name)]
    out.ref_only.update(r_side.ops[i].name for i in computing)
    if len(computing) * 4 > out.ref_ops and not cut_short:  # (a side cut short lacks ops too: said by the caller)
        # not the same program on every rank as in the single process: no verdict on a mapping of what is left
        raise UsageError(
            f"the single process runs {len(computing)} of its {out.ref_ops} ops with no counterpart on every rank "
            f"(first #{computing[0]} {r_side.ops[computing[0]].name}): another program than each rank's, which is "
            f"not mapped onto the ranks; diff one rank op by op with --rank N")
    if shuffled:
        first, inherited = _drop_reordered(shuffled, first, roots, origin, departed, sinks, by_ref, out)
    if first is not None and first[0].name in PICKS:
        first, inherited = _judge_picks(first, inherited, roots, origin, departed, r_side, t_sides, targets, out)
    out.sinks = len(sinks)
    out.settings = differing_settings(ref, set(r_side.ops), [(r, t, set(side.ops)) for r, (t, side) in
                                                             enumerate(zip(targets, t_sides))], world)
    if first is not None and first[2] is not Departure.INPUTS and sinks:
        # judged at the sinks: the roots whose values reach none of them cancel on the way (or feed nothing kept)
        reached = [origin[s] for s in sinks if s in departed]
        kept = frozenset().union(*reached)
        out.cancelled = [departure_of(r, 0, applied.get(r[0].ref), via.get(r[0].ref)) for r in roots
                         if not origin[r[0].ref] & kept and not aten.is_cheap(r[0].name)]
        if not reached:
            out.restored = restored_by(ref, sinks, by_ref, t_sides[0], maps[0])
            first = None
        else:
            # the first sink that parts, traced back to the roots it descends from: the first is where it enters,
            # and each that applies a factor is a site on its way
            on_way = [r for r in roots if origin[r[0].ref] & reached[0]]
            # each line once (a scale applied to every parameter's gradient is one site), the sinks aside (the
            # net factor is said at the sink)
            said: set[tuple] = set()
            for r in sorted(on_way + [c for c in changes if origin[c[0].ref] & reached[0]], key=lambda r: r[0].ref):
                key = (r[0].name, r[0].phase, r[0].source, applied.get(r[0].ref))
                if r[2] is Departure.SCALED and r[0].phase != "optimizer" and key not in said:
                    said.add(key)
                    out.sites.append(departure_of(r, 0, applied.get(r[0].ref), via.get(r[0].ref)))
            first = on_way[0]
            net = None if out.sink is None or out.sink.tensor.layout is None else 1 / out.sink.tensor.layout.factor
            if net is not None:
                # the site that applies the factor the sink parts by is where the difference enters (the others
                # are cancelled on the way: a summed loss the gradients' division brings back)
                site = next((s for s in out.sites if s.applied == net), None)
                if site is not None:
                    first = (site.op, site.tensor, site.kind, site.why)
            inherited = sum(1 for i in departed if i > first[0].ref and reached[0] & origin[i])
    if first is not None:
        step = r_side.ops[first[0].ref].step
        enters = None
        if first[2] is Departure.SCALED and first[0].ref in applied:
            # the factor it parts by is applied by an op only the ranks run (a loss times the world size in the
            # parallel script alone): that op is where the difference enters, named first
            r, j = first[0].on_ranks()[0]
            enters = scale_behind(t_sides[r], maps[r], j, applied[first[0].ref], world)
            if enters is not None and enters.phase == "forward" and _between(t_sides[r], enters.index):
                enters = dataclasses.replace(enters, phase=BETWEEN)
            if enters is not None and not enters.of_loss and loss_op is not None:
                # the loss scaled by the same factor on the ranks alone too (divided by the world size where the
                # gradients are as well): either scale alone is a correct job's, the two together are not
                p = parts_of(loss_op)[0]
                if loss_op in maps[p]:
                    also = loss_scales(t_sides[rank_of[p]], maps[p], maps[p][loss_op], ref, passes)
                    if also is not None:
                        enters = dataclasses.replace(enters, also=also)
        elif first[2] is Departure.NO_LAYOUT and len(first[1].off) == 1 and not owner and passes == 1 and \
                len(first[0].on_ranks()) == world:
            # one rank parts, reading a scale of its own (its loss times 1.01 in a branch of its own): that op
            # heads the verdict, with its line
            r, j = first[0].on_ranks()[first[1].off[0]]
            enters = scale_behind(t_sides[r], maps[r], j, None, world)
            if enters is not None:
                enters = dataclasses.replace(enters, alone=(r,))
        why = first[3]
        if enters is not None and first[1].layout is not None:
            why = (f"{first[1].layout.describe()}: {ratio_text(enters.factor)}x what a correct parallel run holds "
                   f"here, from {enters.name} (#{enters.index} on rank {enters.rank}, {enters.phase}"
                   f"{', ' + enters.source if enters.source else ''}): {enters.describe()}")
            out.sites = [dataclasses.replace(c, why=why, enters=enters) if c.op.ref == first[0].ref else c
                         for c in out.sites]
        out.departure = ParallelDeparture(first[0], first[1], first[2], why, inherited,
                                          earlier_step(step) if first[2] is Departure.INPUTS else None, step,
                                          enters=enters)
        out.within = within
    if out.departure is None and sinks and not out.random_parted:
        # what the job keeps is the single process's: the runs saw the same global batch, whatever its order
        out.batch_warning = None
    # every op that parts, as judged last (what parted only through the batch's order, or a reordered pick, dropped)
    out.parted = set(departed)
    out.ref_layout_ops.update(r_side.ops[i].name for i in r_side.skipped if makes_layout(r_side.ops[i].name))
    if any(declared):
        said = [t.layout_from for op in out.ops for t in op.tensors if t.layout_from is not None]
        out.from_placements = (said.count("placements"), said.count("inferred"))
    return out


def same_program(single: RankTrace, rank: RankTrace) -> bool:
    """Whether one rank of a parallel run runs the single process's program: all but a quarter of the single
    process's computing ops align with the rank's (the test ``diff_parallel`` refuses a mapping by)."""
    a, b = Side(single), Side(rank)
    paired = {i for i, _ in align(a.keys, b.keys).pairs}
    computing = [k.index for k in a.keys if not aten.is_cheap(a.ops[k.index].name)]
    return bool(computing) and sum(i not in paired for i in computing) * 4 <= len(a.keys)


def is_parallel_groups(ref_world: int, ref_ranks: list[int], target_world: int, target_ranks: list[int]) -> bool:
    """A parallel reference against every rank of a job of a world size it divides (2 ranks against 4)."""
    return 1 < ref_world < target_world and target_world % ref_world == 0 and \
        ref_ranks == list(range(ref_world)) and target_ranks == list(range(target_world))


def diff_parallel_groups(refs: list[RankTrace], targets: list[RankTrace],
                         progress: Callable[[int], None] | None = None, cut_short: bool = False) -> ParallelDiff:
    """A run of R ranks against one of W (R divides W) on the same global batch: rank q of the reference holds
    the share of the batch that ranks q*m to q*m+m-1 (m = W/R) hold between them (each slice cut in rank order),
    so each reference rank is diffed as a single process against those m ranks, its own collectives left out (they
    rejoin its layout: after them it holds what the target's ranks hold after theirs)."""
    rw, world = len(refs), len(targets)
    m = world // rw
    fsdp = next((op for op in refs[0] if aten.namespace(op.name) == "fsdp"), None)
    if fsdp is not None:
        raise UsageError(
            f"a {rw}-rank run against a {world}-rank run with FSDP ({fsdp.name}, #{fsdp.index} on rank 0) is not "
            f"mapped: each world size packs its shards into flat buffers of its own; diff each against a "
            f"single-process run of the same script, or compare one rank op by op with --rank N")
    groups = []
    for q, ref in enumerate(refs):
        g = diff_parallel(ref, targets[q * m:(q + 1) * m], progress, cut_short, full_world=world)
        ops = {op.ref: dataclasses.replace(op, ranks=tuple(q * m + r for r, _ in op.on_ranks()), ref_rank=q)
               for op in g.ops}
        g.ops = list(ops.values())
        if g.departure is not None:
            g.departure = dataclasses.replace(g.departure, op=ops[g.departure.op.ref])
        groups.append(g)
    out = ParallelDiff(world, sum(g.ref_ops for g in groups), sum(g.aligned for g in groups),
                       sum(g.compared for g in groups), ref_world=rw, groups=groups)
    for g in groups:
        out.not_aligned += g.not_aligned
        out.layout_ops.update(g.layout_ops)
        out.uneven_ops.update(g.uneven_ops)
        out.ref_layout_ops.update(g.ref_layout_ops)
        out.ref_only.update(g.ref_only)
        for phase, c in g.families.items():
            out.families.setdefault(phase, Counter()).update(c)
        out.random_ops += g.random_ops
        out.not_stored += g.not_stored
        if g.worst_limit is not None and (out.worst_limit is None or
                                          g.worst / g.worst_limit > out.worst / out.worst_limit):
            out.worst, out.worst_limit, out.worst_op = g.worst, g.worst_limit, g.worst_op
        out.ops += g.ops
        out.random_parted += g.random_parted
        out.same_draws += g.same_draws
        out.amplified += g.amplified
    out.batch_warning = next((g.batch_warning for g in groups if g.batch_warning), None)
    said = [g.from_placements for g in groups if g.from_placements is not None]
    if said:
        out.from_placements = (sum(n for n, _ in said), sum(m for _, m in said))
    parted = [g for g in groups if g.departure is not None]
    if parted:  # the reference rank that parts first in its op order (every reference rank runs the same program)
        g = min(parted, key=lambda g: g.departure.op.ref)
        out.departure = g.departure
        out.within = g.within
    return out



def _delivers_reference(mapped: Callable, r_ins: list[TensorRef], t_ins: list[list[TensorRef]], pos: int) -> bool:
    """Whether input ``pos`` of an op is held by the ranks as the single process's, whole or each rank its slice,
    at factor 1 (``mapped``: the op's mapping of one tensor)."""
    if pos >= len(r_ins) or any(pos >= len(ti) for ti in t_ins):
        return False
    m = mapped(r_ins[pos], [ti[pos] for ti in t_ins], "in", pos, None)
    return m is not None and any(f.factor == 1 and f.kind in (LayoutKind.REPLICATED, LayoutKind.SHARDED)
                                 for f in m.fits)


def _picked(mop: MappedOp, r_side: Side, t_sides: list[Side]):
    on_ranks = mop.on_ranks()
    if len(on_ranks) != len(t_sides):
        return None
    return rows_picked(r_side.ops[mop.ref], r_side.ops, [t_sides[r].ops[j] for r, j in on_ranks],
                       [side.ops for side in t_sides])


def _other_arguments(m: Mapped, found: list, world: int, own: list[int], rank_of: list[int]) -> str:
    """An output that parts from inputs that map, where the ranks give the op other arguments."""
    return (f"output {m.position} ({m.describe}) maps onto the reference's under no layout, from inputs that do: the "
            f"ranks run this op with other arguments than the single process: "
            f"{arguments_text(found, world, [rank_of[p] for p in own] if len(own) > world else None)}")


def _judge_picks(first, inherited: int, roots: list, origin: dict[int, frozenset[int]], departed: set[int],
                 r_side: Side, t_sides: list[Side], targets: list[RankTrace], out: ParallelDiff):
    """The first op that parts picks one row of a dataset (a DataLoader over a map-style dataset): where the ranks
    pick the single process's rows between them in another order (a DistributedSampler interleaves), the same global
    batch: every such pick, and what parts only through them, is no departure, and the first root left heads (the
    reordered roots dropped from ``roots``, ``origin`` and ``departed`` in place); where every rank picks the same
    rows, each rank reads the same shard. Returns (first, inherited)."""
    picks: set[int] = set()
    for r in roots:
        if r[0].name not in PICKS or r[0].ref in picks:
            continue
        picked = _picked(r[0], r_side, t_sides)
        if not same_rows_reordered(picked):
            continue
        source = r_side.ops[r[0].ref].args[0].geometry
        picks.update(i for i, op in r_side.ops.items() if op.name in PICKS and op.args and
                     getattr(op.args[0], "geometry", None) == source)
    if picks:
        out.batch_warning, out.rows_reordered = None, first[0].ref
        roots[:] = [r for r in roots if r[0].ref not in picks]
        for i in list(origin):
            origin[i] = origin[i] - picks
            if not origin[i]:
                departed.discard(i)
        first = roots[0] if roots else None
        if first is not None:
            inherited = sum(1 for i in departed if i > first[0].ref and first[0].ref in origin.get(i, ()))
        return first, inherited
    rows = same_rows_on_every_rank(_picked(first[0], r_side, t_sides))
    if rows is not None:
        shown = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
        why = (f"every rank picks the same {len(rows)} rows ({shown}) of input 0 "
               f"({r_side.ops[first[0].ref].inputs()[0].describe()}), where each should pick its own: each rank "
               f"reads the same shard; {same_shard_cause(targets, True)}")
        out.batch_warning = None
        first = (first[0], first[1], Departure.SAME_SHARD, why)
        roots[:] = [first if r[0].ref == first[0].ref else r for r in roots]
    return first, inherited


def _drop_reordered(shuffled: set[int], first, roots: list, origin: dict[int, frozenset[int]], departed: set[int],
                    sinks: list[int], by_ref: dict[int, MappedOp], out: ParallelDiff):
    """What parts only through ``shuffled`` (ops reading a batch the ranks hold in another order) is no departure:
    dropped from ``origin`` and ``departed`` (in place), unless it is a value the job keeps, which then depends on
    the order of the batch's rows (a weight by position, a cumulative op over the batch): that is a root, said so.
    Returns (first, inherited)."""
    for i in sorted(origin):
        if i in shuffled or not origin[i] & shuffled:
            continue
        rest = origin[i] - shuffled
        if rest:
            origin[i] = rest
            continue
        if i in sinks and i in departed and i in by_ref:
            mop = by_ref[i]
            m = next((t for t in mop.tensors if t.kind == "out" and (t.layout is None or t.layout.factor != 1)),
                     None)
            if m is not None:
                why = (f"output {m.position} ({m.describe}) maps onto the reference's under no layout, and what it "
                       f"reads parts only by the order of the batch's rows (the ranks hold the single process's rows "
                       f"in another order, first read by ref #{min(shuffled)}): what the job keeps depends on that "
                       f"order (a weight by position in the batch, a cumulative op over it)")
                roots.append((mop, m, Departure.NO_LAYOUT, why))
                origin[i] = frozenset({i})
                continue
        origin[i] = rest
        departed.discard(i)
        out.parted.discard(i)
    for i in shuffled:
        origin[i] = frozenset()
        departed.discard(i)
    roots.sort(key=lambda r: r[0].ref)
    first = roots[0] if roots else None
    inherited = 0 if first is None else \
        sum(1 for i in departed if i > first[0].ref and first[0].ref in origin.get(i, ()))
    return first, inherited


def _part_off(m: Mapped, own: list[int], rank_of: list[int], world: int, tops: list[OpRecord],
              t_sides: list[Side], maps: list[dict[int, int]]) -> str:
    """The words for micro-batches of the ranks (``own``: the (rank, pass) parts, rank-major) of which some hold
    their share of the reference's value and others (``m.off``) do not: the ones that part, and the op of their
    rank's own that they alone read (by name and line, among all the rank's own ops each part reads)."""
    passes = len(own) // world

    def name(k: int) -> str:
        return f"rank {rank_of[own[k]]}'s micro-batch {k % passes + 1}"

    def lines(k: int) -> dict[tuple, int]:
        side = t_sides[rank_of[own[k]]]
        return {_own_key(side, j): j for j in own_computing(side, maps[own[k]], tops[k].index)}

    held = [k for k in range(len(own)) if k not in m.off]
    common = set().union(*(lines(k) for k in held))
    k0 = m.off[0]
    extra = [(key, j) for key, j in lines(k0).items() if key not in common]
    side = t_sides[rank_of[own[k0]]]
    said = (f"on rank {rank_of[own[k0]]} it reads what {op_words(side, extra[0][1])} made, which neither the single "
            f"process nor the micro-batches that hold their share run") if extra else "this op went wrong there"
    return (f"output {m.position} ({m.describe}): {', '.join(name(k) for k in held)} hold their slice of the "
            f"reference's value, {', '.join(name(k) for k in m.off)} {'do' if len(m.off) > 1 else 'does'} not: "
            f"{said}")


def _own_key(side: Side, j: int) -> tuple:
    """An op of a rank's own by what it is: its name and line (a backward op's, its forward's)."""
    op = side.ops[j]
    fwd = side.ops.get(op.forward_index) if op.phase == "backward" and op.forward_index is not None else None
    return op.name, (fwd.source if fwd is not None and fwd.source else op.source)


def _whole_made_partial(read: list[int], tensors: list[Mapped], by_ref: dict[int, MappedOp],
                        coincident: set[int]) -> bool:
    """Whether the ops ``read`` (parted) made only values every rank holds whole, at some factor (replicated, or
    ``coincident``: found so here), and this op's outputs fit only as partial over the ranks."""
    outs = [m for m in tensors if m.kind == "out" and m.layout is not None]
    if not outs or any(m.layout.kind is not LayoutKind.PARTIAL for m in outs):
        return False
    for p in read:
        if p in coincident:
            continue
        made = [m for m in by_ref[p].tensors if m.kind == "out"] if p in by_ref else []
        if not made or any(m.layout is None or m.layout.kind is not LayoutKind.REPLICATED for m in made):
            return False
    return True


def _between(side: Side, index: int) -> bool:
    """Whether op ``index`` of a rank runs after that rank's last backward op and before its optimizer's first (the
    work between ``backward()`` and ``step()``, which the trace calls forward)."""
    backward = [i for i, op in side.ops.items() if op.phase == "backward" and i < index]
    optimizer = [i for i, op in side.ops.items() if op.phase == "optimizer" and i > index]
    return bool(backward) and bool(optimizer) and \
        not any(op.phase == "backward" for i, op in side.ops.items() if index < i < min(optimizer))
