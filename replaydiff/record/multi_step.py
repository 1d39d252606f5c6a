"""Recording many optimizer steps into one trace: ``--steps 100-2000:10``, ``--flight K``, or ``record(steps=...)``.

Each chosen step is recorded from the end of the optimizer step before it (for step 1: the first module call) to
the end of its own optimizer step, found through torch's global optimizer-step hooks (only the first optimizer that
steps is counted, as for ``--step N``). Between chosen steps the recorder is detached (no dispatch mode, no hooks:
the job runs at full speed) and the trace stays open; every record carries its step (``OpRecord.step``). With
``flight`` the records go to the flight recorder's ring (``flight.py``) instead of the disk, and SIGUSR1, SIGTERM and
an uncaught exception write it out. Nothing here raises into the user's script.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any, Callable

from replaydiff.errors import warn, warn_job
from replaydiff.record import samplers
from replaydiff.record.compiled import no_filter, quiet_global_hook_warning
from replaydiff.record.recorder import Recorder
from replaydiff.record.autostart._replaydiff_record_env import ENV_VAR  # set in children of the CLI
from replaydiff.record.step_range import StepRange

# Said once per process: why step 1 was not recorded (``child_arming`` tells ``replaydiff record`` at exit).
FIRST_STEP_MISSED = ("step 1 called no torch.nn.Module before its optimizer step, and the recording of step 1 starts "
                     "at the first module call: nothing of step 1 was recorded; record step 2 (`--step 2`, or "
                     "steps=\"2\"), or put `with replaydiff.record(\"trace/\"):` around the code of step 1")
first_step_missed = False


def raised(typ: type, value: BaseException | None) -> str:
    """An exception as the flight recorder's reason gives it: 'ValueError: bad shape', or its name alone where its
    message is empty (a KeyboardInterrupt)."""
    text = str(value) if value is not None else ""
    return f"{typ.__name__}: {text}" if text else typ.__name__

class MultiStepRecorder:
    """Records the chosen steps of a training loop run inside it: ``with replaydiff.record(p, steps="1-60"): train()``.

    Also what ``replaydiff record --steps/--flight`` arms in the child process. ``start()``/``stop()`` or ``with``."""

    def __init__(self, path: str | os.PathLike, options: Any, steps: StepRange | None = None,
                 command: list[str] | None = None) -> None:
        """``command``: the job's command line (``replaydiff record -- CMD``), kept in the trace's manifest."""
        self.options = options
        if steps is None:
            steps = StepRange.parse(options.steps) if options.steps else StepRange(1, None, 1)
        self.range = steps
        self.recorder = Recorder(path, options, command)
        self.steps_done = 0
        self.optimizer_id: int | None = None
        self.done = False
        self.recording = False
        self._fwd: Any = None
        self._first_forward_seen = False
        self._unquiet: Callable[[], None] = no_filter  # undoes the warning filter put in with self._fwd
        self._prev_usr1: Any = None
        self._prev_excepthook: Any = None
        self._armed = False
        self._watching_samplers = False

    @property
    def path(self):
        return self.recorder.path

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> "MultiStepRecorder":
        try:
            import torch

            from replaydiff.record.context import add_step_listener, arm_optimizer_hooks

            # Armed, so that a step's closure is told from its update even in a step whose recording starts inside
            # the closure. The step listener goes through replaydiff's own global hook, registered now and not from
            # inside an optimizer hook (see ensure_optimizer_hooks): finish() can then let go of this recorder even
            # from inside a step hook.
            arm_optimizer_hooks()
            self._armed = True
            # the samplers are built before the steps that read them: watched from now (in the CLI's child, from
            # the interpreter's start, so that none built is known as such)
            samplers.watch(whole_process=bool(os.environ.get(ENV_VAR)))
            self._watching_samplers = True
            add_step_listener(self._after_step)
            if 1 in self.range:
                # A global hook: torch.compile'd modules would warn about it (see record.compiled)
                self._unquiet = quiet_global_hook_warning()
                self._fwd = torch.nn.modules.module.register_module_forward_pre_hook(self._first_forward)
            if self.options.flight:
                self._install_flight_triggers()
        except Exception as exc:
            warn_job(f"could not arm step recording: {exc}")
            self.done = True
            self._release()
        return self

    def stop(self) -> None:
        self.finish()

    def finish_at_exit(self) -> "MultiStepRecorder":
        """Finish also when the interpreter exits (the CLI's child, whose script never leaves a ``with``). The exit
        handler goes as soon as the recording finishes."""
        if not self.done:
            atexit.register(self._finish_at_exit)
        return self

    def _finish_at_exit(self) -> None:
        """``finish`` as the interpreter exits. A second Ctrl-C (or SIGINT) that lands while the trace is being
        finished stops it there, said in one line and with no traceback of the recorder's: the trace holds what was
        written up to then and reads as cut short (a partial trace is never called clean)."""
        try:
            self.finish()
        except KeyboardInterrupt:
            try:
                warn("interrupted again while the trace was being finished; it is left partial (show says where "
                     "it was cut)")
            except Exception:  # a closed stderr is no reason to raise at exit
                pass

    def __enter__(self) -> "MultiStepRecorder":
        return self.start()

    def __exit__(self, typ: Any, value: Any, tb: Any) -> None:
        if typ is not None and self.options.flight:
            self.dump(f"the script raised {raised(typ, value)} at step {self.steps_done + 1}")
        self.finish(value)

    # -- hooks ------------------------------------------------------------------------------------------------
    def _drop_first_forward_hook(self) -> None:
        if self._fwd is not None:
            self._fwd.remove()
            self._fwd = None
            self._unquiet()
            self._unquiet = no_filter

    def _first_forward(self, module: Any, inputs: Any) -> None:
        self._drop_first_forward_hook()
        self._first_forward_seen = True
        if self.done or self.steps_done > 0:
            return
        self._resume(1)
        # This module's call began before the recorder's hooks existed: enter it by hand, or every module path of
        # this call would be wrong ("Linear" instead of "Sequential.0").
        try:
            if self.recorder.active:
                self.recorder.enter_module(module, inputs)
        except Exception as exc:
            warn_job(f"module paths of the first call may be wrong: {exc}")

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if self.optimizer_id is None:
                self.optimizer_id = id(optimizer)
            if id(optimizer) != self.optimizer_id or self.done:
                return
            self.steps_done += 1
            step = self.steps_done
            if step == 1 and 1 in self.range and not self._first_forward_seen:
                global first_step_missed
                first_step_missed = True
                if not os.environ.get(ENV_VAR):  # the CLI's child: `replaydiff record` says it, once for the job
                    warn_job(FIRST_STEP_MISSED)
            if self.recording:
                self.recorder.pause()
                self.recording = False
            flight = self._flight()
            if (flight is not None and flight.dumped_to is not None) or self.range.over_after(step):
                self.finish()
            elif step + 1 in self.range:
                self._resume(step + 1)
        except Exception as exc:
            warn_job(f"step recording failed: {exc}")

    def _resume(self, step: int) -> None:
        self.recorder.resume(step)
        self.recording = self.recorder.active

    def _flight(self):
        from replaydiff.record.flight import FlightBuffer

        w = self.recorder.writer
        return w if isinstance(w, FlightBuffer) else None

    def finish(self, raised: BaseException | None = None) -> None:
        """End the recording. ``raised``: the exception that ended the script (at exit: the one Python reported,
        ``sys.last_value``); a step it cut short is said so in the manifest."""
        if self.done:
            return
        self.done = True
        self._release()
        rec = self.recorder
        if rec.writer is not None:
            if self.range.last is not None and self.steps_done < self.range.last and self._flight() is None:
                # a step in progress was recorded in part: its ops are in the trace, only its end is not
                until = f"before the end of step {self.steps_done + 1}" if self.recording else \
                    f"before step {self.range.last}"
                rec.writer.note_lost(f"the recording ended after {self.steps_done} optimizer steps, {until}")
                raised = raised if raised is not None else getattr(sys, "last_value", None)
                if self.recording and raised is not None:
                    rec.cut_short(f"step {self.steps_done + 1} was cut short: the script was interrupted "
                                  f"(KeyboardInterrupt)" if isinstance(raised, KeyboardInterrupt) else
                                  f"step {self.steps_done + 1} was cut short by the script's exception "
                                  f"({type(raised).__name__}: {raised})")
            rec.stop()
        self.recording = False

    def _release(self) -> None:
        """Let go of everything that holds this recorder: its step listener, forward hook, exit handler and flight
        triggers. Nothing of it outlives the recording (gloo's teardown races with what a process still holds at
        exit). Safe from inside the step listener and the forward hook."""
        try:
            from replaydiff.record.context import disarm_optimizer_hooks, remove_step_listener

            if self._armed:
                disarm_optimizer_hooks()
                self._armed = False
            if self._watching_samplers:
                self._watching_samplers = False
                samplers.unwatch()
            remove_step_listener(self._after_step)
            atexit.unregister(self._finish_at_exit)
            self._drop_first_forward_hook()  # torch calls global forward pre hooks from a copy of its table
        except Exception as exc:
            warn_job(f"a step-recording hook could not be removed: {exc}")
        self._remove_flight_triggers()

    # -- flight triggers: SIGUSR1 and an uncaught exception (SIGTERM: the recorder's own handler) ----------------
    def dump(self, reason: str) -> None:
        """Write the flight recorder's steps now (the step in progress included) and stop recording."""
        flight = self._flight()
        if flight is not None and flight.dumped_to is None:
            self.recorder.flush_pending()
            flight.dump(reason)
        self.finish()

    def _install_flight_triggers(self) -> None:
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            try:
                self._prev_usr1 = signal.signal(signal.SIGUSR1, self._on_usr1)
            except (ValueError, OSError):
                self._prev_usr1 = None

    def _remove_flight_triggers(self) -> None:
        if self._prev_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if self._prev_usr1 is not None and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGUSR1) == self._on_usr1:
                    signal.signal(signal.SIGUSR1, self._prev_usr1)
            except (ValueError, OSError, TypeError):
                pass
            self._prev_usr1 = None

    def _on_usr1(self, signum: int, frame: Any) -> None:
        prev = self._prev_usr1
        try:
            self.dump(f"SIGUSR1 at step {self.steps_done + 1}")
        except Exception:  # never stand between a process and its signal
            pass
        if callable(prev):
            prev(signum, frame)

    def _excepthook(self, typ: Any, value: Any, tb: Any) -> None:
        prev = self._prev_excepthook or sys.__excepthook__
        try:
            self.dump(f"the script raised {raised(typ, value)} at step {self.steps_done + 1}")
        except Exception:
            pass
        prev(typ, value, tb)
