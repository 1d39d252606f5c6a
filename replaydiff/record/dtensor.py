"""Provides what the recording mode notes of an op on DTensor arguments before DTensor unwraps it: each DTensor
argument's placements, mesh shape and global shape (trace/placements.py keeps the file). Called only for ops whose
arguments include a wrapper subclass, so a job without DTensor pays nothing; a failure is logged, never raised."""
from __future__ import annotations

import logging
from typing import Any

from replaydiff.aten import iter_tensors

log = logging.getLogger("replaydiff")


def note_dtensor_op(rec: Any, func: Any, args: tuple, kwargs: dict) -> None:
    """Append the op's DTensor facts to the rank's trace, numbered by the op the recorder records next."""
    # imported here: a job without DTensor never loads the module (nor keeps its objects alive)
    from replaydiff.trace.placements import DTensorArg, append_note

    try:
        where = rec.rank_dir
        if where is None:
            return
        found: list = []
        for t in [*iter_tensors(list(args)), *iter_tensors(list(kwargs.values()))]:
            placements = getattr(t, "placements", None)
            mesh = getattr(t, "device_mesh", None)
            found.append(None if placements is None or mesh is None else
                         DTensorArg(tuple(str(p) for p in placements), tuple(mesh.shape), tuple(t.shape)))
        if any(a is not None for a in found):
            append_note(where, rec.next_index, str(func), found)
    except Exception as exc:  # the job goes on; the diff infers these layouts from the values instead
        log.debug("DTensor placements not noted for %s: %s", func, exc)
