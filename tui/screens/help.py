"""Provides HelpScreen: every key and what it does."""
from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from replaydiff.tui.keys import KEYS


# What the figures on the main screen mean (docs/tui.md says the same).
FIGURES = (
    ("err/lim", "the op list's last column: how far the op's error is over its divergence limit, the larger of "
                "max_abs/(eps·absmax) and rel_l2/eps over their limits (an ill-conditioned op: over its own error "
                "at its dtype); 1 is at the limit, over 1 divergent. Replay and the report give the same figure"),
    ("0.31×", "after a phase or module in the tree: the worst err/lim of its ops; (N): how many ops it has"),
    ("heat strip", "each cell coloured by the worst err/lim of its stretch of ops; red is over 1"),
    ("≠N, exact", "an exact comparison (integers, booleans): N elements differ, or none"),
    ("✗", "divergent without a figure (NaN/Inf where the reference has none, a wrong shape)"),
)


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
            figures = Table(show_header=False, box=None, padding=(0, 1))
            figures.add_column(style="bold cyan", no_wrap=True)
            figures.add_column()
            for what, meaning in FIGURES:
                figures.add_row(what, meaning)
            yield Static("\n[b]figures[/]")
            yield Static(figures, id="help-figures")
