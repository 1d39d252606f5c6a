"""After ``record --module/--op``: a filter that matched no op of the trace (a typo, a path the job does not have).

Such a trace stores no tensor data, so its replay judges nothing; the recording itself ran fine, which is why the
CLI says so at the end of ``record`` in one line, with the module paths the trace does have that come nearest to the
glob. The check reads the finished trace and applies the recorder's own test (``RecordOptions.selects``); the
recording's outcome (``record/outcome.py``) carries its warning.
"""
from __future__ import annotations

import difflib
from pathlib import Path

from replaydiff.errors import TraceError
from replaydiff.record.options import RecordOptions
from replaydiff.trace import open_trace

_NEAREST = 5  # module paths named in the warning


def unmatched_filter(out: Path, options: RecordOptions) -> str | None:
    """The warning for a --module/--op filter under which no op of the trace at ``out`` came, else None (no filter,
    an op matched, or the trace cannot be read: ``show`` says what is there)."""
    modules, ops = options.modules, options.ops
    if not modules and not ops:
        return None
    seen: dict[str, None] = {}  # module paths in first-seen order
    names: dict[str, None] = {}
    try:
        t = open_trace(out)
        for rank in t.ranks:
            for op in t.rank(rank):
                if options.selects(op.name, op.module):
                    return None
                if op.module:
                    seen.setdefault(op.module, None)
                names.setdefault(op.name, None)
    except TraceError:
        return None
    flag, globs, pool = ("--module", modules, seen) if modules else ("--op", ops, names)
    what = " ".join(f"{flag} {g!r}" for g in globs)
    if modules and ops:
        what += " with " + " ".join(f"--op {g!r}" for g in ops)
    nearest: list[str] = []
    for g in globs:
        nearest += [m for m in difflib.get_close_matches(g, list(pool), n=_NEAREST, cutoff=0.0) if m not in nearest]
    kind = "modules" if modules else "ops"
    listed = ", ".join(nearest[:_NEAREST]) or "none"
    return f"{what} matched no op (the trace holds no tensor data to replay); {kind} seen: {listed}"

