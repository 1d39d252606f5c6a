"""Provides KEYS: every key of the TUI with what it does (the help screen and the README table both come from it)."""
from __future__ import annotations

KEYS: tuple[tuple[str, str], ...] = (
    ("↑ ↓ j k, PgUp PgDn, Home End", "move in the op list (or click a row)"),
    ("f", "first divergent op"),
    ("n / N", "next / previous divergent op"),
    ("e", "first NaN/Inf origin (finite inputs, non-finite output)"),
    ("p", "producer of an input (asks which when several)"),
    ("c", "consumers of the outputs"),
    ("b", "between a backward op and its forward op"),
    ("g", "ancestry: the producers of the inputs, recursively, with verdicts"),
    ("v", "hide / show views, detaches and other zero-cost ops"),
    ("x", "compiled unit: show / hide kernels and nodes"),
    ("/", "filter rows by op or module name (Esc clears)"),
    ("Enter on a tree node", "narrow the list to that module and phase (the root shows all)"),
    ("Tab", "move focus: op list, module tree, detail pane"),
    ("click on the heat strip", "jump to the worst op of that stretch"),
    ("t", "trend of a multi-step trace, its first change"),
    ("r", "next rank"),
    ("R", "replay again with other settings"),
    ("?", "this help"),
    ("q", "quit"),
)


def markdown_table() -> str:
    """The key table of docs/tui.md, generated here so the help screen and the docs cannot drift apart."""
    def key(k: str) -> str:  # single keys in backticks, descriptive ones ("Enter on a tree node") as they are
        return " / ".join(f"`{p}`" for p in k.split(" / ")) if all(len(p) == 1 for p in k.split(" / ")) else k
    rows = ["| key | what it does |", "|---|---|"] + [f"| {key(k)} | {what} |" for k, what in KEYS]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
