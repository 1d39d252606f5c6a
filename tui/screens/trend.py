"""Provides TrendScreen: a multi-step trace's per-module series and, on top, the first sudden change, the op that
caused it, and the commands to run next.

The figures come from ``replaydiff.trend`` and the words from ``replaydiff.report.trend`` (the same as ``replaydiff
trend TRACE`` prints); this screen only lays them out. Enter on the first-change line (or ``j`` anywhere) closes it
and selects that op in the op list; Enter on the cause line (or ``c``) selects the causing op; Enter on a command
copies it to the clipboard.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from replaydiff.report.trend import (describe_cause, describe_change, describe_late_window, describe_no_change,
                                     describe_passed_over, describe_unscored, next_lines, table_lines)
from replaydiff.trend import TrendResult

CHANGE_ID = "first-change"
CAUSE_ID = "cause"
PASSED_ID = "passed-over"  # an earlier weak jump, said so that the reader can weigh it
UNSCORED_ID = "not-scored"  # records holding tensor data without statistics, which trend cannot score
LATE_ID = "late-window"  # a flight window that may have begun after the change
HEADER_ID = "table-header"
COMMAND_IDS = ("next-1", "next-2")  # next_lines: the explanation (next-0), record, replay, the note (next-3)
STYLES = {CHANGE_ID: "bold red", CAUSE_ID: "bold yellow", LATE_ID: "yellow", HEADER_ID: "bold",
          **{i: "cyan" for i in COMMAND_IDS}}
SPARK_WIDTH = 40  # the last this many steps in a row's sparkline


class TrendScreen(ModalScreen[int | None]):
    """Dismissed with the first change's op number (Enter on its line, or ``j``), or None (Esc)."""

    BINDINGS = [Binding("escape,q,t", "cancel", "close"), Binding("j", "jump", "go to the first change"),
                Binding("c", "cause", "go to the op that caused it")]
    DEFAULT_CSS = """
    TrendScreen { align: center middle; }
    TrendScreen > Vertical { width: 95%; height: 90%; border: round $accent; background: $surface; }
    TrendScreen OptionList { height: 1fr; }
    """

    def __init__(self, trend: TrendResult, trace: str = "TRACE") -> None:
        """``trace``: the trace as the user named it, for the next commands."""
        super().__init__()
        self.trend = trend
        self.trace = trace

    def lines(self) -> list[tuple[str, str | None]]:
        """(text, option id) of every line of the list: the first change, its cause, an earlier weak jump passed over,
        a flight window that may have begun too late, the records trend could not score, the next commands, the
        header, one row per series."""
        t, c = self.trend, self.trend.first_change
        if c is None:
            top = [(describe_no_change(t), None)]
        else:
            top = [(f"▶ first change: {describe_change(c, t.threshold)}  (Enter or j: go to #{c.index})", CHANGE_ID)]
        cause = t.cause_to_tell
        if cause is not None:
            top.append((f"▶ cause: {describe_cause(cause)}  (Enter or c: go to #{cause.index})", CAUSE_ID))
        if t.passed_over is not None:
            top.append((describe_passed_over(t), PASSED_ID))
        if t.late_window is not None:
            top.append((describe_late_window(t.late_window), LATE_ID))
        if t.unscored is not None:
            top.append((describe_unscored(t.unscored, self.trace), UNSCORED_ID))
        nxt = [(line, f"next-{k}") for k, line in enumerate(next_lines(t, self.trace))]
        header, *rows = table_lines(t, SPARK_WIDTH)
        return [*top, *nxt, (header, HEADER_ID), *((line, None) for line in rows)]

    def compose(self) -> ComposeResult:
        t = self.trend
        with Vertical():
            yield Static(f"trend of rank {t.rank}: {len(t.steps)} steps ({t.steps[0]}..{t.steps[-1]}), "
                         f"{t.ops_read} records  (Esc closes)", id="trend-title")
            options = []
            for text, oid in self.lines():
                # the lines above the table wrap (they are the point of the screen); table rows stay one line each
                wrap = oid not in (None, HEADER_ID)
                options.append(Option(Text(text, style=STYLES.get(oid or "", ""), no_wrap=not wrap), id=oid))
            yield OptionList(*options, id="trend")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        ol.focus()
        ol.highlighted = 0

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id == CHANGE_ID:
            self.action_jump()
        elif event.option.id == CAUSE_ID:
            self.action_cause()
        elif event.option.id in COMMAND_IDS:
            command = next(text for text, oid in self.lines() if oid == event.option.id).strip()
            self.app.copy_to_clipboard(command)
            self.notify(f"copied: {command}", timeout=3)

    def action_jump(self) -> None:
        c = self.trend.first_change
        if c is None:
            self.notify("no sudden change to go to", timeout=3)
            return
        self.dismiss(c.index)

    def action_cause(self) -> None:
        cause = self.trend.cause_to_tell
        if cause is None:
            self.notify("the first change is its own cause" if self.trend.first_change else "no change, no cause",
                        timeout=3)
            return
        self.dismiss(cause.index)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @property
    def text(self) -> str:
        """Every line of the list (for tests)."""
        return "\n".join(text for text, _ in self.lines())
