"""Provides OpList: the virtualised op list (Textual's line API: only the rows on screen are ever drawn).

A compiled unit's row expands (x) to its kernels and graph nodes, one row each under it; those rows belong to the
unit (the cursor on one selects the unit). With no unit expanded a row is an op of ``model.visible``; with one,
the list keeps its own table of rows."""
from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from replaydiff.rebuild_and_judge import shown
from replaydiff.trace.schema.left_out import LEFT_OUT_BUDGET, LEFT_OUT_DISK_FULL, LEFT_OUT_FILTERED
from replaydiff.tui.model import PHASE_SHORT, TraceModel, shorten_left, short_op
from replaydiff.tui.styles import STATUS_STYLE as REPLAY_STATUS_STYLE

STATUS_LABEL = {None: "", "ok": "ok", "divergent": "DIVERG", "nondeterministic": "NONDET", "skipped": "skip",
                "error": "error",
                "inherited": "inher", "target_only": "T-only"}
STATUS_STYLE = {
    **REPLAY_STATUS_STYLE,
    "inherited": Style(color="#d9822b", dim=True),  # diff mode: carried an earlier difference forward
    "target_only": Style(color="cyan", italic=True),  # diff mode: no aligned op in the reference
}
# An op whose tensor data the recording left out is skipped by replay: its row says why instead of "skip". Past the
# budget or after a full disk is a gap (never clean): in yellow; outside the --module/--op filter is a choice: dim.
LEFT_OUT_LABEL = {LEFT_OUT_FILTERED: "filter", LEFT_OUT_BUDGET: "budget", LEFT_OUT_DISK_FULL: "disk"}
LEFT_OUT_STYLE = {LEFT_OUT_FILTERED: Style(dim=True), LEFT_OUT_BUDGET: Style(color="yellow", bold=True),
                  LEFT_OUT_DISK_FULL: Style(color="yellow", bold=True)}
PHASE_STYLE = {"forward": Style(color="blue"), "backward": Style(color="magenta"), "optimizer": Style(color="cyan")}
DIM = Style(dim=True)
MODULE_STYLE = Style(color="cyan")
UNIT_ROW_STYLE = Style(color="bright_black", italic=True)


class OpList(ScrollView, can_focus=True):
    """Rows of ops: number, phase, module (shortened from the left), op, output, status, and error over the op's
    divergence limit (err/lim: its severity, as the module tree and the heat strip give it)."""

    BINDINGS = [
        Binding("up,k", "cursor(-1)", "up", show=False),
        Binding("down,j", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home", "edge(0)", "first", show=False),
        Binding("end", "edge(1)", "last", show=False),
        Binding("x", "expand", "expand unit", show=False),
    ]

    DEFAULT_CSS = """
    OpList { background: $surface; overflow-x: hidden; }
    OpList > .oplist--cursor { background: $accent 40%; }
    OpList:focus > .oplist--cursor { background: $accent; color: $text; }
    OpList > .oplist--header { text-style: bold; background: $panel; }
    """
    COMPONENT_CLASSES = {"oplist--cursor", "oplist--header"}

    cursor_row: reactive[int] = reactive(0, always_update=True, repaint=False)

    class Selected(Message):
        """The op under the cursor changed."""

        def __init__(self, op: int | None) -> None:
            super().__init__()
            self.op = op

    def __init__(self, model: TraceModel, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model
        self._cache: dict[tuple, Strip] = {}
        self._paint: tuple | None = None
        self.expanded: dict[int, list[str]] = {}  # op number of an expanded unit -> the text of its rows
        self._rows: list[tuple[int, int]] | None = None  # with a unit expanded: (op, its row k, or -1 for the op)
        self._first: dict[int, int] = {}  # with a unit expanded: op -> its row
        self.refresh_rows()

    # -- data -------------------------------------------------------------------------------------------------
    @property
    def selected_op(self) -> int | None:
        return self.entry(self.cursor_row)[0]

    @property
    def row_count(self) -> int:
        return len(self.model.visible) if self._rows is None else len(self._rows)

    def entry(self, row: int) -> tuple[int | None, int]:
        """(op, k) of a row: k is -1 for the op's own row, else the k-th row of an expanded unit; op None past the
        end."""
        if self._rows is not None:
            return self._rows[row] if 0 <= row < len(self._rows) else (None, -1)
        v = self.model.visible
        return (v[row], -1) if 0 <= row < len(v) else (None, -1)

    def _row_of_visible(self, k: int) -> int:
        return k if self._rows is None else self._first[self.model.visible[k]]

    def refresh_rows(self) -> None:
        """Call after the model's rows or verdicts changed."""
        self._cache.clear()
        if self.expanded:
            self._rows, self._first = [], {}
            for op in self.model.visible:
                self._first[op] = len(self._rows)
                self._rows.append((op, -1))
                self._rows.extend((op, k) for k in range(len(self.expanded.get(op, ()))))
        else:
            self._rows, self._first = None, {}
        self.virtual_size = Size(0, self.row_count + 1)  # +1: the header line
        self.refresh()

    def refresh_ops(self, ops: set[int]) -> None:
        """Redraw the rows of these ops that are on screen (new verdicts came in for them)."""
        top = int(self.scroll_y)
        for row in range(top, min(self.row_count, top + self.scrollable_content_region.height)):
            if self.entry(row)[0] in ops:
                self._refresh_row(row)

    def set_model(self, model: TraceModel) -> None:
        self.model = model
        self.expanded = {}
        self.cursor_row = 0
        self.refresh_rows()
        self.scroll_to(y=0, animate=False)

    def select_op(self, op: int, exact: bool = False) -> bool:
        """Move the cursor to op number ``op`` (or the next shown op unless ``exact``); False if not shown."""
        row = self.model.row_of(op)
        if row is None:
            if exact or not self.model.visible:
                return False
            row = self.model.nearest_row(op)
        self.move_to(self._row_of_visible(row), center=True)
        return True

    def action_expand(self) -> None:
        """Expand the compiled unit under the cursor to its kernels and nodes, or collapse it."""
        op = self.selected_op
        if op is None:
            return
        if op in self.expanded:
            del self.expanded[op]
        else:
            from replaydiff.tui.details import unit_rows

            with self.app.trace_lock:  # the trace decodes lazily and a background run may be reading it
                rows = unit_rows(self.model.trace[op])
            if not rows:
                self.app.notify(f"#{op} is not a compiled unit: nothing to expand", timeout=3)
                return
            self.expanded[op] = rows
        self.refresh_rows()
        self.move_to(self._first.get(op, self.model.row_of(op) or 0))

    def move_to(self, row: int, center: bool = False) -> None:
        n = self.row_count
        row = max(0, min(row, n - 1)) if n else 0
        old = self.cursor_row
        self.cursor_row = row
        self._refresh_row(old)
        self._refresh_row(row)
        self._scroll_to_row(row, center)
        self.post_message(self.Selected(self.selected_op))

    def _scroll_to_row(self, row: int, center: bool) -> None:
        height = max(1, self.scrollable_content_region.height - 1)
        top = int(self.scroll_y)
        if center and not top <= row < top + height:
            self.scroll_to(y=max(0, row - height // 2), animate=False)
        elif row < top:
            self.scroll_to(y=row, animate=False)
        elif row >= top + height:
            self.scroll_to(y=row - height + 1, animate=False)

    def _refresh_row(self, row: int) -> None:
        y = row + 1 - int(self.scroll_y)
        self.refresh(Region(0, y, self.size.width, 1))

    # -- actions ----------------------------------------------------------------------------------------------
    def action_cursor(self, delta: int) -> None:
        self.move_to(self.cursor_row + delta)

    def action_page(self, direction: int) -> None:
        self.move_to(self.cursor_row + direction * max(1, self.scrollable_content_region.height - 2))

    def action_edge(self, end: int) -> None:
        self.move_to(self.row_count - 1 if end else 0)

    def on_click(self, event: events.Click) -> None:
        if event.y == 0:
            return
        row = int(self.scroll_y) + event.y - 1
        if 0 <= row < self.row_count:
            self.focus()
            self.move_to(row)

    # -- drawing ----------------------------------------------------------------------------------------------
    def columns(self, width: int) -> tuple[int, int, int, int, int, int, int]:
        """Widths of: number, phase, module, op, output, status, error (separated by one space)."""
        w_idx = max(3, len(str(max(0, self.model.n - 1))))
        w_phase, w_status, w_err = 3, 6, 8
        rest = max(0, width - (w_idx + w_phase + w_status + w_err) - 6)  # six separating spaces
        # the op name matters most, then the module, then the output (dropped when there is no room for it)
        w_op = min(30, max(10, rest // 2), rest)
        w_out = min(22, (rest - w_op) * 2 // 5)
        if w_out < 12:
            w_out = 0
        w_mod = rest - w_op - w_out
        if w_mod > 40:  # give spare room back to the op and output columns
            spare = w_mod - 40
            w_mod = 40
            w_op += min(spare, 16)
            w_out += max(0, spare - 16)
        return w_idx, w_phase, w_mod, w_op, w_out, w_status, w_err

    def render_lines(self, crop: Region) -> list[Strip]:
        # styles and width are the same for every line of one paint: look them up once, not per line
        self._paint = (self.scrollable_content_region.width, self.rich_style)
        try:
            return super().render_lines(crop)
        finally:
            self._paint = None

    def render_line(self, y: int) -> Strip:
        width, base = self._paint or (self.scrollable_content_region.width, self.rich_style)
        if y == 0:
            return self._header(width)
        row = int(self.scroll_y) + y - 1
        op, k = self.entry(row)
        if op is None:
            return Strip.blank(width, base)
        selected = row == self.cursor_row
        key = (op, k, selected and (1 + self.has_focus), width, id(self.model.results[op]))
        strip = self._cache.get(key)
        if strip is None:
            strip = self._row(op, width, base, selected) if k < 0 else self._unit_row(op, k, width, base, selected)
            if len(self._cache) > 2000:
                self._cache.clear()
            self._cache[key] = strip
        return strip

    def _header(self, width: int) -> Strip:
        w_idx, w_phase, w_mod, w_op, w_out, w_status, w_err = self.columns(width)
        style = self.get_component_rich_style("oplist--header")
        cells = ["#".rjust(w_idx), "ph ", "module".ljust(w_mod)[:w_mod], "op".ljust(w_op)[:w_op],
                 "output".ljust(w_out)[:w_out], "status".ljust(w_status), "err/lim".rjust(w_err)]
        text = " ".join(c for c in cells if c)
        return Strip([Segment(text.ljust(width)[:width], style)], width)

    def _row(self, op: int, width: int, base: Style, selected: bool) -> Strip:
        m = self.model
        ix = m.index
        w_idx, w_phase, w_mod, w_op, w_out, w_status, w_err = self.columns(width)
        status = m.status[op]
        phase = ix.phase[op]
        mod = shown(ix.module[op] or "")  # strings from the trace: control characters as visible escapes
        out = shown(ix.output[op] or "")
        cheap = ix.cheap[op]
        err = m.error[op]
        name_style = DIM if cheap else Style()
        result = m.results[op]
        left_out = result.left_out if result is not None else None
        label = LEFT_OUT_LABEL.get(left_out) or STATUS_LABEL.get(status, status or "")  # type: ignore[arg-type]
        label_style = LEFT_OUT_STYLE.get(left_out) or STATUS_STYLE.get(status, DIM)  # type: ignore[arg-type]
        segs = [
            Segment(str(op).rjust(w_idx) + " ", DIM),
            Segment(PHASE_SHORT.get(phase, (phase or "")[:3]).ljust(w_phase)[:w_phase] + " ",
                    PHASE_STYLE.get(phase, DIM)),
            Segment(shorten_left(mod, w_mod).ljust(w_mod) + " " if w_mod else "", MODULE_STYLE),
            Segment(_fit(shown(short_op(ix.name[op])), w_op) + " ", name_style),
            Segment(_fit(out, w_out) + " " if w_out else "", DIM),
            Segment(label.ljust(w_status)[:w_status] + " ", label_style),
            Segment(err.rjust(w_err)[:w_err], STATUS_STYLE.get(status, DIM) if status != "ok" else Style()),
        ]
        strip = Strip(segs).adjust_cell_length(width)
        if selected:
            strip = strip.apply_style(self.get_component_rich_style("oplist--cursor"))
        return strip.apply_style(base) if not selected else strip

    def _unit_row(self, op: int, k: int, width: int, base: Style, selected: bool) -> Strip:
        """The k-th row of an expanded unit: a kernel line or a node, indented under the op column."""
        w_idx, w_phase, w_mod = self.columns(width)[:3]
        rows = self.expanded[op]
        branch = "└ " if k == len(rows) - 1 else "├ "
        strip = Strip([Segment(" " * (w_idx + w_phase + 2) + (" " * (w_mod + 1) if w_mod else "") + branch, DIM),
                       Segment(shown(rows[k]), UNIT_ROW_STYLE)]).adjust_cell_length(width)
        if selected:
            return strip.apply_style(self.get_component_rich_style("oplist--cursor"))
        return strip.apply_style(base)

    def on_resize(self) -> None:
        self._cache.clear()
        self.virtual_size = Size(0, self.row_count + 1)

    def watch_has_focus(self, value: bool) -> None:  # the cursor's colour depends on focus
        self._refresh_row(self.cursor_row)


def _fit(text: str, width: int) -> str:
    if width <= 0:
        return ""
    if len(text) <= width:
        return text.ljust(width)
    return text[: width - 1] + "…"
