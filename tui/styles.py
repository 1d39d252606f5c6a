"""How the TUI colours an op's replay status, in one place: as Textual markup (the detail pane, the ancestry
screen) and parsed into rich Styles (the op list)."""
from __future__ import annotations

from rich.style import Style

STATUS_MARKUP: dict[str | None, str] = {
    "ok": "green",
    "divergent": "bold red",
    "nondeterministic": "bold magenta",
    "skipped": "dim",
    "error": "yellow",
    None: "dim",  # not replayed (yet)
}
STATUS_STYLE: dict[str | None, Style] = {k: Style.parse(v) for k, v in STATUS_MARKUP.items()}
# A diff pair's own statuses (diff mode's detail pane), over the replay colours.
DIFF_PAIR_MARKUP = {"inherited": "#d9822b", "same": "green"}


def pair_markup(pair_status: object, status: str | None) -> str:
    """The colour of a diff pair's status word: its own, else ``status``'s replay colour."""
    return DIFF_PAIR_MARKUP.get(str(pair_status)) or STATUS_MARKUP.get(status, "dim")
