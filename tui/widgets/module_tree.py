"""Provides ModuleTree: the model's modules under forward / backward / optimizer, each with its worst error."""
from __future__ import annotations

from rich.text import Text
from textual.message import Message
from textual.widgets import Tree

from tui.model import ModuleGroup, TraceModel
from tui.widgets.heat_strip import heat_colour


def worst_text(worst: float | None) -> Text:
    if worst is None:
        return Text("")
    if worst >= 1.0:
        return Text(" ✗" if worst == float("inf") else f" {worst:.3g}×", style="bold red")
    return Text(f" {worst:.2g}×", style=heat_colour(worst))


class ModuleTree(Tree[ModuleGroup]):
    """Choosing a node (Enter or a click) narrows the op list to that module's ops in that phase; the root shows
    every op again. A node's figure is its worst error as a multiple of the divergence limit."""

    DEFAULT_CSS = """
    ModuleTree { width: 30; min-width: 16; border-right: solid $panel-lighten-2; }
    """

    class Scope(Message):
        def __init__(self, scope: tuple[str, str] | None) -> None:
            super().__init__()
            self.scope = scope

    def __init__(self, model: TraceModel, **kwargs) -> None:
        super().__init__("all ops", **kwargs)
        self.model = model
        self.show_root = True
        self.guide_depth = 2
        self._group_nodes: dict[tuple[str, str], object] = {}

    def on_mount(self) -> None:
        self.rebuild()

    def set_model(self, model: TraceModel) -> None:
        self.model = model
        self.rebuild()

    def rebuild(self) -> None:
        self.clear()
        self._group_nodes = {}
        self.root.set_label(self._root_label())
        for g in self.model.module_groups():
            self._add(self.root, g, expand=g.phase != "optimizer")
        self.root.expand()

    def _add(self, parent, g: ModuleGroup, expand: bool) -> None:
        node = parent.add(self._label(g), data=g, expand=expand and len(g.children) <= 12,
                          allow_expand=bool(g.children))
        self._group_nodes[(g.phase, g.path)] = node
        for c in g.children:
            self._add(node, c, expand=g.path == "" or g.path.count(".") < 1)

    def _root_label(self) -> Text:
        return Text(f"all ops ({self.model.n})", style="bold")

    def _label(self, g: ModuleGroup) -> Text:
        t = Text(g.name, style="bold" if g.path == "" else "")
        t.append(f" {g.count}", style="dim")
        t.append_text(worst_text(g.worst))
        return t

    def refresh_worst(self) -> None:
        """Relabel nodes after new verdicts (the structure stays)."""
        self.model.refresh_worst()
        for node in self._group_nodes.values():
            node.set_label(self._label(node.data))

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        event.stop()
        g = event.node.data
        self.post_message(self.Scope(None if g is None else (g.phase, g.path)))
