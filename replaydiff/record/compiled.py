"""Which ``torch.compile`` regions ran while recording, and how: eager (in the trace) or compiled (not in it).

What torch 2.13 does with compiled code while a ``TorchDispatchMode`` such as the recorder's is on the mode stack
(docs/design/compile.md has the details and the torch file:line references):

* A region whose dynamo cache misses (the first call, or any call whose tensor guards fail, which is every call
  with a tensor argument because tensor guards include the thread-local dispatch keys the mode adds) is handed to
  dynamo's frame callback, which skips it because a dispatch mode is present
  (``torch/_dynamo/convert_frame.py:2542-2567``). The region's Python code then runs as plain eager aten ops, all of
  which the recorder sees: the trace holds an eager step, not the compiled one the job runs otherwise.
* torch marks such a skipped code object "skip" for good (``ConvertFrameReturn.apply_to_code=True``,
  ``torch/_dynamo/types.py:75-88``), so without intervention the region stays eager for the rest of the process,
  after recording ends.
* With ``fullgraph=True`` the skipped call raises ``RuntimeError: torch.compile with fullgraph=True found no compiled
  frames`` into the job (``torch/_dynamo/eval_frame.py:1186-1202``).
* A region whose guards pass under the mode (one without tensor guards, e.g. it takes no tensor argument) runs its
  cached compiled code. With inductor the fused kernels never reach the dispatcher, so the trace does not hold them;
  with the eager/aot_eager backends the graph's aten ops do reach it.
* A compiled backward (AOTAutograd) of a forward that ran compiled, run under the mode, runs compiled too: with
  inductor only its extern kernels (``mm.out`` ...) reach the trace.

``CompiledRegionTracker`` watches these paths while recording:

    tracker = CompiledRegionTracker()
    tracker.start()            # when recording starts, in the recording thread
    ...                        # the recorded block
    regions = tracker.stop()   # -> list of region dicts, for the manifest
    msg = tracker.first_warning()   # one sentence the first time, then None

It also (by default) undoes, at ``stop()``, torch's marking of the regions it skipped as "skip" for good, so they
run compiled again once recording ends, and keeps ``fullgraph=True`` regions from raising because of the recorder's
mode; both only for skips whose reason is the dispatch mode. Everything it does is wrapped so that no
exception reaches the job; a failure to attach is reported as one "unknown" entry with a note.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import warnings
from typing import Any, Callable

from replaydiff.trace.schema import CompiledRegion, compiled_regions_from_wire

log = logging.getLogger("replaydiff")

EAGER, COMPILED, MIXED, UNKNOWN = "eager", "compiled", "mixed", "unknown"
_MODE_SKIP = "torch dispatch mode"  # in dynamo's skip reason "non-infra torch dispatch mode present, ..."
_BACKENDS_WITH_ATEN_OPS = ("eager", "aot_eager", "aot_eager_default_partitioner", "aot_eager_decomp_partition",
                           "aot_ts", "cudagraphs_inner")


class _Call:
    """One entry into a compiled region: what dynamo did for its frames while it ran."""

    __slots__ = ("region", "mode_on", "fullgraph", "hits", "misses", "skips", "fullgraph_saved", "captured")

    def __init__(self, region: "_Region", mode_on: bool, fullgraph: bool = False, captured: bool = False) -> None:
        self.region = region
        self.mode_on = mode_on
        self.fullgraph = fullgraph
        self.captured = captured  # entered while the recorder captured compiled units: it ran compiled
        self.hits = self.misses = self.skips = self.fullgraph_saved = 0

    def how(self) -> str:
        if self.hits and (self.skips or self.region.marked):  # marked: a frame of it was skipped in an earlier call
            return MIXED
        if self.skips:
            return EAGER
        if self.hits or self.misses:  # a miss without a skip: dynamo compiled it and ran the compiled code
            return COMPILED
        if self.captured:  # its first compile under the capture backend (no guard was evaluated): compiled
            return COMPILED
        # No frame reached dynamo: its code is marked skip already (torch's own marking from before this tracker
        # started): eager under a dispatch mode. Without a mode on the stack there is nothing to go on.
        return EAGER if self.mode_on else UNKNOWN


class _Region:
    __slots__ = ("name", "kind", "backend", "calls", "marked", "units")

    def __init__(self, name: str, kind: str, backend: str | None) -> None:
        self.name, self.kind, self.backend = name, kind, backend
        self.calls: list[_Call] = []
        self.marked = False  # one of its frames was marked "skip" by torch during this recording
        self.units = False  # its graphs were compiled by the capture backend: its calls are compiled units

    def to_json(self) -> dict:
        hows = [c.how() for c in self.calls]
        counts = {h: hows.count(h) for h in (EAGER, COMPILED, MIXED, UNKNOWN) if h in hows}
        how = next(iter(counts)) if len(counts) == 1 else (MIXED if counts else UNKNOWN)
        backend = self.backend
        in_trace: bool | None
        units = how == COMPILED and self.units
        if how == EAGER or units:
            in_trace = True
        elif how in (COMPILED, MIXED) and backend in _BACKENDS_WITH_ATEN_OPS:
            in_trace = True  # these backends run the graph's aten ops through the dispatcher
        elif how == COMPILED and backend == "inductor":
            in_trace = False  # inductor's kernels bypass the dispatcher (only its extern kernels reach it)
        else:
            in_trace = None  # a backend replaydiff does not know, or partly eager and partly inductor
        return CompiledRegion(self.name, self.kind, len(self.calls), how, counts, backend,
                              any(c.fullgraph for c in self.calls), in_trace,
                              sum(c.fullgraph_saved for c in self.calls), units=units).to_wire()


# -- the patches: installed once while any tracker is started, dispatching to the started trackers ---------------
_lock = threading.Lock()
_active: list["CompiledRegionTracker"] = []
_patches: dict[str, Any] = {}  # what was replaced, to put back
_COMPILE_WRAPPER = "compile_wrapper"


# torch warns at every call of a torch.compile'd module while any global module hook is installed
# (torch/_dynamo/eval_frame.py, OptimizedModule.__call__). While recording, the hooks are the recorder's own (its module
# tracker and module statistics), which expect the OptimizedModule's extra call: the warning would be about
# replaydiff, not about the job.
_GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def no_filter() -> None:
    """What ``quiet_global_hook_warning`` returns when it put in no filter: nothing to undo."""


def quiet_global_hook_warning() -> Callable[[], None]:
    """Filter torch's global-hook warning for compiled modules while recording, only when the job has installed no
    global module hook of its own (then the warning still reaches it); returns what undoes exactly that filter."""
    try:
        from torch.nn.modules.module import _has_any_global_hook

        if _has_any_global_hook():
            return no_filter
        warnings.filterwarnings("ignore", message=_GLOBAL_HOOK_WARNING, category=UserWarning)
        entry = warnings.filters[0]
    except Exception as exc:
        log.debug("torch's global-hook warning not filtered: %s", exc)
        return no_filter

    def undo() -> None:
        try:
            warnings.filters.remove(entry)
            warnings._filters_mutated()  # type: ignore[attr-defined]  # what filterwarnings itself calls
        except (ValueError, AttributeError):
            pass  # the job's own catch_warnings() already put its filters back
    return undo


def _eval_frame_file() -> str | None:
    mod = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(mod, "__file__", None)


def _install() -> None:
    """Patch dynamo's region entry, skip handling, guard-complete hook and compiled backward. Idempotent; all or
    nothing (a failure puts back what was patched and raises to ``start()``, which notes it)."""
    if _patches:
        return
    try:
        _patch()
    except BaseException:
        _uninstall()
        raise


def _patch() -> None:
    import torch._dynamo.convert_frame as cf
    import torch._dynamo.eval_frame as ef
    from torch._C._dynamo.eval_frame import set_guard_complete_hook

    orig_cfs = ef._callback_from_stance
    orig_skip = cf.CatchErrorsWrapper._handle_skip
    ef_file = ef.__file__

    def _callback_from_stance(callback):  # noqa: ANN001  (torch's signature)
        result = orig_cfs(callback)
        if callback is not None and _active:  # None: a torch._dynamo.disable wrapper (every dispatch-mode op)
            try:
                caller = sys._getframe(1)
                if caller.f_code.co_name == _COMPILE_WRAPPER and caller.f_code.co_filename == ef_file:
                    for t in list(_active):
                        t._on_enter(caller)
            except Exception as exc:  # never into the job
                log.debug("compiled-region tracker: entry: %s", exc)
        return result

    def _handle_skip(self, result, frame):  # noqa: ANN001
        result = orig_skip(self, result, frame)
        if _active:
            try:
                reason = getattr(result, "skip_reason", None) or ""
                if _MODE_SKIP in reason and getattr(result, "guarded_code", None) is None:
                    for t in list(_active):
                        result = t._on_mode_skip(result, frame)
            except Exception as exc:
                log.debug("compiled-region tracker: skip: %s", exc)
        return result

    prior_hook = [None]

    def _guard_complete(cache_hit: bool) -> bool:
        out = cache_hit
        try:
            if prior_hook[0] is not None:
                out = prior_hook[0](cache_hit)
        finally:
            try:
                for t in list(_active):
                    t._on_guard(bool(cache_hit))
            except Exception as exc:
                log.debug("compiled-region tracker: guard hook: %s", exc)
        return out

    _patches["cfs"] = (ef, "_callback_from_stance", orig_cfs)
    ef._callback_from_stance = _callback_from_stance
    _patches["skip"] = (cf.CatchErrorsWrapper, "_handle_skip", orig_skip)
    cf.CatchErrorsWrapper._handle_skip = _handle_skip
    prior_hook[0] = set_guard_complete_hook(_guard_complete)
    _patches["hook"] = (set_guard_complete_hook, _guard_complete, prior_hook[0])

    try:  # compiled backward: CompiledFunction._backward_impl calls this module global
        import torch._functorch._aot_autograd.runtime_wrappers as rw

        orig_call = rw.call_func_at_runtime_with_args

        def call_func_at_runtime_with_args(f, args, steal_args=False, disable_amp=False):  # noqa: ANN001
            if _active:
                try:
                    caller = sys._getframe(1)
                    if caller.f_code.co_name == "_backward_impl":
                        for t in list(_active):
                            t._on_compiled_backward(caller, f)
                            if t.wrap_backward is not None:  # the recorder's unit capture (record/unit_capture.py)
                                f = t.wrap_backward(f, caller) or f
                except Exception as exc:
                    log.debug("compiled-region tracker: backward: %s", exc)
            return orig_call(f, args, steal_args=steal_args, disable_amp=disable_amp)

        _patches["bw"] = (rw, "call_func_at_runtime_with_args", orig_call)
        rw.call_func_at_runtime_with_args = call_func_at_runtime_with_args
    except Exception as exc:
        log.debug("compiled-region tracker: no compiled-backward hook: %s", exc)


def _uninstall() -> None:
    for key, entry in list(_patches.items()):
        try:
            if key == "hook":
                setter, ours, prior = entry
                current = setter(prior)
                if current is not ours:  # someone set their own hook after ours: leave theirs in place
                    setter(current)
            else:
                owner, name, orig = entry
                setattr(owner, name, orig)
        except Exception as exc:
            log.debug("compiled-region tracker: could not restore %s: %s", key, exc)
        _patches.pop(key, None)


# -- naming -------------------------------------------------------------------------------------------------------
def _where(code: Any) -> str:
    name = code.co_filename
    cwd = os.getcwd() + os.sep
    if name.startswith(cwd):
        name = name[len(cwd):]
    elif "site-packages" + os.sep in name:  # torch.nn.Sequential.forward: torch/nn/modules/container.py
        name = name.rsplit("site-packages" + os.sep, 1)[1]
    return f"{name}:{code.co_firstlineno}"


def _region_name(fn: Any) -> str:
    """A readable name for what a compile wrapper runs: ``Net.forward (model.py:12)``, ``step (train.py:40)``."""
    import torch

    target = getattr(fn, "__wrapped__", None)  # external_utils.wrap_inline(module)
    if isinstance(target, torch.nn.Module):
        fn = target
    owner = getattr(fn, "__self__", None)  # OptimizedModule: module.__call__; Module.compile(): module._call_impl
    mod = fn if isinstance(fn, torch.nn.Module) else (owner if isinstance(owner, torch.nn.Module) else None)
    if mod is not None:
        forward = getattr(type(mod), "forward", None)
        code = getattr(forward, "__code__", None)
        qual = f"{type(mod).__qualname__}.forward"
        return f"{qual} ({_where(code)})" if code is not None else qual
    code = getattr(fn, "__code__", None)
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    return f"{qual} ({_where(code)})" if code is not None else str(qual)


def user_compiler(callback: Any) -> tuple[str | None, Any]:
    """(name, object) of the user's compiler behind a dynamo callback: follows dynamo's
    ``_torchdynamo_orig_backend`` chain and torch's wrapper around a backend given by name or object."""
    obj, seen = callback, 0
    while hasattr(obj, "_torchdynamo_orig_backend") and seen < 8:  # CatchErrorsWrapper, ConvertFrame, ...
        obj = obj._torchdynamo_orig_backend
        seen += 1
    callable_ = obj  # what dynamo calls: keeps the wrapper's kwargs and inductor's config
    inner = getattr(obj, "compiler_fn", None)  # torch._TorchCompileWrapper around a backend given by name or object
    if inner is not None:
        obj = inner
    for attr in ("compiler_name", "__name__"):  # _TorchCompileInductorWrapper.compiler_name = "inductor"
        name = getattr(obj, attr, None)
        if isinstance(name, str):
            return name, callable_
    return (type(obj).__name__ if obj is not None else None), callable_


def _backend_name(callback: Any) -> str | None:
    """The name of the user's compiler behind a dynamo callback."""
    return user_compiler(callback)[0]


def _unwrapped(fn: Any) -> Any:
    """Through torch._dynamo.disable's wrapper (functools.wraps) to a unit's runtime callable, if it is one."""
    for _ in range(4):
        if type(fn).__name__ == "UnitCall" or not hasattr(fn, "__wrapped__"):
            break
        fn = fn.__wrapped__
    return fn


def _is_unit_call(fn: Any) -> bool:
    return type(_unwrapped(fn)).__name__ == "UnitCall"


def _compiled_fn_backend(fn: Any) -> str | None:
    """Which compiler made an AOTAutograd backward: inductor's CompiledFxGraph (wrapped in dynamo.disable's
    ``_fn``), the aot_eager family's ``boxed_nop`` (torch/_dynamo/backends/debugging.py), or something else."""
    fn = _unwrapped(fn)
    if type(fn).__name__ == "UnitCall":  # record/unit_capture.py: a graph compiled by the capture backend
        return fn._graph.backend
    mod = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    if mod.startswith("torch._inductor"):
        return "inductor"
    if mod == "torch._dynamo.backends.debugging":
        return "aot_eager"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{mod}.{name}" if mod else name


def _mode_blocks_dynamo() -> bool:
    """The check dynamo itself makes before compiling a frame (convert_frame.py:2542-2547)."""
    from torch._dynamo import config
    from torch.utils import _python_dispatch as pd

    if getattr(config, "inline_torch_dispatch_torch_compile", True):
        return pd.any_torch_dispatch_mode_on_stack()
    return pd.is_in_any_mode_without_ignore_compile_internals()


class CompiledRegionTracker:
    """Notices each ``torch.compile`` region entered between ``start()`` and ``stop()``, and how it ran.

    keep_compiled: torch marks each code object it skips because of the recorder's dispatch mode "skip" for the rest
        of the process (the region would run eager after recording too); ``stop()`` puts those marks back to
        default, so the cached compiled code runs again. During recording torch's marking is left alone (a marked
        frame costs nothing on later calls).
    quiet_fullgraph: a ``fullgraph=True`` region skipped because of the recorder's mode runs eager instead of
        raising "found no compiled frames" into the job; the manifest counts these. (Its top frame is then left
        unmarked so that every call is counted.)
    """

    def __init__(self, *, keep_compiled: bool = True, quiet_fullgraph: bool = True) -> None:
        self.keep_compiled = keep_compiled
        self.quiet_fullgraph = quiet_fullgraph
        self._regions: dict[tuple[str, str, str | None], _Region] = {}
        self._by_frame: dict[int, _Call] = {}  # id(compile_wrapper frame) -> its call; live frames have unique ids
        self._thread: int | None = None
        self._started = False
        self._warned = False
        self._result: list[dict] = []
        self._note: str | None = None  # why tracking could not be done, if it could not
        self._compile_patch: Any = None
        self.on_attach: Any = None  # called (no arguments, must not raise) once dynamo is loaded and patched
        self.capturing: Any = None  # () -> bool: the recorder captures compiled units now (record/unit_capture.py)
        # (compiled backward, _backward_impl frame) -> a callable to run instead, or None (record/unit_capture.py)
        self.wrap_backward: Any = None
        self._marked: dict[Any, None] = {}  # code objects torch marked "skip" for the dispatch mode, to put back

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> "CompiledRegionTracker":
        try:
            self._thread = threading.get_ident()
            self._started = True
            if "torch._dynamo.eval_frame" in sys.modules:
                self._attach()
            else:
                # No compiled region can exist yet: attach (importing dynamo, ~1 s) only if torch.compile is called.
                self._wrap_torch_compile()
        except Exception as exc:
            self._note = f"compiled regions were not tracked ({type(exc).__name__}: {exc})"
            log.debug("compiled-region tracker: start: %s", exc)
        return self

    def stop(self) -> list[dict]:
        if not self._started:
            return self._result
        self._started = False
        try:
            self._unwrap_torch_compile()
            with _lock:
                if self in _active:
                    _active.remove(self)
                    if not _active:
                        _uninstall()
        except Exception as exc:
            log.debug("compiled-region tracker: stop: %s", exc)
        self._unmark()
        try:
            self._result = [r.to_json() for r in self._regions.values() if r.calls]
        except Exception as exc:
            log.debug("compiled-region tracker: summary: %s", exc)
            self._result = []
        if self._note:  # tracking failed: say so in the manifest rather than claim no region ran
            self._result.append(CompiledRegion(how=UNKNOWN, note=self._note).to_wire())
        self._by_frame.clear()
        return self._result

    def _unmark(self) -> None:
        """Put the code objects torch marked "skip" (because of the recorder's mode) back to dynamo's default."""
        if not self._marked:
            return
        try:
            from torch._C._dynamo.eval_frame import set_code_exec_strategy
            from torch._dynamo.types import FrameAction, FrameExecStrategy

            default = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
            for code in self._marked:
                set_code_exec_strategy(code, default)
        except Exception as exc:
            log.debug("compiled-region tracker: could not unmark skipped code: %s", exc)
        self._marked.clear()

    def regions(self) -> list[dict]:
        """The regions seen so far (a snapshot; ``stop()`` gives the final list)."""
        return [r.to_json() for r in self._regions.values() if r.calls]

    def first_warning(self) -> str | None:
        """A one-sentence warning the first time a region has been seen; None before that and after.

        The sentence has no "replaydiff: " prefix (``Recorder._warn`` adds one)."""
        if self._warned:
            return None
        regions = self._result if not self._started else self.regions()
        typed = compiled_regions_from_wire(regions)
        if typed and all(r.units for r in typed):  # every region is in the trace as compiled units: nothing to warn of
            return None
        msg = summarize(regions)
        if msg is not None:
            self._warned = True
        return msg

    # -- attaching ----------------------------------------------------------------------------------------------
    def _attach(self) -> None:
        with _lock:
            _install()
            if self not in _active:
                _active.append(self)
        if self.on_attach is not None:  # dynamo is loaded now: the recorder's unit capture can engage
            self.on_attach()

    def _wrap_torch_compile(self) -> None:
        import torch

        orig = torch.compile
        tracker = self

        def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001  (stands in for torch.compile)
            if tracker._started:
                try:
                    tracker._attach()
                except Exception as exc:
                    tracker._note = f"compiled regions were not tracked ({type(exc).__name__}: {exc})"
            return orig(*args, **kwargs)

        compile.__wrapped__ = orig  # type: ignore[attr-defined]
        compile.__doc__ = orig.__doc__
        torch.compile = compile
        self._compile_patch = (orig, compile)

    def _unwrap_torch_compile(self) -> None:
        if self._compile_patch is None:
            return
        import torch

        orig, ours = self._compile_patch
        if torch.compile is ours:
            torch.compile = orig
        self._compile_patch = None

    # -- events (called by the patches; exceptions are caught there) --------------------------------------------
    def _mine(self) -> bool:
        return self._started and threading.get_ident() == self._thread

    def _region(self, name: str, kind: str, backend: str | None) -> _Region:
        key = (kind, name, backend)  # one function compiled twice, with two backends, is two regions
        r = self._regions.get(key)
        if r is None:
            r = self._regions[key] = _Region(name, kind, backend)
        return r

    def _on_enter(self, wrapper_frame: Any) -> None:
        if not self._mine():
            return
        loc = wrapper_frame.f_locals  # compile_wrapper's closure: fn, callback, self (the OptimizeContext)
        ctx = loc.get("self")
        region = self._region(_region_name(loc.get("fn")), "forward", _backend_name(loc.get("callback")))
        captured = bool(self.capturing is not None and self.capturing())
        call = _Call(region, _mode_blocks_dynamo(), bool(getattr(ctx, "fullgraph", False)), captured)
        region.units = region.units or captured
        region.calls.append(call)
        self._by_frame[id(wrapper_frame)] = call

    def _current_call(self) -> _Call | None:
        """The innermost compiled-region call on this thread's Python stack."""
        ef_file = _eval_frame_file()
        f = sys._getframe(2)
        while f is not None:
            code = f.f_code
            if code.co_name == _COMPILE_WRAPPER and code.co_filename == ef_file:
                call = self._by_frame.get(id(f))
                if call is None:  # entered before start(): name it now
                    self._on_enter(f)
                    call = self._by_frame.get(id(f))
                return call
            f = f.f_back
        return None

    def _on_mode_skip(self, result: Any, frame: Any) -> Any:
        if not self._mine():
            return result
        call = self._current_call()
        if call is not None:
            call.skips += 1
        fullgraph = self.quiet_fullgraph and call is not None and call.fullgraph
        if getattr(result, "apply_to_code", False):
            if fullgraph and call.skips == 1:
                # The region's top frame (its first frame skipped for the mode: the Module.__call__ frames before it
                # are skipped as torch files): skip it now without marking it, so every call comes back here.
                result = dataclasses.replace(result, apply_to_code=False)
            elif self.keep_compiled:
                code = getattr(frame, "f_code", None)
                if code is not None:
                    self._marked[code] = None  # torch marks it "skip" now; stop() puts it back
                    if call is not None:
                        call.region.marked = True
        if fullgraph:
            from torch._C._dynamo.eval_frame import set_fullgraph_compiled_frame_count

            # The setter only stores a non-negative value while the counter is negative (off), so read it by
            # switching it off, then store the count plus this frame.
            count = set_fullgraph_compiled_frame_count(-1)
            if count >= 0:  # a fullgraph wrapper is counting: count this skipped frame so it does not raise
                set_fullgraph_compiled_frame_count(count + 1)
                call.fullgraph_saved += 1
            else:
                set_fullgraph_compiled_frame_count(count)
        return result

    def _on_guard(self, cache_hit: bool) -> None:
        if not self._mine():
            return
        call = self._current_call()
        if call is not None:
            if cache_hit:
                call.hits += 1
            else:
                call.misses += 1

    def _on_compiled_backward(self, impl_frame: Any, compiled_bw: Any) -> None:
        if not self._mine():
            return
        name = compiled_backward_name(impl_frame)
        region = self._region(name, "backward", _compiled_fn_backend(compiled_bw))
        call = _Call(region, _mode_blocks_dynamo())
        region.units = region.units or _is_unit_call(compiled_bw)
        call.hits = 1  # it ran compiled code by definition
        region.calls.append(call)


def compiled_backward_name(impl_frame: Any) -> str:
    """``compiled backward of AOT graph N``, from AOTAutograd's ``_backward_impl`` frame."""
    ctx = impl_frame.f_locals.get("ctx")
    fwd_cls = getattr(type(ctx), "_forward_cls", None)
    aot_id = getattr(fwd_cls, "_aot_id", None)
    return f"compiled backward of AOT graph {aot_id}" if aot_id is not None else "compiled backward"


def summarize(regions: list[dict] | None, limit: int = 4) -> str | None:
    """One sentence on the compiled regions of a recording (from ``stop()`` or a manifest's ``compiled_regions``),
    or None if none ran. For ``record``'s warning and the summaries of ``show`` and ``replay``.

    Names at most ``limit`` regions, the ones whose ops are not (or not surely) in the trace first."""
    typed = compiled_regions_from_wire(regions)
    if not typed:
        return None
    notes = [r.note for r in typed if r.note]
    typed = [r for r in typed if not r.note]
    if not typed:
        return "; ".join(notes) + "." if notes else None
    ordered = sorted(typed, key=lambda r: r.ops_in_trace is True)  # stable: missing ops first
    parts = []
    for r in ordered[:limit]:
        n, how = r.calls or 0, r.how or UNKNOWN
        times = f"{n} call{'s' if n != 1 else ''}"
        backend = r.backend or "its backend"
        if how == EAGER:
            what = "ran as eager aten ops (in the trace; not the compiled code the job runs otherwise)"
        elif how == COMPILED and r.units:
            what = f"ran compiled by {backend}, each call of its graphs recorded as a compiled unit"
        elif how == COMPILED:
            in_trace = r.ops_in_trace
            what = (f"ran compiled by {backend} (its graph's aten ops are in the trace)" if in_trace is True
                    else f"ran compiled by {backend} (its kernels are NOT in the trace)" if in_trace is False
                    else f"ran compiled by {backend} (whether its ops reach the trace depends on that backend)")
        elif how == MIXED:
            # Say each kind with its count: "mixed" may be compiled calls beside one whose way was not told, with no
            # eager call at all.
            ways = {EAGER: "as eager aten ops", COMPILED: f"compiled by {backend}",
                    MIXED: f"partly eager, partly compiled by {backend}", UNKNOWN: "in a way that could not be told"}
            what = "ran " + ", ".join(f"{k} call{'s' if k != 1 else ''} {ways.get(h, h)}"
                                      for h, k in (r.calls_by_how or {}).items())
        else:
            what = "ran, but how could not be told"
        extra = ""
        if r.fullgraph_errors_suppressed:
            extra = " (fullgraph=True: torch's 'no compiled frames' error was kept out of the job)"
        parts.append(f"{r.region} [{r.kind or 'forward'}, {times}] {what}{extra}")
    if len(ordered) > limit:
        parts.append(f"and {len(ordered) - limit} more (see the manifest's compiled_regions)")
    parts.extend(notes)
    return (f"{len(typed)} torch.compile region{'s' if len(typed) != 1 else ''} ran while recording: "
            + "; ".join(parts) + ".")