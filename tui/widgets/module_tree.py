"""Provides ModuleTree: the model's modules under forward / backward / optimizer, each with its worst error."""
from __future__ import annotations

from rich.text import Text
from textual.message import Message
from textual.widgets import Tree

from replaydiff.rebuild_and_judge import shown
from replaydiff.tui.model import ModuleGroup, TraceModel, severity_text
from replaydiff.tui.widgets.heat_strip import heat_colour


TREE_HEADER = "module  worst err/lim (ops)"  # over the tree, as the op list's header is over its rows


def worst_text(worst: float | None) -> Text:
    """A module's worst error as a multiple of the divergence limit: ``0.31×``, ``1e3×`` (divergent, in red),
    ``✗`` (a divergence with no figure: NaN/Inf or exact mismatches). Two digits: the tree is narrow, and the op's
    own row gives three."""
    if worst is None:
        return Text("")
    if worst == float("inf"):
        return Text(" ✗", style="bold red")
    return Text(" " + severity_text(worst, 2), style="bold red" if worst >= 1.0 else heat_colour(worst))


class ModuleTree(Tree[ModuleGroup]):
    """Choosing a node (Enter or a click) narrows the op list to that module's ops in that phase; the root shows
    every op again. A node's figure is its worst error as a multiple of the divergence limit."""

    DEFAULT_CSS = """
    ModuleTree { border-right: solid $panel-lighten-2; overflow-x: hidden; }
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
        self._filled: set = set()
        self.root.set_label(self._root_label())
        for g in self.model.module_groups():
            self._add(self.root, g, expand=g.phase != "optimizer")
        self.root.expand()

    def _add(self, parent, g: ModuleGroup, expand: bool) -> None:
        # a module whose ops all sit in its only child shows as one node: "Model.layers", not "Model" > "layers"
        chain = [g]
        while len(chain[-1].children) == 1 and chain[-1].children[0].count == chain[-1].count and chain[-1].path:
            chain.append(chain[-1].children[0])
        last = chain[-1]
        expand = expand and len(last.children) <= 12
        node = parent.add(self._label(g, last), data=last, expand=expand, allow_expand=bool(last.children))
        self._group_nodes[(last.phase, last.path)] = (node, g)
        if expand:
            self._fill(node)

    def _fill(self, node) -> None:
        """Add a node's children (done when it is first expanded: a model may have thousands of modules)."""
        if node in self._filled:
            return
        self._filled.add(node)
        last = node.data
        for c in last.children:
            self._add(node, c, expand=last.path == "" or last.path.count(".") < 1)

    def on_tree_node_expanded(self, event: Tree.NodeExpanded) -> None:
        if event.node.data is not None:
            self._fill(event.node)

    def _root_label(self) -> Text:
        return Text(f"all ops ({self.model.n})", style="bold")

    def _label(self, first: ModuleGroup, last: ModuleGroup | None = None) -> Text:
        last = last or first
        name = first.name if last is first else first.name + last.path[len(first.path):]
        t = Text(shown(name), style="bold" if first.path == "" else "")  # a module path from the trace
        t.append_text(worst_text(last.worst))
        t.append(f" ({last.count})", style="dim")
        return t

    def refresh_worst(self) -> None:
        """Relabel nodes after new verdicts (the structure stays)."""
        self.model.refresh_worst()
        for node, first in self._group_nodes.values():
            node.set_label(self._label(first, node.data))

    def node_for(self, phase: str, path: str):
        """The tree node of a module in a phase (path "" for the phase itself), or None if not shown yet."""
        entry = self._group_nodes.get((phase, path))
        return entry[0] if entry else None

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        event.stop()
        g = event.node.data
        self.post_message(self.Scope(None if g is None else (g.phase, g.path)))
