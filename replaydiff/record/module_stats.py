"""``granularity="module"``: the statistics of each module call's outputs and of the gradients that reach them.

Why: a per-op dispatch mode costs ~20 us of Python per aten op before it does anything (a do-nothing mode alone
doubles the tiny step), so watching thousands of steps op by op is never cheap. Global module hooks run once per
module call instead of once per op, and a hook on each output tensor sees its gradient: no dispatch mode at all.
Each call becomes one record named ``MODULE_OUTPUT`` (forward phase, outputs = the module's output tensors) and each
gradient one ``MODULE_GRAD`` record (backward phase, ``forward_index`` = the output record); at a module's first call
in a step, each parameter it holds itself one ``MODULE_PARAM`` record (forward phase, args = [parameter name],
outputs = [the parameter]) before anything the call computes; module paths are
spelled as the op recorder spells them (``GPT2LMHeadModel.transformer.h.0.mlp``). Hooks return nothing: the job
computes exactly what it would have.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable

import torch

from replaydiff.record.context import drop_global_hook, put_global_hook
from replaydiff.trace import schema

log = logging.getLogger("replaydiff")

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# The arguments of an output's or a gradient's record: none. One list and one dict for all of them, never written: a
# record kept until the writer encodes it lives through collections of the job's garbage collector, and each
# container it holds is traversed there (a container fewer a record).
_NO_ARGS: list = []
_NO_KWARGS: dict = {}

MODULE_OUTPUT, MODULE_GRAD, MODULE_PARAM = schema.MODULE_OUTPUT, schema.MODULE_GRAD, schema.MODULE_PARAM


def output_tensors(v: Any, depth: int = 0, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Tensors of a module's output: a tensor, or inside tuples, lists and dicts (a transformers ModelOutput).
    A list filled in place, not a generator per level: this runs at every module call."""
    if out is None:
        out = []
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif depth < 3 and isinstance(v, (list, tuple)):
        for x in v:
            output_tensors(x, depth + 1, out)
    elif depth < 3 and isinstance(v, dict):
        for x in v.values():
            output_tensors(x, depth + 1, out)
    return out


_NAMED_PARAMETERS = torch.nn.Module.named_parameters
_NAMED_MEMBERS = torch.nn.Module._named_members


def own_parameters(module: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Parameter]]:
    """``module.named_parameters(recurse=False)``: read from ``module._parameters`` as torch's own method does (None
    and repeats left out), without its generators, unless the module's class defines its own way to list them."""
    cls = type(module)
    if cls.named_parameters is not _NAMED_PARAMETERS or cls._named_members is not _NAMED_MEMBERS:
        return module.named_parameters(recurse=False)
    out = []
    seen: set = set()
    for name, p in module._parameters.items():
        if p is None or p in seen:
            continue
        seen.add(p)
        out.append((name, p))
    return out


_installed: list["ModuleStatsHooks"] = []


def _enter_all(module: torch.nn.Module, inputs: Any) -> None:
    for h in list(_installed):
        h.enter_module(module, inputs)


def _after_all(module: torch.nn.Module, inputs: Any, output: Any) -> None:
    for h in list(_installed):
        h._after_forward(module, inputs, output)


def _on_grad(hooks: "ModuleStatsHooks", forward_index: int, module: str, grad: torch.Tensor) -> None:
    """The gradient reaching a module call's output (``ModuleStatsHooks._grad_hook``): its ``MODULE_GRAD`` record."""
    rec = hooks.rec
    if not rec.active or grad is None:
        return
    try:
        hooks._record(schema.wire_op(rec.next_index, MODULE_GRAD, "backward", module, forward_index, None), [grad])
    except Exception as exc:
        rec.disable(f"gradient statistics failed ({type(exc).__name__}: {exc})")


class ModuleStatsHooks:
    """Installed for a recorded step, removed when it ends; records through the recorder's builder and writer."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self._names: dict[int, str] = {}
        self._measured: set[int] = set()  # modules whose parameters this step has recorded

    def install(self) -> None:
        from torch.nn.modules import module as nn_module

        self._names.clear()  # ids of modules freed since the last step may have been reused
        self._measured.clear()  # installed once per recorded step: each step measures the parameters again
        if self not in _installed:
            _installed.append(self)
        # The same two functions under the same keys at every recorded step (as context._Tracker's): dynamo guards
        # torch's global hook dicts, so a new hook object each step recompiled a torch.compile'd model every recorded
        # step until its recompile limit, after which it ran eager and its numbers changed.
        put_global_hook(nn_module._global_forward_pre_hooks, "stats-pre", _enter_all)
        put_global_hook(nn_module._global_forward_hooks, "stats-post", _after_all)

    def uninstall(self) -> None:
        from torch.nn.modules import module as nn_module

        if self in _installed:
            _installed.remove(self)
        if not _installed:
            drop_global_hook(nn_module._global_forward_pre_hooks, "stats-pre")
            drop_global_hook(nn_module._global_forward_hooks, "stats-post")

    def enter_module(self, module: torch.nn.Module, inputs: Any) -> None:
        """A module call begins: name it, and at its first call in the step record its own parameters."""
        if torch.compiler.is_compiling():  # a compiled region's modules: see _after_forward
            return
        if id(module) in self._measured:  # named and its parameters recorded at its first call in this step
            return
        name = self._name(module)
        if self.rec.active:
            self._measured.add(id(module))
            self._parameters(module, name)

    def _name(self, module: torch.nn.Module) -> str:
        """The outermost module not yet seen names its whole tree, as torch's ModuleTracker does (its children
        start after it, so they find their names ready); a call that began before the hooks were installed too."""
        name = self._names.get(id(module))
        if name is None:
            for sub_name, sub in module.named_modules(prefix=type(module).__name__):
                self._names[id(sub)] = sub_name
            name = self._names[id(module)]
        return name

    def _parameters(self, module: torch.nn.Module, name: str) -> None:
        """One ``MODULE_PARAM`` record per parameter the module holds itself. Why: a module's output can hide a
        change of its weights (a GRU's gates saturate, a norm layer rescales), while a weight's own series is
        smooth from step to step, so a spike in it stands out even when only every N-th step is recorded."""
        rec = self.rec
        try:
            for pname, p in own_parameters(module):
                self._record(schema.wire_op(rec.next_index, MODULE_PARAM, "forward", name, None, None), [p],
                             args=[pname])
        except Exception as exc:
            rec.disable(f"parameter statistics failed ({type(exc).__name__}: {exc})")

    def _after_forward(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        # Global hooks run while dynamo traces a compiled region too: what they did would be traced into its graph
        # (dynamo fails on the statistics' numpy, the recording stops, the region runs eager). The modules inside a
        # region get no records; the module whose call enters it (OptimizedModule) gets its output's, as the op
        # recorder's module tracker does (context._Tracker).
        rec = self.rec
        if torch.compiler.is_compiling() or not rec.active:
            return
        try:
            tensors = [output] if type(output) in _PLAIN else output_tensors(output)
            if not tensors:
                return
            name = self._name(module)
            index = self._record(schema.wire_op(rec.next_index, MODULE_OUTPUT, "forward", name, None, None), tensors)
            for t in tensors:
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(self._grad_hook(index, name))
        except Exception as exc:
            rec.disable(f"module statistics failed ({type(exc).__name__}: {exc})")

    def _grad_hook(self, forward_index: int, module: str) -> Callable[[torch.Tensor], None]:
        # A partial rather than a closure: one object where a closure makes four (the function and a cell for each
        # name it holds), and each lives on the output tensor until backward, through the job's garbage collections.
        return functools.partial(_on_grad, self, forward_index, module)

    def _record(self, record: dict, tensors: list[torch.Tensor], args: list | None = None) -> int:
        rec = self.rec
        index = schema.wire_index(record)
        rec.next_index += 1
        if rec.step is not None:
            schema.wire_set_step(record, rec.step)
        b = rec.builder
        b.autograd_versions = True  # no dispatch mode here: see OpBuilder.ref
        schema.wire_set_inputs(record, args or _NO_ARGS, _NO_KWARGS)
        schema.wire_set_outputs(record, [b.ref(t, True) for t in tensors], None, False)
        b.add_op(record)
        return index
