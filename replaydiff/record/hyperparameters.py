"""Provides the note the recorder writes at the start of each optimizer step it records: the optimizer's class and
each parameter group's plain settings (trace/hyperparameters.py keeps the file). Called from the optimizer-step pre
hook the recorder already has; a failure is logged, never raised, and nothing of the optimizer is changed."""
from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

from replaydiff.record.context import user_frames
from replaydiff.trace.sources import read_source

log = logging.getLogger("replaydiff")


def built_at(optimizer: Any) -> str | None:
    """'file.py:LINE' of the assignment that names the optimizer in the user's code calling its step: the nearest
    user frame whose local (or global) variable holds it, and the last line before the frame's current one that
    assigns that name (``opt = torch.optim.SGD(...)``); None when no frame names it or no such line is found."""
    for depth, frame in enumerate(user_frames(sys._getframe(1))):
        if depth >= 8:
            break
        names = [n for n, v in frame.f_locals.items() if v is optimizer] or \
            [n for n, v in frame.f_globals.items() if v is optimizer]
        if not names:
            continue
        read = read_source(frame.f_code.co_filename)
        if read is None:
            return None
        pattern = re.compile(rf"^\s*(?:self\.)?{re.escape(names[0])}\s*(?::[^=]*)?=[^=]")
        lines = read[1]
        found = [k for k in range(min(frame.f_lineno - 1, len(lines))) if pattern.match(lines[k])]
        if not found:
            return None
        path, cwd = frame.f_code.co_filename, os.getcwd() + os.sep
        return f"{path[len(cwd):] if path.startswith(cwd) else path}:{found[-1] + 1}"
    return None


def note_optimizer_step(rec: Any, optimizer: Any) -> None:
    """Append the step's hyperparameters to the rank's trace, numbered by the op the recorder records next."""
    from replaydiff.trace.hyperparameters import append_optimizer_step
    from replaydiff.trace.schema.hyperparameters import OptimizerStep, settings_of

    try:
        where = getattr(rec, "rank_dir", None)
        if where is None or not where.exists():
            return
        groups = tuple(settings_of(g) for g in getattr(optimizer, "param_groups", ()) if isinstance(g, dict))
        append_optimizer_step(where, OptimizerStep(int(rec.next_index), type(optimizer).__name__, groups,
                                                   built_at(optimizer)))
    except Exception as exc:  # the job goes on; the diff then cannot compare the runs' settings
        log.debug("optimizer hyperparameters not noted: %s", exc)
