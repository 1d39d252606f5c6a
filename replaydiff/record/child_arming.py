"""Arming the recorder in a child of ``replaydiff record`` (``--step N``, ``--steps``, ``--flight``).

The CLI starts the child with ``REPLAYDIFF_RECORD`` set and our ``autostart/`` folder first on PYTHONPATH, so its
``sitecustomize`` calls ``install()`` at interpreter start. One mechanism serves every form: ``MultiStepRecorder``
(multi_step.py) records the chosen optimizer steps, each from the end of the step before it (for step 1: the first
module call) to the end of its own, found through torch's global optimizer-step hooks; ``--step N`` is the range N..N.
Nothing here may raise into the user's script.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import weakref
from typing import Any

from replaydiff.errors import warn_job
from replaydiff.record.autostart._replaydiff_record_env import ENV_VAR

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # replaydiff/
# torch's frames between an op the job calls and a dispatch mode's __torch_dispatch__ (the dispatcher looks up the
# mode's rule, and calls the mode through dynamo's disable wrapper): they are the recorder's call, not the job's code.
_DISPATCH_MACHINERY = (os.path.join("torch", "_compile.py"), os.path.join("torch", "_dynamo", "eval_frame.py"),
                       os.path.join("torch", "_library", "simple_registry.py"),
                       os.path.join("torch", "utils", "_python_dispatch.py"))

_armed = False  # once per process. The recorder itself is held only by its hooks while it records: not after.


def _report_steps(folder: str, recorder: "weakref.ref[Any]") -> None:
    """Tell ``replaydiff record`` this process's rank and how many optimizer steps it ran, so that a step the script
    never reaches ("the script ran 4 optimizer steps") and a job with no rank of --rank ("it ran as rank 0") are
    said as such: one small file per process in a folder the CLI made. The recorder is reached through a weak
    reference: one that finished recording is gone by now: it says "finished" (every step asked for was reached),
    not how many steps ran."""
    try:
        from replaydiff.aten import current_rank
        from replaydiff.record import multi_step

        rec = recorder()
        report = {"steps": rec.steps_done if rec is not None else None, "finished": rec is None,
                  "rank": current_rank()[0]}
        if multi_step.first_step_missed:
            report["missed"] = multi_step.FIRST_STEP_MISSED
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(report, f)
    except (Exception, KeyboardInterrupt):  # a second Ctrl-C at exit: record then says what the trace holds
        pass


def _without_recorder_frames(tb: Any) -> Any:
    """The traceback ``tb`` cut before its first frame of the recorder (replaydiff's own, or torch's dispatch
    machinery that calls it) when no frame after that one is the job's own code: a Ctrl-C lands wherever the job
    is, often inside the recorder's dispatch mode, and the frames a user reads last must be their own code's, as
    without the recorder. Unchanged when there is nothing to cut, or the cut would leave no frame."""
    import sysconfig

    torch = sys.modules.get("torch")
    library = [os.path.dirname(os.path.abspath(torch.__file__)) + os.sep] if torch is not None else []
    library += [os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")]

    def recorder(filename: str) -> bool:
        return os.path.abspath(filename).startswith(_PACKAGE + os.sep) or \
            any(filename.endswith(m) for m in _DISPATCH_MACHINERY)

    def jobs(filename: str) -> bool:
        path = os.path.abspath(filename)
        return not recorder(filename) and not any(path.startswith(lib) for lib in library)

    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    names = [t.tb_frame.f_code.co_filename for t in frames]
    for k, name in enumerate(names):
        if recorder(name):
            if k == 0 or any(jobs(n) for n in names[k + 1:]):
                break
            frames[k - 1].tb_next = None
            return frames[0]
    return frames[0] if frames else None


def _interrupts_show_the_jobs_frames() -> None:
    """A KeyboardInterrupt (Ctrl-C) that ends the job is printed without the recorder's frames: the interrupt is the
    job's, and a traceback ending in replaydiff/record/ reads as replaydiff crashing. Other exceptions are left as
    they are (one raised inside the recorder is a bug of ours and must show where)."""
    prev = sys.excepthook

    def hook(typ: Any, value: Any, tb: Any) -> None:
        if isinstance(typ, type) and issubclass(typ, KeyboardInterrupt):
            try:
                tb = _without_recorder_frames(tb)
                if value is not None:
                    value.__traceback__ = tb
            except Exception:  # never stand between the job and its own error report
                pass
        prev(typ, value, tb)

    sys.excepthook = hook


def install() -> None:
    global _armed
    raw = os.environ.get(ENV_VAR)
    if not raw or _armed:
        return
    _armed = True
    try:
        from replaydiff.record.options import RecordOptions
        from replaydiff.record.step_range import StepRange
        from replaydiff.record.multi_step import MultiStepRecorder

        _interrupts_show_the_jobs_frames()
        config = json.loads(raw)
        options = RecordOptions.from_json(config.get("options") or {})
        step = int(config.get("step", 1))
        # --steps and --flight say which steps themselves; --step N alone is the one step N
        steps = None if (options.steps or options.flight) else StepRange(step, step, 1)
        command = config.get("command")
        command = [str(x) for x in command] if isinstance(command, list) else None
        if options.compiled == "capture":  # graphs compiled before the recorded step stay replayable
            from replaydiff.record.unit_capture import watch_compiles

            watch_compiles()
        rec = MultiStepRecorder(config["out"], options, steps, command).start().finish_at_exit()
        if config.get("status"):
            atexit.register(_report_steps, config["status"], weakref.ref(rec))
    except Exception as exc:
        warn_job(f"could not arm step recording: {exc}")
