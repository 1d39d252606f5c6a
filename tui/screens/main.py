"""Provides MainScreen: heat strip on top, module tree beside the op list, detail pane below, status and footer."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Input, ProgressBar, Static

from tui.model import TraceModel
from tui.widgets.detail import DetailPane
from tui.widgets.heat_strip import HeatStrip
from tui.widgets.module_tree import ModuleTree
from tui.widgets.op_list import OpList


class MainScreen(Screen):
    BINDINGS = [
        Binding("f", "app.first_divergent", "first div"),
        Binding("n", "app.next_divergent(1)", "next"),
        Binding("N", "app.next_divergent(-1)", "prev", show=False),
        Binding("e", "app.nonfinite", "NaN origin", show=False),
        Binding("p", "app.producer", "producer"),
        Binding("c", "app.consumers", "consumers"),
        Binding("b", "app.partner", "fwd/bwd"),
        Binding("g", "app.ancestry", "ancestry"),
        Binding("v", "app.toggle_cheap", "views"),
        Binding("slash", "app.filter", "filter"),
        Binding("r", "app.next_rank", "rank", show=False),
        Binding("R", "app.replay_form", "replay", show=False),
        Binding("escape", "app.clear_view", "clear", show=False),
    ]

    def __init__(self, model: TraceModel) -> None:
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        yield HeatStrip(self.model, id="heat")
        with Horizontal(id="body"):
            yield ModuleTree(self.model, id="modules")
            with Vertical(id="right"):
                yield OpList(self.model, id="ops")
                yield DetailPane(id="detail")
        with Horizontal(id="statusbar"):
            # the filter box lives in the status line: focusing it (/) moves nothing else on the screen
            yield Input(placeholder="/ filter op or module", id="filter")
            yield Static("", id="status")
            yield ProgressBar(id="progress", show_eta=False)
        yield Footer()

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
