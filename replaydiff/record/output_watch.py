"""The flight recorder's watch on what a model hands back: the outputs of its top-level forward calls.

A root module call (one no other module call encloses) returns what the user's code receives and watches: the
logits, a tuple, a dict or a transformers ``ModelOutput``. When a floating tensor in it holds NaN or Inf, the flight
recorder's trigger is set (``FlightBuffer.watch_output``), even where no loss or gradient ever goes non-finite (an
evaluation pass, a loss that is only logged, a backward pass on another loss).

Why only root calls: models make non-finite values on purpose and discard them inside their forward (T5's ``where``
over ``log(0)``, attention scores filled with -inf and then softmaxed); what leaves the model is what counts. Why it
is cheap: with ``tensors="stats"`` the op that made an output has already measured it, and the recorder's statistics
cache answers (``OpBuilder.ref``); on an accelerator those statistics arrive when the step ends, and are judged
then. Without statistics (``meta``, ``full``) the output's NaN and Inf are counted here, outside the recorder's
dispatch mode, and read when the step ends.

Two global forward hooks keep the stack of open module calls (per recorded step; a call whose forward raised is
popped when its caller returns). Hooks return nothing and only read tensors: the job computes what it would have.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from replaydiff.record.context import drop_global_hook, put_global_hook, user_frames
from replaydiff.trace import schema
from replaydiff.trace.modes import TensorMode

_installed: list["OutputWatch"] = []
_MAX_DEPTH = 4  # nesting looked into: ModelOutput > tuple > tuple > tensor (past key values) and one more
_MAX_TENSORS = 256  # floating tensors judged per call (a model returning every layer's cache stops there)


def _pre_all(module: torch.nn.Module, inputs: Any) -> None:
    if torch.compiler.is_compiling():  # inside a compiled region: nothing traced into its graph
        return
    for w in list(_installed):
        w.enter_module(module)


def _post_all(module: torch.nn.Module, inputs: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    for w in list(_installed):
        w.leave_module(module, output)


def floating_outputs(v: Any, path: str | None = None, depth: int = 0,
                     out: list[tuple[str, torch.Tensor]] | None = None) -> list[tuple[str, torch.Tensor]]:
    """(where, tensor) of each floating tensor in a module's output: ``the output`` for a bare tensor, ``output[1]``
    in a tuple or list, ``logits`` in a dict or dataclass (a ModelOutput), ``past_key_values[0][1]`` further in."""
    if out is None:
        out = []
    if len(out) >= _MAX_TENSORS:
        return out
    if isinstance(v, torch.Tensor):
        if v.is_floating_point():
            out.append((path or "the output", v))
        return out
    if depth >= _MAX_DEPTH:
        return out
    if isinstance(v, (tuple, list)):
        for i, x in enumerate(v):
            floating_outputs(x, f"{path or 'output'}[{i}]", depth + 1, out)
    elif isinstance(v, dict):
        for k, x in v.items():
            floating_outputs(x, f"{path}.{k}" if path else str(k), depth + 1, out)
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        for f in dataclasses.fields(v):
            floating_outputs(getattr(v, f.name, None), f"{path}.{f.name}" if path else f.name, depth + 1, out)
    return out


class OutputWatch:
    """Installed for each recorded step of a flight recording, removed when it ends."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self._open: list[int] = []  # ids of the module calls in progress, outermost first
        self.failed = False
        # The thread that runs the step (its module calls nest; another thread's, e.g. DataParallel's replicas, are
        # inside a call of this one's)
        self._thread: int | None = None

    def install(self) -> None:
        from torch.nn.modules import module as nn_module

        self._open.clear()  # a call whose forward raised in an earlier step is open no more
        self._thread = threading.get_ident()
        if self not in _installed:
            _installed.append(self)
        # The same functions under the same keys every step (see context.put_global_hook: dynamo guards these dicts)
        put_global_hook(nn_module._global_forward_pre_hooks, "flight-pre", _pre_all)
        put_global_hook(nn_module._global_forward_hooks, "flight-post", _post_all)

    def uninstall(self) -> None:
        from torch.nn.modules import module as nn_module

        if self in _installed:
            _installed.remove(self)
        if not _installed:
            drop_global_hook(nn_module._global_forward_pre_hooks, "flight-pre")
            drop_global_hook(nn_module._global_forward_hooks, "flight-post")

    def enter_module(self, module: torch.nn.Module) -> None:
        """A module call begins (also one that began before the hooks were installed: recording starts in it)."""
        if threading.get_ident() == self._thread:
            self._open.append(id(module))

    def leave_module(self, module: torch.nn.Module, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        opened = self._open
        key = id(module)
        if opened and opened[-1] == key:
            opened.pop()
        elif key in opened:  # the calls inside it whose forward raised never returned: closed with it
            del opened[len(opened) - 1 - opened[::-1].index(key):]
        if opened or self.failed or not self.rec.active:
            return
        if torch._C._current_autograd_node() is not None:  # a checkpointed module run again in backward
            return
        try:
            self._judge(module, output)
        except Exception as exc:  # the watch goes; the recording stays
            self.failed = True
            self.rec.warn(f"the flight recorder stopped watching model outputs for NaN/Inf "
                          f"({type(exc).__name__}: {exc})")

    def _judge(self, module: torch.nn.Module, output: Any) -> None:
        found = floating_outputs(output)
        if not found:
            return
        rec = self.rec
        flight = rec.writer
        if flight is None or flight.trigger is not None:
            return
        b = rec.builder
        counts: list[tuple[str, Callable[[], tuple[int, int] | None]]]
        if b is not None and b.mode is TensorMode.STATS:
            # The statistics the recorder keeps for these values (cached where an op made them in this step), taken
            # below every dispatch mode (an accelerator's statistics run torch ops): the recorder records none of
            # it, and no planted fault touches it.
            with _disable_current_modes():
                refs = [(where, b.ref(t, True)) for where, t in found]
                b.flush_stats()  # no reference to the job's tensors held past this call (OpBuilder._stat_queue)
                rec.flush_pending()  # CPU statistics waiting for their batch: measured now
            counts = [(where, _stats_counts(ref)) for where, ref in refs]
        else:
            counts = [(where, _counted(t)) for where, t in found]
        flight.watch_output(counts, f"{type(module).__name__}.forward", self._called_at(), rec.step)

    def _called_at(self) -> str | None:
        """'file.py:LINE' of the user's code that called the module."""
        for f in user_frames(sys._getframe(2)):
            name = f.f_code.co_filename
            root = self.rec.context.root + os.sep
            return f"{name[len(root):] if name.startswith(root) else name}:{f.f_lineno}"
        return None


def _stats_counts(ref: dict) -> Callable[[], tuple[int, int] | None]:
    return lambda: schema.wire_ref_nonfinite(ref)


def _counted(t: torch.Tensor) -> Callable[[], tuple[int, int] | None]:
    """NaN and Inf of ``t`` counted on its device now (below every dispatch mode: the recorder records none of it,
    and no planted fault touches it), read when asked (when the step ends: no synchronisation here)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout is not torch.strided or t.device.type == "meta":
        return lambda: None
    with _disable_current_modes(), torch.no_grad():
        both = torch.stack([torch.isnan(t).sum(), torch.isinf(t).sum()])
    return lambda: tuple(int(x) for x in both.tolist())  # type: ignore[return-value]
