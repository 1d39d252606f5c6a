"""Diffing a compiled unit of one trace against the eager ops of the same region in the other.

The same job recorded eagerly and recorded with torch.compile holds different records for a compiled region: one
``compiled.unit.*`` record on one side (its aten graph stored as data, its boundaries as tensors), the region's aten
ops one by one on the other. Alignment leaves both unaligned; here they are paired:

1. Which eager ops: the other side's unaligned ops of the unit's phase in the same gap between aligned pairs.
2. The graph mapped onto them: a matcher over op names (the unit's call nodes in graph order against the eager ops
   in op order). A node whose module is recorded (``Sequential.1 (GELU)``) must be in the eager op's module. Where a
   run of nodes stands against a single eager op of their module, it is that op decomposed (inductor's GELU is mul,
   erf, add...): the run's last node holds the op's value. Nodes and eager ops left over are said, never guessed.
3. The boundaries: the unit's recorded inputs against the eager inputs they stand for, its recorded outputs against
   the matching eager outputs, judged as aligned pairs are. Outputs that agree: same; an input that already
   differed: inherited; else divergent.
4. Where they part (divergent): the graph recompiled on this machine with the recorded backend, every node's value
   kept (as replay localises a unit), run on the unit's recorded inputs. Each matched node's value is judged against
   its eager op's recorded output, and its inputs against the eager op's inputs: the first whose output differs
   while its inputs agree is named. Whether that compile gives the recorded outputs bit for bit is said; when no
   compile is possible here, the first differing boundary output's node is named instead, and why.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from replaydiff import aten
from replaydiff.compare.metrics import measure
from replaydiff.compare.notes import Note, render, verdict_reason
from replaydiff.compare.tolerance import Tolerances, reduction_length
from replaydiff.compare.verdict import Verdict, judge
from replaydiff.diff.align import Alignment, module_key
from replaydiff.diff.pairs import PairComparer, coarser_dtype, op_reduction_k
from replaydiff.diff.notes import (DiffFact, NodesUnmatched, RightGivenOwnInputs, UnitInputDiffered, UnitNotLocalised,
                                   UnitRecompiled)
from replaydiff.diff.result import PairStatus, UnitPair, UnitPart
from replaydiff.replay.compared import named_output
from replaydiff.replay.policy import Precision, target_dtype
from replaydiff.replay.unit_replay import Graph, Refused, compile_device, compile_graph
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.schema.units import NODE_CALL, NODE_CONST, NODE_INPUT, NODE_OUTPUT, NodeRef, UnitInfo, UnitNode
from replaydiff.trace.schema.values import Opaque, TensorRef


@dataclass(frozen=True)
class Match:
    """Call nodes of the unit (graph positions, in order) standing for one eager op; the last holds its value."""

    nodes: tuple[int, ...]
    eager: int

    @property
    def value(self) -> int:
        return self.nodes[-1]


def _node_module(n: UnitNode, root: str = "") -> str | None:
    """A node's module as alignment keys modules: ``Sequential.1 (GELU)`` -> ``1``; None when not recorded. A node's
    path is under the region's root module, which sits at ``root`` (the unit record's own module, as a key) in the
    trace: a LayerNorm compiled alone is ``LayerNorm (LayerNorm)`` in a unit recorded in ``Net.block.ln1``."""
    if not n.module:
        return None
    return ".".join(p for p in (root, module_key(n.module.split(" (")[0])) if p)


def _flat(v: Any) -> Iterator[Any]:
    if isinstance(v, (list, tuple)) and not isinstance(v, NodeRef):
        for x in v:
            yield from _flat(x)
    else:
        yield v


def _getitem(n: UnitNode) -> tuple[int, int] | None:
    """(the node it reads, which output) for ``operator.getitem`` of a multi-output node, else None."""
    if n.kind == NODE_CALL and n.target == "operator.getitem" and len(n.args) == 2 and \
            isinstance(n.args[0], NodeRef) and isinstance(n.args[1], int):
        return n.args[0].index, n.args[1]
    return None


def _held(info: UnitInfo, value_of: dict[int, "Match"], g: Any) -> tuple["Match", int] | None:
    """Which eager op's output the graph value ``g`` (a NodeRef) is: (the match, output position). A getitem of a
    multi-output node (aot_eager's native_layer_norm) is that node's output k; a match's value node is output 0."""
    if not isinstance(g, NodeRef):
        return None
    item = _getitem(info.nodes[g.index])
    if item is not None:
        m = value_of.get(item[0])
        return None if m is None else (m, item[1])
    m = value_of.get(g.index)
    return None if m is None else (m, 0)


def _tensor_args(info: UnitInfo, nodes: tuple[int, ...]) -> list[int]:
    """The graph positions a run of nodes reads from outside itself (inputs, constants, earlier nodes), in the order
    of first reading: the eager op's tensor inputs, in its input order."""
    inside = set(nodes)
    out: list[int] = []
    for i in nodes:
        n = info.nodes[i]
        for v in _flat([n.args, list(n.kwargs.values())]):
            if isinstance(v, NodeRef) and v.index not in inside and v.index not in out:
                out.append(v.index)
    return out


def _run_module(n: UnitNode, root: str) -> str | None:
    """A node's module for taking it into a decomposed op's run: a node without one (most of a backward graph) is in
    the region's root when that is a module of the trace (a LayerNorm compiled alone: its backward graph is the
    eager native_layer_norm_backward, decomposed)."""
    m = _node_module(n, root)
    return root if m is None and root else m


def map_nodes(info: UnitInfo, eager: list[OpRecord], root: str = "") -> tuple[list[Match], list[int], list[int]]:
    """The unit's call nodes mapped onto eager ops: (matches in graph order, unmatched node positions, unmatched
    eager op numbers). See the module docstring, step 2."""
    # A getitem picks an output of the node before it: it stands for no eager op of its own (see _held)
    calls = [i for i, n in enumerate(info.nodes) if n.kind == NODE_CALL and _getitem(n) is None]
    names_n = [str(info.nodes[i].target) for i in calls]
    names_e = [op.name for op in eager]
    matches: list[Match] = []
    left_n: list[int] = []
    left_e: list[int] = []

    def fits(i: int, op: OpRecord) -> bool:
        m = _node_module(info.nodes[i], root)
        return m is None or m == module_key(op.module)

    for tag, a1, a2, b1, b2 in difflib.SequenceMatcher(None, names_n, names_e, autojunk=False).get_opcodes():
        if tag == "equal":
            for i, op in zip(calls[a1:a2], eager[b1:b2]):
                if fits(i, op):
                    matches.append(Match((i,), op.index))
                else:
                    left_n.append(i)
                    left_e.append(op.index)
            continue
        # Names that differ: each eager op against the run of nodes recorded in its module that comes next (the op
        # decomposed by the compiler: GELU as mul, erf, add; t as permute). Of several eager ops of one module in a
        # row, each takes the nodes up to the one of its own name.
        run, pos = calls[a1:a2], 0
        block = eager[b1:b2]
        for b, op in enumerate(block):
            mod = module_key(op.module)
            more = b + 1 < len(block) and module_key(block[b + 1].module) == mod
            took: list[int] = []
            while pos < len(run) and _run_module(info.nodes[run[pos]], root) == mod:
                took.append(run[pos])
                pos += 1
                if more and str(info.nodes[took[-1]].target) == op.name:
                    break
            if took:
                matches.append(Match(tuple(took), op.index))
            else:
                left_e.append(op.index)
        left_n.extend(run[pos:])
    matches.sort(key=lambda m: m.value)
    mapped = {i for m in matches for i in m.nodes}
    left_n += [i for i, n in enumerate(info.nodes) if (item := _getitem(n)) is not None and item[0] not in mapped]
    return matches, sorted(left_n), sorted(left_e)


def _gap(unit: int, side_pairs: list[tuple[int, int]], cheap: Callable[[int], bool]) -> tuple[int, int]:
    """The other side's open range of op numbers between the aligned pairs around op ``unit`` of the unit's side
    (pairs given as (this side, other side), in order). A view or detach after the unit does not end the range:
    aligned by its name alone (the compiled side's gradient accumulation against the eager side's), it says
    nothing about where the region's ops end."""
    lo, hi = -1, 1 << 62
    for a, b in side_pairs:
        if a < unit:
            lo = b
        elif a > unit and not cheap(a):
            hi = b
            break
    return lo, hi


class _Sides:
    """The unit's side and the eager side of one unit pair, with the comparer's argument order settled: the
    comparer takes (reference, target) and the unit may be on either."""

    def __init__(self, comparer: PairComparer, unit_trace: RankTrace, eager_trace: RankTrace, unit_is_ref: bool
                 ) -> None:
        self.comparer = comparer
        self.unit_trace = unit_trace
        self.eager_trace = eager_trace
        self.unit_is_ref = unit_is_ref
        self.eager_side = "target" if unit_is_ref else "ref"

    def refs(self, unit_ref: TensorRef, eager_ref: TensorRef, k: int, where: tuple[int, str, int]
             ) -> Verdict | None:
        if tuple(unit_ref.shape) != tuple(eager_ref.shape):  # not the tensor that node stands for: not compared
            return None
        r, t = (unit_ref, eager_ref) if self.unit_is_ref else (eager_ref, unit_ref)
        _, v = self.comparer.tensor_verdict(r, t, k, where)
        return v

    def live(self, value: Any, eager_ref: TensorRef, k: int, where: tuple[int, str, int]) -> Verdict | None:
        """A value computed here for the unit's side against a recorded tensor of the eager side."""
        if not isinstance(value, torch.Tensor) or not eager_ref.stored or eager_ref.meta or eager_ref.uninitialised:
            return None
        e = self.eager_trace.tensor(eager_ref)
        value = value.detach().to("cpu")
        if tuple(value.shape) != tuple(e.shape):  # not the tensor that node stands for: not compared
            return None
        dtype = coarser_dtype(str(e.dtype).removeprefix("torch."), str(value.dtype).removeprefix("torch."))
        target, ref = (e, value) if self.unit_is_ref else (value, e)
        return self.comparer.judge(measure(target, ref), dtype, k, where)


def _eager_where(side: _Sides, eager: int, kind: str, pos: int) -> tuple[int, str, int]:
    """The key baseline limits use: (reference op number, in/out, position); only an eager reference has one."""
    return (eager, kind, pos) if not side.unit_is_ref else (-1, kind, pos)


def diff_unit(op: OpRecord, eager: list[OpRecord], side: _Sides) -> tuple[UnitPair, list[Match]]:
    """One unit against the eager ops of its gap: the unit pair and the node matches (see the module docstring)."""
    info = op.unit
    assert info is not None
    matches, left_n, left_e = map_nodes(info, eager, module_key(op.module))
    by_index = {e.index: e for e in eager}
    notes: list[Note] = []
    # The boundaries: unit inputs (placeholders) against the eager inputs they stand for ...
    placeholders = [i for i, n in enumerate(info.nodes) if n.kind == NODE_INPUT]
    recorded_in = list(op.args)
    bad_input: UnitInputDiffered | None = None
    compared_in: set[int] = set()
    for m in matches:
        e = by_index[m.eager]
        reads, e_ins = _tensor_args(info, m.nodes), e.inputs()
        if len(reads) != len(e_ins):
            continue
        for q, (g, r) in enumerate(zip(reads, e_ins)):
            if g in placeholders and g not in compared_in:
                compared_in.add(g)
                k = placeholders.index(g)
                rec = recorded_in[k] if k < len(recorded_in) else None
                if isinstance(rec, TensorRef):
                    v = side.refs(rec, r, 1, _eager_where(side, e.index, "in", q))
                    if v is not None and v.divergent and bad_input is None:
                        bad_input = UnitInputDiffered(k, side.eager_side, e.index)
    # ... and its outputs against the matching eager op's output.
    value_of = {m.value: m for m in matches}
    outs = next((list(_flat(n.args[0] if n.args else [])) for n in info.nodes if n.kind == NODE_OUTPUT), [])
    recorded_out = list(_flat(op.outputs))
    judged: list[tuple[int, Verdict]] = []  # (node position, verdict)
    judged_eager: list[OpRecord] = []  # the eager op each was judged against
    # A node of a decomposed run may hold another output of the eager op than its value does: inductor's LayerNorm
    # keeps the mean and rstd for the backward, its backward returns the input's, weight's and bias's gradients.
    inside = {i: m for m in matches for i in m.nodes}
    taken: set[tuple[int, int]] = set()
    for pos, (ref, rec) in enumerate(zip(outs, recorded_out)):
        if not isinstance(rec, TensorRef):
            continue
        held = _held(info, value_of, ref)
        if held is not None and _getitem(info.nodes[ref.index]) is None and \
                [tuple(r.shape) for r in by_index[held[0].eager].outputs_refs()[:1]] != [tuple(rec.shape)]:
            held = None  # a run's last node that is not the op's output 0 (the bias gradient of a backward)
        if held is None and isinstance(ref, NodeRef):
            item = _getitem(info.nodes[ref.index])
            m = inside.get(item[0] if item is not None else ref.index)
            held = None if m is None else _other_output(m, rec, by_index[m.eager], taken, side)
        if held is None:
            continue
        m, k = held
        e = by_index[m.eager]
        e_outs = e.outputs_refs()
        if k >= len(e_outs):
            continue
        v = side.refs(rec, e_outs[k], op_reduction_k(e), _eager_where(side, e.index, "out", k))
        if v is not None:
            taken.add((e.index, k))
            judged.append((ref.index, named_output(v, e, k)))
            judged_eager.append(e)
    bad = [(i, v) for i, v in judged if v.divergent]
    if bad and bad_input is None and _each_side_right(op, [e for (_, v), e in zip(judged, judged_eager)
                                                            if v.divergent], side):
        # Outputs beyond the fixed limits that the unit and the eager ops, each replayed from its own inputs, both
        # make: a mean that cancels to ~0, or a within-tolerance input difference carried through.
        judged = [(i, replace(v, divergent=False, reason=None)) for i, v in judged]
        bad = []
        notes.append(RightGivenOwnInputs(None))
    part: UnitPart | None = None
    verdict = bad[0][1] if bad else max((v for _, v in judged), key=lambda v: v.severity) if judged else None
    if not judged:
        status = PairStatus.NOT_COMPARED
        notes.append(DiffFact.NO_UNIT_OUTPUT_MATCHED)
    elif not bad:
        status = PairStatus.SAME
    elif bad_input is not None:
        status = PairStatus.INHERITED
        notes += [*verdict_reason(bad[0][1].reason), bad_input]
    else:
        status = PairStatus.DIVERGENT
        notes += verdict_reason(bad[0][1].reason)
        part, found = _localise(op, info, matches, by_index, side)
        if part is None and isinstance(found, str):
            first = info.nodes[min(i for i, _ in bad)]  # the earliest in graph order
            notes.append(UnitNotLocalised(found, first.describe()))
        elif part is None:
            notes += [found, DiffFact.NO_NODE_PARTS]
        else:
            notes.append(found)
    if left_n or left_e:
        notes.append(NodesUnmatched(tuple(info.nodes[i].name for i in left_n), len(left_e)))
    pair = UnitPair(side="ref" if side.unit_is_ref else "target", unit=op.index, op=op.name, region=info.region,
                    backend=info.backend, phase=op.phase, status=status,
                    eager=tuple(sorted(m.eager for m in matches)), nodes=len(info.calls()), matched=len(info.calls()) - len(left_n),
                    unmatched_nodes=tuple(info.nodes[i].name for i in left_n),
                    unmatched_eager=tuple(left_e), verdict=verdict, part=part, reason=render(notes))
    return pair, matches


def _each_side_right(op: OpRecord, eager: list[OpRecord], side: _Sides) -> bool:
    """Whether the unit, and every eager op that a divergent output of it was judged against, is right given its
    own recorded inputs (each replayed alone, as replay does)."""
    unit_side = "ref" if side.unit_is_ref else "target"
    return side.comparer.right_given_own_inputs(unit_side, op) and all(
        side.comparer.right_given_own_inputs(side.eager_side, e) for e in {e.index: e for e in eager}.values())


def _other_output(m: Match, rec: TensorRef, e: OpRecord, taken: set[tuple[int, int]], side: _Sides
                  ) -> tuple[Match, int] | None:
    """Which output of eager op ``e`` a unit output held inside ``m``'s decomposed run is: the one output of its
    shape; of several (mean and rstd are both [N, 1]), the one it agrees with when exactly one does (else it is not
    judged: a guess could call a right value wrong)."""
    same = [k for k, r in enumerate(e.outputs_refs()) if (e.index, k) not in taken and tuple(r.shape) == tuple(rec.shape)]
    if len(same) == 1:
        return m, same[0]
    agree = [k for k in same if (v := side.refs(rec, e.outputs_refs()[k], op_reduction_k(e),
                                                 _eager_where(side, e.index, "out", k))) is not None
             and not v.divergent]
    return (m, agree[0]) if len(agree) == 1 else None


def _localise(op: OpRecord, info: UnitInfo, matches: list[Match], by_index: dict[int, OpRecord], side: _Sides
              ) -> tuple[UnitPart | None, Note | str]:
    """Where the unit and the eager ops part, on this machine's compile of the graph with every node kept: (the
    part or None, the note on the compile), or (None, why no compile was possible)."""
    backend = info.backend or "inductor"
    try:
        g = Graph(info)
        device, moved = compile_device(op)
        if moved:
            return None, moved
        trace = side.unit_trace

        def convert(v: Any) -> Any:
            if isinstance(v, TensorRef):
                return trace.tensor(v, copy=True).to(device)
            if isinstance(v, Opaque):
                raise Refused(f"an argument of kind {v.kind!r} cannot be rebuilt")
            if isinstance(v, torch.device):
                return device
            return v

        ins = [convert(a) for a in op.args]
        consts = [convert(c) for c in info.consts]
        values = compile_graph(g, consts, convert, backend, every_node=True)(list(ins))
    except Exception as exc:  # a graph this machine cannot compile: the boundaries' verdict stands
        first = (str(exc).splitlines() or [""])[0][:120]
        return None, f"not recompiled with {backend} here: {type(exc).__name__}: {first}"
    env: dict[int, Any] = {}
    calls = iter(values)
    k_in = 0
    for i, n in enumerate(info.nodes):
        if n.kind == NODE_INPUT:
            env[i] = ins[k_in]
            k_in += 1
        elif n.kind == NODE_CONST:
            env[i] = consts[int(str(n.target))]
        elif n.kind == NODE_CALL:
            env[i] = next(calls)
    outs = next((list(_flat(n.args[0] if n.args else [])) for n in info.nodes if n.kind == NODE_OUTPUT), [])
    recorded = [side.unit_trace.tensor(r) if isinstance(r, TensorRef) and r.stored and not r.meta else None
                for r in _flat(op.outputs)]
    reproduces = all(r is None or (isinstance(ref, NodeRef) and isinstance(env.get(ref.index), torch.Tensor)
                                   and env[ref.index].shape == r.shape and torch.equal(env[ref.index].cpu(), r))
                     for ref, r in zip(outs, recorded))
    note = UnitRecompiled(backend, reproduces)
    for m in matches:  # in graph order of the node holding the value
        e = by_index[m.eager]
        reads, e_ins = _tensor_args(info, m.nodes), e.inputs()
        inputs_agree = len(reads) == len(e_ins)
        if inputs_agree:
            for q, (g_pos, r) in enumerate(zip(reads, e_ins)):
                v = side.live(_first_tensor(env.get(g_pos)), r, 1, _eager_where(side, e.index, "in", q))
                if v is not None and v.divergent:
                    inputs_agree = False
                    break
        e_outs = e.outputs_refs()
        if not inputs_agree:
            continue
        # A multi-output node (aot_eager's native_layer_norm) holds a value per eager output; a decomposed run's
        # last node holds the eager op's output 0.
        got = env.get(m.value)
        values = list(got) if isinstance(got, (list, tuple)) else [got]
        v = None
        for k, (value, e_out) in enumerate(zip(values, e_outs)):
            v = side.live(_first_tensor(value), e_out, op_reduction_k(e), _eager_where(side, e.index, "out", k))
            if v is not None and v.divergent:
                v = named_output(v, e, k)
                break
        if v is not None and v.divergent:
            module = next((info.nodes[i].module for i in m.nodes if info.nodes[i].module), None)
            within = _earliest_node(g, m.nodes, env, convert, side.comparer.judge.tolerances) \
                if len(m.nodes) > 1 else None
            return UnitPart(tuple(info.nodes[i].describe() for i in m.nodes), module, e.index, e.name, v,
                            within), note
    return None, note


def _earliest_node(g: Graph, nodes: tuple[int, ...], env: dict[int, Any], convert: Callable[[Any], Any],
                   tolerances: Tolerances) -> str | None:
    """Of the nodes standing for one eager op, the earliest whose compiled value diverges from the node run at
    float64 on the compiled values of its own inputs (as replay localises inside a unit)."""
    def value(v: Any, up: bool) -> Any:
        if isinstance(v, NodeRef):
            x = env.get(v.index)
            return x.to(target_dtype(Precision.FP64, x.dtype)) if up and isinstance(x, torch.Tensor) else x
        if isinstance(v, list):
            return [value(x, up) for x in v]
        v = convert(v)
        return target_dtype(Precision.FP64, v) if up and isinstance(v, torch.dtype) else v

    for i in nodes:
        n = g.info.nodes[i]
        got = _first_tensor(env.get(i))
        if not isinstance(got, torch.Tensor) or not got.is_floating_point() or aten.is_cheap(str(n.target)):
            continue
        args, kwargs = value(n.args, False), {key: value(v, False) for key, v in n.kwargs.items()}
        fine = _first_tensor(g.targets[i](*value(n.args, True), **{key: value(v, True) for key, v in n.kwargs.items()}))
        if not isinstance(fine, torch.Tensor) or fine.shape != got.shape:
            continue
        shapes = [list(t.shape) for t in aten.iter_tensors([args, list(kwargs.values())])]
        k = reduction_length(aten.packet(str(n.target)), shapes, max(1, got.numel()))
        if judge(got, fine.to(got.device), tolerances, k).divergent:
            return n.describe()
    return None


def _first_tensor(v: Any) -> Any:
    return next((t for t in aten.iter_tensors(v)), None)


def pair_units(ref: RankTrace, ref_ops: dict[int, OpRecord], target: RankTrace, target_ops: dict[int, OpRecord],
               al: Alignment, comparer: PairComparer) -> tuple[list[UnitPair], dict[tuple[str, int], UnitPair]]:
    """Every unaligned unit of either side diffed against the other side's unaligned eager ops of its gap: the
    unit pairs, and for each op taken into one (``("ref" | "target", op number)``, the unit's own and the eager ops
    its nodes map onto) the pair it belongs to."""
    ref_only, target_only = set(al.ref_only), set(al.target_only)
    out: list[UnitPair] = []
    taken: dict[tuple[str, int], UnitPair] = {}
    sides: list[tuple[str, RankTrace, dict[int, OpRecord], set[int], str, RankTrace, dict[int, OpRecord], set[int],
                      list[tuple[int, int]]]] = [
        ("ref", ref, ref_ops, ref_only, "target", target, target_ops, target_only, al.pairs),
        ("target", target, target_ops, target_only, "ref", ref, ref_ops, ref_only, [(b, a) for a, b in al.pairs])]
    for name, u_trace, u_ops, u_only, other, e_trace, e_ops, e_only, pairs in sides:
        for u in sorted(u_only):
            op = u_ops[u]
            if not aten.is_unit(op.name) or op.unit is None or not op.unit.nodes:
                continue
            lo, hi = _gap(u, pairs, lambda a: aten.is_cheap(u_ops[a].name))
            eager = [e_ops[j] for j in sorted(e_only) if lo < j < hi and (other, j) not in taken
                     and not aten.is_unit(e_ops[j].name) and e_ops[j].phase == op.phase]
            if not eager:
                continue
            pair, matches = diff_unit(op, eager, _Sides(comparer, u_trace, e_trace, unit_is_ref=name == "ref"))
            if not matches:
                continue
            out.append(pair)
            taken[(name, u)] = pair
            for m in matches:
                taken[(other, m.eager)] = pair
    return out, taken
