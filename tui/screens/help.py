"""Provides HelpScreen: every key and what it does."""
from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from replaydiff.tui.keys import KEYS


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "app.pop_screen", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 84; max-width: 100%; height: auto; max-height: 90%;
                                  border: round $accent; background: $surface; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        table = Table(show_header=False, box=None, padding=(0, 1))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, what in KEYS:
            table.add_row(key, what)
        with VerticalScroll():
            yield Static("[b]replaydiff tui: keys[/]  (Esc closes)")
            yield Static(table, id="help-keys")
