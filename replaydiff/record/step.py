"""Arming the recorder in a child of ``replaydiff record`` (``--step N``, ``--steps``, ``--flight``).

The CLI starts the child with ``REPLAYDIFF_RECORD`` set and our ``autostart/`` folder first on PYTHONPATH, so its
``sitecustomize`` calls ``install()`` at interpreter start. One mechanism serves every form: ``MultiStepRecorder``
(steps.py) records the chosen optimizer steps, each from the end of the step before it (for step 1: the first module
call) to the end of its own, found through torch's global optimizer-step hooks; ``--step N`` is the range N..N.
Nothing here may raise into the user's script.
"""
from __future__ import annotations

import json
import os
import warnings

ENV_VAR = "REPLAYDIFF_RECORD"

_armed = False  # once per process. The recorder itself is held only by its hooks while it records: not after.


def install() -> None:
    global _armed
    raw = os.environ.get(ENV_VAR)
    if not raw or _armed:
        return
    _armed = True
    try:
        from replaydiff.record.options import RecordOptions
        from replaydiff.record.step_range import StepRange
        from replaydiff.record.steps import MultiStepRecorder

        config = json.loads(raw)
        options = RecordOptions.from_dict(config.get("options") or {})
        step = int(config.get("step", 1))
        # --steps and --flight say which steps themselves; --step N alone is the one step N
        steps = None if (options.steps or options.flight) else StepRange(step, step, 1)
        MultiStepRecorder(config["out"], options, steps).start().finish_at_exit()
    except Exception as exc:
        warnings.warn(f"replaydiff: could not arm step recording: {exc}", RuntimeWarning, stacklevel=2)
