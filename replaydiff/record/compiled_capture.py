"""PROTOTYPE (not wired into the recorder): capture each compiled graph as one unit, and replay it at float64.

A compile backend that wraps the user's one at the level where graphs are final: the aten graphs AOTAutograd hands
to its forward and backward compilers (inductor's ``inner_compile``, or aot_eager's ``boxed_nop``). Each compiled
graph's runtime callable is wrapped so that every call stores

    {"op": "compiled::<region>/<fw|bw><n>", "graph": <the aten FX GraphModule>, "inputs": [...], "outputs": [...]}

and ``replay_unit`` re-runs the aten graph eagerly (float64 by default) on the stored inputs and compares.

Why this is a prototype and not part of ``replaydiff.record`` (docs/design/compile.md, "Capture as a unit"):

* Under the recorder's dispatch mode dynamo never runs compiled code for a region with tensor inputs, so nothing
  is captured unless the recorder's mode answers ``ignore_compile_internals() -> True``
  (torch/utils/_python_dispatch.py:238); then dynamo compiles and runs the compiled code with the mode on, and the
  recorder would see inductor's buffer allocations and extern kernels (``empty_strided``, ``mm.out``) as stray ops
  unless the unit wrapper hid them from it, which this wrapper does (it runs the compiled code with the modes off).
* The backend must be in place when dynamo compiles: either the user passes ``backend=capture_backend(...)``, or
  the recorder forces it for the recorded step (``torch._dynamo.set_stance(force_backend=...)``), which recompiles
  every region in the recorded step.
* The trace format, the writer, ``show`` and the replay engine know only aten ops with schemas; a unit needs a new
  record kind (a graph blob plus input/output refs).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes


@dataclass
class Unit:
    op: str
    graph: torch.fx.GraphModule
    inputs: list[Any]
    outputs: list[Any]


@dataclass
class CaptureSink:
    """Where captured units go (in memory for the prototype); ``enabled`` is switched on for the recorded step."""

    units: list[Unit] = field(default_factory=list)
    enabled: bool = True
    errors: list[str] = field(default_factory=list)


def _snapshot(values: list[Any]) -> list[Any]:
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values]


class _CapturedCall:
    """The runtime callable of one compiled graph, storing its inputs and outputs when the sink is on.

    Boxed calling convention (AOTAutograd's ``_boxed_call``): called with one list it may clear."""

    _boxed_call = True

    def __init__(self, compiled: Any, graph: torch.fx.GraphModule, name: str, sink: CaptureSink) -> None:
        self._boxed_call = True  # in the instance dict too: torch._dynamo.disable's functools.wraps copies only that
        self._compiled = compiled
        self._graph = graph
        self._name = name
        self._sink = sink

    def __getattr__(self, name: str) -> Any:  # OutputCode's other attributes, for AOTAutograd's wrappers
        return getattr(self._compiled, name)

    def __call__(self, args: list) -> Any:
        sink = self._sink
        if not sink.enabled:
            return self._call(args)
        try:
            with _disable_current_modes():
                inputs = _snapshot(list(args))
        except Exception as exc:  # never into the job
            sink.errors.append(f"{self._name}: inputs: {exc}")
            return self._call(args)
        # The compiled code runs with the dispatch modes off: a recorder on the stack would otherwise see its buffer
        # allocations and extern kernels as ops of their own; the unit stands for all of them.
        with _disable_current_modes():
            out = self._call(args)
        try:
            with _disable_current_modes():
                outs = _snapshot(list(out) if isinstance(out, (list, tuple)) else [out])
            sink.units.append(Unit(self._name, self._graph, inputs, outs))
        except Exception as exc:
            sink.errors.append(f"{self._name}: outputs: {exc}")
        return out

    def _call(self, args: list) -> Any:
        if getattr(self._compiled, "_boxed_call", False):
            return self._compiled(args)
        return self._compiled(*args)


_ids = itertools.count()


def capture_backend(inner: str = "inductor", sink: CaptureSink | None = None,
                    region: str | None = None) -> tuple[Callable, CaptureSink]:
    """A dynamo backend compiling like ``inner`` ("inductor" or "aot_eager") whose graphs are captured as units."""
    sink = sink or CaptureSink()

    def wrap(compile_graph: Callable, gm: torch.fx.GraphModule, example_inputs: Any, is_backward: bool,
             kwargs: dict) -> Any:
        # inductor rewrites the graph it compiles (post-grad passes): keep a copy of the graph as handed over
        copy = torch.fx.Graph()
        copy.output(copy.graph_copy(gm.graph, {}))
        graph = torch.fx.GraphModule(gm, copy)
        compiled = compile_graph(gm, example_inputs, **kwargs)
        name = f"compiled::{region or 'graph'}{next(_ids)}/{'bw' if is_backward else 'fw'}"
        return _CapturedCall(compiled, graph, name, sink)

    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(gm, example_inputs, **kwargs):  # noqa: ANN001
            return wrap(compile_fx_inner, gm, example_inputs, bool(kwargs.get("is_backward")), kwargs)

        def backend(gm, example_inputs):  # noqa: ANN001
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    elif inner == "aot_eager":
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def nop(gm, example_inputs):  # noqa: ANN001
            return make_boxed_func(gm.forward)

        backend = aot_autograd(
            fw_compiler=lambda gm, ex: wrap(nop, gm, ex, False, {}),
            bw_compiler=lambda gm, ex: wrap(nop, gm, ex, True, {}),
        )
    else:
        raise ValueError(f"capture_backend prototype knows inductor and aot_eager, not {inner!r}")
    return backend, sink


def replay_unit(unit: Unit, dtype: torch.dtype = torch.float64) -> dict:
    """Run the unit's aten graph eagerly on its stored inputs (floating tensors cast to ``dtype``) and compare with
    what the compiled code returned. Returns {"max_abs": ..., "max_rel": ..., "per_output": [...]}."""
    def cast(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        return v

    args = [cast(v) for v in unit.inputs]
    with _disable_current_modes(), torch.no_grad():
        ref = unit.graph(*args)
    ref = list(ref) if isinstance(ref, (list, tuple)) else [ref]
    per = []
    for got, want in zip(unit.outputs, ref):
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)) or not got.is_floating_point():
            per.append(None)
            continue
        diff = (got.to(dtype) - want).abs()
        scale = want.abs().max().clamp_min(torch.finfo(got.dtype).tiny)
        per.append({"max_abs": float(diff.max()) if diff.numel() else 0.0,
                    "max_rel": float(diff.max() / scale) if diff.numel() else 0.0})
    nums = [p for p in per if p is not None]
    return {"max_abs": max((p["max_abs"] for p in nums), default=0.0),
            "max_rel": max((p["max_rel"] for p in nums), default=0.0), "per_output": per}
