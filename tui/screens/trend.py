"""Provides TrendScreen: a multi-step trace's per-module series and, on top, the first sudden change.

The figures come from ``replaydiff.report.trend`` (the same as ``replaydiff trend TRACE`` prints); this screen only
lays them out. Enter on the first-change line (or ``j`` anywhere) closes it and selects that op in the op list.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from replaydiff.report.trend import Trend, describe_change, table_lines

CHANGE_ID = "first-change"
SPARK_WIDTH = 40  # the last this many steps in a row's sparkline


class TrendScreen(ModalScreen[int | None]):
    """Dismissed with the first change's op number (Enter on its line, or ``j``), or None (Esc)."""

    BINDINGS = [Binding("escape,q,t", "cancel", "close"), Binding("j", "jump", "go to the first change")]
    DEFAULT_CSS = """
    TrendScreen { align: center middle; }
    TrendScreen > Vertical { width: 95%; height: 90%; border: round $accent; background: $surface; }
    TrendScreen OptionList { height: 1fr; }
    """

    def __init__(self, trend: Trend) -> None:
        super().__init__()
        self.trend = trend

    def lines(self) -> list[tuple[str, str | None]]:
        """(text, option id) of every line of the list: the first change, the header, one row per series."""
        t, c = self.trend, self.trend.first_change
        if c is None:
            top = (f"no sudden change (robust z-score >= {t.threshold:g} against the {t.window} steps before)", None)
        else:
            top = (f"▶ first change: {describe_change(c)}  (Enter or j: go to #{c.index})", CHANGE_ID)
        return [top, *((line, None) for line in table_lines(t, SPARK_WIDTH))]

    def compose(self) -> ComposeResult:
        t = self.trend
        with Vertical():
            yield Static(f"trend of rank {t.rank}: {len(t.steps)} steps ({t.steps[0]}..{t.steps[-1]}), "
                         f"{t.ops_read} records  (Esc closes)", id="trend-title")
            options = []
            for text, oid in self.lines():
                style = "bold red" if oid == CHANGE_ID else ("bold" if not options else "")
                # the first-change line wraps (it is the point of the screen); table rows stay one line each
                options.append(Option(Text(text, style=style, no_wrap=oid != CHANGE_ID), id=oid))
            yield OptionList(*options, id="trend")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        ol.focus()
        ol.highlighted = 0

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id == CHANGE_ID:
            self.action_jump()

    def action_jump(self) -> None:
        c = self.trend.first_change
        if c is None:
            self.notify("no sudden change to go to", timeout=3)
            return
        self.dismiss(c.index)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @property
    def text(self) -> str:
        """Every line of the list (for tests)."""
        return "\n".join(text for text, _ in self.lines())
