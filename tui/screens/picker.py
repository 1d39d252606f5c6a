"""Provides OpPicker: a small list of ops to jump to (the producers of inputs, the consumers of outputs)."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option


class OpPicker(ModalScreen[int | None]):
    """Choose one op among ``choices`` (label, op number or None for a line that cannot be chosen)."""

    @property
    def ops(self) -> list[int | None]:
        return [op for _, op in self.choices]

    BINDINGS = [Binding("escape,q", "cancel", "close")]
    DEFAULT_CSS = """
    OpPicker { align: center middle; }
    OpPicker > Vertical { width: 90; max-width: 100%; height: auto; max-height: 80%;
                          border: round $accent; background: $surface; }
    OpPicker OptionList { height: auto; max-height: 30; border: none; }
    """

    def __init__(self, title: str, choices: list[tuple[str, int | None]]) -> None:
        super().__init__()
        self.title_text = title
        self.choices = choices

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.title_text, id="picker-title")
            yield OptionList(*[Option(label, id=f"choice{k}", disabled=op is None)
                               for k, (label, op) in enumerate(self.choices)], id="picker-list")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        first = next((k for k, (_, op) in enumerate(self.choices) if op is not None), None)
        ol.highlighted = first
        ol.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.choices[event.option_index][1])

    def action_cancel(self) -> None:
        self.dismiss(None)
