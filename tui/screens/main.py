"""Provides MainScreen: heat strip on top, module tree beside the op list, detail pane below, status and footer."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Input, ProgressBar, Static

from replaydiff.tui.model import TraceModel
from replaydiff.tui.widgets.detail import DetailPane
from replaydiff.tui.widgets.heat_strip import HeatStrip
from replaydiff.tui.widgets.module_tree import TREE_HEADER, ModuleTree
from replaydiff.tui.widgets.op_list import OpList


# One line of the most used keys, each clickable. A fixed line rather than Textual's Footer: the Footer rebuilds
# itself whenever focus moves (into the filter box, say), which costs tens of milliseconds on a keypress.
KEY_BAR = "  ".join(f"[@click=app.{action}][b]{key}[/b][/] {label}" for key, action, label in (
    ("?", "help", "help"), ("q", "quit", "quit"), ("f", "first_divergent", "first div"),
    ("n", "next_divergent", "next"), ("N", "previous_divergent", "prev"),
    ("e", "nonfinite", "NaN origin"), ("p", "producer", "producer"), ("c", "consumers", "consumers"),
    ("b", "partner", "fwd/bwd"), ("g", "ancestry", "ancestry"), ("v", "toggle_cheap", "views"),
    ("/", "filter", "filter"), ("r", "next_rank", "rank"), ("R", "replay_form", "replay")))


class MainScreen(Screen):
    BINDINGS = [
        Binding("f", "app.first_divergent", "first div", show=False),
        Binding("n", "app.next_divergent", "next", show=False),
        Binding("N", "app.previous_divergent", "prev", show=False),
        Binding("e", "app.nonfinite", "NaN origin", show=False),
        Binding("p", "app.producer", "producer", show=False),
        Binding("c", "app.consumers", "consumers", show=False),
        Binding("b", "app.partner", "fwd/bwd", show=False),
        Binding("g", "app.ancestry", "ancestry", show=False),
        Binding("v", "app.toggle_cheap", "views", show=False),
        Binding("slash", "app.filter", "filter", show=False),
        Binding("r", "app.next_rank", "rank", show=False),
        Binding("R", "app.replay_form", "replay", show=False),
        Binding("t", "app.trend", "trend", show=False),
        Binding("escape", "app.clear_view", "clear", show=False),
    ]

    def __init__(self, model: TraceModel) -> None:
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        yield HeatStrip(self.model, id="heat")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield Static(TREE_HEADER, id="tree-header")
                yield ModuleTree(self.model, id="modules")
            with Vertical(id="right"):
                yield OpList(self.model, id="ops")
                yield DetailPane(id="detail")
        with Horizontal(id="statusbar"):
            # the filter box lives in the status line: focusing it (/) moves nothing else on the screen
            yield Input(placeholder="/ filter op or module", id="filter")
            yield Static("", id="status")
            yield ProgressBar(id="progress", show_eta=False)
        yield Static(KEY_BAR, id="keybar", markup=True)

    def on_mount(self) -> None:
        self.query_one(OpList).focus()

    @property
    def op_list(self) -> OpList:
        return self.query_one(OpList)

    @property
    def heat(self) -> HeatStrip:
        return self.query_one(HeatStrip)

    @property
    def tree(self) -> ModuleTree:
        return self.query_one(ModuleTree)

    @property
    def detail(self) -> DetailPane:
        return self.query_one(DetailPane)

    @property
    def filter_input(self) -> Input:
        return self.query_one("#filter", Input)
