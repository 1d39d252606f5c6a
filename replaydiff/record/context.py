"""Where an op happens: phase, module path, source line, and the forward op a backward op belongs to.

All of it is read from state torch already keeps (the current autograd node, ModuleTracker, the optimizer step hooks,
the Python stack) so that tracking costs a few attribute reads per op.
"""
from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Callable

import torch
from torch.utils.module_tracker import ModuleTracker

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the replaydiff package
# Frames to look past for the user's source line: torch, replaydiff's own instrumentation, the stdlib's plumbing.
# replaydiff's built-in models and the demo are user code as far as a trace is concerned.
_SKIP_PREFIXES = (
    os.path.dirname(torch.__file__) + os.sep,
    _PKG + "record" + os.sep, _PKG + "trace" + os.sep, _PKG + "faults.py",
    "<frozen ", os.path.dirname(os.__file__) + os.sep + "contextlib.py",
)


_SKIP_CODE: dict = {}  # code object -> skip it? (a dict hit is cheaper than six startswith tests per frame)

_active: list["OpContext"] = []  # installed contexts, told about optimizer steps by the two hooks below
_step_listeners: list[Callable[..., None]] = []  # called after every optimizer step (steps.py), after the contexts
_optimizer_hooks: list = []


def ensure_optimizer_hooks() -> None:
    """Register replaydiff's global optimizer-step hooks, once per process; they stay registered.

    torch iterates over its global optimizer hooks while calling them, so registering or removing one from inside
    another (``replaydiff record --step N`` starts and stops recording in an optimizer step post hook) raises
    "OrderedDict mutated during iteration" in the user's ``optimizer.step()``. Contexts come and go in ``_active``,
    step recorders in ``_step_listeners``: the two hooks torch keeps are plain functions that hold no recording.
    """
    if _optimizer_hooks:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _optimizer_hooks.extend([register_optimizer_step_pre_hook(_opt_pre_all),
                             register_optimizer_step_post_hook(_opt_post_all)])


def _opt_pre_all(*args: object) -> None:
    for ctx in list(_active):
        ctx._opt_pre()


def _opt_post_all(optimizer: object, args: object, kwargs: object) -> None:
    for ctx in list(_active):
        ctx._opt_post()
    for listener in list(_step_listeners):
        listener(optimizer, args, kwargs)


def add_step_listener(fn: Callable[..., None]) -> None:
    """Call ``fn(optimizer, args, kwargs)`` after every optimizer step, until ``remove_step_listener(fn)``."""
    ensure_optimizer_hooks()
    if fn not in _step_listeners:
        _step_listeners.append(fn)


def remove_step_listener(fn: Callable[..., None]) -> None:
    """Safe from inside a listener (the hook iterates over a copy)."""
    if fn in _step_listeners:
        _step_listeners.remove(fn)


class OpContext:
    """Tracks phase and module; owned by one recording, installed on enter and removed on exit."""

    def __init__(self, source_lines: bool) -> None:
        self.source_lines = source_lines
        self.in_optimizer = 0
        self._tracker = ModuleTracker()
        self._seq_to_forward: dict[int, tuple[int, str | None]] = {}  # autograd seq nr -> (forward op, module)
        self._cwd = os.getcwd() + os.sep

    def install(self) -> None:
        self._tracker.__enter__()
        ensure_optimizer_hooks()
        if self not in _active:
            _active.append(self)

    def uninstall(self) -> None:
        if self in _active:
            _active.remove(self)
        self._tracker.__exit__(None, None, None)

    def enter_module(self, module: torch.nn.Module, inputs: object) -> None:
        """Enter a module whose forward pre hooks ran before ``install()`` (recording started inside its call)."""
        self._tracker._fw_pre_hook(module, inputs)

    def _opt_pre(self, *args: object) -> None:
        self.in_optimizer += 1

    def _opt_post(self, *args: object) -> None:
        self.in_optimizer = max(0, self.in_optimizer - 1)

    def phase(self) -> tuple[str, int | None]:
        """The phase and, for a backward op, the autograd sequence number of the node it runs in."""
        node = torch._C._current_autograd_node()
        if node is not None:
            return BACKWARD, node._sequence_nr()
        if self.in_optimizer:
            return OPTIMIZER, None
        return FORWARD, None

    def note_forward(self, index: int, module: str | None = None) -> None:
        """Remember the first forward op seen after each autograd node was made: the op that made it."""
        if torch.is_grad_enabled():
            seq = torch._C._autograd._get_sequence_nr() - 1
            self._seq_to_forward.setdefault(seq, (index, module))

    def forward_of(self, seq: int | None) -> int | None:
        found = None if seq is None else self._seq_to_forward.get(seq)
        return None if found is None else found[0]

    def forward_module(self, seq: int | None) -> str | None:
        """The module path of the forward op that made the autograd node ``seq`` (None if unknown)."""
        found = None if seq is None else self._seq_to_forward.get(seq)
        return None if found is None else found[1]

    def module(self) -> str | None:
        parents = self._tracker.parents
        if len(parents) <= 1:
            return None
        best = None
        for p in parents:  # the innermost module has the longest dotted path; ties broken by name, since parents
            # is a set and its order changes from process to process (two sibling embeddings in backward)
            if p != "Global" and (best is None or (p.count("."), len(p), p) > (best.count("."), len(best), best)):
                best = p
        return best

    def source(self) -> str | None:
        if not self.source_lines:
            return None
        f: FrameType | None = sys._getframe(2)
        skip = _SKIP_CODE
        while f is not None:
            code = f.f_code
            s = skip.get(code)
            if s is None:
                s = skip[code] = code.co_filename.startswith(_SKIP_PREFIXES)
            if not s:
                break
            f = f.f_back
        if f is None:
            return None
        name = f.f_code.co_filename
        if name.startswith(self._cwd):
            name = name[len(self._cwd):]
        return f"{name}:{f.f_lineno}"
