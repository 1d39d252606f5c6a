"""Provides Navigation, the part of the app that answers keys: walking divergent ops, the op graph (producers,
consumers, ancestry, forward/backward partner), the trend, the filter box, the view, ranks, and the replay form.
"""
from __future__ import annotations

from textual.widgets import Input

from replaydiff.replay.policy import ReplayOptions
from replaydiff.tui.model import short_op
from replaydiff.tui.runs import RunState
from replaydiff.tui.screens.ancestry import AncestryScreen
from replaydiff.tui.screens.help import HelpScreen
from replaydiff.tui.screens.picker import OpPicker
from replaydiff.tui.screens.replay_form import ReplayForm
from replaydiff.tui.screens.trend import TrendScreen
from replaydiff.tui.widgets.op_list import OpList


class Navigation:
    """Mixed into ReplaydiffApp: its ``action_*`` methods (bound in screens/main.py) and the filter box's events."""

    # -- keys -------------------------------------------------------------------------------------------------
    def _jump(self, op: int | None, what: str) -> None:
        if op is None:
            self.notify(f"no {what}" + ("" if self.replay_state in (RunState.DONE, RunState.REPORT) else " (yet)"),
                        timeout=3)
            return
        self.select(op)

    def action_first_divergent(self) -> None:
        self._jump(self.model.first_divergent(), "divergent op")

    def action_next_divergent(self) -> None:
        cur = self.selected_op if self.selected_op is not None else -1
        self._jump(self.model.next_divergent(cur), "next divergent op")

    def action_previous_divergent(self) -> None:
        cur = self.selected_op if self.selected_op is not None else self.model.n
        self._jump(self.model.previous_divergent(cur), "earlier divergent op")

    def action_nonfinite(self) -> None:
        self._jump(self.model.first_nonfinite(), "NaN/Inf origin")

    def action_partner(self) -> None:
        op = self.selected_op
        if op is None:
            return
        m = self.model
        other = m.partner(op)
        kind = "forward op" if m.index.forward[op] is not None else "backward op"
        self._jump(other, f"{kind} linked to #{op}")

    def action_producer(self) -> None:
        op = self.selected_op
        if op is None:
            return
        m = self.model
        with self.trace_lock:
            record = m.trace[op]
            inputs = record.inputs()
            producers = m.trace.producers(op)
        choices = []
        for k, ref in enumerate(inputs):
            p = producers.get(k)
            where = f"#{p} {short_op(m.index.name[p])} {m.status[p] or ''}" if p is not None else "outside the trace"
            choices.append((f"in{k} {ref.describe()}  ← {where}", p))
        inside = [p for _, p in choices if p is not None]
        if not inside:
            self.notify(f"#{op}: no input was produced inside the trace", timeout=3)
        elif len(inside) == 1:
            self.select(inside[0])
        else:
            self.push_screen(OpPicker(f"#{op} {short_op(m.index.name[op])}: go to the producer of", choices),
                             self._picked)

    def action_consumers(self) -> None:
        op = self.selected_op
        if op is None:
            return
        m = self.model
        with self.trace_lock:
            outs = m.trace[op].outputs_refs()
            consumers = m.trace.consumers(op)
        choices: list[tuple[str, int | None]] = []
        for k, ref in enumerate(outs):
            users = consumers.get(k) or []
            choices.append((f"out{k} {ref.describe()}: read by {len(users)} op(s)", None))
            for u in users:
                choices.append((f"   #{u} {short_op(m.index.name[u])}  {m.index.module[u] or ''}  {m.status[u] or ''}",
                                u))
        if not any(u is not None for _, u in choices):
            self.notify(f"#{op}: no op in the trace reads its outputs", timeout=3)
            return
        self.push_screen(OpPicker(f"consumers of #{op} {short_op(m.index.name[op])}", choices), self._picked)

    def action_ancestry(self) -> None:
        op = self.selected_op
        if op is None:
            return
        with self.trace_lock:
            screen = AncestryScreen(self.model, op)
        self.push_screen(screen, self._picked)

    def action_trend(self) -> None:
        """The per-module series of a multi-step trace (recorded with --steps or --flight) and its first change."""
        from replaydiff.trend import NoSteps, NoTrend, compute_trend

        trend = self._trends.get(self.rank)
        if trend is None:
            try:
                with self.trace_lock:
                    trend = compute_trend(self.model.trace)
            except NoSteps:
                self.notify("no trend: this trace has one step (record with --steps or --flight for many)",
                            timeout=4)
                return
            except NoTrend as exc:  # many steps, but nothing to draw (no statistics in the trace)
                self.notify(f"no trend: {exc}", timeout=4)
                return
            self._trends[self.rank] = trend
        self.push_screen(TrendScreen(trend, str(self.trace.path)), self._picked)

    def _picked(self, op: int | None) -> None:
        if op is not None:
            self.select(op)

    def action_goto(self, op: int) -> None:
        self.select(int(op))
        self.main.op_list.focus()

    def action_toggle_cheap(self) -> None:
        cur = self.selected_op
        self.model.set_view(hide_cheap=not self.model.hide_cheap)
        self._after_view_change(cur)

    def action_filter(self) -> None:
        self.main.filter_input.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        """The box echoes each key at once; the rows are filtered when typing pauses (FILTER_DELAY), so a fast typist
        never waits for 100,000 rows to be filtered per character."""
        if event.input.id != "filter":
            return
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self._filter_due = event.value
        self._filter_timer = self.set_timer(self.FILTER_DELAY, self._apply_filter)

    def _apply_filter(self) -> None:
        self._filter_timer = None
        text, self._filter_due = self._filter_due, None
        if text is None or text == self.model.filter_text:
            return
        cur = self.selected_op
        self.model.set_view(filter_text=text)
        self._after_view_change(cur)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            if self._filter_timer is not None:
                self._filter_timer.stop()
                self._apply_filter()
            self.main.op_list.focus()

    def action_clear_view(self) -> None:
        """Esc: drop the filter, then the module scope."""
        m = self.model
        cur = self.selected_op
        if self._filter_timer is not None:
            self._filter_timer.stop()
            self._filter_timer, self._filter_due = None, None
        if m.filter_text or self.main.filter_input.value or self.focused is self.main.filter_input:
            self.main.filter_input.value = ""
            m.set_view(filter_text="")
        elif m.scope is not None:
            m.set_view(scope=None)
        else:
            return
        self._after_view_change(cur)
        self.main.op_list.focus()

    def _after_view_change(self, previous: int | None) -> None:
        ol = self.main.op_list
        ol.refresh_rows()
        if self.model.visible:
            ol.select_op(previous if previous is not None else 0)
        else:
            ol.cursor_row = 0
            ol.post_message(OpList.Selected(None))
        self.update_status()

    def action_next_rank(self) -> None:
        if len(self.ranks) < 2:
            self.notify("this trace has one rank", timeout=3)
            return
        self.rank = self.ranks[(self.ranks.index(self.rank) + 1) % len(self.ranks)]
        m = self.model
        self.main.model = m
        self.main.op_list.set_model(m)
        self.main.heat.set_model(m)
        self.main.tree.set_model(m)
        self.main.op_list.move_to(0)
        self.update_status()

    def action_replay_form(self) -> None:
        self.push_screen(ReplayForm(self.settings), self._replay_chosen)

    def _replay_chosen(self, settings: ReplayOptions | None) -> None:
        if settings is not None:
            self.start_replay(settings)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())
