"""Provides AncestryScreen: an op's inputs' producers as a tree, recursively, each with its verdict."""
from __future__ import annotations

from typing import Any, Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static, Tree

from replaydiff.rebuild_and_judge import shown
from replaydiff.tui.model import TraceModel, short_op
from replaydiff.tui.styles import STATUS_MARKUP

MAX_NODES = 300


def ancestry(model: TraceModel, op: int, depth: int = 4) -> dict[str, Any]:
    """{"op": N, "input": k, "children": [...], "seen": bool} for op and its producers, ``depth`` levels deep;
    an op met again is listed once more but not expanded."""
    seen: set[int] = set()
    budget = [MAX_NODES]

    def node(i: int, k: int | None, level: int) -> dict[str, Any]:
        budget[0] -= 1
        n: dict[str, Any] = {"op": i, "input": k, "children": [], "seen": i in seen}
        if i in seen:
            return n
        seen.add(i)
        if level >= depth or budget[0] <= 0:
            n["more"] = True
            return n
        try:
            prods = model.trace.producers(i)
        except Exception:
            prods = {}
        for pos in sorted(prods):
            p = prods[pos]
            if p is None:
                n["children"].append({"op": None, "input": pos, "children": [], "seen": False})
            elif budget[0] > 0:
                n["children"].append(node(p, pos, level + 1))
        n["more"] = False
        return n

    return node(op, None, 0)


def node_label(model: TraceModel, n: dict[str, Any]) -> Text:
    t = Text()
    if n["input"] is not None:
        t.append(f"in{n['input']} ← ", style="dim")
    i = n["op"]
    if i is None:
        t.append("outside the trace (a parameter, an input)", style="dim")
        return t
    t.append(f"#{i} ", style="bold")
    t.append(shown(short_op(model.index.name[i])))  # strings from the trace: control characters escaped
    mod = model.index.module[i]
    if mod:
        t.append(f"  {shown(mod)}", style="cyan")
    s = model.status[i]
    style = STATUS_MARKUP.get(s, "dim")
    t.append(f"  {s or 'pending'}", style=style)
    r = model.results[i]
    if r is not None:
        err = r.error
        if err:
            t.append(f" {err}", style=style)
    if n.get("seen"):
        t.append("  (above)", style="dim")
    return t


class AncestryScreen(ModalScreen[int | None]):
    """Enter jumps to the op under the cursor; Esc closes."""

    BINDINGS = [Binding("escape,q,g", "cancel", "close")]
    DEFAULT_CSS = """
    AncestryScreen { align: center middle; }
    AncestryScreen > Vertical { width: 95%; height: 90%; border: round $accent; background: $surface; }
    AncestryScreen Tree { height: 1fr; }
    """

    def __init__(self, model: TraceModel, op: int, depth: int = 4,
                 build: Callable[..., dict[str, Any]] = ancestry) -> None:
        super().__init__()
        self.model = model
        self.op = op
        self.tree_data = build(model, op, depth)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(f"ancestry of #{self.op}: where its inputs came from (Enter jumps, Esc closes)")
            tree: Tree[int | None] = Tree(node_label(self.model, self.tree_data), data=self.op, id="ancestry")
            self._fill(tree.root, self.tree_data)
            tree.root.expand_all()
            yield tree

    def _fill(self, parent, n: dict[str, Any]) -> None:
        for c in n["children"]:
            node = parent.add(node_label(self.model, c), data=c["op"], allow_expand=bool(c["children"]))
            self._fill(node, c)

    def on_mount(self) -> None:
        self.query_one(Tree).focus()

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        event.stop()
        if event.node.data is not None:
            self.dismiss(event.node.data)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @property
    def labels(self) -> list[str]:
        """Every node's text, depth-first (for tests)."""
        out = []

        def walk(node, depth):
            out.append("  " * depth + str(node.label))
            for c in node.children:
                walk(c, depth + 1)

        walk(self.query_one(Tree).root, 0)
        return out
