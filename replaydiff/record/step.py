"""Recording the N-th optimizer step of an unmodified script (used by ``replaydiff record --step N -- ...``).

The CLI starts the child with ``REPLAYDIFF_RECORD`` set and our ``autostart/`` folder first on PYTHONPATH, so its
``sitecustomize`` calls ``install()`` at interpreter start. Recording then runs from the end of optimizer step N-1
(for N = 1: the first module call) to the end of step N, found through torch's global optimizer-step hooks; only
the first optimizer that steps is counted. Nothing here may raise into the user's script.
"""
from __future__ import annotations

import atexit
import json
import os
import warnings
from typing import Any

ENV_VAR = "REPLAYDIFF_RECORD"


class StepTrigger:
    def __init__(self, config: dict[str, Any]) -> None:
        import torch

        from replaydiff.record.options import RecordOptions
        from replaydiff.record.recorder import Recorder

        self.step = int(config.get("step", 1))
        options = RecordOptions.from_dict(config.get("options") or {})
        self._make = lambda: Recorder(config["out"], options)
        self.recorder = None
        self.done = False
        self.steps = 0
        self.optimizer_id: int | None = None
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from replaydiff.record.context import ensure_optimizer_hooks

        # Registered now, not from inside the optimizer hook that starts the recording (see ensure_optimizer_hooks).
        ensure_optimizer_hooks()
        self._post = register_optimizer_step_post_hook(self._after_step)
        self._fwd = None
        if self.step <= 1:
            self._fwd = torch.nn.modules.module.register_module_forward_pre_hook(self._first_forward)
        atexit.register(self.finish)

    def _start(self) -> None:
        if self.recorder is None and not self.done:
            self.recorder = self._make().start()

    def _first_forward(self, module: Any, inputs: Any) -> None:
        if self._fwd is not None:
            self._fwd.remove()
            self._fwd = None
        self._start()
        # This module's call began before the recorder's module tracker existed: enter it by hand, or every path
        # of this call would be wrong ("Linear" instead of "Sequential.0").
        rec = self.recorder
        if rec is not None and rec.active:
            try:
                rec.context.enter_module(module, inputs)
            except Exception as exc:
                warnings.warn(f"replaydiff: module paths of the first call may be wrong: {exc}", RuntimeWarning,
                              stacklevel=2)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if self.optimizer_id is None:
                self.optimizer_id = id(optimizer)
            if id(optimizer) != self.optimizer_id or self.done:
                return
            self.steps += 1
            if self.steps == self.step:
                self.finish()
            elif self.steps == self.step - 1:
                self._start()
        except Exception as exc:
            warnings.warn(f"replaydiff: step recording failed: {exc}", RuntimeWarning, stacklevel=2)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        # self._post stays registered (it returns at once when done): finish() runs inside it, and removing a
        # global optimizer hook while torch iterates over them raises in the user's optimizer.step().
        if self._fwd is not None:
            self._fwd.remove()
        if self.recorder is not None:
            if self.steps < self.step:
                self.recorder.writer and self.recorder.writer.note_lost(
                    f"the process ended after {self.steps} optimizer steps, before step {self.step} finished")
            self.recorder.stop()


_trigger: Any = None  # the armed StepTrigger or MultiStepRecorder


def install() -> None:
    global _trigger
    raw = os.environ.get(ENV_VAR)
    if not raw or _trigger is not None:
        return
    try:
        config = json.loads(raw)
        opts = config.get("options") or {}
        if opts.get("steps") or opts.get("flight"):  # many steps, or the flight recorder: steps.py
            from replaydiff.record.options import RecordOptions
            from replaydiff.record.steps import MultiStepRecorder

            many = MultiStepRecorder(config["out"], RecordOptions.from_dict(opts)).start()
            atexit.register(many.finish)
            _trigger = many  # type: ignore[assignment]
            return
        _trigger = StepTrigger(config)
    except Exception as exc:
        warnings.warn(f"replaydiff: could not arm step recording: {exc}", RuntimeWarning, stacklevel=2)
