"""Provides ReplaydiffApp (the trace browser) and make_app(), which builds it from a trace path and options."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.reactive import var
from textual.widgets import Input, ProgressBar, Static

from replaydiff.tui import details
from replaydiff.tui.model import TraceModel, short_op
from replaydiff.tui.runs import Cancelled, RunState, RunFailed, RunFinished, RunMessage, RunOutbox, RunUpdate
from replaydiff.tui.screens.ancestry import AncestryScreen
from replaydiff.tui.screens.help import HelpScreen
from replaydiff.tui.screens.main import MainScreen
from replaydiff.tui.screens.picker import OpPicker
from replaydiff.tui.screens.replay_form import ReplaySettings, ReplayForm
from replaydiff.tui.screens.trend import TrendScreen
from replaydiff.tui.widgets.heat_strip import HeatStrip
from replaydiff.tui.widgets.module_tree import ModuleTree
from replaydiff.tui.widgets.op_list import OpList

Runner = Callable[..., Any]


def _default_runner(path: str, settings: ReplaySettings, **callbacks: Any) -> Any:
    from replaydiff.replay import ReplayOptions

    from replaydiff.tui.replay_runner import replay_in_background

    opts = ReplayOptions(device=settings.device, precision=settings.precision, repeat=settings.repeat)
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


def _default_reference(trace: Any, i: int, settings: ReplaySettings) -> list | None:
    from replaydiff.replay import ReplayOptions

    opts = ReplayOptions(device=settings.device, precision=settings.precision)
    return details.reference_pairs(trace, i, opts)


class ReplaydiffApp(App):
    """Browse one trace: ops coloured by a replay report (given, or run in the background as the app starts), or
    in diff mode (``diff``) by the diff of a reference trace against it, computed in the background."""

    CSS_PATH = "app.tcss"
    TITLE = "replaydiff"
    FILTER_DELAY = 0.08  # seconds of no typing before the filter box's text filters the rows
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
    ]
    replay_state: var[RunState] = var(RunState.NONE)  # where the rows' verdicts stand; the status line follows it

    def __init__(self, trace: Any, *, rank: int | None = None, report: Any = None,
                 replay: ReplaySettings | None = None, runner: Runner | None = None,
                 reference: Callable[[Any, int, ReplaySettings], list | None] | None = None,
                 diff: str | Path | None = None) -> None:
        super().__init__()
        # diff mode: rows are coloured by the diff of this reference trace against ``trace`` instead of a replay
        self.diff_ref: str | None = None if diff is None else str(diff)
        self.diff_report: Any = None  # the DiffReport, once the diff is done
        self.trace = trace
        self.ranks: list[int] = list(trace.ranks)
        self.rank = rank if rank is not None else self.ranks[0]
        self.settings = replay or ReplaySettings()
        self.replay_on_start = replay is not None and diff is None
        self.runner = runner or _default_runner
        self.reference = reference or _default_reference
        self.models: dict[int, TraceModel] = {}
        self.results_by_rank: dict[int, list] = {}
        self.trace_lock = threading.RLock()  # RankTrace decodes lazily and is not meant for two threads at once
        self._generation = 0  # of the run (replay or diff) under way; messages of older runs are dropped
        self._outbox: RunOutbox | None = None  # the current run's channel from its worker thread
        self._total = 0
        self._done = 0
        self.set_reactive(ReplaydiffApp.replay_state, RunState.REPORT if report is not None else RunState.NONE)
        self.replay_message = ""
        self._last_tree = self._last_heat = 0.0
        self.detail_op: int | None = None  # the op the detail pane shows (set once its content is in)
        self._main_ready = False  # the main screen is composed
        self._detail_timer = None
        self._detail_due: int | None = None  # an op whose details wait for the cursor to rest
        self._filter_timer = None
        self._filter_due: str | None = None  # filter text typed but not applied yet
        self._status_text = ""
        self._trends: dict[int, Any] = {}  # rank -> Trend, computed the first time `t` is pressed
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

    def _take(self, results) -> set[int]:
        touched = set()
        for r in results:
            self.results_by_rank.setdefault(r.rank, []).append(r)
            touched.add(r.rank)
        return touched

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

    def start_replay(self, settings: ReplaySettings) -> None:
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
    def _replay_worker(self, settings: ReplaySettings, outbox: RunOutbox) -> None:
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
                   f"{c['ok']} ok · {c['skipped']} skip"
        if self.diff_ref is not None:
            verdicts = self._diff_status(c)
        elif self.replay_state is RunState.RUNNING:
            verdicts = f"replaying on {self.settings.device} at {self.settings.precision}: {verdicts}"
        elif self.replay_state is RunState.FAILED:
            verdicts = f"replay failed: {self.replay_message}"
        elif self.replay_state is RunState.NONE:
            verdicts = "not replayed (R runs a replay)"
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

    # -- keys -------------------------------------------------------------------------------------------------
    def _jump(self, op: int | None, what: str) -> None:
        if op is None:
            self.notify(f"no {what}" + ("" if self.replay_state in (RunState.DONE, RunState.REPORT) else " (yet)"),
                        timeout=3)
            return
        self.select(op)

    def action_first_divergent(self) -> None:
        self._jump(self.model.first_divergent(), "divergent op")

    def action_next_divergent(self) -> None:
        cur = self.selected_op if self.selected_op is not None else -1
        self._jump(self.model.next_divergent(cur), "next divergent op")

    def action_previous_divergent(self) -> None:
        cur = self.selected_op if self.selected_op is not None else self.model.n
        self._jump(self.model.previous_divergent(cur), "earlier divergent op")

    def action_nonfinite(self) -> None:
        self._jump(self.model.first_nonfinite(), "NaN/Inf origin")

    def action_partner(self) -> None:
        op = self.selected_op
        if op is None:
            return
        m = self.model
        other = m.partner(op)
        kind = "forward op" if m.index.forward[op] is not None else "backward op"
        self._jump(other, f"{kind} linked to #{op}")

    def action_producer(self) -> None:
        op = self.selected_op
        if op is None:
            return
        m = self.model
        with self.trace_lock:
            record = m.trace[op]
            inputs = record.inputs()
            producers = m.trace.producers(op)
        choices = []
        for k, ref in enumerate(inputs):
            p = producers.get(k)
            where = f"#{p} {short_op(m.index.name[p])} {m.status[p] or ''}" if p is not None else "outside the trace"
            choices.append((f"in{k} {ref.describe()}  ← {where}", p))
        inside = [p for _, p in choices if p is not None]
        if not inside:
            self.notify(f"#{op}: no input was produced inside the trace", timeout=3)
        elif len(inside) == 1:
            self.select(inside[0])
        else:
            self.push_screen(OpPicker(f"#{op} {short_op(m.index.name[op])}: go to the producer of", choices),
                             self._picked)

    def action_consumers(self) -> None:
        op = self.selected_op
        if op is None:
            return
        m = self.model
        with self.trace_lock:
            outs = m.trace[op].outputs_refs()
            consumers = m.trace.consumers(op)
        choices: list[tuple[str, int | None]] = []
        for k, ref in enumerate(outs):
            users = consumers.get(k) or []
            choices.append((f"out{k} {ref.describe()}: read by {len(users)} op(s)", None))
            for u in users:
                choices.append((f"   #{u} {short_op(m.index.name[u])}  {m.index.module[u] or ''}  {m.status[u] or ''}",
                                u))
        if not any(u is not None for _, u in choices):
            self.notify(f"#{op}: no op in the trace reads its outputs", timeout=3)
            return
        self.push_screen(OpPicker(f"consumers of #{op} {short_op(m.index.name[op])}", choices), self._picked)

    def action_ancestry(self) -> None:
        op = self.selected_op
        if op is None:
            return
        with self.trace_lock:
            screen = AncestryScreen(self.model, op)
        self.push_screen(screen, self._picked)

    def action_trend(self) -> None:
        """The per-module series of a multi-step trace (recorded with --steps or --flight) and its first change."""
        from replaydiff.report.trend import NoSteps, compute_trend

        trend = self._trends.get(self.rank)
        if trend is None:
            try:
                with self.trace_lock:
                    trend = compute_trend(self.model.trace)
            except NoSteps:
                self.notify("no trend: this trace has one step (record with --steps or --flight for many)",
                            timeout=4)
                return
            self._trends[self.rank] = trend
        self.push_screen(TrendScreen(trend), self._picked)

    def _picked(self, op: int | None) -> None:
        if op is not None:
            self.select(op)

    def action_goto(self, op: int) -> None:
        self.select(int(op))
        self.main.op_list.focus()

    def action_toggle_cheap(self) -> None:
        cur = self.selected_op
        self.model.set_view(hide_cheap=not self.model.hide_cheap)
        self._after_view_change(cur)

    def action_filter(self) -> None:
        self.main.filter_input.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        """The box echoes each key at once; the rows are filtered when typing pauses (FILTER_DELAY), so a fast typist
        never waits for 100,000 rows to be filtered per character."""
        if event.input.id != "filter":
            return
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self._filter_due = event.value
        self._filter_timer = self.set_timer(self.FILTER_DELAY, self._apply_filter)

    def _apply_filter(self) -> None:
        self._filter_timer = None
        text, self._filter_due = self._filter_due, None
        if text is None or text == self.model.filter_text:
            return
        cur = self.selected_op
        self.model.set_view(filter_text=text)
        self._after_view_change(cur)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            if self._filter_timer is not None:
                self._filter_timer.stop()
                self._apply_filter()
            self.main.op_list.focus()

    def action_clear_view(self) -> None:
        """Esc: drop the filter, then the module scope."""
        m = self.model
        cur = self.selected_op
        if self._filter_timer is not None:
            self._filter_timer.stop()
            self._filter_timer, self._filter_due = None, None
        if m.filter_text or self.main.filter_input.value or self.focused is self.main.filter_input:
            self.main.filter_input.value = ""
            m.set_view(filter_text="")
        elif m.scope is not None:
            m.set_view(scope=None)
        else:
            return
        self._after_view_change(cur)
        self.main.op_list.focus()

    def _after_view_change(self, previous: int | None) -> None:
        ol = self.main.op_list
        ol.refresh_rows()
        if self.model.visible:
            ol.select_op(previous if previous is not None else 0)
        else:
            ol.cursor_row = 0
            ol.post_message(OpList.Selected(None))
        self.update_status()

    def action_next_rank(self) -> None:
        if len(self.ranks) < 2:
            self.notify("this trace has one rank", timeout=3)
            return
        self.rank = self.ranks[(self.ranks.index(self.rank) + 1) % len(self.ranks)]
        m = self.model
        self.main.model = m
        self.main.op_list.set_model(m)
        self.main.heat.set_model(m)
        self.main.tree.set_model(m)
        self.main.op_list.move_to(0)
        self.update_status()

    def action_replay_form(self) -> None:
        self.push_screen(ReplayForm(self.settings), self._replay_chosen)

    def _replay_chosen(self, settings: ReplaySettings | None) -> None:
        if settings is not None:
            self.start_replay(settings)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())


def make_app(path: str | Path, *, rank: int | None = None, report_path: str | Path | None = None,
             replay: ReplaySettings | None = None, diff_ref: str | Path | None = None) -> ReplaydiffApp:
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
    report = None
    if report_path is not None:
        from replaydiff.report import load_replay_json

        report = load_replay_json(report_path)
    return ReplaydiffApp(trace, rank=rank, report=report,
                         replay=None if report is not None else (replay or ReplaySettings()))


__all__ = ["ReplaydiffApp", "ReplaySettings", "make_app"]
