"""Provides the note the recorder writes at the start of each optimizer step it records: the optimizer's class and
each parameter group's plain settings (trace/hyperparameters.py keeps the file). Called from the optimizer-step pre
hook the recorder already has; a failure is logged, never raised, and nothing of the optimizer is changed."""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("replaydiff")


def note_optimizer_step(rec: Any, optimizer: Any) -> None:
    """Append the step's hyperparameters to the rank's trace, numbered by the op the recorder records next."""
    from replaydiff.trace.hyperparameters import append_optimizer_step
    from replaydiff.trace.schema.hyperparameters import OptimizerStep, settings_of

    try:
        where = getattr(rec, "rank_dir", None)
        if where is None or not where.exists():
            return
        groups = tuple(settings_of(g) for g in getattr(optimizer, "param_groups", ()) if isinstance(g, dict))
        append_optimizer_step(where, OptimizerStep(int(rec.next_index), type(optimizer).__name__, groups))
    except Exception as exc:  # the job goes on; the diff then cannot compare the runs' settings
        log.debug("optimizer hyperparameters not noted: %s", exc)
