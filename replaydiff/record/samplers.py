"""Provides the recorder's watch on data samplers: where each ``torch.utils.data.DistributedSampler`` (and subclass)
is built and the ``rank`` and ``num_replicas`` it is given and takes. A sampler is built before the step that reads
it, so the recorded ops cannot show it; with this note the diff of a parallel run names the line that gave every
rank the same shard ("given rank=0 on rank 1") instead of only saying the ranks hold the same rows.

While watched, ``DistributedSampler.__init__`` is wrapped: the original runs first, untouched, with the very
arguments the job gave, and its result is returned; only then are plain facts copied (no reference to the sampler is
kept). The wrapper goes when the last watch ends (left in place, passing straight through, if something else wrapped
``__init__`` over it since). A failure of the note never reaches the job: it is said in one warning per recording,
and that sampler is left out."""
from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading
from typing import Any

from replaydiff.errors import warn_job
from replaydiff.trace.schema.samplers import MAX_SAMPLERS, SamplerBuilt, SamplersNote

log = logging.getLogger("replaydiff")

_lock = threading.Lock()
_watchers = 0
_whole_process = False
_built: list[SamplerBuilt] = []
_wrapper: Any = None  # the installed wrapper (None: not installed)
_original: Any = None  # DistributedSampler.__init__ as found
_warned = False  # a failure was said (once per recording: from the first watch to the last unwatch)


def _degrade(what: str, exc: Exception) -> None:
    """Say a failure of the watch once; the job goes on, and the diff says less (no sampler's line)."""
    global _warned
    log.debug("%s: %s", what, exc)
    if not _warned:
        _warned = True
        try:
            warn_job(f"{what} ({type(exc).__name__}: {exc}); the diff of a parallel run cannot name a sampler's line")
        except Exception:  # warnings turned into errors by the job: its own choice, never our exception
            pass


def _site(sampler: Any) -> str | None:
    """'file.py:LINE' of the code that built ``sampler``: the nearest frame outside torch and replaydiff that is not
    a sampler subclass's own ``__init__`` (its ``super().__init__`` call is not where the job builds it)."""
    from replaydiff.record.context import user_frames

    for frame in user_frames(sys._getframe(2)):
        if frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is sampler:
            continue
        path, cwd = frame.f_code.co_filename, os.getcwd() + os.sep
        return f"{path[len(cwd):] if path.startswith(cwd) else path}:{frame.f_lineno}"
    return None


def _given(original: Any, sampler: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """The ``rank`` and ``num_replicas`` arguments as the job passed them (None when left out)."""
    bound = inspect.signature(original).bind(sampler, *args, **kwargs)
    return bound.arguments.get("rank"), bound.arguments.get("num_replicas")


def _plain_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _note(original: Any, sampler: Any, args: tuple, kwargs: dict) -> None:
    rank, replicas = _given(original, sampler, args, kwargs)
    shuffle = getattr(sampler, "shuffle", None)
    entry = SamplerBuilt(type(sampler).__name__[:200], _site(sampler), _plain_int(rank), _plain_int(replicas),
                         _plain_int(getattr(sampler, "rank", None)), _plain_int(getattr(sampler, "num_replicas", None)),
                         shuffle if isinstance(shuffle, bool) else None, _plain_int(getattr(sampler, "seed", None)))
    with _lock:
        if len(_built) < MAX_SAMPLERS:
            _built.append(entry)


def _make_wrapper(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        result = original(self, *args, **kwargs)  # the job's call, first and untouched (it may raise: its own error)
        if _watchers and _wrapper is __init__:
            try:
                _note(original, self, args, kwargs)
            except Exception as exc:  # the sampler is built as the job asked; the diff then cannot name its line
                _degrade("a DistributedSampler was not noted", exc)
        return result

    return __init__


def watch(whole_process: bool = False) -> None:
    """Begin noting samplers as they are built (nested watches share one wrapper). ``whole_process``: this watch
    began at the interpreter's start, so the note can say that no sampler was built."""
    global _watchers, _wrapper, _original, _whole_process, _warned
    try:
        from torch.utils.data import DistributedSampler

        with _lock:
            if _watchers == 0:
                _built.clear()
                _warned = False
                _whole_process = whole_process
                current = DistributedSampler.__dict__.get("__init__")
                if _wrapper is None or current is not _wrapper:
                    _original = current
                    _wrapper = _make_wrapper(current)
                    DistributedSampler.__init__ = _wrapper
            _watchers += 1
    except Exception as exc:  # the job goes on; the diff says what it says without the sampler's line
        _degrade("DistributedSampler is not watched", exc)


def unwatch() -> None:
    """End one watch; the last restores ``DistributedSampler.__init__`` (if it is still the wrapper)."""
    global _watchers, _wrapper
    try:
        from torch.utils.data import DistributedSampler

        with _lock:
            if _watchers == 0:
                return
            _watchers -= 1
            if _watchers == 0 and _wrapper is not None and DistributedSampler.__dict__.get("__init__") is _wrapper:
                DistributedSampler.__init__ = _original
                _wrapper = None
    except Exception as exc:
        _degrade("DistributedSampler's __init__ could not be restored", exc)


def noted() -> SamplersNote | None:
    """What is known of the samplers built so far; None when nothing watches."""
    with _lock:
        return SamplersNote(_whole_process, tuple(_built)) if _watchers else None


def note_samplers(rec: Any) -> None:
    """Write the samplers noted so far into the rank's trace, when they changed since the recorder last wrote."""
    from replaydiff.trace.samplers import write_samplers

    try:
        where = getattr(rec, "rank_dir", None)
        note = noted()
        if note is None or where is None or not where.exists() or getattr(rec, "samplers_written", None) == note:
            return
        write_samplers(where, note)
        rec.samplers_written = note
    except Exception as exc:  # the job goes on; the diff then cannot name a sampler's line
        _degrade("the samplers built were not written into the trace", exc)
