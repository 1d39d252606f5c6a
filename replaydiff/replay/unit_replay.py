"""Replaying a compiled unit (record/unit_capture.py): its aten graph interpreted from the recorded inputs, judged as
ops are.

The graph is data: each node names its target, which is looked up only among registered aten/prims ops and a few
``operator`` functions (``aten.resolve_graph_target``); anything else is refused with the node's name, so a trace
can never make replay run other code. Three runs of the same graph:

* the reference: interpreted at the replay precision (float64 by default: floating inputs, constants and dtype
  arguments upcast, as an op's are);
* the dtype's own error: interpreted eagerly at the recorded dtypes on the CPU. An output over the fixed limits is
  divergent only if it is also over ``conditioning_factor`` times this error where that error itself breaks the
  limits (``verdict.calibrated``): a compiled output closer to float64 than eager is never a fault;
* for a divergent unit, localisation: the graph rebuilt from its nodes with every intermediate value an output,
  compiled with the recorded backend on this machine and run at the recorded dtypes. Each node's compiled value is
  judged against the node run at float64 on the compiled values of its own inputs; the earliest divergent node is
  named. Before that, the unit as recorded is recompiled and run on the recorded inputs: whether this machine
  reproduces the recorded outputs (bit for bit, or not: another torch, device or compiler) is said, since then
  the localisation judges this machine's kernels, not the recorded ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch

from replaydiff import device as seam
from replaydiff import aten
from replaydiff.compare.metrics import FloatError, ScalarMismatch, measure
from replaydiff.compare.tolerance import reduction_length
from replaydiff.compare.verdict import Verdict, calibrated, judge
from replaydiff.replay.policy import Precision, target_dtype
from replaydiff.replay.notes import Judgement, UnitDivergent, UnitDraws, UnitWithin
from replaydiff.replay.result import Status
from replaydiff.trace.schema import (NODE_CALL, NODE_CONST, NODE_INPUT, NODE_OUTPUT, NodeRef, Opaque, OpRecord,
                                     TensorRef, UnitInfo, UnitNode)

Pairs = list[tuple[Any, Any]]


class Graph:
    """A unit's graph with every call target resolved (or the reason it cannot be run)."""

    def __init__(self, info: UnitInfo) -> None:
        self.info = info
        self.targets: dict[int, Any] = {}
        for i, n in enumerate(info.nodes):
            if n.kind == NODE_CALL:
                try:
                    self.targets[i] = aten.resolve_graph_target(str(n.target))
                except aten.UnknownOp as exc:
                    raise Refused(f"node {n.name}: {exc}") from None
            elif n.kind not in (NODE_INPUT, NODE_CONST, NODE_OUTPUT):
                raise Refused(f"node {n.name} is of unknown kind {n.kind!r}")

    def random_nodes(self, cut: Collection[int] = ()) -> dict[int, str]:
        """Nodes whose value depends on a random node (dropout, rand): {node position: the random node's name}.
        The compiled code drew those numbers from the backend's own generator (inductor's seeds), which replay
        cannot draw again. Nodes in ``cut`` are given values (recovered draws): nothing flows through them."""
        out: dict[int, str] = {}
        for i, n in enumerate(self.info.nodes):
            if i in cut:
                continue
            func = self.targets.get(i)
            if _seeded(func):
                out[i] = n.name
                continue
            for ref in _refs([n.args, list(n.kwargs.values())]):
                if ref.index in out:
                    out[i] = out[ref.index]
                    break
        return out

    def draws(self, stored: set[int]) -> "Draws":
        """How the unit's random draws can be replayed, given the output positions whose recorded tensors are
        stored: a draw is recovered where a recorded output holds it (a mask computed from draws alone, or a
        dropout op's mask or value output, or the value of a decomposed dropout: mask * x, scaled);
        outputs behind a draw no output holds stay random."""
        d = self._draws(stored, {})
        found = self._masks_from_values(d, stored)
        return self._draws(stored, found) if found else d

    def _masks_from_values(self, d: "Draws", stored: set[int]) -> dict[int, "Pin"]:
        """Masks (random-only comparisons of a uniform draw) not recovered, whose product with a value ``x`` is
        held, after scaling by constants, by a recorded output: the mask is where that output is non-zero."""
        nodes = self.info.nodes
        recorded = self._recorded(stored)
        users: dict[int, list[int]] = {}
        for i, n in enumerate(nodes):
            if n.kind == NODE_CALL:
                for r in {r.index for r in _refs([n.args, list(n.kwargs.values())])}:
                    users.setdefault(r, []).append(i)

        def uniform(v: Any) -> bool:
            return isinstance(v, NodeRef) and aten.uniform_draw(str(nodes[v.index].target), nodes[v.index].args)

        out: dict[int, Pin] = {}
        for m in d.random:
            n = nodes[m]
            keep = aten.threshold_keep(str(n.target), n.args, uniform) if m in d.only else None
            if keep is None:
                continue
            for u in users.get(m, []):
                un = nodes[u]
                if not aten.applies_mask(str(un.target)) or len(un.args) != 2:
                    continue
                x = un.args[1] if un.args[0] == NodeRef(m) else un.args[0]
                if not isinstance(x, NodeRef) or x.index in d.random or x.index in d.only:
                    continue
                y = u
                while y not in recorded:
                    nxt = [v for v in users.get(y, []) if nodes[v].args and nodes[v].args[0] == NodeRef(y)
                           and aten.scales_by_constant(str(nodes[v].target), nodes[v].args)]
                    if len(nxt) != 1:
                        break
                    y = nxt[0]
                if y in recorded:
                    out[m] = Pin(n.name, recorded[y], keep, None, True, x.index)
                    break
        return out

    def _recorded(self, stored: set[int]) -> dict[int, int]:
        """Node -> the first stored output position that holds its value."""
        recorded: dict[int, int] = {}
        for pos, node in enumerate(self.output_nodes()):
            if node is not None and pos in stored:
                recorded.setdefault(node, pos)
        return recorded

    def _draws(self, stored: set[int], found: dict[int, "Pin"]) -> "Draws":
        nodes = self.info.nodes
        recorded = self._recorded(stored)
        items = {(n.args[0].index, n.args[1]): i for i, n in enumerate(nodes)
                 if n.kind == NODE_CALL and n.target == "operator.getitem" and len(n.args) == 2
                 and isinstance(n.args[0], NodeRef) and isinstance(n.args[1], int)}
        d = Draws({}, {}, set())
        fed: set[int] = set()  # nodes whose value depends on an input's value

        def uniform(v: Any) -> bool:
            return isinstance(v, NodeRef) and aten.uniform_draw(str(nodes[v.index].target), nodes[v.index].args)

        for i, n in enumerate(nodes):
            if n.kind == NODE_INPUT:
                fed.add(i)
            if n.kind != NODE_CALL:
                continue
            name = str(n.target)
            refs = [r.index for r in _refs([n.args, list(n.kwargs.values())])]
            src = next((d.random[r] for r in refs if r in d.random), None)
            seeded = _seeded(self.targets[i])
            if any(r in fed for r in refs) and (not seeded or aten.draw_reads_input_values(name)):
                fed.add(i)
            if seeded:
                drop = aten.dropout_args(name, n.args)
                mask_at = recorded.get(items.get((i, aten.DROPOUT_MASK_OUTPUT), -1))
                value_at = recorded.get(items.get((i, 0), -1))
                if drop is not None and src is None and (mask_at is not None or value_at is not None):
                    x = n.args[0].index if isinstance(n.args[0], NodeRef) else None
                    d.pins[i] = Pin(n.name, mask_at if mask_at is not None else value_at, 1.0 - drop[1], drop[1],
                                    mask_at is None, x)
                    if mask_at is not None:
                        d.own.add(items[(i, aten.DROPOUT_MASK_OUTPUT)])
                    continue
                d.random[i] = n.name
                if i not in fed:
                    d.only.add(i)
                continue
            if src is None and not any(r in d.only for r in refs):
                continue  # no draw behind it, or only recovered ones
            if i not in fed:
                d.only.add(i)
                if src is not None and i in recorded:  # a mask computed from draws alone, held by an output
                    d.pins[i] = Pin(n.name, recorded[i], aten.threshold_keep(name, n.args, uniform), None, False)
                    d.own.add(i)
                    continue
                if src is not None and i in found:  # such a mask, read off the value it was applied to
                    d.pins[i] = found[i]
                    continue
            if src is not None:
                d.random[i] = src
        return d

    def output_nodes(self) -> list[int | None]:
        """The node position behind each flat output (None for a constant output)."""
        for n in self.info.nodes:
            if n.kind == NODE_OUTPUT:
                return [v.index if isinstance(v, NodeRef) else None for v in flat(n.args[0] if n.args else [])]
        return []

    def mutated_inputs(self) -> set[int]:
        """Positions of the inputs the graph itself writes (in-place ops on its placeholders)."""
        inputs = {i: k for k, i in enumerate(i for i, n in enumerate(self.info.nodes) if n.kind == NODE_INPUT)}
        out = set()
        for i, func in self.targets.items():
            if isinstance(func, torch._ops.OpOverload) and aten.facts(func).writes:
                n = self.info.nodes[i]
                for v in aten.written_values(aten.facts(func), n.args, n.kwargs):
                    if isinstance(v, NodeRef) and v.index in inputs:
                        out.add(inputs[v.index])
        return out


@dataclass(frozen=True)
class Pin:
    """A random node whose draw is recovered from one recorded output of the unit."""

    name: str  # the node's name
    output: int  # the recorded output that holds the draw
    keep: float | None  # the probability that a mask position is kept (None: unknown, no binomial check)
    p: float | None = None  # a dropout op's p; None for a node computed from draws alone (its value is the output)
    from_value: bool = False  # the mask is where a recorded value output is non-zero (no mask output)
    input: int | None = None  # from_value: the node the mask multiplies (where it is 0, the value says nothing)


@dataclass
class Draws:
    """A unit's random draws: those recovered from recorded outputs, and the nodes still behind an unknown one."""

    pins: dict[int, Pin]  # node position -> how its draw is recovered
    random: dict[int, str]  # node position -> the random node (not recovered) its value depends on
    only: set[int]  # nodes computed from draws and constants alone (seeds, uniform draws, masks)
    own: set[int] = field(default_factory=set)  # nodes whose recorded value is the draw itself (a recovered mask)


# Binomial bound on a mask's kept count: |kept - n*q| <= Z * sqrt(n*q*(1-q)) + 1/2. At 6 standard deviations a
# correct dropout fails it about once in 10^9 masks; a wrong keep probability (p for 1 - p) fails it once the mask
# holds a few hundred positions.
_BINOMIAL_Z = 6.0


def binomial_within(kept: int, n: int, q: float) -> tuple[bool, float]:
    """Whether ``kept`` of ``n`` positions is a plausible draw with keep probability ``q``; and the allowed spread."""
    spread = _BINOMIAL_Z * math.sqrt(n * q * (1.0 - q)) + 0.5
    return abs(kept - n * q) <= spread, spread


def _mask_of(held: Any, pin: Pin) -> Any:
    """A recovered mask node's value from the recorded output that holds it (itself, or a value it was applied to)."""
    return held != 0 if pin.from_value and isinstance(held, torch.Tensor) else held


def _seeded(func: Any) -> bool:
    return isinstance(func, torch._ops.OpOverload) and aten.facts(func).seeded


class Refused(Exception):
    """The unit's graph cannot be interpreted here; the message says which node and why."""


def _refs(v: Any):
    if isinstance(v, NodeRef):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _refs(x)


def _materialize(v: Any, env: list, convert: Callable[[Any], Any]) -> Any:
    if isinstance(v, NodeRef):
        return env[v.index]
    if isinstance(v, list):
        return [_materialize(x, env, convert) for x in v]
    return convert(v)


def interpret(g: Graph, inputs: list, consts: list, convert: Callable[[Any], Any],
              on_node: Callable[[int, UnitNode, Any, list, dict], None] | None = None,
              pinned: dict[int, Callable[[list], Any]] | None = None) -> tuple[list, list]:
    """Run the graph node by node: (flat outputs, every node's value). ``convert`` maps constant arguments (dtype,
    device, recorded values); ``on_node`` sees each call with its output and arguments; ``pinned`` computes the
    nodes whose draws were recovered (from their arguments) instead of drawing."""
    pinned = pinned or {}
    env: list = []
    k = 0
    outputs: list = []
    for i, n in enumerate(g.info.nodes):
        if n.kind == NODE_INPUT:
            env.append(inputs[k])
            k += 1
        elif n.kind == NODE_CONST:
            env.append(consts[int(n.target)])
        elif n.kind == NODE_CALL:
            args = _materialize(n.args, env, convert)
            kwargs = {key: _materialize(v, env, convert) for key, v in n.kwargs.items()}
            out = pinned[i](args) if i in pinned else g.targets[i](*args, **kwargs)
            env.append(out)
            if on_node is not None:
                on_node(i, n, out, args, kwargs)
        else:
            env.append(None)
            outputs = list(flat(_materialize(n.args[0] if n.args else [], env, convert)))
    return outputs, env


def flat(v: Any):
    """The leaves of a nested list/tuple of values or node references, in order."""
    if isinstance(v, (list, tuple)) and not isinstance(v, NodeRef):
        for x in v:
            yield from flat(x)
    else:
        yield v


def node_k(n: UnitNode, out: Any, args: list, kwargs: dict) -> int:
    """The longest sum behind a call node's value (its first tensor), for scaling the limits: 1 for none."""
    for t in aten.iter_tensors(out):
        return reduction_length(aten.packet(str(n.target)), _shapes(args, kwargs), max(1, t.numel()))
    return 1


def _shapes(args: list, kwargs: dict) -> list[list[int]]:
    return [list(t.shape) for t in aten.iter_tensors([args, list(kwargs.values())])]


class UnitReplayer:
    """Replays one unit record for an ``OpReplayer`` (its trace, options and input builder)."""

    def __init__(self, replayer: Any, inputs: type, skip: type[Exception]) -> None:
        """``replayer``: the OpReplayer (trace, options, device); ``inputs``: its input builder class (rebuilds
        recorded tensors at a precision); ``skip``: its exception for an op not replayed."""
        self.r = replayer
        self.trace = replayer.trace
        self.opts = replayer.opts
        self._build = inputs
        self._skip = skip

    def _inputs(self, op: OpRecord, precision: Precision, keep: bool, device: torch.device, info: UnitInfo
                ) -> tuple[list, list, Callable[[Any], Any]]:
        build = self._build(self.trace, precision, keep, device, None)

        def convert(v: Any) -> Any:
            if isinstance(v, Opaque):
                raise Refused(f"an argument of kind {v.kind!r} cannot be rebuilt")
            return build.value(v)

        return [build.value(a) for a in op.args], [build.value(c) for c in info.consts], convert

    def replay(self, op: OpRecord) -> tuple[Judgement, Pairs, bool | None]:
        Skip = self._skip
        info = op.unit
        if info is None or info.note:
            raise Skip(f"compiled unit without a replayable graph ({info.note if info else 'none stored'})",
                       unjudged=True)
        if not aten.matches_any(op.name, self.opts.ops):
            raise Skip("not selected by --op")
        try:
            g = Graph(info)
        except Refused as exc:
            raise Skip(f"unit graph not replayed: {exc}", unjudged=True) from None
        where = f"unit of {info.region} (graph {info.graph_id}, {info.backend})"
        recorded = list(flat(op.outputs))
        draws = g.draws({n for n, r in enumerate(recorded) if isinstance(r, TensorRef) and r.stored
                         and not r.uninitialised})
        behind = g.output_nodes()
        precision = self.opts.precision
        # The reference: the graph at the replay precision; k is the longest sum behind any node (limit scaling)
        ks = [1]

        def note_k(i: int, n: UnitNode, out: Any, args: list, kwargs: dict) -> None:
            ks.append(node_k(n, out, args, kwargs))

        try:
            ins, consts, convert = self._inputs(op, precision, precision is Precision.SAME, self.r.device, info)
            ref_out, ref_env = interpret(g, ins, consts, convert, note_k, self._pinned(draws, recorded, convert))
            same_ins, same_consts, same_convert = self._inputs(op, Precision.SAME, True, torch.device("cpu"), info)
            same_out, _ = interpret(g, same_ins, same_consts, same_convert, None,
                                    self._pinned(draws, recorded, same_convert))
        except Refused as exc:
            raise Skip(f"unit graph not replayed: {exc}", unjudged=True) from None
        k = max(ks)
        pairs, judged, same_vals = self._judge_outputs(op, g, draws, ref_out, ins, same_out, same_ins, k)
        finite = True
        for _, v in judged:
            if getattr(v.measure, "nonfinite_recorded", 0):
                finite = False
        checked, odd = self._check_draws(g, draws, recorded, ref_env)
        unknown = {n: draws.random[b] for n, b in enumerate(behind) if b is not None and b in draws.random}
        notes: tuple = ()
        if draws.pins or unknown:
            notes = (UnitDraws(tuple(checked), len(unknown), tuple(sorted(set(unknown.values())))),)
        bad = odd + [(n, v) for n, v in judged if v.divergent]  # a wrong draw first: the values follow from it
        if bad:
            n, v = bad[0]
            try:
                within = {m for m, w in judged if not w.divergent}
                found = self.localize(op, g, draws, Outputs(bad, within, pairs, same_vals, k, self._judge))
            except Exception as exc:  # localisation is extra: the unit's verdict stands
                found = f"not localised ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]})"
            return Judgement(Status.DIVERGENT, v, (UnitDivergent(where, n, v.reason, found),) + notes), pairs, finite
        if judged:
            verdict = max((v for _, v in judged), key=lambda v: (v.explanation is not None, v.severity))
            return (Judgement(Status.OK, verdict, (UnitWithin(where, len(judged), verdict.explanation),) + notes),
                    pairs, finite)
        return Judgement(Status.OK, None, (UnitWithin(where, 0, None),) + notes), pairs, finite

    def _pinned(self, draws: Draws, recorded: list, convert: Callable[[Any], Any]
                ) -> dict[int, Callable[[list], Any]]:
        """For each recovered draw, its node computed from the recorded output that holds it (at the run's
        precision): a mask is the recorded mask; a dropout op is its input times the recorded mask, scaled."""
        out: dict[int, Callable[[list], Any]] = {}
        for i, pin in draws.pins.items():
            held = recorded[pin.output]
            if pin.p is None:
                out[i] = lambda args, held=held, pin=pin: _mask_of(convert(held), pin)
            else:
                def dropout(args: list, held: Any = held, pin: Pin = pin) -> tuple:
                    mask = convert(held)
                    mask = mask != 0 if pin.from_value else mask.to(torch.bool)
                    return aten.dropout_value(args[0], mask.to(args[0].device), pin.p), mask
                out[i] = dropout
        return out

    def _check_draws(self, g: Graph, draws: Draws, recorded: list, env: list
                     ) -> tuple[list[str], list[tuple[int, Verdict]]]:
        """The statistics of each recovered mask: its kept count against its keep probability (a binomial bound).
        A sentence per draw, and a divergent verdict (at the output holding it) for each count out of bounds."""
        said, bad = [], []
        for i, pin in draws.pins.items():
            node = g.info.nodes[i]
            mask = self.trace.tensor(recorded[pin.output])
            how = f"{node.name} from output {pin.output}"
            if pin.from_value:  # where the masked input is 0, the value says nothing of the mask
                x = env[pin.input] if pin.input is not None else None
                valid = ((x != 0).to(mask.device) if isinstance(x, torch.Tensor)
                         else torch.ones_like(mask, dtype=torch.bool))
                mask, how = (mask != 0) & valid, how + " (its mask: where the value is non-zero)"
                n = int(valid.sum())
            else:
                n = mask.numel()
            if pin.keep is None:
                said.append(f"{how}: kept fraction not checked (its keep probability is unknown)")
                continue
            kept = int((mask != 0).sum())
            ok, spread = binomial_within(kept, n, pin.keep)
            figure = f"kept {kept} of {n}, {n * pin.keep:.0f} ± {spread:.0f} expected at keep probability {pin.keep:g}"
            said.append(f"{how}: {figure}")
            if not ok:
                bad.append((pin.output, Verdict(True, ScalarMismatch(kept, round(n * pin.keep)),
                                                f"random draw {node.name} {figure} (binomial bound)")))
        return said, bad

    def _judge_outputs(self, op: OpRecord, g: Graph, draws: Draws, ref_out: list, ref_ins: list, same_out: list,
                       same_ins: list, k: int) -> tuple[Pairs, list[tuple[int, Verdict]], list]:
        recorded = list(flat(op.outputs))
        pairs: Pairs = list(zip(recorded, ref_out))
        same_vals = list(same_out)
        mutated = g.mutated_inputs()
        for path, after in op.writes:  # inputs the graph writes: judged as they are after it
            if path.kind == "arg" and path.key in mutated:
                pairs.append((after, ref_ins[path.key]))
                same_vals.append(same_ins[path.key])
        judged = []
        behind = g.output_nodes()
        for n, (rec, value) in enumerate(pairs):
            if not isinstance(rec, TensorRef) or not isinstance(value, torch.Tensor):
                continue
            node = behind[n] if n < len(behind) else None
            # drawn by the backend's generator and not recovered: not comparable value by value; a draw itself
            # (a recovered mask) is its own reference, checked by statistics instead
            if node is not None and (node in draws.random or node in draws.own):
                continue
            if not rec.stored or rec.uninitialised:
                continue
            same = same_vals[n] if n < len(same_vals) else None
            judged.append((n, self._judge(self.trace.tensor(rec), value, same, k)))
        return pairs, judged, same_vals

    def _judge(self, recorded: torch.Tensor, value: torch.Tensor, same: Any, k: int) -> Verdict:
        """The verdict on one compiled value against its reference, calibrated by the eager run at its dtype."""
        tol = self.opts.tolerances
        value = value.to(recorded.device)
        if not (recorded.is_floating_point() or recorded.is_complex()):
            return judge(recorded, value.to(recorded.dtype), tol, k, exact=True)
        v = judge(recorded, value, tol, k)
        if v.divergent and isinstance(v.measure, FloatError) and isinstance(same, torch.Tensor) \
                and same.shape == value.shape:
            v = calibrated(v, measure(same.to(recorded.device), value), str(same.dtype).removeprefix("torch."),
                           tol.conditioning_factor)
        return v

    # -- localisation ------------------------------------------------------------------------------------------
    def localize(self, op: OpRecord, g: Graph, draws: Draws | None = None, judged: "Outputs | None" = None) -> str:
        """Where inside the unit its error comes from (see the module docstring). When this machine's recompile of
        the unit reproduces the recording, or is as wrong as it, the earliest node whose compiled output diverges
        given its own inputs. When it does not reproduce it and its own outputs are within limits (``judged``: the
        unit's outputs as judged, to judge this machine's against), the fault is in the recorded compiled code,
        which this machine does not run: the recorded outputs that diverge and the nodes behind them are named from
        the trace instead. Masks recovered from recorded outputs are inputs of the recompiled graph, so that its
        values after them are the recorded unit's, not a new draw's."""
        info = g.info
        draws = draws or Draws({}, {}, set())
        backend = info.backend or "inductor"
        device, moved = compile_device(op)
        ins, consts, convert = self._inputs(op, Precision.SAME, True, device, info)
        leaves = list(flat(op.outputs))
        recorded = [self.trace.tensor(r) if isinstance(r, TensorRef) and r.stored else None for r in leaves]
        held = sorted(i for i, pin in draws.pins.items() if pin.p is None)
        ins = list(ins) + [_mask_of(convert(leaves[draws.pins[i].output]), draws.pins[i]) for i in held]
        fresh = g.random_nodes(cut=set(held))  # still drawn anew by the recompiled graph
        behind = g.output_nodes()
        torch_version = torch.__version__ + (f", on {device.type}: {moved}" if moved else "")
        # 1. this machine's compile of the unit as recorded
        try:
            run = compile_graph(g, consts, convert, backend, every_node=False, held=held)
            out = run([x.clone() if isinstance(x, torch.Tensor) else x for x in ins])
            same = all(r is None or (n < len(behind) and behind[n] in fresh)
                       or (isinstance(o, torch.Tensor) and o.shape == r.shape and torch.equal(o.to(r.device), r))
                       for n, (r, o) in enumerate(zip(recorded, out)))
            if not same and judged is not None and judged.within(out):
                return self._recorded_code_at_fault(g, judged, set(draws.pins) | draws.own, backend, torch_version)
            repro = ("this machine's " + backend + " reproduces the recorded outputs bit for bit" if same else
                     f"this machine's {backend} (torch {torch_version}) does NOT reproduce the recorded outputs "
                     f"bit for bit (another torch, device or compiler): the nodes judged are this machine's kernels")
        except Exception as exc:
            return (f"could not recompile the unit with {backend} here ({type(exc).__name__}: "
                    f"{(str(exc).splitlines() or [''])[0][:120]}); judged: the unit's outputs only")
        # 2. every node's value from one compile, each judged against the node at float64 on its own inputs; a
        # draw (a random op, a value computed from draws alone) is not judged: the backend's generator is not eager's
        compiled_vals = compile_graph(g, consts, convert, backend, every_node=True, held=held)(list(ins))
        calls = [i for i, n in enumerate(info.nodes) if n.kind == NODE_CALL and i not in held]
        drawn = set(g.random_nodes()) & (draws.only | {i for i in calls if _seeded(g.targets[i])})
        env: list = []
        k_in = 0
        by_node = dict(zip(calls, compiled_vals))
        by_node.update(zip(held, ins[len(ins) - len(held):]))
        for i, n in enumerate(info.nodes):
            if n.kind == NODE_INPUT:
                env.append(ins[k_in])
                k_in += 1
            elif n.kind == NODE_CONST:
                env.append(consts[int(n.target)])
            elif n.kind == NODE_CALL:
                got = by_node[i]
                verdict = None if i in drawn else self._judge_node(g, i, n, env, convert, got)
                if verdict is not None and verdict.divergent:
                    at = f" in {n.module}" if n.module else ""
                    return (f"earliest divergent node given its own inputs: {n.describe()}{at} "
                            f"({verdict.reason}; kernels {', '.join(info.kernels) or 'not named'}); {repro}")
                env.append(got)
            else:
                env.append(None)
        return f"no single node diverges given its own inputs (the error builds up across nodes); {repro}"

    def _recorded_code_at_fault(self, g: Graph, judged: "Outputs", drawn: set[int], backend: str,
                                torch_version: str) -> str:
        """The sentence for a unit whose recorded outputs diverge while this machine's compile of it does not: the
        fault is in the compiled code that ran when recording. Localised from what the trace holds: the earliest
        divergent recorded output (those saved for the backward are outputs too), the node behind it and the nodes
        that computed it from values known to be right (the unit's inputs, recorded outputs within limits); then
        the later divergent outputs, which may only carry its error. ``drawn``: random nodes whose draws were
        recovered from the recording (known too)."""
        behind = g.output_nodes()
        nodes = g.info.nodes
        node_of = lambda n: behind[n] if n < len(behind) else None  # noqa: E731  (None: a written input)
        bad = sorted(judged.bad, key=lambda nv: (node_of(nv[0]) is None, node_of(nv[0]) or 0, nv[0]))
        good = ({node_of(n) for n in judged.good} - {None}) | drawn
        head = (f"the fault is in the recorded compiled code: this machine's {backend} (torch {torch_version}) "
                f"recompiles the unit with outputs within limits, not bit for bit the recorded ones; of the recorded "
                f"outputs, {len(bad)} diverge from the float64 graph")
        first, verdict = bad[0]
        node = node_of(first)
        if node is None:
            return f"{head}, the earliest written input {first} ({verdict.reason})"
        nd = nodes[node]
        at = f" in {nd.module}" if nd.module else ""
        made = [nodes[i].name for i in sorted(self._computed_by(g, node, good))
                if not aten.is_cheap(str(nodes[i].target)) and not aten.is_graph_plumbing(str(nodes[i].target))]
        out = (f"{head}, earliest output {first}: {nd.describe()}{at} ({verdict.reason}), computed inside the unit "
               f"by {', '.join(made) or nd.name} from the unit's inputs and recorded values within limits")
        later = []
        for n, _ in bad[1:]:
            i = node_of(n)
            later.append(f"output {n}" + (f" {nodes[i].name}" + (f" in {nodes[i].module}" if nodes[i].module else "")
                                          if i is not None else " (a written input)"))
        if later:
            more = f" and {len(later) - 4} more" if len(later) > 4 else ""
            out += f"; later: {'; '.join(later[:4])}{more}"
        return out

    @staticmethod
    def _computed_by(g: Graph, node: int, known: set[int]) -> set[int]:
        """The call nodes ``node`` is computed from (itself included), walking back to the unit's inputs,
        constants and the nodes in ``known``."""
        nodes = g.info.nodes
        seen: set[int] = set()
        todo = [node]
        while todo:
            i = todo.pop()
            if i in seen or nodes[i].kind != NODE_CALL or (i in known and i != node):
                continue
            seen.add(i)
            todo.extend(r.index for r in _refs([nodes[i].args, list(nodes[i].kwargs.values())]))
        return seen

    def _judge_node(self, g: Graph, i: int, n: UnitNode, env: list, convert: Callable[[Any], Any], got: Any
                    ) -> Verdict | None:
        """The node run at float64 (and at its dtype, for its own error) on the compiled values of its inputs,
        against its compiled value: the first divergent tensor of its outputs, or None."""
        got_t = [t for t in aten.iter_tensors(got)]
        if not any(t.is_floating_point() or t.is_complex() for t in got_t) or aten.is_cheap(str(n.target)):
            return None
        func = g.targets[i]
        args = _materialize(n.args, env, convert)
        kwargs = {key: _materialize(v, env, convert) for key, v in n.kwargs.items()}
        up = lambda v: v.to(target_dtype(Precision.FP64, v.dtype)) if isinstance(v, torch.Tensor) else (  # noqa: E731
            target_dtype(Precision.FP64, v) if isinstance(v, torch.dtype) else v)
        fine = list(aten.iter_tensors(func(*_map(args, up), **{key: _map(v, up) for key, v in kwargs.items()})))
        same = list(aten.iter_tensors(func(*args, **kwargs)))
        k = reduction_length(aten.packet(str(n.target)), _shapes(args, kwargs), max(1, got_t[0].numel()))
        for c, f, s in zip(got_t, fine, same):
            if (c.is_floating_point() or c.is_complex()) and f.shape == c.shape:
                v = self._judge(c, f, s, k)
                if v.divergent:
                    return v
        return None


@dataclass(frozen=True)
class Outputs:
    """A unit's outputs as judged against the float64 graph: the divergent ones, and what judges any value of them
    (the reference, the eager run at the recorded dtype and the reduction length), for this machine's recompile."""

    bad: list[tuple[int, Verdict]]  # (output position, verdict), divergent
    good: set[int]  # output positions judged within limits
    pairs: Pairs  # (recorded, reference) per output and written input
    same: list  # the graph run eagerly at the recorded dtypes, per output and written input
    k: int
    judge: Callable[[torch.Tensor, torch.Tensor, Any, int], Verdict]  # (value, reference, eager value, k)

    def within(self, values: list) -> bool:
        """Whether every output that diverges in the recording is within limits in ``values`` (a recompile's
        outputs, in the same order)."""
        judge = self.judge
        for n, _ in self.bad:
            if n >= len(values) or n >= len(self.pairs) or not isinstance(values[n], torch.Tensor):
                return False
            ref = self.pairs[n][1]
            same = self.same[n] if n < len(self.same) else None
            if not isinstance(ref, torch.Tensor) or judge(values[n], ref, same, self.k).divergent:
                return False
        return True


def compile_device(op: OpRecord) -> tuple[torch.device, str | None]:
    """Where to recompile a unit: the device it was recorded on when this machine has it, else the CPU (and why)."""
    recorded = next((r.device for r in op.inputs() if isinstance(r.device, str)), "cpu")
    dev = torch.device(recorded)
    if dev.type == "cpu":
        return dev, None
    if seam.replay_device_problem(torch.device(dev.type, dev.index or 0)) is None:
        return dev, None
    return torch.device("cpu"), f"recorded on {recorded}, which this machine does not have"


def _map(v: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(v, (list, tuple)):
        return [_map(x, fn) for x in v]
    return fn(v)


def compile_graph(g: Graph, consts: list, convert: Callable[[Any], Any], backend: str, every_node: bool,
                  held: Sequence[int] = ()) -> Callable[[list], list]:
    """The graph rebuilt as an FX graph from its resolved targets (never from code in the trace) and compiled
    with ``backend``. ``every_node``: its outputs are every call node's first tensor value, in order. ``held``:
    call nodes that become inputs instead (given after the graph's own inputs, in this order)."""
    root = torch.nn.Module()
    fx = torch.fx.Graph()
    env: list = []
    values = []
    placeholders = {i: fx.placeholder(f"in{k}") for k, i in
                    enumerate([i for i, n in enumerate(g.info.nodes) if n.kind == NODE_INPUT] + list(held))}
    for i, n in enumerate(g.info.nodes):
        if n.kind == NODE_INPUT or i in held:
            env.append(placeholders[i])
        elif n.kind == NODE_CONST:
            name = f"const{n.target}"
            root.register_buffer(name, consts[int(n.target)])
            env.append(fx.get_attr(name))
        elif n.kind == NODE_CALL:
            node = fx.call_function(g.targets[i], tuple(_materialize(n.args, env, convert)),
                                    {key: _materialize(v, env, convert) for key, v in n.kwargs.items()})
            env.append(node)
            values.append(node)
        else:
            env.append(None)
            if not every_node:
                fx.output(_materialize(n.args[0] if n.args else [], env, convert))
    if every_node:
        fx.output(values)
    gm = torch.fx.GraphModule(root, fx)
    compiled = torch.compile(gm, backend=backend, dynamic=False)

    def run(inputs: list) -> list:
        with torch.no_grad():
            out = compiled(*inputs)
        return list(flat(out)) if not every_node else list(out)

    return run
