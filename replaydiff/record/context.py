"""Where an op happens: phase, module path, source line, and the forward op a backward op belongs to.

All of it is read from state torch already keeps (the current autograd node, the optimizer step hooks, the Python
stack) or that two global module forward hooks keep, so that tracking costs a few attribute reads per op.

The phase says what an op is, not which call it is nested in: an op of an autograd node is backward; inside
``optimizer.step()`` only the optimizer's own update is optimizer, while the closure a step may call (LBFGS, and
frameworks' automatic optimization, run forward and backward in ``optimizer.step(closure)``) is forward and backward
as anywhere else, and so is a module's forward.
"""
from __future__ import annotations

import logging
import bisect
import os
import sys
import threading
import weakref
from types import CodeType, FrameType
from typing import Any, Callable

import torch
from torch.utils.module_tracker import ModuleTracker

from replaydiff.record.recompute import Recompute, Recomputes
from replaydiff.trace.sources import line_text, read_source

# torch's functions OpContext.place calls for every op, looked up once
_current_autograd_node = torch._C._current_autograd_node
_is_grad_enabled = torch.is_grad_enabled
_get_sequence_nr = torch._C._autograd._get_sequence_nr
# -1 outside a backward pass; the pass's id inside it, in its autograd nodes and in the callbacks the engine runs as
# the pass ends (queue_callback), where no node is current
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)

log = logging.getLogger("replaydiff")

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
_CLOSURE = "closure"
# The node type whose ops store a parameter's gradient into ``.grad`` (detach of a stolen gradient, add_ when
# accumulating): it has no forward op; its module is the one holding the parameter.
_ACCUMULATE_GRAD = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the replaydiff package
# Frames to look past for the user's source line: torch, replaydiff's own instrumentation, the stdlib's plumbing.
# replaydiff's built-in models and the demo are user code as far as a trace is concerned.
_SKIP_PREFIXES = (
    os.path.dirname(torch.__file__) + os.sep,
    _PKG + "record" + os.sep, _PKG + "trace" + os.sep, _PKG + "faults.py",
    "<frozen ", os.path.dirname(os.__file__) + os.sep + "contextlib.py",
)


# id(code object) -> skip it? (a dict hit is cheaper than six startswith tests per frame). By id, not by the code
# object: a code object's hash is computed at every lookup from its name, bytecode and constants (0.1 to 2 us; a
# model's forward ~1 us), and source() looks up every frame it passes, for every op. _KEPT_CODE keeps every code
# object named here alive (as the dict's keys did before), so an id here is never another object's, and neither is
# one in OpContext._lines.
_SKIP_CODE: dict[int, bool] = {}
_KEPT_CODE: list[CodeType] = []


def _skip_entry(code: CodeType) -> bool:
    _KEPT_CODE.append(code)
    skip = _SKIP_CODE[id(code)] = code.co_filename.startswith(_SKIP_PREFIXES)
    return skip


_active: list["OpContext"] = []  # installed contexts
_step_listeners: list[Callable[..., None]] = []  # called after every optimizer step (multi_step.py)
_step_start_listeners: list[Callable[[object], None]] = []  # called as every optimizer step begins (recorder.py)
_optimizer_hooks: list = []
# What the innermost optimizer call in progress is: OPTIMIZER inside step(), _CLOSURE inside the closure it called.
# Kept by the hooks for every step once installed (a recording may begin inside a step: `--step 1` starts at the
# first module call, inside an LBFGS closure), so one stack serves every context.
_optimizer_calls: list[str] = []
_armed = 0  # recordings armed or running (MultiStepRecorder, installed contexts): closures are watched only then


def arm_optimizer_hooks() -> None:
    """A recording is armed: watch optimizer steps and their closures until ``disarm_optimizer_hooks()``."""
    global _armed
    ensure_optimizer_hooks()
    _armed += 1


def disarm_optimizer_hooks() -> None:
    global _armed
    _armed = max(0, _armed - 1)


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


def _opt_pre_all(optimizer: object, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    _optimizer_calls.append(OPTIMIZER)
    for listener in list(_step_start_listeners):
        listener(optimizer)
    if not _armed:
        return None
    # The closure runs the job's forward and backward: wrapped so that its ops are not taken for the update's.
    # The wrapper only calls it; what it computes and returns is untouched.
    try:
        if callable(kwargs.get("closure")):
            return args, dict(kwargs, closure=_watched(kwargs["closure"]))
        if len(args) > 1 and callable(args[1]):
            return (args[0], _watched(args[1]), *args[2:]), kwargs
    except Exception as exc:  # never stand in the way of the step
        log.debug("closure not watched: %s", exc)
    return None


def _opt_post_all(optimizer: object, args: object, kwargs: object) -> None:
    # Pop this step's entry (and a closure's left by an exception inside it).
    while _optimizer_calls and _optimizer_calls.pop() != OPTIMIZER:
        pass
    for listener in list(_step_listeners):
        listener(optimizer, args, kwargs)


def user_frames(frame: FrameType | None):
    """The frames of the user's code from ``frame`` outward (torch's and replaydiff's own skipped)."""
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_SKIP_PREFIXES):
            yield frame
        frame = frame.f_back


def add_step_listener(fn: Callable[..., None]) -> None:
    """Call ``fn(optimizer, args, kwargs)`` after every optimizer step, until ``remove_step_listener(fn)``."""
    ensure_optimizer_hooks()
    if fn not in _step_listeners:
        _step_listeners.append(fn)


def add_step_start_listener(fn: Callable[[object], None]) -> None:
    """Call ``fn(optimizer)`` as every optimizer step begins, until ``remove_step_start_listener(fn)``; ``fn`` must
    not raise."""
    ensure_optimizer_hooks()
    if fn not in _step_start_listeners:
        _step_start_listeners.append(fn)


def remove_step_start_listener(fn: Callable[[object], None]) -> None:
    if fn in _step_start_listeners:
        _step_start_listeners.remove(fn)


def remove_step_listener(fn: Callable[..., None]) -> None:
    """Safe from inside a listener (the hook iterates over a copy)."""
    if fn in _step_listeners:
        _step_listeners.remove(fn)


def _watched(closure: Callable[..., Any]) -> Callable[..., Any]:
    def closure_of_an_optimizer_step(*args: Any, **kwargs: Any) -> Any:
        _optimizer_calls.append(_CLOSURE)
        depth = len(_optimizer_calls)
        try:
            return closure(*args, **kwargs)
        finally:
            del _optimizer_calls[depth - 1:]
    return closure_of_an_optimizer_step


# torch's global module-hook dicts as dynamo guards them: by key and function. Every recording of this process puts
# the same two functions back under the same keys, so a region compiled while recording (record(compiled="capture"))
# is compiled once per process, not once per recording.
_HOOK_KEYS: dict[str, int] = {}
_trackers: list["_Tracker"] = []


def _forward_pre_all(mod: Any, input: Any) -> None:
    if torch.compiler.is_compiling():  # see _Tracker
        return
    for t in list(_trackers):
        t._fw_pre_hook(mod, input)


def _forward_post_all(mod: Any, input: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    for t in list(_trackers):
        t._fw_post_hook(mod, input, output)


def put_global_hook(hooks: dict, which: str, fn: Callable[..., None]) -> None:
    """Put ``fn`` into one of torch's global module-hook dicts under the key this process keeps for ``which``."""
    from torch.utils.hooks import RemovableHandle

    key = _HOOK_KEYS.get(which)
    if key is None:
        key = _HOOK_KEYS[which] = RemovableHandle(hooks).id
    hooks[key] = fn


def drop_global_hook(hooks: dict, which: str) -> None:
    hooks.pop(_HOOK_KEYS.get(which), None)


def _deeper(a: str, b: str | None) -> bool:
    """Whether module path ``a`` is inner to ``b``: the longer dotted path; ties broken by name, so that the choice
    does not depend on a set's order (which changes from process to process)."""
    return b is None or (a.count("."), len(a), a) > (b.count("."), len(b), b)


class _Tracker(ModuleTracker):
    """The modules whose forward is running, from two global forward hooks: ModuleTracker's names and ``parents``
    (the set of open modules' paths, "Global" always in it), without its backward tracking.

    Why not ModuleTracker itself: it also follows modules through backward, with a multi-grad hook on every module
    call's inputs and outputs (a pytree walk, hook objects, and callbacks the engine runs in backward), ~5 us per op
    of the tiny step. A backward op gets its module from the forward op that made its autograd node instead
    (``OpContext.backward_of``); for a node no recorded forward op made, from ``module_at(seq)``: the innermost
    module open when that node was made, read from marks kept here (one per module call boundary, by autograd
    sequence number).

    The hooks do nothing where dynamo traces them: a region compiled while recording (record(compiled="capture"))
    must compile to the graph it has without the recorder (torch's own ModTracker does the same with
    ``_is_in_optimized_module``). The compiled unit is attributed to the module whose call entered the region. The
    hooks are two module-level functions under keys kept for the process (see _HOOK_KEYS)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner: str | None = None  # the innermost open module (see module()), kept as modules open and close
        # (autograd sequence number of the next node, innermost module from then on), in sequence order; only the
        # thread that installed the tracker marks (sequence numbers are counted per thread)
        self._mark_seqs: list[int] = []
        self._mark_modules: list[str | None] = []
        self._thread: int | None = None

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:
        name = self._get_mod_name(mod)
        self.parents.add(name)
        if _deeper(name, self.inner):
            self.inner = name
            self._mark(name)

    def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
        name = self._get_mod_name(mod)
        parents = self.parents
        parents.discard(name)
        if name == self.inner:
            inner = None
            for p in parents:
                if p != "Global" and _deeper(p, inner):
                    inner = p
            self.inner = inner
            self._mark(inner)

    def _mark(self, module: str | None) -> None:
        """Nodes made from now on are made inside ``module``."""
        if threading.get_ident() != self._thread:
            return
        seq = torch._C._autograd._get_sequence_nr()
        seqs = self._mark_seqs
        if seqs and seqs[-1] >= seq:  # no node made since the last mark: it is replaced
            if seqs[-1] == seq:
                self._mark_modules[-1] = module
            return
        seqs.append(seq)
        self._mark_modules.append(module)

    def reset(self) -> None:
        """No module open: what a backward pass ends with (ModuleTracker's rule; it also forgets a module whose
        forward raised, whose post hook never ran)."""
        self.parents = {"Global"}
        if self.inner is not None:
            self.inner = None
            self._mark(None)

    def module_at(self, seq: int) -> str | None:
        """The innermost module open when the autograd node with sequence number ``seq`` was made (None: none, or
        made before the tracker was installed)."""
        i = bisect.bisect_right(self._mark_seqs, seq)
        return self._mark_modules[i - 1] if i else None

    def __enter__(self) -> "_Tracker":
        from torch.nn.modules import module as nn_module

        self._thread = threading.get_ident()
        self._mark(self.inner)
        _trackers.append(self)
        put_global_hook(nn_module._global_forward_pre_hooks, "pre", _forward_pre_all)
        put_global_hook(nn_module._global_forward_hooks, "post", _forward_post_all)
        return self

    def __exit__(self, *args: Any) -> None:
        from torch.nn.modules import module as nn_module

        self._mark(None)  # nodes made while uninstalled: no module known
        self._thread = None
        if self in _trackers:
            _trackers.remove(self)
        if not _trackers:
            drop_global_hook(nn_module._global_forward_pre_hooks, "pre")
            drop_global_hook(nn_module._global_forward_hooks, "post")


class OpContext:
    """Tracks phase and module; owned by one recording, installed on enter and removed on exit."""

    def __init__(self, source_lines: bool) -> None:
        self.source_lines = source_lines
        self._tracker = _Tracker()
        self._seq_to_forward: dict[int, tuple[int, str | None]] = {}  # autograd seq nr -> (forward op, module)
        self.root = os.getcwd()  # file names under it are kept relative to it
        self._cwd = self.root + os.sep
        # parameter id -> (weak reference, path of the module holding it), built from the modules ModuleTracker named
        self._param_modules: dict[int, tuple[weakref.ref, str]] = {}
        self._params_indexed_in: int | None = None  # the backward pass (graph task) the map was last rebuilt in
        self._reset_queued_in: int | None = None  # the backward pass whose end resets the module tracker
        # (id of the code, instruction offset) -> ("file.py:LINE", the line's text); file name -> its SHA-256 (None:
        # not readable) and lines. By offset, not line number: reading a frame's f_lineno scans its code's line
        # table up to the instruction, ~7 us at line 600 of a function (transformers' forwards are long). By the
        # code's id, not the code (see _SKIP_CODE, which keeps every code object source() meets alive).
        self._lines: dict[tuple[int, int], tuple[str, str | None]] = {}
        self._files: dict[str, tuple[str | None, list[str]]] = {}
        self._recomputes = Recomputes()
        self._calls: dict[int, tuple[str, str | None] | None] = {}  # backward pass -> where backward() was called

    def install(self) -> None:
        self._tracker.__enter__()
        if self not in _active:
            _active.append(self)
            arm_optimizer_hooks()

    def uninstall(self) -> None:
        if self in _active:
            _active.remove(self)
            disarm_optimizer_hooks()
        self._tracker.__exit__(None, None, None)

    def enter_module(self, module: torch.nn.Module, inputs: object) -> None:
        """Enter a module whose forward pre hooks ran before ``install()`` (recording started inside its call)."""
        self._tracker._fw_pre_hook(module, inputs)

    def phase(self) -> tuple[str, Any]:
        """The phase and, for a backward op, the autograd node it runs in."""
        node = torch._C._current_autograd_node()
        if node is not None or _current_graph_task_id() != -1:
            return BACKWARD, node
        if _optimizer_calls and _optimizer_calls[-1] == OPTIMIZER and self._tracker.inner is None:
            return OPTIMIZER, None  # in step() itself, outside its closure and outside any module's forward
        return FORWARD, None

    def backward_of(self, node: Any, module: str | None) -> tuple[int | None, str | None]:
        """(the forward op that made ``node``, the module its backward ops belong to) for an op running in
        ``node``; ``module`` (the modules open now) stands when nothing better is known."""
        task = torch._C._current_graph_task_id()
        if task != self._reset_queued_in:
            self._reset_queued_in = task
            self._queue_reset()
        if _ACCUMULATE_GRAD is not None and type(node) is _ACCUMULATE_GRAD:
            return None, self._parameter_module(node)
        seq = node._sequence_nr()
        found = self._seq_to_forward.get(seq)
        if found is not None:
            # A backward op belongs to the module of the forward op that made its autograd node. (ModuleTracker's
            # backward tracking cannot tell sibling modules apart: it never leaves a module whose inputs need no
            # grad, e.g. two embeddings.)
            return found
        # No recorded forward op made it (a custom autograd Function's node: its forward runs without grad): the
        # module that was open when it was made.
        made_in = self._tracker.module_at(seq)
        return None, made_in if made_in is not None else module

    def _queue_reset(self) -> None:
        """At the end of this backward pass, forget the open modules, as ModuleTracker did: a module whose forward
        raised stays open otherwise, and every later op would be put inside it."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._tracker.reset)
        except Exception as exc:
            log.debug("module tracker not reset after backward: %s", exc)

    def _parameter_module(self, node: Any) -> str | None:
        """The path of the module holding the parameter whose gradient an AccumulateGrad node stores (None: a leaf
        that no module seen holds)."""
        try:
            param = node.variable
        except Exception:
            return None
        hit = self._param_modules.get(id(param))
        if hit is None or hit[0]() is not param:
            task = torch._C._current_graph_task_id()
            if task == self._params_indexed_in:  # rebuilt once per backward pass at most
                return None
            self._params_indexed_in = task
            self._index_parameters()
            hit = self._param_modules.get(id(param))
            if hit is None or hit[0]() is not param:
                return None
        return hit[1]

    def _index_parameters(self) -> None:
        """Map each parameter of the modules ModuleTracker has named to the path of the module holding it (the
        first one named, for a parameter two modules share)."""
        known = getattr(self._tracker, "_known_modules", None)  # torch's own name map: one naming for both
        if known is None:
            log.debug("ModuleTracker keeps no module names here: gradient accumulation ops get no module")
            return
        table: dict[int, tuple[weakref.ref, str]] = {}
        for mod, name in list(known.items()):
            for p in mod.parameters(recurse=False):
                if id(p) not in table:
                    table[id(p)] = (weakref.ref(p), name)
        self._param_modules = table

    def place(self, index: int, name: str = "") -> tuple[str, str | None, int | None, Recompute | None]:
        """Where op ``index`` (named ``name``) runs: its phase, its module, (backward) the forward op it belongs to,
        and (an op of a checkpointed region run again in the backward) the forward op it recomputes. A forward op is
        noted as such for the backward ops and recomputes to find."""
        # phase(), module() and note_forward() inlined: this runs for every op, and most ops are forward ops
        node = _current_autograd_node()
        module = self._tracker.inner
        if node is None:
            if _optimizer_calls and _optimizer_calls[-1] == OPTIMIZER and module is None:
                return OPTIMIZER, module, None, None  # in step() itself, outside its closure and any module's forward
            if _current_graph_task_id() != -1:
                # A callback the engine runs as the backward pass ends (FSDP2's reduce-scatter of the gradients of
                # the last parameter group, DDP's finalize): no autograd node, no forward op, but the backward's
                return BACKWARD, module, None, None
            grad = _is_grad_enabled()
            if grad:  # the first forward op seen after each autograd node was made: the op that made it
                self._seq_to_forward.setdefault(_get_sequence_nr() - 1, (index, module))
            self._recomputes.note_forward(index, name, module, grad)
            return FORWARD, module, None, None
        # a backward op
        fwd, bw_module = self.backward_of(node, module)
        grad = torch.is_grad_enabled()
        rc = self._recomputes.recompute(node, name, grad)
        if rc is None:
            module = bw_module
        else:
            # Forward code: the module of the forward op it repeats (the checkpointed function may be a plain
            # function, whose calling module is not open now), and the nodes it makes (the reentrant
            # checkpoint differentiates them next) belong to that forward op.
            fwd = None
            if rc.module is not None:
                module = rc.module
            if rc.of is not None and grad:
                seq = torch._C._autograd._get_sequence_nr() - 1
                self._seq_to_forward.setdefault(seq, (rc.of, module))
        return BACKWARD, module, fwd, rc

    def backward_source(self, where: tuple[str, str | None] | None,
                        recompute: Recompute | None) -> tuple[tuple[str, str | None] | None, str | None]:
        """For an op of the backward pass, given its own source line: (its source line, where ``backward()`` was
        called when that is not its source line). A backward op's own line is the ``backward()`` call, read from
        the calling thread's stack where the op runs on another (autograd's device threads have no user frame);
        a recomputed op's line is the forward code it runs, and the call is said apart."""
        if recompute is not None:
            call = self.backward_call()
            return where, call[0] if call is not None else None
        if where is None:
            return self.backward_call(), None
        return where, None

    def backward_call(self) -> tuple[str, str | None] | None:
        """("file.py:LINE", text) of the ``backward()`` (or ``autograd.grad``) call running now, once per backward
        pass: the user's frame that called into the autograd engine, on this thread or, for an op on one of
        autograd's device threads, on the one thread waiting in the engine."""
        task = torch._C._current_graph_task_id()
        if task in self._calls:
            return self._calls[task]
        found = None
        try:
            engine = _engine_code()
            f = _find_frame(sys._getframe(1), engine)
            if f is None and engine is not None:
                me = threading.get_ident()
                waiting = [g for tid, top in sys._current_frames().items() if tid != me
                           for g in (_find_frame(top, engine),) if g is not None]
                f = waiting[0] if len(waiting) == 1 else None  # two threads in backward: which one is unknown
            f = _user_frame(f)
            if f is not None:
                found = self._resolve(f.f_code.co_filename, f.f_lineno) if self.source_lines else None
        except Exception as exc:  # the call site is a hint: never stop recording for it
            log.debug("backward() call not found: %s", exc)
        if len(self._calls) > 10_000:
            self._calls.clear()
        self._calls[task] = found
        return found

    def note_forward(self, index: int, module: str | None = None) -> None:
        """Remember the first forward op seen after each autograd node was made: the op that made it."""
        if torch.is_grad_enabled():
            seq = torch._C._autograd._get_sequence_nr() - 1
            self._seq_to_forward.setdefault(seq, (index, module))

    def module(self) -> str | None:
        """The innermost module open: the longest dotted path among them (see _deeper), kept by the tracker."""
        return self._tracker.inner

    def source(self) -> tuple[str, str | None] | None:
        """("file.py:LINE", the line's text) of the innermost frame of the user's code, or None."""
        if not self.source_lines:
            return None
        f: FrameType | None = sys._getframe(2)
        skip = _SKIP_CODE
        while f is not None:
            code = f.f_code
            s = skip.get(id(code))
            if s is None:
                s = _skip_entry(code)
            if not s:
                break
            f = f.f_back
        if f is None:
            return None
        key = (id(code), f.f_lasti)
        found = self._lines.get(key)
        if found is None:  # once per code location: the file is read and hashed once, at its first location
            if len(self._lines) > 100_000:
                self._lines.clear()
            found = self._lines[key] = self._resolve(code.co_filename, f.f_lineno)
        return found

    def _resolve(self, filename: str, lineno: int) -> tuple[str, str | None]:
        name = filename[len(self._cwd):] if filename.startswith(self._cwd) else filename
        known = self._files.get(name)
        if known is None:
            read = read_source(filename)
            known = self._files[name] = read if read is not None else (None, _cached_lines(filename))
        lines = known[1]
        return f"{name}:{lineno}", line_text(lines[lineno - 1]) if 0 < lineno <= len(lines) else None

    def source_files(self) -> dict[str, str]:
        """SHA-256 of each file a recorded source line points into (as named there), as it was when first read."""
        return {name: digest for name, (digest, _) in self._files.items() if digest is not None}


def _engine_code() -> CodeType | None:
    """The code of the function every backward() and autograd.grad() call runs the engine from."""
    fn = getattr(sys.modules.get("torch.autograd.graph"), "_engine_run_backward", None)
    return getattr(fn, "__code__", None)


def _find_frame(f: FrameType | None, code: CodeType | None) -> FrameType | None:
    while f is not None and code is not None:
        if f.f_code is code:
            return f
        f = f.f_back
    return None


def _user_frame(f: FrameType | None) -> FrameType | None:
    """The innermost frame at or above ``f`` that is the user's code (see _SKIP_PREFIXES)."""
    while f is not None:
        code = f.f_code
        s = _SKIP_CODE.get(id(code))
        if s is None:
            s = _skip_entry(code)
        if not s:
            return f
        f = f.f_back
    return None


def _cached_lines(filename: str) -> list[str]:
    """Lines of code that has no file to read (an interactive cell, which linecache holds)."""
    import linecache

    try:
        return linecache.getlines(filename)
    except Exception:
        return []
