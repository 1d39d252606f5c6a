"""Activation checkpointing: which forward op a recomputed op runs again.

``torch.utils.checkpoint`` (and what is built on it: ``checkpoint_sequential``, transformers' gradient
checkpointing, FSDP2's activation checkpointing) runs a region's forward code a second time inside the backward
pass. Those ops run in an autograd node, so they look like backward ops; they are forward code, and a reader wants
the module and line of that code and the forward op each one repeats (whose values it should reproduce).

A region is known by what torch itself keeps for it, read at a cost of one call per op:
- non-reentrant: the saved-tensor hooks torch installs around the region hold its ``_CheckpointFrame``, in the
  forward (the pack hook's closure holds the frame) and in the recompute (a weak reference to it);
- reentrant: ``CheckpointFunction``'s autograd node, which is the ``ctx`` its forward is given: its forward's ops
  (run without grad) find it on the stack, and the recompute runs inside that node.

A recompute's ops are matched to the region's forward ops in order, by name: an op the recompute does not run again
(selective checkpointing's saved ops, the early stop once every saved tensor is back) is passed over, and an op of
the checkpoint's own bookkeeping (the detach of a tensor it saves) matches nothing. When torch keeps these things
another way, nothing matches: the ops are recorded as plain backward ops, as before.
"""
from __future__ import annotations

import sys
import weakref
from types import CodeType
from typing import Any, Callable, NamedTuple

import torch

_FRAME_CLASS = "_CheckpointFrame"
_REENTRANT_NODE = "CheckpointFunctionBackward"
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks  # called at every forward op
_MAX_REGIONS = 4096  # regions kept at once; the oldest go first (a region is recomputed once per backward)


# A forward op of a region: (index, name, module). A plain tuple, not a NamedTuple: the collector stops tracking a
# plain tuple of numbers and strings once it has seen it, never a tuple subclass, and a region's ops live until its
# recompute (one per op of every checkpointed region: they reached the oldest generation, whose growth brings on
# full collections of the job's heap).
ForwardOp = tuple[int, str, "str | None"]
_INDEX, _NAME, _MODULE = 0, 1, 2


class Recompute(NamedTuple):
    """A recomputed op: the forward op it runs again (None: the checkpoint's own bookkeeping, or no op matched)."""

    of: int | None
    module: str | None


class _Region:
    __slots__ = ("ops", "cursors", "alive")

    def __init__(self, alive: Any) -> None:
        self.ops: list[ForwardOp] = []
        self.cursors: dict[int, int] = {}  # backward pass (graph task) -> next forward op to match
        self.alive = alive  # a callable: False once the region's frame is gone (its key may then be reused)


def _always() -> bool:
    return True


def _nothing() -> None:
    return None


class Recomputes:
    """The checkpointed regions seen in the forward, and the matching of their recomputes."""

    def __init__(self) -> None:
        self._regions: dict[Any, _Region] = {}
        self._cells: dict[CodeType, int] = {}  # a hook's code -> the closure cell holding the frame (-1: none)
        # (sequence number, region key or None, the reentrant checkpoint's ctx, weakly) of no-grad forward ops
        self._nograd: tuple[int, Any, Any] | None = None
        self._last: tuple[Any, Any] | None = None  # (weak hook function, weak frame) last found

    # -- the forward -----------------------------------------------------------------------------------------
    def note_forward(self, index: int, name: str, module: str | None, grad: bool) -> None:
        """A forward op: added to the region it runs in, if any."""
        if grad:
            self._nograd = None
            # _hook_frame(), its common case first (no saved-tensor hooks: no checkpoint): one call fewer an op
            frame = self._hook_frame() if _top_saved_tensors_hooks(True) is not None else None
            if frame is not None:
                self._region(id(frame), frame).ops.append((index, name, module))
            return
        if "torch.utils.checkpoint" not in sys.modules:
            return
        seq = torch._C._autograd._get_sequence_nr() - 1
        known = self._nograd
        if known is None or known[0] != seq:
            # Once per node made: is this inside CheckpointFunction.forward? (a walk up the stack). The region is
            # its ctx, the very node its recompute runs in; not the last node made, since autocast's casts of the
            # weights make nodes of their own inside that forward.
            ctx = _reentrant_ctx()
            known = self._nograd = (seq, None if ctx is None else ("node", id(ctx)), _weak(ctx))
        if known[1] is not None:
            self._region(known[1], known[2]()).ops.append((index, name, module))

    def _region(self, key: Any, frame: Any) -> _Region:
        r = self._regions.get(key)
        if r is None or not r.alive():
            if len(self._regions) >= _MAX_REGIONS:
                for k in [k for k, v in self._regions.items() if not v.alive()] or list(self._regions)[:64]:
                    del self._regions[k]
            try:
                alive = weakref.ref(frame) if frame is not None else _always
            except TypeError:
                alive = _always
            r = self._regions[key] = _Region(alive)
        return r

    # -- the backward ----------------------------------------------------------------------------------------
    def recompute(self, node: Any, name: str, grad: bool) -> Recompute | None:
        """For an op running in autograd node ``node``: the forward op it runs again, or None when it is not a
        recompute."""
        frame = self._hook_frame()
        if frame is not None:
            key = id(frame)
        elif grad and type(node).__name__ == _REENTRANT_NODE:
            key = ("node", id(node))
        else:
            return None
        region = self._regions.get(key)
        if region is None:
            return Recompute(None, None)
        task = torch._C._current_graph_task_id()
        at = region.cursors.get(task, 0)
        ops = region.ops
        if grad:  # not the checkpoint's own bookkeeping (a saved tensor's detach, without grad)
            for k in range(at, len(ops)):
                if ops[k][_NAME] == name:
                    region.cursors[task] = k + 1
                    return Recompute(ops[k][_INDEX], ops[k][_MODULE])
        # No forward op of its own: it belongs to the module of the last op matched (an early stop leaves the
        # modules the recompute entered open, so the module tracker cannot say).
        return Recompute(None, ops[at - 1][_MODULE] if 0 < at <= len(ops) else None)

    def _hook_frame(self) -> Any:
        """The ``_CheckpointFrame`` of the innermost saved-tensor hooks, if they are a checkpoint's."""
        hooks = _top_saved_tensors_hooks(True)
        if hooks is None:
            return None
        fn = hooks[0]
        last = self._last
        if last is not None and last[0]() is fn:  # the same hooks as the op before: every op of a region
            return last[1]()
        frame = self._frame_of(fn)
        try:  # weak: holding the frame (and the inputs it keeps) past the op would change the job's memory
            self._last = (weakref.ref(fn), weakref.ref(frame) if frame is not None else _nothing)
        except TypeError:
            self._last = None
        return frame

    def _frame_of(self, fn: Any) -> Any:
        for _ in range(3):  # torch wraps the recompute's hook (dynamo disabled)
            inner = getattr(fn, "__wrapped__", None)
            if inner is None:
                break
            fn = inner
        code = getattr(fn, "__code__", None)
        cells = getattr(fn, "__closure__", None)
        if code is None or not cells:
            return None
        at = self._cells.get(code)
        if at is None:
            at = self._cells[code] = next((k for k, c in enumerate(cells) if _frame_in(c) is not None), -1)
        return _frame_in(cells[at]) if 0 <= at < len(cells) else None


def _frame_in(cell: Any) -> Any:
    try:
        v = cell.cell_contents
    except ValueError:
        return None
    if isinstance(v, weakref.ref):
        v = v()
    return v if type(v).__name__ == _FRAME_CLASS else None


_REENTRANT_CODE: list[CodeType] = []


def _reentrant_ctx() -> Any:
    """The ctx of the ``CheckpointFunction.forward`` on the stack (the reentrant checkpoint's forward): the autograd
    node its recompute runs in. None when there is none."""
    if not _REENTRANT_CODE:
        fn = getattr(getattr(sys.modules.get("torch.utils.checkpoint"), "CheckpointFunction", None), "forward", None)
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        _REENTRANT_CODE.append(code)
    target = _REENTRANT_CODE[0]
    f = sys._getframe(2)
    depth = 0
    while f is not None and depth < 400:
        if f.f_code is target:
            return f.f_locals.get("ctx")
        f = f.f_back
        depth += 1
    return None


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj`` (not kept alive: a checkpoint's node holds its saved inputs); a call that gives
    None where there is nothing to refer to or it cannot be referred to weakly."""
    if obj is None:
        return _nothing
    try:
        return weakref.ref(obj)
    except TypeError:
        return _nothing
