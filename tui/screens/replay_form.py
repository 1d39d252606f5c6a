"""Provides ReplayForm: the settings for a new replay (device, precision, repeat), as the replay's own options."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from replaydiff.replay.policy import PRECISIONS, ReplayOptions


class ReplayForm(ModalScreen[ReplayOptions | None]):
    BINDINGS = [Binding("escape", "cancel", "cancel")]
    DEFAULT_CSS = """
    ReplayForm { align: center middle; }
    ReplayForm > Vertical { width: 60; height: auto; border: round $accent; background: $surface; padding: 0 1; }
    ReplayForm Horizontal { height: auto; }
    ReplayForm .field { width: 12; padding: 1 0 0 0; }
    ReplayForm Input, ReplayForm Select { width: 1fr; }
    ReplayForm #form-error { color: $error; height: auto; }
    """

    def __init__(self, current: ReplayOptions) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("[b]replay again[/] (Enter runs, Esc cancels)")
            with Horizontal():
                yield Label("device", classes="field")
                yield Input(self.current.device, id="form-device", placeholder="cpu or cuda[:N]")
            with Horizontal():
                yield Label("precision", classes="field")
                yield Select([(p, p) for p in PRECISIONS], value=self.current.precision, allow_blank=False,
                             id="form-precision")
            with Horizontal():
                yield Label("repeat", classes="field")
                yield Input(str(self.current.repeat), id="form-repeat", type="integer")
            yield Label("", id="form-error")
            with Horizontal():
                yield Button("Run", id="form-run", variant="primary")
                yield Button("Cancel", id="form-cancel")

    def on_mount(self) -> None:
        self.query_one("#form-device", Input).focus()

    def settings(self) -> ReplayOptions | None:
        device = self.query_one("#form-device", Input).value.strip() or "cpu"
        precision = str(self.query_one("#form-precision", Select).value)
        try:
            repeat = int(self.query_one("#form-repeat", Input).value or "1")
        except ValueError:
            repeat = 0
        if repeat < 1:
            self.query_one("#form-error", Label).update("repeat must be a whole number, at least 1")
            return None
        return ReplayOptions(device, precision, repeat)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._run()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "form-run":
            self._run()
        else:
            self.dismiss(None)

    def _run(self) -> None:
        s = self.settings()
        if s is not None:
            self.dismiss(s)

    def action_cancel(self) -> None:
        self.dismiss(None)
