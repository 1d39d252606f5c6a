"""Arming the recorder in a child of ``replaydiff record`` (``--step N``, ``--steps``, ``--flight``).

The CLI starts the child with ``REPLAYDIFF_RECORD`` set and our ``autostart/`` folder first on PYTHONPATH, so its
``sitecustomize`` calls ``install()`` at interpreter start. One mechanism serves every form: ``MultiStepRecorder``
(steps.py) records the chosen optimizer steps, each from the end of the step before it (for step 1: the first module
call) to the end of its own, found through torch's global optimizer-step hooks; ``--step N`` is the range N..N.
Nothing here may raise into the user's script.
"""
from __future__ import annotations

import atexit
import json
import os
import warnings
import weakref
from typing import Any

ENV_VAR = "REPLAYDIFF_RECORD"

_armed = False  # once per process. The recorder itself is held only by its hooks while it records: not after.


def _report_steps(folder: str, recorder: "weakref.ref[Any]") -> None:
    """Tell ``replaydiff record`` this process's rank and how many optimizer steps it ran, so that a step the script
    never reaches ("the script ran 4 optimizer steps") and a job with no rank of --ranks ("it ran as rank 0") are
    said as such: one small file per process in a folder the CLI made. The recorder is reached through a weak
    reference: one that finished recording is gone by now: it says "finished" (every step asked for was reached),
    not how many steps ran."""
    try:
        from replaydiff.aten import current_rank

        rec = recorder()
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump({"steps": rec.steps_done if rec is not None else None, "finished": rec is None,
                       "rank": current_rank()[0]}, f)
    except Exception:
        pass


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
        if options.compiled == "capture":  # graphs compiled before the recorded step stay replayable
            from replaydiff.record.units import watch_compiles

            watch_compiles()
        rec = MultiStepRecorder(config["out"], options, steps).start().finish_at_exit()
        if config.get("status"):
            atexit.register(_report_steps, config["status"], weakref.ref(rec))
    except Exception as exc:
        warnings.warn(f"replaydiff: could not arm step recording: {exc}", RuntimeWarning, stacklevel=2)
