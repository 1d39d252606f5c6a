"""The public recorder: ``with replaydiff.record("trace/"): ...`` records every aten op of the block.

The recorder is a guest in someone else's job. It never changes a bit of the results (it only reads tensors and
copies them), and any failure inside it (a full disk, an op it cannot describe) disables recording with one warning
and a line in the manifest; nothing is ever raised into the training code.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from replaydiff import device
from replaydiff.aten import current_rank, facts, iter_tensors, written_args
from replaydiff.record.autostart._replaydiff_record_env import ENV_VAR  # set in children of the CLI
from replaydiff.errors import warn, warn_job
from replaydiff.record.compiled import CompiledRegionTracker, no_filter, quiet_global_hook_warning
from replaydiff.record.context import OpContext, add_step_start_listener, remove_step_start_listener
from replaydiff.record.environment import environment_snapshot
from replaydiff.record.flight import FlightBuffer
from replaydiff.record.hyperparameters import note_optimizer_step
from replaydiff.record import samplers
from replaydiff.record.mode import OpBuilder, RecordingMode, record_after, record_before
from replaydiff.record.module_stats import ModuleStatsHooks
from replaydiff.record.options import RecordOptions
from replaydiff.record.output_watch import OutputWatch
from replaydiff.record.owner_token import recording_token
from replaydiff.record.storage import StorageTable
from replaydiff.record.unit_capture import CapturingMode, UnitCapture, boundary_backward
from replaydiff.trace import schema
from replaydiff.trace.codec import tensor_bytes_view
from replaydiff.trace.format import MANIFEST, rank_dir_name
from replaydiff.trace.ownership import DirectoryHeld, NotWritable, claim, release
from replaydiff.trace.schema import wire_closing_facts, wire_manifest
from replaydiff.trace.writer import RankWriter, Snapshot

log = logging.getLogger("replaydiff")


class Recorder:
    """Records one block of a job into ``path/rank<N>/``. Use as a context manager, or ``start()``/``stop()``."""

    def __init__(self, path: str | os.PathLike, options: RecordOptions, command: list[str] | None = None) -> None:
        """``command``: the job's command line, stored in the manifest when ``replaydiff record -- CMD`` armed this
        recorder (the next commands ``trend`` prints then hold it)."""
        self.path = Path(path)
        self.options = options
        self.command = command
        self.active = False
        self.paused = False  # between recorded steps: nothing attached, the trace still open (pause/resume)
        self.step: int | None = None  # optimizer step being recorded, stamped on each record (multi-step)
        self.next_index = 0
        self.rank_dir: Path | None = None
        self.writer: RankWriter | None = None
        self.storages = StorageTable()
        self.context = OpContext(options.source_lines)
        self._mode: RecordingMode | None = None
        self._module_hooks: ModuleStatsHooks | None = None
        self._watch: OutputWatch | None = None  # the flight recorder's watch on the model's outputs
        self._context_installed = False
        self._builder: OpBuilder | None = None
        self._started = 0.0
        self._disabled_reason: str | None = None
        self._prev_sigterm: Any = None
        self.custom_ops: dict[str, str] = {}  # custom op -> the Python module that defines it
        self._compiled = CompiledRegionTracker()
        # record(compiled="capture"): regions run compiled, each graph call a unit (unit_capture.py)
        self._units = UnitCapture(self) if options.compiled == "capture" else None
        if self._units is not None:
            self._compiled.on_attach = self._units.engage
            self._compiled.capturing = self._units.engaged
            self._compiled.wrap_backward = boundary_backward
        self._compiled_regions: list[dict] = []  # as stored (CompiledRegionTracker.stop())
        self.failed_ops = 0
        self._failed_names: set[str] = set()
        self._sigterm_installed = False
        self._trace_closed = False
        self._plant = None  # the PlantedFault of options.plant, a mode below the recording mode
        # The token of the claim this recorder made on its directory (trace/ownership.py), released at stop(); None
        # when it made none (not started, or another process of this recording made it). _made_dir: the claim made
        # the directory, which is removed again if nothing was written into it.
        self._claim: str | None = None
        self._made_dir = False
        self._unquiet = no_filter  # undoes the filter of torch's global-hook warning (compiled.quiet_global_hook_warning)
        self._watching_samplers = False  # this recorder holds one of samplers.watch()'s watches
        self.samplers_written: Any = None  # the samplers note last written into rank_dir (samplers.note_samplers)

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> "Recorder":
        try:
            rank, world = current_rank()
            if self.options.ranks is not None and rank not in self.options.ranks:
                return self  # not a rank asked for: this process runs untouched (no mode, no directory)
            # The directory is this recording's before anything is written into it (trace/ownership.py)
            made, token = not self.path.exists(), recording_token(world)
            if claim(self.path, token):
                self._claim, self._made_dir = token, made
            self.rank_dir = self.path / rank_dir_name(rank)
            if (self.rank_dir / MANIFEST).exists():
                raise FileExistsError(f"{self.rank_dir} already holds a trace, which the recorder never replaces; "
                                      f"pass another directory, or remove that trace first")
            held = sorted(p.name for p in self.rank_dir.iterdir()) if self.rank_dir.exists() else []
            if held:  # writing there could replace a file that is not ours, and the recorder deletes nothing of theirs
                raise FileExistsError(f"{self.rank_dir} already holds files ({', '.join(held[:3])}"
                                      f"{', ...' if len(held) > 3 else ''}); choose another directory")
            # source_root: relative file names in source lines are relative to it
            manifest = wire_manifest(rank, world, environment_snapshot(rank, world), self.options.to_json(),
                                     time.time(), self.context.root, self.command)
            if self.options.flight:
                self.writer = FlightBuffer(self.rank_dir, manifest, self.options, self._closing_facts)
            else:
                self.writer = RankWriter(self.rank_dir, manifest, self.options.compress, self.options.shuffle,
                                         self.options.chunk_ops, self.options.chunk_bytes, self.options.flush_seconds,
                                         self.options.queue_bytes, self.options.compress_auto)
            self._builder = OpBuilder(self)
            if self.options.plant:  # entered first, so that it sits below the recorder and is recorded as a kernel
                from replaydiff.faults import PlantedFault

                self._plant = PlantedFault.from_spec(self.options.plant)
                self._plant.__enter__()
            if isinstance(self.writer, FlightBuffer):
                self.writer.begin_step(self.step)
            samplers.watch()
            self._watching_samplers = True
            self._attach()
            self._compiled.start()
            self._started = time.perf_counter()
            self.active = True
            self._install_sigterm()
        except Exception as exc:
            own = isinstance(exc, (DirectoryHeld, NotWritable))  # their message names the directory and why
            why = f"recording is off: {exc}" if own else f"recording is off: {type(exc).__name__}: {exc}"
            # nothing is recorded at all; where a trace is already there, it would be taken for this run's
            self._warn(why, unmissable=own or isinstance(exc, FileExistsError))
            self._teardown()
            if self.writer is not None:  # opened before the failure: finish it now, so its thread ends with it
                self._disabled_reason = why
                self._close_trace()
            self._release()
        return self

    def _release(self) -> None:
        """End this recording's claim on its directory (trace/ownership.py), if it made the claim."""
        if self._claim is None:
            return
        release(self.path, self._claim)
        self._claim = None
        if self._made_dir:  # only if empty: what any process of the recording wrote stays
            try:
                self.path.rmdir()
            except OSError:
                pass

    def stop(self) -> None:
        was_active = self.active or self.paused
        self.active = self.paused = False
        self._teardown()
        if self._watching_samplers:
            self._watching_samplers = False
            samplers.unwatch()
        self.flush_pending()
        if self.writer is not None and (was_active or self._disabled_reason):
            self._close_trace()
        self._release()
        self.storages.clear()

    def _close_trace(self) -> None:
        """Write the final manifest and end the writer's thread; once (stop() may follow a start() that failed)."""
        if self._trace_closed:
            return
        self._trace_closed = True
        try:
            unseen = self._builder.unseen_writes if self._builder is not None else 0
            if unseen:
                self._warn(f"{unseen} storage(s) were written outside torch's dispatcher (numpy, a C extension) "
                           f"while recording; they were stored again as new versions")
            msg = self._compiled.first_warning()
            if msg and self.options.plant and self._units is not None:
                # capture was asked for, yet a region ran eager: the plant's mode is the reason, not the recorder's
                msg += " --plant is a dispatch mode below the recorder's, and under it torch runs compiled regions " \
                       "as eager aten ops, so the fault is planted in (and the trace holds) those eager ops; " \
                       "without --plant the compiled regions are recorded as compiled units."
            if msg:
                self._warn(msg)
            device.hold_queries(False)  # a capture the last ops were under has ended by now
            self.writer.close(self._closing_facts())
            device.RUNTIME.release_pinned()  # the copies' page-locked memory, which torch would keep cached
        except Exception as exc:
            self._warn(f"the trace could not be finished: {exc}")
            return
        if self.options.plant and not os.environ.get(ENV_VAR):  # the CLI says it itself, at the end
            self._say_plant()

    def _say_plant(self) -> None:
        """From Python, as the CLI does: the trace holds a fault on purpose, and where it landed (as read back)."""
        try:
            from replaydiff.trace.format import MANIFEST
            from replaydiff.trace.reader import RankTrace

            info = RankTrace(self.rank_dir).planted if (self.rank_dir / MANIFEST).exists() else None
        except Exception as exc:  # the trace says it in any case (show, replay): this line is a courtesy
            log.debug("planted fault not read back: %s", exc)
            return
        if info is not None:
            then = "every report on this trace names it" if info.landed else "replay will have nothing to find"
            self._warn(f"PLANTED FAULT (plant={self.options.plant!r}): {info.describe()}; {then}")

    def flush_pending(self) -> None:
        """Records waiting for their statistics go to the writer now (end of a step, of the recording, a signal)."""
        if self._builder is not None and self.writer is not None:
            try:
                self._builder.flush()
            except Exception as exc:
                self.disable(f"statistics of the last ops could not be computed ({type(exc).__name__}: {exc})")

    def _closing_facts(self) -> dict:
        """What the final manifest says about the recording (also for a flight dump written mid-run)."""
        return wire_closing_facts(
            compiled_regions=self._compiled_regions,
            unseen_writes=self._builder.unseen_writes if self._builder is not None else 0,
            ops_seen=self.next_index,
            record_seconds=time.perf_counter() - self._started if self._started else 0.0,
            disabled=self._disabled_reason,
            custom_ops=self.custom_ops,
            source_files=self.context.source_files(),
            planted=self._planted() if self.options.plant else None)

    # -- many steps: attached while a chosen step runs, detached (full speed, trace open) in between -------------
    @property
    def builder(self) -> OpBuilder | None:
        return self._builder

    def pause(self) -> None:
        if not self.active:
            return
        self.active = False
        self.paused = True
        self._detach()
        self.flush_pending()
        if isinstance(self.writer, FlightBuffer):
            self.writer.end_step()

    def resume(self, step: int | None) -> None:
        """Record again from here, as step ``step`` (starts the recording the first time)."""
        self.step = step
        if self.writer is None:
            self.start()
            return
        if not self.paused or self._disabled_reason or self.writer.failed:
            return
        # The job ran unobserved since the last step: storage versions and cached statistics describe bytes it may
        # have rewritten (the optimizer updates every parameter in place). Version ids keep counting, so no id is
        # ever reused for other bytes.
        self.storages.clear()
        self._builder.forget_stats()
        if isinstance(self.writer, FlightBuffer):
            self.writer.begin_step(step)
        try:
            self._attach()
        except Exception as exc:
            self.disable(f"could not resume recording at step {step}: {exc}")
            return
        self.paused = False
        self.active = True

    def enter_module(self, module: torch.nn.Module, inputs: Any) -> None:
        """Enter a module whose forward pre hooks ran before recording started (it started inside its call)."""
        if self._watch is not None:
            self._watch.enter_module(module)
        if self._module_hooks is not None:
            self._module_hooks.enter_module(module, inputs)
        else:
            self.context.enter_module(module, inputs)

    def _attach(self) -> None:
        self._unquiet = quiet_global_hook_warning()  # before the recorder's own global hooks go in
        if isinstance(self.writer, FlightBuffer):
            self._watch = self._watch or OutputWatch(self)
            self._watch.install()
        if self.options.granularity == "module":
            self._module_hooks = self._module_hooks or ModuleStatsHooks(self)
            self._module_hooks.install()
            return
        self.context.install()
        self._context_installed = True
        add_step_start_listener(self._optimizer_step_begins)
        self._mode = CapturingMode(self) if self._units is not None else RecordingMode(self)
        self._mode.__enter__()
        if self._units is not None:
            self._units.attach(self._mode)

    def _optimizer_step_begins(self, optimizer: Any) -> None:
        """The hyperparameters of the step about to be recorded, and the samplers built so far, for the diff of a
        parallel run."""
        note_optimizer_step(self, optimizer)
        samplers.note_samplers(self)

    def _detach(self) -> None:
        self._unquiet()
        self._unquiet = no_filter
        if self._units is not None:
            self._units.detach()
        if self._module_hooks is not None:
            self._module_hooks.uninstall()
        if self._watch is not None:
            self._watch.uninstall()
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            except Exception as exc:
                log.debug("could not pop the recording mode: %s", exc)
            self._mode = None
        remove_step_start_listener(self._optimizer_step_begins)
        if self._context_installed:
            self._context_installed = False
            try:
                self.context.uninstall()
            except Exception as exc:
                log.debug("could not remove tracking hooks: %s", exc)

    # -- SIGTERM: what torchrun sends the surviving workers when one rank fails ---------------------------------
    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; a trace cut short then keeps what the timer flushed
        try:
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True
        except (ValueError, OSError) as exc:
            log.debug("no SIGTERM handler: %s", exc)

    def _restore_sigterm(self) -> None:
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._prev_sigterm)
            except (ValueError, OSError, TypeError) as exc:
                log.debug("could not restore the SIGTERM handler: %s", exc)
            self._sigterm_installed = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Write what is recorded, then do what the process would have done without us."""
        prev = self._prev_sigterm
        try:
            if self.writer is not None and (self.active or self.paused):
                self.active = self.paused = False
                self.flush_pending()
                self.writer.note_lost(f"the process got SIGTERM during op #{self.next_index - 1}; the trace holds "
                                      f"the ops recorded before it")
                self.writer.sync(timeout=10.0)
                self.writer.write_manifest_now()
        except Exception as exc:  # never stand between a process and its termination
            log.debug("SIGTERM flush failed: %s", exc)
        finally:
            self._restore_sigterm()
        if callable(prev):
            prev(signum, frame)
        elif prev in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _teardown(self) -> None:
        self._restore_sigterm()
        try:
            self._compiled_regions = self._compiled.stop()
        except Exception as exc:  # stop() never raises by design; belt and braces around someone else's job
            log.debug("compiled-region tracker: %s", exc)
        self._detach()
        if self._plant is not None and self._plant in _active_modes():
            try:
                self._plant.__exit__(None, None, None)
            except Exception as exc:
                log.debug("could not pop the planted fault: %s", exc)

    def _planted(self) -> dict:
        """What the manifest says of the planted fault: the spec, how many calls of its op the recording made,
        whether the planted call came and what it changed there."""
        from replaydiff.faults import PlantSpec

        spec = PlantSpec.parse(self.options.plant)
        p = self._plant
        return schema.wire_plant(spec.op, spec.call, spec.rel, landed=bool(p is not None and p.planted),
                                 calls_seen=p.seen if p is not None else None,
                                 effect=p.effect if p is not None else None)

    def __enter__(self) -> "Recorder":
        return self.start()

    def __exit__(self, typ: Any, value: Any, tb: Any) -> None:
        if value is not None and (self.active or self.paused):
            # the recorded block ended by an exception: what it would have run after it was never recorded
            self.cut_short("the recorded block was interrupted (KeyboardInterrupt)" if isinstance(
                value, KeyboardInterrupt) else f"the recorded block raised {type(value).__name__}: {value}")
        self.stop()

    # -- called by the mode -----------------------------------------------------------------------------------
    def before(self, func: Any, types: Any, args: tuple, kwargs: dict):
        if self.writer.failed:
            # The writer has already warned and noted in the manifest what was lost: stop without a second warning.
            self._disabled_reason = self._disabled_reason or "the trace writer failed"
            self.active = False
            return None
        return record_before(self, self._builder, func, types, args, kwargs)

    def after(self, pending: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        return record_after(self, self._builder, pending, func, args, kwargs, out)

    def rng_state(self, args: tuple, kwargs: dict) -> tuple[str, int, int, int] | None:
        """Store the generator state a random op is about to use: (device, storage version, chunk, bytes)."""
        gen = kwargs.get("generator")
        where = None
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, torch.Tensor):
                where = v.device
                break
        if where is None and isinstance(kwargs.get("device"), torch.device):
            where = kwargs["device"]
        where = where or torch.device("cpu")
        if gen is not None:
            state = gen.get_state()
        else:
            state = device.RUNTIME.rng_state(where)
            if state is None:
                return None
        if not self._builder.admit(state.numel()):  # past the budget: a random op without its draw's state
            return None
        version = self.storages.new_version_id()
        # Copied into the writer's staging memory (a fresh CPU tensor of the job's heap would sit there until the
        # chunk is written; staging.py says why that matters).
        nbytes = state.numel()
        slot = self.writer.staging.take(nbytes)
        slot.view[:] = tensor_bytes_view(state.contiguous())
        chunk = self.writer.add_snapshot(Snapshot(version, slot.view, 1, slot=slot))
        return str(where), version, chunk, nbytes

    MAX_FAILED_OPS = 1000

    def op_failed(self, func: Any, args: tuple, kwargs: dict, exc: Exception) -> None:
        """An op the recorder could not describe costs that op alone: a stub record with the reason; what it
        writes gets new storage versions, so later readers never get the bytes from before its write."""
        self.failed_ops += 1
        name = str(func)
        why = f"could not be recorded ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})"
        if self.failed_ops > self.MAX_FAILED_OPS or self.writer is None or self.writer.failed:
            self.disable(f"too many ops could not be recorded (last: {name} {why})")
            return
        index = self.next_index - 1
        stub = schema.wire_op(index, name, None, None, None, None)
        if self.step is not None:
            schema.wire_set_step(stub, self.step)
        self._builder.add_op(schema.wire_not_recorded(stub, why))
        try:
            for _, v in written_args(facts(func), args, kwargs):
                for t in iter_tensors(v):
                    self.storages.bump(self.storages.entry(t.untyped_storage()))
        except Exception as exc2:
            self.disable(f"after {name} {why}, what it wrote could not be tracked ({exc2})")
            return
        if name not in self._failed_names:
            self._failed_names.add(name)
            self.writer.note_lost(f"op #{index} {name} {why}; later readers of its outputs take them as inputs "
                                  f"from outside the trace")
            if len(self._failed_names) <= 5:
                self._warn(f"op #{index} {name} {why}; recording goes on")

    def cut_short(self, why: str) -> None:
        """The recording ends before what was asked for, for a reason outside the recorder (the script raised): the
        manifest says why, as for ``disable``; no warning (the script's own traceback said it)."""
        if self._disabled_reason is None:
            self._disabled_reason = why

    def disable(self, why: str) -> None:
        if self._disabled_reason is None:
            self._disabled_reason = why
            self._warn(f"recording stopped: {why}")
            if self.writer is not None:
                self.writer.note_lost(f"{why}; ops from #{self.next_index - 1} on were not recorded")
        self.active = False

    def warn(self, msg: str) -> None:
        """One warning from the recorder's parts (``OpBuilder``): as ``_warn``."""
        self._warn(msg)

    def _warn(self, msg: str, unmissable: bool = False) -> None:
        """One warning. ``unmissable``: one the job's warning filters must not hide (the recording is off and the
        directory already holds a trace, which a later diff would take for this run's): where they drop it, the
        line goes to stderr all the same."""
        if os.environ.get(ENV_VAR):  # a child of `replaydiff record`: one line, like the CLI's own warnings
            try:
                warn(msg)
            except Exception:  # a closed stderr is no reason to raise into the job
                pass
            return
        if not unmissable:
            warn_job(msg)  # the Python API: filterable, catchable
            return
        with warnings.catch_warnings(record=True) as shown:  # the job's filters apply; "ignore" leaves it out
            warn_job(msg)
        for w in shown:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
        if not shown:
            try:
                warn(msg)
            except Exception:
                pass


def _active_modes() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()
