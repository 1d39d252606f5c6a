"""Provides ReplaydiffApp (the trace browser) and make_app(), which builds it from a trace path and options.

The app is three parts: this module holds the screen (the models per rank, the status line, the selection and the
detail pane); tui/background.py the background run (replay or diff) and its verdicts; tui/navigation.py the keys.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.widgets import ProgressBar, Static

from replaydiff.replay.engine import trace_uses
from replaydiff.replay.policy import ReplayOptions
from replaydiff.trace.modes import TensorMode
from replaydiff.tui import details
from replaydiff.tui.background import Runner, Runs, _default_reference
from replaydiff.tui.model import TraceModel
from replaydiff.tui.navigation import Navigation
from replaydiff.tui.runs import RunState
from replaydiff.tui.screens.main import MainScreen
from replaydiff.tui.widgets.heat_strip import HeatStrip
from replaydiff.tui.widgets.module_tree import ModuleTree
from replaydiff.tui.widgets.op_list import OpList

class ReplaydiffApp(Runs, Navigation, App):
    """Browse one trace: ops coloured by a replay report (given, or run in the background as the app starts), or
    in diff mode (``diff``) by the diff of a reference trace against it, computed in the background."""

    CSS_PATH = "app.tcss"
    TITLE = "replaydiff"
    FILTER_DELAY = 0.08  # seconds of no typing before the filter box's text filters the rows
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(self, trace: Any, *, rank: int | None = None, report: Any = None,
                 replay: ReplayOptions | None = None, runner: Runner | None = None,
                 reference: Callable[[Any, int, ReplayOptions], list | None] | None = None,
                 diff: str | Path | None = None) -> None:
        super().__init__()
        # diff mode: rows are coloured by the diff of this reference trace against ``trace`` instead of a replay
        self.diff_ref: str | None = None if diff is None else str(diff)
        self.trace = trace
        self.ranks: list[int] = list(trace.ranks)
        self.rank = rank if rank is not None else self.ranks[0]
        self.settings = replay or ReplayOptions()
        # a trace of statistics or shapes (record --tensors stats|meta) holds nothing to replay: it is never started
        self.uses = trace_uses(trace.rank(self.rank))
        self.replay_on_start = replay is not None and diff is None and "replay" in self.uses
        self.reference = reference or _default_reference
        self.models: dict[int, TraceModel] = {}
        self.trace_lock = threading.RLock()  # RankTrace decodes lazily and is not meant for two threads at once
        self._init_runs(report, runner)
        self._last_tree = self._last_heat = 0.0
        self.detail_op: int | None = None  # the op the detail pane shows (set once its content is in)
        self._main_ready = False  # the main screen is composed
        self._detail_timer = None
        self._detail_due: int | None = None  # an op whose details wait for the cursor to rest
        self._filter_timer = None
        self._filter_due: str | None = None  # filter text typed but not applied yet
        self._status_text = ""
        self._trends: dict[int, Any] = {}  # rank -> TrendResult, computed the first time `t` is pressed
        # a given report is applied right after the first paint: the rows show at once, their colours a moment later
        self._initial_report = report

    # -- models -----------------------------------------------------------------------------------------------
    def model_for(self, rank: int) -> TraceModel:
        m = self.models.get(rank)
        if m is None:
            with self.trace_lock:
                m = TraceModel(self.trace.rank(rank))
            m.add_results(self.results_by_rank.get(rank, []))
            self.models[rank] = m
        return m

    @property
    def model(self) -> TraceModel:
        return self.model_for(self.rank)

    # -- app lifecycle ----------------------------------------------------------------------------------------
    def on_mount(self) -> None:
        self.main = MainScreen(self.model)
        self.push_screen(self.main)
        self.call_after_refresh(self._after_first_paint)

    def _after_first_paint(self) -> None:
        self._status_widget = self.main.query_one("#status", Static)
        self._progress_widget = self.main.query_one("#progress", ProgressBar)
        self._main_ready = True
        self.main.op_list.move_to(0)
        self.update_status()
        if self._initial_report is not None:
            self.set_timer(0.01, self._apply_initial_report)  # after the first frame is out
        else:
            self._settle_memory()
        if self.replay_on_start:
            self.start_replay(self.settings)
        elif self.diff_ref is not None:
            self.start_diff()

    def _apply_initial_report(self) -> None:
        report, self._initial_report = self._initial_report, None
        if report is not None:
            self._apply(report.ops)
            self._refresh_verdicts(full=True)
        self._settle_memory()

    @staticmethod
    def _settle_memory() -> None:
        """Move what is loaded now (index columns, 100,000 results) out of the garbage collector's sight: a full
        collection over it takes most of a second and would land on some keypress."""
        import gc

        gc.freeze()

    def _refresh_verdicts(self, full: bool, ops: set[int] | None = None) -> None:
        """Redraw what new verdicts change: every row (``full``) or the rows of ``ops``; the heat strip and the
        module tree, which summarise every op, now and then."""
        if not self._main_ready:
            return
        if full or ops is None:
            self.main.op_list.refresh_rows()
        else:
            self.main.op_list.refresh_ops(ops)
        now = self._clock()
        # the heat strip and the tree summarise every op: while results stream in, redraw them now and then
        if full or now - self._last_heat > 0.5:
            self._last_heat = now
            self.main.heat.refresh_heat()
        if full or now - self._last_tree > 1.0:
            self._last_tree = now
            self.main.tree.refresh_worst()
        if self.detail_op is not None and self.detail_op == self.main.op_list.selected_op \
                and (ops is None or self.detail_op in ops):
            r = self.model.results[self.detail_op]
            if r is not None and r is not getattr(self, "_detail_result", None):
                self.show_detail(self.detail_op)
        self.update_status()

    @staticmethod
    def _clock() -> float:
        import time

        return time.monotonic()

    def watch_replay_state(self) -> None:
        self.update_status()

    def update_status(self) -> None:
        if not self._main_ready:
            return
        m = self.model
        parts = [f"rank {self.rank}" + (f" ({self.ranks.index(self.rank) + 1}/{len(self.ranks)})"
                                        if len(self.ranks) > 1 else ""),
                 f"{m.n} ops" if len(m.visible) == m.n else f"{len(m.visible)} of {m.n} ops shown"]
        truncated = getattr(m.trace, "truncated_after", None)
        if truncated is not None:
            parts.append(f"recording stopped after #{truncated}")
        if m.hide_cheap:
            parts.append("views hidden")
        if m.filter_text:
            parts.append(f"filter '{m.filter_text}'")
        if m.scope is not None:
            parts.append(f"in {m.scope[0]}" + (f" {m.scope[1]}" if m.scope[1] else ""))
        c = m.counts()
        verdicts = f"{c['divergent']} divergent · {c['nondeterministic']} nondet · {c['error']} err · " \
                   f"{c['ok']} ok · {c['skipped']} skip" + left_out_status(m.trace)
        if self.diff_ref is not None:
            verdicts = self._diff_status(c)
        elif self.replay_state is RunState.RUNNING:
            verdicts = f"replaying on {self.settings.device} at {self.settings.precision}: {verdicts}"
        elif self.replay_state is RunState.FAILED:
            verdicts = f"replay failed: {self.replay_message}"
        elif self.replay_state is RunState.NONE and "replay" not in self.uses:
            mode = m.trace.options.tensors
            held = "statistics" if mode is TensorMode.STATS else "shapes"
            verdicts = f"--tensors {mode}: {held} only, never replayed " \
                       f"(record --tensors full to judge ops)"
        elif self.replay_state is RunState.NONE:
            verdicts = "not replayed (R runs a replay)"
        gone = getattr(m.trace, "missing_ops", ())
        if gone:  # a damaged trace is never shown as if whole: its missing ops first (`replaydiff show` lists files)
            spans = ", ".join(g.span for g in gone[:3]) + (", ..." if len(gone) > 3 else "")
            verdicts = f"DAMAGED: {sum(g.count for g in gone)} ops missing ({spans}) · {verdicts}"
        text = verdicts + "  │ " + " · ".join(parts)  # verdicts first: they matter most on a narrow screen
        if text != self._status_text:
            self._status_text = text
            self._status_widget.update(text, layout=False)
        bar = self._progress_widget
        bar.display = self.replay_state is RunState.RUNNING
        if self.replay_state is RunState.RUNNING:
            bar.update(total=self._total or None, progress=self._done)

    def _diff_status(self, c: dict[str, int]) -> str:
        against = f"diff against {self.diff_ref}"
        if self.replay_state is RunState.RUNNING:
            return f"{against}: diffing…"
        if self.replay_state is RunState.FAILED:
            return f"{against} failed: {self.replay_message}"
        return f"{against}: {c['divergent']} divergent · {c.get('inherited', 0)} inherited · {c['ok']} same · " \
               f"{c.get('target_only', 0)} target-only · {c['skipped']} not compared"

    async def workers_done(self, replay: bool = False) -> None:
        """Wait until the detail pane's workers (and the replay's, with ``replay``) have finished; for tests and
        benchmarks. Workers replaced by newer ones are not waited for."""
        import asyncio

        while self._detail_due is not None or self._filter_due is not None or self._initial_report is not None:
            await asyncio.sleep(0.005)
        while True:
            busy = [w for w in self.workers if not w.is_cancelled and not w.is_finished
                    and (replay or w.group != "replay")]
            if not busy:
                break
            await asyncio.gather(*(w.wait() for w in busy), return_exceptions=True)
        # a finished run's last word is a message on its way to the app: let it land
        while replay and self.replay_state is RunState.RUNNING and self._outbox is not None and self._outbox.ended:
            await asyncio.sleep(0.005)

    # -- selection and detail ---------------------------------------------------------------------------------
    @property
    def selected_op(self) -> int | None:
        return self.main.op_list.selected_op

    def select(self, op: int) -> bool:
        """Put the cursor on op ``op``; when the current view hides it, the view is widened until it shows."""
        m = self.model
        if not 0 <= op < m.n:
            return False
        ol = self.main.op_list
        if m.row_of(op) is None:
            m.set_view(hide_cheap=False, filter_text="", scope=None)
            self.main.filter_input.value = ""
            ol.refresh_rows()
            self.update_status()
        ol.select_op(op, exact=True)
        return True

    def on_op_list_selected(self, message: OpList.Selected) -> None:
        self.main.heat.set_selected(message.op)
        if message.op is not None:
            self.show_detail(message.op)
        else:
            self.detail_op = None
            self.main.detail.show("[dim]no op selected[/]")

    def on_heat_strip_jump(self, message: HeatStrip.Jump) -> None:
        self.select(message.op)
        self.main.op_list.focus()

    def on_module_tree_scope(self, message: ModuleTree.Scope) -> None:
        cur = self.selected_op
        self.model.set_view(scope=message.scope)
        self._after_view_change(cur)

    def show_detail(self, op: int, delay: float = 0.03) -> None:
        """Fill the detail pane for ``op`` in a worker, once the cursor has rested ``delay`` seconds (holding a key
        down moves the cursor at full speed and reads only the op it stops on)."""
        if self._detail_timer is not None:
            self._detail_timer.stop()
            self._detail_timer = None
        self._detail_due = op
        if delay:
            self._detail_timer = self.set_timer(delay, self._start_detail)
        else:
            self._start_detail()

    def _start_detail(self) -> None:
        self._detail_timer = None
        op, self._detail_due = self._detail_due, None
        if op is not None:
            self._detail_worker(self.rank, op)

    @work(thread=True, exclusive=True, group="detail", exit_on_error=False)
    def _detail_worker(self, rank: int, op: int) -> None:
        m = self.model_for(rank)
        result = m.results[op]
        try:
            with self.trace_lock:
                text = details.op_markup(m.trace, op, result, m.status)
        except Exception as exc:  # a damaged chunk: show it where the op would be
            text = f"[bold]#{op}[/]\n[red]cannot read this op: {details.esc(exc)}[/]"
        self.call_from_thread(self._detail_ready, rank, op, result, text)
        if details.is_problem(result) and not result.in_diff:  # diff mode: no replay to compare with
            try:
                with self.trace_lock:
                    pairs = self.reference(m.trace, op, self.settings)
                if pairs is None:
                    hist = "[dim]element-wise error histogram: needs replaydiff.replay.replay_op[/]"
                else:
                    hist = details.histogram_markup(*details.error_histogram(pairs))
            except Exception as exc:
                hist = f"[dim]element-wise error histogram unavailable: {details.esc(exc)}[/]"
            self.call_from_thread(self._histogram_ready, rank, op, hist)

    def _detail_ready(self, rank: int, op: int, result: Any, text: str) -> None:
        if rank != self.rank or op != self.selected_op:
            return
        self.detail_op = op
        self._detail_result = result
        self.main.detail.show(text)

    def _histogram_ready(self, rank: int, op: int, text: str) -> None:
        if rank == self.rank and op == self.detail_op:
            self.main.detail.show_histogram(text)

def left_out_status(trace: Any) -> str:
    """What the status line adds for ops whose tensor data the recording left out: never judged, so a replay with
    nothing divergent is still not clean (the op list marks each such row with its reason)."""
    from replaydiff.trace.schema import LEFT_OUT_FILTERED

    parts = []
    for lo in getattr(trace, "data_left_out", []):
        what = "outside the record filter" if lo.reason == LEFT_OUT_FILTERED else f"data left out: {lo.reason}"
        parts.append(f"{lo.ops} not judged ({what})")
    return "".join(f" · {p}" for p in parts)


def make_app(path: str | Path, *, rank: int | None = None, report_path: str | Path | None = None,
             replay: ReplayOptions | None = None, diff_ref: str | Path | None = None,
             rows: Any = None) -> ReplaydiffApp:
    """Open a trace (TraceError if it cannot be read) and build the app: colours from ``report_path`` when given,
    otherwise a background replay with ``replay`` settings (fp64 on the CPU by default); with ``diff_ref``, the diff
    of that reference trace against this one instead (no replay). Nothing runs until the
    caller runs the app (``app.run()``, or ``app.run_test()`` in tests)."""
    import replaydiff

    trace = replaydiff.open_trace(path)
    if rank is not None:
        trace.rank(rank)  # raises UsageError for a rank the trace does not hold
    if diff_ref is not None:
        replaydiff.open_trace(diff_ref)  # TraceError (exit 3) now rather than a failure inside the UI
        return ReplaydiffApp(trace, rank=rank, diff=diff_ref)
    report = rows  # rows computed before (model.invariance_rows): coloured as a given report's
    if report_path is not None:
        from replaydiff.report import load_replay_json

        from replaydiff.replay.result import check_replay_of

        report = load_replay_json(report_path)
        said = check_replay_of(report, trace, str(report_path), str(path))
        if said:
            from replaydiff.errors import warn

            warn(said)
    return ReplaydiffApp(trace, rank=rank, report=report,
                         replay=None if report is not None else (replay or ReplayOptions()))


__all__ = ["ReplaydiffApp", "ReplayOptions", "make_app"]
