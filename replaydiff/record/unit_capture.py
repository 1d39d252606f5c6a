"""Compiled units: ``torch.compile`` regions run compiled while recording, each call of a compiled graph one record.

How (docs/design/compile.md, "Units"):

* The recording mode answers ``ignore_compile_internals()`` True once capture is engaged (as torch's DebugMode
  does), so dynamo compiles with the modes off and runs the compiled code with the recorder on the stack.
* While recording, dynamo's stance forces one backend, ``capture_backend``, for every region
  (``torch._dynamo.eval_frame._set_stance``; the stance before is put back when recording pauses or stops, and the
  job's own cached code runs again). It compiles exactly as the region's own backend would (inductor:
  ``compile_fx`` with the region's config; aot_eager: ``aot_eager``), but wraps each aten-level graph AOTAutograd
  hands to the forward and backward compilers. A backend it does not know compiles unwrapped (its code then runs
  under the recorder as it would, and the manifest's compiled_regions say so).
* The wrapper of each compiled graph, called while a capturing recorder is on: describes the flat inputs (through
  the recorder's storage table, so a parameter is the same storage version as in eager ops), runs the compiled code
  with every dispatch mode off (inductor's buffer allocations and extern kernels are parts of the unit, not ops of
  their own), then describes the outputs and the inputs the graph mutates, and writes one record named
  ``compiled.unit.<kind>`` holding the graph as data (``schema.wire_set_unit``).

Recompiling each region once per process under the capture backend is the price (the inductor FX graph cache makes
it cheap for a region compiled before). The compiled code itself is the same the job runs: the recorded step is bit
for bit the unrecorded compiled step. Nothing here raises into the job: a failure to engage leaves the recording as
it was before units (regions run eager, each op recorded), with one warning; a unit that cannot be described is a
numbered stub with the reason.
"""
from __future__ import annotations

import itertools
import logging
import re
import sys
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from replaydiff.errors import prefixed
from replaydiff import aten
from replaydiff.record.mode import RecordingMode, select
from replaydiff.trace import schema

log = logging.getLogger("replaydiff")

_AOT_EAGER = ("aot_eager",)  # aot_eager takes fw_compiler/bw_compiler (torch/_dynamo/backends/debugging.py)
_ids = itertools.count()
_capturing: list[Any] = []  # recorders capturing units now (innermost last)
_KERNEL_NAME = re.compile(r"\b((?:cpp|triton)_\w+?_\d+|extern_kernels\.\w+)\b")


class CapturingMode(RecordingMode):
    """The recording mode of ``record(compiled="capture")``: lets dynamo compile and run compiled code once capture
    is engaged; before that (and if it never is) torch treats it as any mode: regions run eager."""

    capturing = False

    def ignore_compile_internals(self) -> bool:  # noqa: D102  (torch calls it on the instance)
        return self.capturing


# -- the graph as data ------------------------------------------------------------------------------------------
class UnitGraph:
    """One compiled aten graph: its nodes in wire form (built once, at compile time), its constant tensors, the
    inputs it mutates, and its kernel names once the backend gives them."""

    def __init__(self, gm: torch.fx.GraphModule | None, region: str, backend: str, kind: str,
                 note: str | None = None) -> None:
        self.region, self.backend, self.kind = region, backend, kind
        self.graph_id = f"{next(_ids)}"
        self.kernels: list[str] = []
        self.consts: list[Any] = []
        self.mutated: set[int] = set()
        self.note = note
        self.nodes: list = []
        if gm is None:  # boundaries only (note says why)
            return
        try:
            self.nodes = self._encode(gm)
        except Exception as exc:  # boundaries are still recorded; replay says why the unit cannot be run
            self.nodes, self.consts = [], []
            self.note = f"graph not stored ({type(exc).__name__}: {exc})"

    def _encode(self, gm: torch.fx.GraphModule) -> list:
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        inputs = {n: k for k, n in enumerate(n for n in nodes if n.op == "placeholder")}

        def no_tensor(t: torch.Tensor) -> dict:
            raise TypeError("a tensor inside a node's arguments")

        def enc(v: Any) -> Any:
            return schema.encode_graph_value(v, lambda x: pos.get(x) if isinstance(x, torch.fx.Node) else None,
                                             no_tensor)

        out = []
        root = _region_class(self.region)
        for n in nodes:
            src = _node_module(n, root)
            if n.op == "placeholder":
                out.append(schema.wire_node(schema.NODE_INPUT, n.name, None, [], {}, src))
            elif n.op == "get_attr":
                value = gm
                for part in str(n.target).split("."):
                    value = getattr(value, part)
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"attribute {n.target} is a {type(value).__name__}")
                self.consts.append(value)
                out.append(schema.wire_node(schema.NODE_CONST, n.name, len(self.consts) - 1, [], {}, src))
            elif n.op == "call_function":
                target = n.target
                if isinstance(target, torch._ops.OpOverload) and aten.facts(target).writes:
                    for v in aten.written_values(aten.facts(target), n.args, n.kwargs):
                        if isinstance(v, torch.fx.Node) and v in inputs:
                            self.mutated.add(inputs[v])
                out.append(schema.wire_node(schema.NODE_CALL, n.name, aten.graph_target_name(target),
                                            enc(list(n.args)), {k: enc(v) for k, v in n.kwargs.items()}, src))
            elif n.op == "output":
                out.append(schema.wire_node(schema.NODE_OUTPUT, n.name, None, enc(list(n.args)), {}, None))
            else:
                raise TypeError(f"node {n.name} is a {n.op}")
        return out


def _node_module(n: torch.fx.Node, root: str | None = None) -> str | None:
    """The module a node was traced in, as ``Sequential.1 (GELU)`` or ``Net.block.ln1 (LayerNorm)``: dynamo's
    ``nn_module_stack`` (its innermost entry, its path under the region's root module), which AOTAutograd keeps on
    the aten nodes. Dynamo names a module by how the region reached it: ``L['fn'].1`` for a module the region calls
    (the stack then begins at the root, ``L['fn']``), ``L['self'].block.ln1`` for a region that is the root's own
    forward, whose stack holds only the submodules: the root's class is then ``root`` (the region's class)."""
    stack = n.meta.get("nn_module_stack") if hasattr(n, "meta") else None
    if not stack:
        return None
    entries = list(stack.values())
    path, typ = entries[-1][0], entries[-1][1]
    short = lambda t: (getattr(t, "__name__", None) or str(t)).rsplit(".", 1)[-1]  # noqa: E731
    bracket = path.find("]")
    dot = path.find(".", bracket if bracket >= 0 else 0)
    head = path if dot < 0 else path[:dot]  # L['self'], L['fn']
    if entries[0][0] == head:
        name = short(entries[0][1])
    elif root:
        name = root
    else:  # no root known: the path as dynamo wrote it
        return f"{path} ({short(typ)})"
    return f"{name}{path[len(head):]} ({short(typ)})"


def _region_class(region: str) -> str | None:
    """The class of a region that is a module's forward (``Net.forward (model.py:12)`` -> ``Net``), else None."""
    qual = region.split(" (")[0]
    return qual.rsplit(".", 1)[0].rsplit(".", 1)[-1] if qual.endswith(".forward") and "." in qual else None


# -- the compiled graph's runtime callable ----------------------------------------------------------------------
class UnitCall:
    """The runtime callable of one compiled graph (boxed calling convention, as AOTAutograd calls it): a unit
    record per call while a capturing recorder is on, the compiled code alone otherwise."""

    _boxed_call = True

    def __init__(self, compiled: Any, graph: UnitGraph) -> None:
        self._boxed_call = True  # in the instance dict too: torch._dynamo.disable's functools.wraps copies only it
        self._compiled = compiled
        self._graph = graph
        try:  # inductor's CompiledFxGraph keeps its generated wrapper; only the kernel names are taken from it
            code = getattr(compiled, "source_code", None)
            if isinstance(code, str):
                graph.kernels = sorted(set(_KERNEL_NAME.findall(code)))
        except Exception:
            pass

    def __getattr__(self, name: str) -> Any:  # OutputCode's other attributes, for AOTAutograd's wrappers
        return getattr(self._compiled, name)

    def __call__(self, args: list) -> Any:
        rec = _capturing[-1] if _capturing else None
        if rec is None or not rec.active:
            return self._run(args)
        return record_unit(rec, self._graph, args, self._run)

    def _run(self, args: list) -> Any:
        if getattr(self._compiled, "_boxed_call", False):
            return self._compiled(args)
        return self._compiled(*args)


def record_unit(rec: Any, g: UnitGraph, args: list, run: Callable[[list], Any]) -> Any:
    """Run one compiled graph call (always, exactly once) and record it as a unit."""
    inputs = list(args)  # the boxed call may clear ``args``
    pending = None
    index = rec.next_index
    rec.next_index += 1
    try:
        pending = _unit_before(rec, g, inputs, index)
    except Exception as exc:
        _unit_failed(rec, g, inputs, exc, index)
    # With every mode off: the unit stands for the allocations and extern kernels of the compiled code.
    with _disable_current_modes():
        out = run(args)
    if pending is not None:
        try:
            _unit_after(rec, g, inputs, pending, out)
        except Exception as exc:
            _unit_failed(rec, g, inputs, exc, index)
    return out


def _unit_before(rec: Any, g: UnitGraph, inputs: list, index: int) -> tuple[dict, list]:
    b = rec.builder
    ctx = rec.context
    phase, module, fwd, _ = ctx.place(index)
    where = ctx.source()
    source, text = where if where is not None else (None, None)
    name = aten.unit_name(g.kind)
    select(b, rec.options, name, module)  # its own --module/--op decision, not the previous op's
    record = schema.wire_op(index, name, phase, module, fwd, source, text)
    if rec.step is not None:
        schema.wire_set_step(record, rec.step)
    schema.wire_set_inputs(record, b.encode(inputs), {})
    b.flush_stats()  # inputs the graph may write get their statistics as they are now
    versions = [t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None for t in inputs]
    return record, versions


def _unit_after(rec: Any, g: UnitGraph, inputs: list, pending: tuple[dict, list], out: Any) -> None:
    record, versions = pending
    b = rec.builder
    written = set(g.mutated)
    for i, (t, v) in enumerate(zip(inputs, versions)):
        if v is not None and t._version != v:  # written behind the graph (an epilogue, an extern kernel)
            written.add(i)
    for i in sorted(written):
        t = inputs[i]
        if isinstance(t, torch.Tensor):
            rec.storages.bump(rec.storages.entry(t.untyped_storage()))
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    writes = [(("arg", i), b.encode(inputs[i])) for i in sorted(written) if isinstance(inputs[i], torch.Tensor)]
    schema.wire_set_outputs(record, b.encode(outs), writes, False)
    schema.wire_set_unit(record, g.region, g.backend, g.graph_id, g.kind, g.nodes, b.encode(g.consts),
                         g.kernels, g.note)
    b.add_op(record)


def _unit_failed(rec: Any, g: UnitGraph, inputs: list, exc: Exception, index: int) -> None:
    """A unit that could not be described: a numbered stub with the reason; what it may write gets new versions."""
    why = f"compiled unit could not be recorded ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})"
    try:
        stub = schema.wire_op(index, aten.unit_name(g.kind), None, None, None, None)
        rec.builder.add_op(schema.wire_not_recorded(stub, why))
        for t in inputs:
            if isinstance(t, torch.Tensor):
                rec.storages.bump(rec.storages.entry(t.untyped_storage()))
        if not getattr(rec, "_unit_warned", False):
            rec._unit_warned = True
            rec._warn(f"unit #{index} ({g.region}) {why}; recording goes on")
        rec.writer.note_lost(f"unit #{index} ({g.region}) {why}")
    except Exception as exc2:
        rec.disable(f"{why}; then {exc2}")


# -- the backend forced while recording -------------------------------------------------------------------------
def _region_of_compile() -> tuple[str, Any]:
    """(region name, the region's own dynamo callback) of the compile in progress, from dynamo's compile_wrapper
    frame on this thread's stack."""
    from replaydiff.record.compiled import _COMPILE_WRAPPER, _eval_frame_file, _region_name

    ef_file = _eval_frame_file()
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == _COMPILE_WRAPPER and f.f_code.co_filename == ef_file:
            return _region_name(f.f_locals.get("fn")), f.f_locals.get("callback")
        f = f.f_back
    return "compiled region", None


def _graph_kind(kwargs: dict) -> str:
    if kwargs.get("is_backward"):
        return "backward"
    return "inference" if kwargs.get("is_inference") else "forward"


def capture_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """The backend dynamo compiles with while units are captured: the region's own backend, its aten graphs
    wrapped. One object for the process, so a region recompiled for one recording is cached for the next."""
    from replaydiff.record.compiled import user_compiler

    try:
        region, callback = _region_of_compile()
        name, compiler = user_compiler(callback)
    except Exception as exc:  # never into the job: the graph runs as eager aten ops, each recorded
        log.warning(prefixed("a compiled region runs eager while recording (its backend could not be found: "
                             "%s)"), exc)
        return gm.forward

    def wrap(compiled: Any, graph_gm: torch.fx.GraphModule, kind: str) -> Any:
        return UnitCall(compiled, UnitGraph(graph_gm, region, name or "?", kind))

    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(g: torch.fx.GraphModule, ex: Any, **kw: Any) -> Any:
            graph = UnitGraph(g, region, "inductor", _graph_kind(kw))  # before inductor's own passes rewrite g
            return UnitCall(compile_fx_inner(g, ex, **kw), graph)

        config = getattr(compiler, "config", None) or None
        # AOTAutograd's cache, on a hit (the region compiled before, in this process or an earlier one), hands back
        # compiled code without calling inner_compile: no graph would be kept, and the unit could not be replayed.
        # Inductor's own FX graph cache (inside compile_fx_inner) still serves the kernels.
        from torch._functorch import config as aot_config

        with aot_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config)
    if name in _AOT_EAGER:
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        def fw(g: torch.fx.GraphModule, ex: Any) -> Any:
            graph = UnitGraph(g, region, name, "forward")
            return UnitCall(boxed_nop(g, ex), graph)

        def bw(g: torch.fx.GraphModule, ex: Any) -> Any:
            graph = UnitGraph(g, region, name, "backward")
            return UnitCall(boxed_nop(g, ex), graph)

        return aot_eager(gm, example_inputs, fw_compiler=fw, bw_compiler=bw)
    if compiler is None:  # the graph runs as eager aten ops, each recorded
        log.warning(prefixed("compiled region %s runs eager while recording (its backend could not be found)"),
                    region)
        return gm.forward
    return compiler(gm, example_inputs)  # not captured: runs as its backend makes it


_BOUNDARY_NOTE = ("graph not captured: its forward was compiled before recording started (call "
                  "replaydiff.watch_compiles() before the model is compiled, or record with replaydiff record -- CMD, "
                  "which does)")


def boundary_backward(f: Any, impl_frame: Any) -> Any:
    """A compiled backward whose forward ran before recording (not under the capture backend): with inductor its
    extern kernels would reach the recorder as loose ops, so it runs as a unit of its boundaries only. Other
    backends (aot_eager) run their aten ops, each recorded. None: leave ``f`` as it is."""
    from replaydiff.record.compiled import _compiled_fn_backend, _is_unit_call, compiled_backward_name

    if not _capturing or _is_unit_call(f) or _compiled_fn_backend(f) != "inductor":
        return None
    graph = UnitGraph(None, compiled_backward_name(impl_frame), "inductor", "backward", _BOUNDARY_NOTE)
    return UnitCall(f, graph)


def _sync_guard_flag() -> None:
    """Tell dynamo's guards whether a mode that does not ignore compile internals is on the stack. torch sets this
    when a mode is pushed (``TorchDispatchMode.__enter__``), from ``ignore_compile_internals()`` at that moment; the
    capturing mode's answer changes when capture engages, and a stale flag makes every tensor guard fail on the
    mode's dispatch keys (one recompile per call)."""
    from torch._C._dynamo.guards import set_is_in_mode_without_ignore_compile_internals
    from torch.utils import _python_dispatch as pd

    flag = any(not m.ignore_compile_internals() for m in pd._get_current_dispatch_mode_stack())
    # the Python copy too: torch sets the C flag from it again when modes are popped and pushed around a compile
    pd._is_in_any_mode_without_ignore_compile_internals = flag
    set_is_in_mode_without_ignore_compile_internals(flag)


class UnitCapture:
    """A recorder's switch for units: ``attach`` when its mode is pushed, ``engage`` once dynamo is loaded (now or
    at the first torch.compile), ``detach`` when the mode is popped. Never raises."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.mode: CapturingMode | None = None
        self._prior: Any = None
        self.failed: str | None = None

    def engaged(self) -> bool:
        return self.mode is not None and self.mode.capturing

    def attach(self, mode: CapturingMode) -> None:
        self.mode = mode
        if "torch._dynamo.eval_frame" in sys.modules:
            self.engage()

    def engage(self) -> None:
        if self.mode is None or self.mode.capturing or self.failed:
            return
        try:
            from torch._dynamo import eval_frame as ef

            prior = ef._stance
            if prior.stance != "default" or prior.backend not in (None, capture_backend):  # capture_backend: watched
                raise RuntimeError(f"torch.compile's stance is {prior.stance!r} (backend {prior.backend!r})")
            self._prior = ef._set_stance(ef.DynamoStance("default", prior.skip_guard_eval_unsafe, capture_backend))
            _capturing.append(self.rec)
            self.mode.capturing = True
            _sync_guard_flag()
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            self.rec._warn(f"compiled regions run eager while recording (units could not be captured: "
                           f"{self.failed})")

    def detach(self) -> None:
        if self.mode is not None and self.mode.capturing:
            self.mode.capturing = False
            try:
                _sync_guard_flag()
                if self.rec in _capturing:
                    _capturing.remove(self.rec)
                from torch._dynamo import eval_frame as ef

                ef._set_stance(self._prior)
            except Exception as exc:
                log.debug("could not restore torch.compile's stance: %s", exc)
        self.mode = None


# -- watching compiles before any recording -----------------------------------------------------------------------
_watch: dict[str, Any] = {}  # "compile": torch.compile as it was before watch_compiles wrapped it


def watch_compiles() -> None:
    """Compile every ``torch.compile`` region from now on through ``capture_backend`` (the region's own backend,
    the same compiled code, each aten graph also kept as data), so that a later recording can replay the graphs
    compiled before it started: a compiled backward whose forward ran before recording (``loss = model(x)``, then
    ``with record(...): loss.backward()``), or regions compiled at step 1 of a job recorded at step 2 (no recompile
    then). ``replaydiff record -- CMD`` calls it at the start of the command. Call it early in the script, before
    the first compiled call; idempotent; never raises. Costs: each graph's nodes are encoded once, at compile time,
    and AOTAutograd's cache is bypassed (inductor's FX graph cache still serves the kernels)."""
    try:
        if "torch._dynamo.eval_frame" in sys.modules:
            _watch_now()
            return
        if "compile" in _watch:
            return
        # dynamo is not loaded yet (importing it costs about a second): set the stance at the first torch.compile
        orig = torch.compile

        def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001  (stands in for torch.compile)
            if "compile" in _watch:  # the first call (a stand-in wrapped over this one may outlive it)
                _watch_now()
            return orig(*args, **kwargs)

        compile.__wrapped__ = orig  # type: ignore[attr-defined]
        compile.__doc__ = orig.__doc__
        _watch["compile"] = (orig, compile)
        torch.compile = compile
    except Exception as exc:  # a guest: the job runs on, compiled as it asked
        log.warning(prefixed("compiles not watched (%s: %s); graphs compiled before a recording starts will not "
                             "be replayable"), type(exc).__name__, exc)


def _watch_now() -> None:
    """Force ``capture_backend`` through dynamo's stance (once; only over torch's default stance)."""
    try:
        entry = _watch.pop("compile", None)
        if entry is not None and torch.compile is entry[1]:
            torch.compile = entry[0]
        from torch._dynamo import eval_frame as ef

        prior = ef._stance
        if prior.stance == "default" and prior.backend is capture_backend:
            return
        if prior.stance != "default" or prior.backend is not None:
            raise RuntimeError(f"torch.compile's stance is {prior.stance!r} (backend {prior.backend!r})")
        ef._set_stance(ef.DynamoStance("default", prior.skip_guard_eval_unsafe, capture_backend))
    except Exception as exc:
        log.warning(prefixed("compiles not watched (%s: %s); graphs compiled before a recording starts will not "
                             "be replayable"), type(exc).__name__, exc)
