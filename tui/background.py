"""Provides Runs, the part of the app that holds the background run (a replay or a diff) and the verdicts it
brings: starting a run, taking its workers' messages (dropping those of a run that a newer one replaced), and the
default runner and reference the app uses when none is given.
"""
from __future__ import annotations

from typing import Any, Callable

from textual import work
from textual.reactive import var

from replaydiff.replay.policy import ReplayOptions
from replaydiff.tui import details
from replaydiff.tui.runs import Cancelled, RunFailed, RunFinished, RunMessage, RunOutbox, RunState, RunUpdate

Runner = Callable[..., Any]


def _default_runner(path: str, opts: ReplayOptions, **callbacks: Any) -> Any:
    from replaydiff.tui.replay_runner import replay_in_background

    if _ops_in(path) < IN_PROCESS_OPS:
        # a small trace replays in a second or two: not worth starting a process that imports torch first
        from replaydiff.replay import replay_trace

        return replay_trace(path, opts, **callbacks)
    return replay_in_background(path, opts, **callbacks)


IN_PROCESS_OPS = 5000  # below this many ops, replay in a thread of the UI's process; above, in a worker process


def _ops_in(path: str) -> int:
    import replaydiff

    trace = replaydiff.open_trace(path)
    return sum(len(trace.rank(r)) for r in trace.ranks)


def _prepare_default_runner(path: str) -> None:
    if _ops_in(path) >= IN_PROCESS_OPS:
        from replaydiff.tui.replay_runner import prepare

        prepare()


_default_runner.prepare = _prepare_default_runner  # type: ignore[attr-defined]


def _default_reference(trace: Any, i: int, settings: ReplayOptions) -> list | None:
    opts = ReplayOptions(device=settings.device, precision=settings.precision)
    return details.reference_pairs(trace, i, opts)


class Runs:
    """Mixed into ReplaydiffApp: the run under way and the results it brought (``results_by_rank``). Only the UI
    thread writes these; a run's worker posts RunMessages through its RunOutbox."""

    replay_state: var[RunState] = var(RunState.NONE)  # where the rows' verdicts stand; the status line follows it

    def _init_runs(self, report: Any, runner: Runner | None) -> None:
        self.runner = runner or _default_runner
        self.results_by_rank: dict[int, list] = {}
        self.diff_report: Any = None  # the DiffReport, once the diff is done
        self._generation = 0  # of the run (replay or diff) under way; messages of older runs are dropped
        self._outbox: RunOutbox | None = None  # the current run's channel from its worker thread
        self._total = 0
        self._done = 0
        self.set_reactive(Runs.replay_state, RunState.REPORT if report is not None else RunState.NONE)
        self.replay_message = ""

    def _take(self, results) -> set[int]:
        touched = set()
        for r in results:
            self.results_by_rank.setdefault(r.rank, []).append(r)
            touched.add(r.rank)
        return touched

    # -- runs in the background (a replay or a diff) -----------------------------------------------------------
    def _new_run(self, kind: str) -> RunOutbox:
        """Forget every verdict and stop the run that was producing them; returns the new run's outbox, whose
        generation the app now takes messages from."""
        if self._outbox is not None:
            self._outbox.close()
        self._generation += 1
        self.results_by_rank = {}
        for m in self.models.values():
            m.clear_results()
        self._total, self._done = 0, 0
        self._outbox = RunOutbox(self, self._generation, kind)
        return self._outbox

    def start_diff(self) -> None:
        """Diff ``diff_ref`` against the open trace in a worker thread; rows take their colour when it is done."""
        outbox = self._new_run("diff")
        self.replay_state = RunState.RUNNING
        self.replay_message = ""
        self._refresh_verdicts(full=True)
        self._diff_worker(self.diff_ref, outbox)

    @work(thread=True, exclusive=True, group="replay", exit_on_error=False)
    def _diff_worker(self, ref: str, outbox: RunOutbox) -> None:
        from replaydiff.diff import diff_traces

        try:
            report = diff_traces(ref, self.trace.path, progress_total=outbox.total, progress=outbox.advance)
        except Cancelled:
            return
        except Exception as exc:  # an unreadable chunk, traces with no rank in common: say so, keep the UI
            outbox.fail(f"{type(exc).__name__}: {exc}")
            return
        outbox.finish(report)

    def start_replay(self, settings: ReplayOptions) -> None:
        self.diff_ref = None  # a replay asked for (R) leaves diff mode
        outbox = self._new_run("replay")
        self.settings = settings
        self.replay_state = RunState.RUNNING
        self.replay_message = ""
        self._refresh_verdicts(full=True)
        prepare = getattr(self.runner, "prepare", None)
        if prepare is not None:
            try:
                prepare(str(self.trace.path))  # here, on the main thread: it may borrow the real stderr
            except Exception as exc:
                self._run_failed("replay", f"{type(exc).__name__}: {exc}")
                return
        self._replay_worker(settings, outbox)

    @work(thread=True, exclusive=True, group="replay", exit_on_error=False)
    def _replay_worker(self, settings: ReplayOptions, outbox: RunOutbox) -> None:
        try:
            report = self.runner(str(self.trace.path), settings, progress_total=outbox.total,
                                 progress=outbox.advance, on_result=outbox.result)
        except Cancelled:
            return
        except Exception as exc:  # a missing device, an unreadable chunk: say so, keep the UI
            outbox.fail(f"{type(exc).__name__}: {exc}")
            return
        outbox.finish(report)

    def _current(self, message: RunMessage) -> bool:
        """Whether ``message`` comes from the run under way (an older run's word is dropped)."""
        return message.generation == self._generation

    def on_run_update(self, message: RunUpdate) -> None:
        if self._current(message):
            self._take_update(message.outbox)

    def _take_update(self, outbox: RunOutbox) -> None:
        total, advance, results = outbox.take()
        if total is not None:
            self._total = total
        self._done += advance
        if results:
            self._apply(results)
            self._refresh_verdicts(full=False, ops={r.index for r in results if r.rank == self.rank})
        else:
            self.update_status()

    def on_run_failed(self, message: RunFailed) -> None:
        if self._current(message):
            self._take_update(message.outbox)
            self._run_failed(message.kind, message.text)

    def _run_failed(self, kind: str, text: str) -> None:
        self.replay_state = RunState.FAILED
        self.replay_message = text.splitlines()[0] if text else "failed"
        self.notify(self.replay_message, title=f"{kind} failed", severity="error", timeout=8)
        self.update_status()

    def on_run_finished(self, message: RunFinished) -> None:
        if not self._current(message):
            return
        self._take_update(message.outbox)
        if message.kind == "diff":
            self._diff_finished(message.report)
        else:
            self._replay_finished(message.report)

    def _diff_finished(self, report: Any) -> None:
        from replaydiff.tui.diff_mode import diff_results

        self.diff_report = report
        self._apply(diff_results(report))
        self.replay_state = RunState.DONE
        self._refresh_verdicts(full=True)

    def _replay_finished(self, report: Any) -> None:
        # results normally arrived one by one; a runner that only returns a report still fills the rows
        have = {(r.rank, r.index) for rs in self.results_by_rank.values() for r in rs}
        late = [r for r in getattr(report, "ops", []) if (r.rank, r.index) not in have]
        self._apply(late)
        # collective checks and forward sources are filled in after the per-op pass: take the final word
        final = {(r.rank, r.index): r for r in getattr(report, "ops", [])}
        for rank, rs in self.results_by_rank.items():
            self.results_by_rank[rank] = [final.get((r.rank, r.index), r) for r in rs]
        for rank, m in self.models.items():
            m.clear_results()
            m.add_results(self.results_by_rank.get(rank, []))
        self.replay_state = RunState.DONE
        self._refresh_verdicts(full=True)

    def _apply(self, results: list) -> None:
        for rank in self._take(results):
            m = self.models.get(rank)
            if m is not None:
                m.add_results([r for r in results if r.rank == rank])
