"""Provides HeatStrip: the whole op sequence in one line, each cell coloured by the worst error of its ops."""
from __future__ import annotations

import math

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from replaydiff.tui.model import TraceModel

# severity (a multiple of the op's limit) -> colour; the last step is a divergence
LEVELS = ((0.0, "#1f5f2f"), (0.125, "#2e8b3e"), (0.5, "#b8a200"), (1.0, "#d9822b"), (math.inf, "#e0202a"))
PENDING = "#3a3a3a"
CURSOR = "▼"


def heat_colour(worst: float | None) -> str:
    if worst is None:
        return PENDING
    if worst >= 1.0:
        return "#e0202a"
    for limit, colour in LEVELS:
        if worst <= limit:
            return colour
    return LEVELS[-1][1]


class HeatStrip(Widget):
    """Two lines: a marker over the cell holding the selected op, and the cells. Clicking a cell jumps to its worst
    op (its first when nothing in it has a verdict yet)."""

    DEFAULT_CSS = """
    HeatStrip { height: 2; width: 1fr; }
    """

    class Jump(Message):
        def __init__(self, op: int) -> None:
            super().__init__()
            self.op = op

    def __init__(self, model: TraceModel, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.selected: int | None = None
        self._cells: list[tuple[int, int, float | None, int | None]] = []
        self._key: tuple = ()

    def set_model(self, model: TraceModel) -> None:
        self.model = model
        self._key = ()
        self.refresh()

    def set_selected(self, op: int | None) -> None:
        if op != self.selected:
            self.selected = op
            self.refresh()

    def refresh_heat(self) -> None:
        """Recompute the cells from the verdicts (a pass over every op: the app calls it when verdicts changed,
        at most a few times a second; moving the selection only moves the marker)."""
        self._key = ()
        self.refresh()

    def cells(self) -> list[tuple[int, int, float | None, int | None]]:
        key = (id(self.model), self.size.width)
        if key != self._key:
            self._cells = self.model.heat(self.size.width)
            self._key = key
        return self._cells

    def cell_of(self, op: int) -> int | None:
        for k, (lo, hi, _, _) in enumerate(self.cells()):
            if lo <= op <= hi:
                return k
        return None

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        cells = self.cells()
        if y == 0:
            k = self.cell_of(self.selected) if self.selected is not None else None
            if k is None:
                return Strip.blank(width)
            return Strip([Segment(" " * k), Segment(CURSOR, Style(bold=True)), Segment(" " * (width - k - 1))], width)
        if y == 1:
            segs = [Segment("▀" if worst is not None and worst >= 1.0 else "▄",
                            Style(color=heat_colour(worst), bgcolor=heat_colour(worst)
                                  if worst is not None and worst >= 1.0 else None))
                    for _, _, worst, _ in cells]
            return Strip(segs, len(segs)).adjust_cell_length(width)
        return Strip.blank(width)

    def on_click(self, event: events.Click) -> None:
        cells = self.cells()
        if 0 <= event.x < len(cells):
            lo, _, worst, at = cells[event.x]
            self.post_message(self.Jump(at if at is not None and worst is not None and worst > 0 else lo))
