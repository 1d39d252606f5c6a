"""Provides DetailPane: everything about the selected op (schema, arguments, outputs, verdict, source, histogram)."""
from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Static


class DetailPane(VerticalScroll):
    """A scrolling pane of markup produced by tui.details; links in it are ``app.goto`` actions."""

    DEFAULT_CSS = """
    DetailPane { height: 1fr; border-top: solid $panel-lighten-2; padding: 0 1; }
    DetailPane > #detail-body { width: 1fr; }
    DetailPane > #detail-histogram { width: 1fr; }
    """

    def compose(self):
        yield Static("", id="detail-body", markup=True)
        yield Static("", id="detail-histogram", markup=True)

    def show(self, markup: str) -> None:
        self.query_one("#detail-body", Static).update(markup)
        self.query_one("#detail-histogram", Static).update("")
        self.scroll_home(animate=False)

    def show_histogram(self, markup: str) -> None:
        self.query_one("#detail-histogram", Static).update(markup)

    @property
    def text(self) -> str:
        """The pane's text without markup (for tests)."""
        parts = []
        for sid in ("#detail-body", "#detail-histogram"):
            content = self.query_one(sid, Static).visual
            parts.append(str(getattr(content, "plain", content)))
        return "\n".join(parts)
