"""The terminal UI (`replaydiff tui`), driven with Textual's Pilot on a real recorded trace.

The trace is one training step of TinyTransformer with three planted faults (an addmm in the forward pass, the first
LayerNorm backward, and a NaN in the optimizer's last sqrt) on rank 0 and a clean step on rank 1. Every expected op
number is read back from the trace or the replay report, never typed in.
"""
from __future__ import annotations

import asyncio
import functools
import io
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import threading

import pytest
import torch

import replaydiff
from replaydiff.faults import PlantedFault
from replaydiff.models import TinyTransformer, make_step
from replaydiff.replay import ReplayOptions, Status, replay_trace
from replaydiff.report import report_to_json

textual = pytest.importorskip("textual")

from replaydiff.tui.app import ReplaydiffApp, make_app  # noqa: E402
from replaydiff.tui.keys import KEYS  # noqa: E402
from replaydiff.tui.screens.ancestry import AncestryScreen  # noqa: E402
from replaydiff.tui.screens.help import HelpScreen  # noqa: E402
from replaydiff.tui.screens.picker import OpPicker  # noqa: E402
from replaydiff.replay.policy import ReplayOptions  # noqa: E402
from replaydiff.tui.screens.replay_form import ReplayForm  # noqa: E402
from replaydiff.tui.widgets.heat_strip import HeatStrip  # noqa: E402
from replaydiff.tui.widgets.op_list import OpList  # noqa: E402

SIZE = (120, 36)


def sync(fn):
    """Run an async test with asyncio.run (no async plugin needed); pytest still sees its fixtures."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run
PROBLEMS = (Status.DIVERGENT, Status.NONDETERMINISTIC)


def _record(out, rank: int, faults: list[PlantedFault]) -> None:
    saved = os.environ.get("RANK")
    os.environ["RANK"] = str(rank)
    try:
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = make_step(model, model.example_batch(), opt)
        modes = list(faults) + [replaydiff.record(out)]
        for m in modes:
            m.__enter__()
        try:
            step()
        finally:
            for m in reversed(modes):
                m.__exit__(None, None, None)
    finally:
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved
    assert all(f.planted for f in faults)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(trace path, replay report) of the two-rank trace described at the top."""
    out = tmp_path_factory.mktemp("tui") / "trace"
    _record(out, 0, [PlantedFault("aten.addmm.default", rel=1e-3, call=2),
                     PlantedFault("aten.native_layer_norm_backward.default", rel=1e-3),
                     PlantedFault("aten.sqrt.default", rel=float("nan"), call=29)])
    _record(out, 1, [])
    report = replay_trace(str(out), ReplayOptions())
    return out, report


def problems(report, rank: int = 0) -> list[int]:
    return [r.index for r in report.ops if r.rank == rank and r.status in PROBLEMS]


def planted_backward(report):
    """The planted LayerNorm backward's result (a divergent backward op)."""
    return next(r for r in report.ops if r.rank == 0 and r.op == "aten.native_layer_norm_backward.default"
                and r.status is Status.DIVERGENT)


def new_app(traced, **kw) -> ReplaydiffApp:
    path, report = traced
    kw.setdefault("report", report)
    return ReplaydiffApp(replaydiff.open_trace(path), **kw)


async def settle(app, pilot) -> None:
    await pilot.pause()
    await app.workers_done()
    await pilot.pause()


async def press(app, pilot, *keys: str) -> None:
    for k in keys:
        await pilot.press(k)
        await settle(app, pilot)


# -- opening ---------------------------------------------------------------------------------------------------
@sync
async def test_opens_on_the_first_op_with_rows_coloured_from_the_report(traced):
    path, report = traced
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        rank0 = replaydiff.open_trace(path).rank(0)
        assert app.selected_op == 0
        assert app.model.visible == list(range(len(rank0)))
        expected = {r.index: r.status.value for r in report.ops if r.rank == 0}
        assert {i: s for i, s in enumerate(app.model.status) if s is not None} == expected
        assert f"#0 {rank0[0].name}" in app.main.detail.text
        status = str(app.main.query_one("#status").visual)
        assert f"{len(problems(report))} divergent" in status


@sync
async def test_with_a_json_report_the_rows_take_its_verdicts(traced, tmp_path):
    path, report = traced
    report_file = tmp_path / "report.json"
    report_file.write_text(json.dumps(report_to_json(report)))
    app = make_app(path, report_path=report_file)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.replay_state == "report"
        assert app.model.divergent == problems(report)
        await press(app, pilot, "f")
        assert app.selected_op == problems(report)[0]


# -- divergent ops ---------------------------------------------------------------------------------------------
@sync
async def test_f_n_N_walk_the_divergent_ops(traced):
    _, report = traced
    bad = problems(report)
    assert len(bad) == 3
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "f")
        assert app.selected_op == bad[0]
        seen = [app.selected_op]
        for _ in range(len(bad)):
            await press(app, pilot, "n")
            seen.append(app.selected_op)
        assert seen == bad + [bad[-1]]  # past the last one it stays (and says so)
        await press(app, pilot, "N")
        assert app.selected_op == bad[-2]
        await press(app, pilot, "N", "N")
        assert app.selected_op == bad[0]
        # the op list's cursor row and the heat strip's marker follow the selection
        assert app.main.op_list.cursor_row == app.model.row_of(bad[0])
        assert app.main.heat.selected == bad[0]


@sync
async def test_e_jumps_to_the_nan_origin(traced):
    _, report = traced
    origin = report.nonfinite_origin
    assert origin is not None and origin.op == "aten.sqrt.default"
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "e")
        assert app.selected_op == origin.index
        assert "NaN/Inf origin" in app.main.detail.text


@sync
async def test_the_detail_pane_of_a_divergent_op(traced):
    path, report = traced
    r0 = replaydiff.open_trace(path).rank(0)
    op = r0[planted_backward(report).index]
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "f", "n")
        assert app.selected_op == op.index
        text = app.main.detail.text
        assert f"#{op.index} {op.name}" in text
        assert op.schema and op.schema in text.replace("\n", "")
        assert "DIVERGENT" in text and "limit 16" in text
        # every input with its shape, stride and producer
        producers = r0.producers(op.index)
        for k, ref in enumerate(op.inputs()):
            line = next(ln for ln in text.splitlines() if f"in{k} {ref.describe()}" in ln)
            assert f"stride {tuple(ref.stride)}" in line
            assert (f"← #{producers[k]}" if producers[k] is not None else "outside the trace") in line
        # every output with statistics and consumers
        consumers = r0.consumers(op.index)
        for k, ref in enumerate(op.outputs_refs()):
            assert f"out{k} {ref.describe()}" in text
            for c in consumers.get(k, [])[:6]:
                assert f"#{c}" in text
        assert "min " in text and "absmax " in text and "NaN 0" in text
        # the forward op's source line, with the code around it
        fwd_source = r0.index.source[op.forward_index]
        assert fwd_source in text and "backward() called at" in text
        lineno = int(fwd_source.rsplit(":", 1)[1])
        assert f"> {lineno:5d} │" in text.replace(">", "> ", 1) or f">{lineno:5d} │" in text
        # the element-wise error histogram, from replaying the op alone: a 1e-3 fault is 1e3-1e4 eps·absmax
        assert "element-wise error" in text
        hist = {ln.split()[0]: int(ln.split()[-1]) for ln in text.splitlines()
                if ln.strip() and ln.split()[0] in ("0", "<1", "1-10", "10-100", "1e2-1e3", "1e3-1e4")}
        assert sum(hist.values()) == op.outputs_refs()[0].stats.numel if op.outputs_refs()[0].stats else True
        assert hist["1e3-1e4"] + hist["1e2-1e3"] > 0


def test_the_detail_pane_shows_the_recorded_line_and_warns_when_the_file_changed(tmp_path, monkeypatch):
    """Only the trace's own text of the line is shown: the file on this disk is never displayed (a received trace
    may name any file), only said to have changed (read only inside the working directory: the user's project)."""
    from replaydiff.tui.details import op_markup

    user = tmp_path / "train_loop.py"
    user.write_text("import torch\n\n\ndef work(x):\n    y = torch.mul(x, 3)\n    return y + 1\n")
    spec = importlib.util.spec_from_file_location("train_loop", user)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    x = torch.arange(4.0)
    with replaydiff.record(tmp_path / "t"):
        mod.work(x)
    monkeypatch.chdir(tmp_path)  # the user's project: the only place a trace's named files are read
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    statuses = [None] * len(r)
    recorded = ">    5 │ y = torch.mul(x, 3)[/]  [dim](as recorded)[/]"
    text = op_markup(r, 0, None, statuses)
    assert recorded in text and "changed" not in text
    # Two lines added above: the pane warns and shows the recorded text; no line of today's file.
    user.write_text("import torch\nimport math\n\n\n\ndef work(x):\n    y = torch.mul(x, 3)\n    return y + 1\n")
    text = op_markup(r, 0, None, statuses)
    assert f"{user} has changed since it was recorded; the recorded line is now line 7" in text
    assert recorded in text
    assert "import math" not in text and "    7 │" not in text
    # No file here (the trace read on another machine): the recorded text alone.
    user.unlink()
    text = op_markup(r, 0, None, statuses)
    assert recorded in text


# -- the op graph ----------------------------------------------------------------------------------------------
@sync
async def test_b_goes_between_a_backward_op_and_its_forward_op(traced):
    path, report = traced
    r0 = replaydiff.open_trace(path).rank(0)
    first = planted_backward(report)
    fwd = r0[first.index].forward_index
    assert fwd is not None
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.select(first.index)
        await settle(app, pilot)
        await press(app, pilot, "b")
        assert app.selected_op == fwd
        backward_of_fwd = [i for i in range(len(r0)) if r0.index.forward[i] == fwd]
        await press(app, pilot, "b")
        assert app.selected_op == backward_of_fwd[0]


@sync
async def test_p_jumps_to_the_producer_of_an_input(traced):
    path, report = traced
    r0 = replaydiff.open_trace(path).rank(0)
    ix = r0.index
    single = next(i for i in range(len(r0)) if [p for p in r0.producers(i).values() if p is not None].__len__() == 1)
    several = planted_backward(report).index
    prods = r0.producers(several)
    assert len([p for p in prods.values() if p is not None]) > 1
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.select(single)
        await settle(app, pilot)
        await press(app, pilot, "p")
        assert app.selected_op == next(p for p in r0.producers(single).values() if p is not None)
        # several inputs from inside the trace: a picker lists them all, Enter takes the highlighted one
        app.select(several)
        await settle(app, pilot)
        await press(app, pilot, "p")
        assert isinstance(app.screen, OpPicker)
        labels = [str(o.prompt) for o in app.screen.query_one("OptionList").options]
        assert len(labels) == len(prods)
        for k, p in prods.items():
            assert labels[k].startswith(f"in{k} ")
            assert (f"#{p} " in labels[k]) if p is not None else "outside the trace" in labels[k]
        await press(app, pilot, "down", "enter")
        second = [p for p in prods.values() if p is not None][1]
        assert app.selected_op == second
        assert ix.name[second] in app.main.detail.text


@sync
async def test_c_lists_the_consumers_of_the_outputs(traced):
    path, report = traced
    r0 = replaydiff.open_trace(path).rank(0)
    op = planted_backward(report).index
    consumers = r0.consumers(op)
    users = [u for k in sorted(consumers) for u in consumers[k]]
    assert users
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.select(op)
        await settle(app, pilot)
        await press(app, pilot, "c")
        assert isinstance(app.screen, OpPicker)
        assert [op for op in app.screen.ops if op is not None] == users
        await press(app, pilot, "enter")
        assert app.selected_op == users[0]


@sync
async def test_g_shows_the_ancestry_and_enter_walks_to_an_ancestor(traced):
    path, report = traced
    r0 = replaydiff.open_trace(path).rank(0)
    op = planted_backward(report).index
    prods = r0.producers(op)
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.select(op)
        await settle(app, pilot)
        await press(app, pilot, "g")
        screen = app.screen
        assert isinstance(screen, AncestryScreen)
        labels = screen.labels
        assert labels[0].startswith(f"#{op} ") and "divergent" in labels[0]
        children = [ln.strip() for ln in labels if ln.startswith("  ") and not ln.startswith("    ")]
        assert len(children) == len(prods)
        for k, p in prods.items():
            assert children[k].startswith(f"in{k} ← " + (f"#{p} " if p is not None else "outside the trace"))
        # grandparents are there too, with their verdicts
        gp = r0.producers(prods[0])
        assert any(ln.strip().startswith(f"in0 ← #{gp[0]} ") for ln in labels if ln.startswith("    "))
        await press(app, pilot, "down", "enter")
        assert app.selected_op == prods[0]
        assert not isinstance(app.screen, AncestryScreen)


# -- what is listed ---------------------------------------------------------------------------------------------
@sync
async def test_v_hides_views_and_other_zero_cost_ops(traced):
    path, _ = traced
    ix = replaydiff.open_trace(path).rank(0).index
    n = len(ix)
    cheap = [i for i in range(n) if ix.cheap[i]]
    assert cheap
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "v")
        assert app.model.visible == [i for i in range(n) if not ix.cheap[i]]
        await press(app, pilot, "v")
        assert app.model.visible == list(range(n))


@sync
async def test_slash_filter_keeps_only_matching_rows_and_escape_clears_it(traced):
    path, _ = traced
    ix = replaydiff.open_trace(path).rank(0).index
    n = len(ix)
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("slash", *"layer_norm")
        await settle(app, pilot)
        expected = [i for i in range(n) if "layer_norm" in ix.name[i]]
        assert expected and app.model.visible == expected
        await press(app, pilot, "enter")
        assert app.focused is app.main.op_list
        assert app.selected_op in expected
        # module names match too
        await pilot.press("slash", *["backspace"] * 10, *"ln_f")
        await settle(app, pilot)
        assert app.model.visible == [i for i in range(n) if "ln_f" in (ix.module[i] or "") or "ln_f" in ix.name[i]]
        await press(app, pilot, "escape", "escape")
        assert app.model.visible == list(range(n))


@sync
async def test_choosing_a_module_in_the_tree_narrows_the_list(traced):
    path, report = traced
    ix = replaydiff.open_trace(path).rank(0).index
    n = len(ix)
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        tree = app.main.tree
        node = tree.node_for("backward", "TinyTransformer.ln_f")
        tree.focus()
        tree.move_cursor(node)
        await press(app, pilot, "enter")
        expected = [i for i in range(n) if ix.phase[i] == "backward"
                    and (ix.module[i] or "").startswith("TinyTransformer.ln_f")]
        assert app.model.visible == expected
        # the node shows the module's worst error: the planted LayerNorm backward
        assert planted_backward(report).index in expected
        assert "×" in str(node.label) and node.data.worst >= 1.0
        await press(app, pilot, "escape")
        assert app.model.visible == list(range(n))


# -- mouse --------------------------------------------------------------------------------------------------------
@sync
async def test_clicking_the_heat_strip_jumps_to_the_worst_op_of_that_stretch(traced):
    _, report = traced
    target = report.first_divergent.index
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        x = app.main.heat.cell_of(target)
        await pilot.click(HeatStrip, offset=(x, 1))
        await settle(app, pilot)
        assert app.selected_op == target


@sync
async def test_clicking_a_row_selects_it(traced):
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.click(OpList, offset=(10, 4))  # the header is line 0: line 4 shows the 4th row
        await settle(app, pilot)
        assert app.selected_op == app.model.visible[3]


# -- ranks, replay, help, quit ---------------------------------------------------------------------------------------
@sync
async def test_r_moves_to_the_next_rank(traced):
    path, report = traced
    n1 = len(replaydiff.open_trace(path).rank(1))
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "r")
        assert app.rank == 1 and app.model.n == n1
        assert app.model.status == [r.status.value for r in report.ops if r.rank == 1]
        assert app.model.divergent == []  # the clean rank
        assert "rank 1 (2/2)" in str(app.main.query_one("#status").visual)
        await press(app, pilot, "r")
        assert app.rank == 0


def _gated_runner(report, calls: list, gate: threading.Event, half: threading.Event):
    """A replay that hands over the report's results one by one and waits at half of rank 0's for ``gate``."""
    def run(path, settings, progress_total=None, progress=None, on_result=None):
        calls.append(settings)
        ops = [r for r in report.ops]
        progress_total(len(ops))
        halfway = sum(r.rank == 0 for r in ops) // 2
        for k, r in enumerate(ops):
            if k == halfway:
                half.set()
                assert gate.wait(30)
            on_result(r)
            progress(1)
        return report
    return run


@sync
async def test_background_replay_colours_rows_as_results_arrive_and_keys_still_work(traced):
    _, report = traced
    calls: list = []
    gate, half = threading.Event(), threading.Event()
    app = new_app(traced, report=None, replay=ReplayOptions(), runner=_gated_runner(report, calls, gate, half))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        try:
            for _ in range(100):
                if half.is_set() and sum(s is not None for s in app.model.status) >= app.model.n // 2:
                    break
                await pilot.pause(0.05)
            await _check_while_running(app, pilot)
        finally:
            gate.set()
        await app.workers_done(replay=True)
        await settle(app, pilot)
        assert app.replay_state == "done"
        assert not app.main.query_one("#progress").display
        assert app.model.divergent == problems(report)
        assert calls == [ReplayOptions("cpu", "fp64", 1)]


async def _check_while_running(app, pilot) -> None:
    assert app.replay_state == "running"
    assert app.main.query_one("#progress").display
    coloured = sum(s is not None for s in app.model.status)
    assert 0 < coloured < app.model.n
    await press(app, pilot, "j", "j")  # the UI answers while the replay runs
    assert app.selected_op == 2


@sync
async def test_the_default_replay_runs_in_the_background_at_fp64_on_the_cpu(traced):
    _, report = traced
    app = new_app(traced, report=None, replay=ReplayOptions())
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await app.workers_done(replay=True)
        await settle(app, pilot)
        assert app.replay_state == "done"
        assert app.model.status == [r.status.value for r in report.ops if r.rank == 0]
        assert app.model.first_nonfinite() == report.nonfinite_origin.index


def test_a_replay_in_a_worker_process_gives_the_same_report_shard_by_shard(traced, monkeypatch):
    """Big traces replay in a worker process (keeping the UI's GIL free); results arrive shard by shard."""
    from replaydiff.tui import replay_runner

    path, report = traced
    monkeypatch.setattr(replay_runner, "SHARD_OPS", 300)
    seen, total = [], []
    replay_runner.prepare()
    got = replay_runner.replay_in_background(str(path), ReplayOptions(), progress_total=total.append,
                                             on_result=seen.append)
    assert total == [len(report.ops)]
    assert [(r.rank, r.index, r.status) for r in seen] == [(r.rank, r.index, r.status) for r in report.ops]
    assert [(r.rank, r.index, r.status, r.reason) for r in got.ops] == \
        [(r.rank, r.index, r.status, r.reason) for r in report.ops]


@sync
async def test_R_replays_again_with_settings_from_the_form(traced):
    _, report = traced
    calls: list = []
    gate, half = threading.Event(), threading.Event()
    gate.set()
    app = new_app(traced, runner=_gated_runner(report, calls, gate, half))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert calls == []  # a report was given: nothing replays until asked
        await press(app, pilot, "R")
        form = app.screen
        assert isinstance(form, ReplayForm)
        form.query_one("#form-precision").value = "fp32"
        await press(app, pilot, "enter")  # Enter in the device box runs
        await app.workers_done(replay=True)
        await settle(app, pilot)
        assert calls == [ReplayOptions("cpu", "fp32", 1)]
        assert app.replay_state == "done" and app.model.divergent == problems(report)


@sync
async def test_question_mark_lists_every_key(traced):
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "question_mark")
        assert isinstance(app.screen, HelpScreen)
        shown = [k for k, _ in KEYS]
        for key in ("f", "n / N", "e", "p", "c", "b", "g", "v", "/", "r", "R", "?", "q"):
            assert key in shown
        # every key the main screen binds is in the help (Esc is described with the filter and the tree)
        names = {"slash": "/", "question_mark": "?"}
        for binding in [*app.main.BINDINGS, *app.BINDINGS]:
            key = names.get(binding.key, binding.key)
            assert binding.key == "escape" or any(key in k.split(" / ") or key == k for k in shown), key
        await press(app, pilot, "escape")
        assert not isinstance(app.screen, HelpScreen)


@sync
async def test_q_quits(traced):
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0 and not app.is_running


# -- CLI and import hygiene -------------------------------------------------------------------------------------------
def test_cli_unreadable_trace_is_exit_3_and_a_missing_device_exit_4(traced, tmp_path):
    from replaydiff.cli.main import main

    assert main(["tui", str(tmp_path / "nothing-here")]) == 3
    if not torch.cuda.is_available():
        assert main(["tui", str(traced[0]), "--device", "cuda"]) == 4
    assert main(["tui", str(traced[0]), "--device", "nonsense"]) == 2



def test_cli_without_a_terminal_is_a_usage_error(traced, capsys):
    """`replaydiff tui TRACE < /dev/null > file` wrote escape codes into the file until killed."""
    from replaydiff.cli.main import main

    assert main(["tui", str(traced[0])]) == 2  # pytest's stdin/stdout are not terminals
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "replaydiff: error: tui needs a terminal: its standard input and output must both be one (for a report in a "
        "file or pipe: replaydiff replay TRACE, or show TRACE --list)"]

def test_replaydiff_never_imports_textual_or_tui_until_the_ui_starts():
    code = ("import sys, replaydiff, replaydiff.cli.main, replaydiff.cli.tui, replaydiff.replay, replaydiff.report; "
            "p = replaydiff.cli.main.build_parser(); p.parse_args(['tui', 'x']); "
            "import replaydiff.tui.model, replaydiff.tui.details, replaydiff.tui.keys; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'textual'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.strip()
    assert out == "[]"


# -- snapshots (pytest-textual-snapshot; `pytest --snapshot-update` after reviewing the report) -----------------------
SNAP_SIZE = (110, 32)


def steady_report(report):
    """The report with every measured figure replaced by a fixed one (divergent ops 8390 eps·absmax, the others
    0.5), so that a picture does not change with the CPU's fp32 rounding; statuses and NaN counts are kept."""
    from dataclasses import replace

    from replaydiff.compare.verdict import Verdict

    ops = []
    for r in report.ops:
        m = r.metrics
        if m is not None and "norm_max" in m:
            bad = r.status is Status.DIVERGENT
            fixed = {"max_abs": 1e-3 if bad else 6e-8, "rel_l2": 1e-3 if bad else 3e-8,
                     "norm_max": 8390.0 if bad else 0.5, "norm_rel": 8389.0 if bad else 0.25, "cosine": 1.0,
                     "nonfinite_mismatch": m.get("nonfinite_mismatch", 0), "limit_max": 16.0, "limit_rel": 8.0}
            r = replace(r, verdict=Verdict.from_json(fixed, bad), reason="planted fault" if bad else r.reason)
        ops.append(r)
    return replace(report, ops=ops)


def snap_app(traced) -> ReplaydiffApp:
    path, report = traced
    return ReplaydiffApp(replaydiff.open_trace(path), report=steady_report(report))


async def _steady_tree(pilot) -> None:
    """Collapse the backward phase in the module tree: which of the two embeddings a backward ``detach`` is
    attributed to changes from one recording process to the next (a recorder quirk), and with it their counts."""
    app = pilot.app
    await settle(app, pilot)
    node = app.main.tree.node_for("backward", "")
    node.collapse()
    await settle(app, pilot)


async def _to_planted_backward(pilot) -> None:
    app = pilot.app
    await _steady_tree(pilot)
    await press(app, pilot, "f", "n")


def test_snapshot_main_screen_at_a_divergent_backward_op(traced, snap_compare):
    assert snap_compare(snap_app(traced), terminal_size=SNAP_SIZE, run_before=_to_planted_backward)


def test_snapshot_ancestry_of_a_divergent_op(traced, snap_compare):
    async def run_before(pilot):
        await _to_planted_backward(pilot)
        await press(pilot.app, pilot, "g")

    assert snap_compare(snap_app(traced), terminal_size=SNAP_SIZE, run_before=run_before)


def test_snapshot_help(traced, snap_compare):
    async def run_before(pilot):
        await _steady_tree(pilot)
        await press(pilot.app, pilot, "question_mark")

    assert snap_compare(snap_app(traced), terminal_size=SNAP_SIZE, run_before=run_before)


# -- diff mode (replaydiff tui TARGET --diff REF) ----------------------------------------------------------------
LN_BACKWARD = "aten.native_layer_norm_backward.default"


@pytest.fixture(scope="module")
def diffed(tmp_path_factory):
    """(reference, target): two recordings of the same step; the target's LayerNorm backward carries a fault."""
    d = tmp_path_factory.mktemp("tui-diff")
    _record(d / "ref", 0, [])
    _record(d / "target", 0, [PlantedFault(LN_BACKWARD, rel=1e-3)])
    return d / "ref", d / "target"


def _row_text(app, op: int) -> str:
    """The op list's row of ``op`` as drawn (it must be on screen)."""
    ol = app.main.op_list
    return ol.render_line(ol.model.row_of(op) - int(ol.scroll_y) + 1).text


@sync
async def test_diff_mode_f_selects_the_planted_op_and_later_ops_are_marked_inherited(diffed):
    ref, target = diffed
    planted = next(op.index for op in replaydiff.open_trace(target).rank(0) if op.name == LN_BACKWARD)
    app = make_app(target, diff_ref=ref)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await app.workers_done(replay=True)
        await settle(app, pilot)
        assert app.replay_state == "done" and app.diff_report is not None
        rd, first = app.diff_report.first_divergent
        assert first.target == planted
        assert app.model.divergent == [planted]  # f/n/N walk the divergent pairs only
        status = str(app.main.query_one("#status").visual)
        assert f"diff against {ref}: 1 divergent" in status
        await press(app, pilot, "f")
        assert app.selected_op == planted
        text = app.main.detail.text
        assert f"DIVERGENT  aligned with reference op ref #{first.ref} (rank 0)" in text
        assert "evidence: full tensors; inputs agree" in text
        assert "DIVERG" in _row_text(app, planted)
        await press(app, pilot, "n")  # the only divergent pair: n stays
        assert app.selected_op == planted
        later = [p for p in rd.pairs if str(p.status) == "inherited"]
        assert later and all(p.target > planted for p in later)
        pair = later[0]
        assert app.model.status[pair.target] == "inherited"
        app.select(pair.target)
        await settle(app, pilot)
        assert "inher" in _row_text(app, pair.target)
        text = app.main.detail.text
        assert f"INHERITED  aligned with reference op ref #{pair.ref}" in text
        assert f"inherited from {pair.inherited_from.describe()}" in text


def test_cli_diff_and_replay_together_is_a_usage_error(diffed, tmp_path):
    from replaydiff.cli.main import main

    ref, target = diffed
    assert main(["tui", str(target), "--diff", str(ref), "--replay", str(tmp_path / "r.json")]) == 2
    assert main(["tui", str(target), "--diff", str(tmp_path / "missing")]) == 3


def _record_fn(out, fn) -> None:
    x = torch.arange(8, dtype=torch.float32)
    with replaydiff.record(out):
        fn(x)


@sync
async def test_diff_mode_marks_ops_present_in_the_target_only(tmp_path):
    _record_fn(tmp_path / "ref", lambda x: (x * 2).sum())
    _record_fn(tmp_path / "target", lambda x: (x * 2).exp().sum())
    extra = [op.index for op in replaydiff.open_trace(tmp_path / "target").rank(0) if op.name == "aten.exp.default"]
    app = make_app(tmp_path / "target", diff_ref=tmp_path / "ref")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await app.workers_done(replay=True)
        await settle(app, pilot)
        assert app.diff_report.ranks[0].target_only_ops == frozenset(extra) and len(extra) == 1
        assert [i for i, s in enumerate(app.model.status) if s == "target_only"] == extra
        app.select(extra[0])
        await settle(app, pilot)
        assert "T-only" in _row_text(app, extra[0])
        assert "TARGET ONLY  no aligned op in the reference" in app.main.detail.text
        assert "0 divergent" in str(app.main.query_one("#status").visual)
        assert "1 target-only" in str(app.main.query_one("#status").visual)


def _mlp_step(out, compiled: bool) -> None:
    """One recorded step of a small MLP, eager or compiled with aot_eager (compiled inside the recording; callers
    reset dynamo after, so that no later test's module reuses this one's compiled code)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    f = torch.compile(model, backend="aot_eager") if compiled else model
    with replaydiff.record(out):
        f(x).square().mean().backward()


@pytest.fixture
def eager_and_faulty_unit(tmp_path, monkeypatch):
    """(eager trace, compiled trace): the compiled one's aot_eager graph scales each gelu by 1 + 1e-3 (a compiler
    bug: the graph stored in the unit is the right one)."""
    from tests.replay_helpers import faulty_gelu_pass

    _mlp_step(tmp_path / "eager", False)
    faulty_gelu_pass(monkeypatch)
    torch._dynamo.reset()
    _mlp_step(tmp_path / "compiled", True)
    torch._dynamo.reset()
    yield tmp_path / "eager", tmp_path / "compiled"
    torch._dynamo.reset()  # no graph compiled by the faulty pass (the diff recompiles the unit) outlives the test


@pytest.mark.parametrize("unit_side", ["target", "ref"])
@sync
async def test_diff_mode_shows_a_compiled_unit_paired_with_eager_ops_as_diff_prints_it(eager_and_faulty_unit,
                                                                                      unit_side):
    """A compiled unit on one side, the eager ops of its region on the other: f selects the row where they part
    (the unit in the target, or the target's eager op the node stands for), whose detail is the unit pair as
    `replaydiff diff` prints it, with the unit's nodes and kernels when the unit is the target's."""
    from replaydiff.report.diff_text import unit_pair_lines

    eager, compiled = eager_and_faulty_unit
    ref, target = (eager, compiled) if unit_side == "target" else (compiled, eager)
    app = make_app(target, diff_ref=ref)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await app.workers_done(replay=True)
        await settle(app, pilot)
        (unit,) = [u for u in app.diff_report.ranks[0].units if u.op == "compiled.unit.forward"]
        assert str(unit.status) == "divergent" and unit.part is not None and unit.side == unit_side
        row = unit.unit if unit_side == "target" else unit.part.eager
        assert app.model.divergent == [row]
        assert "1 divergent" in str(app.main.query_one("#status").visual)
        await press(app, pilot, "f")
        assert app.selected_op == row and "DIVERG" in _row_text(app, row)
        text = app.main.detail.text
        for line in unit_pair_lines(unit):
            assert line in text, (line, text)
        assert "they part at node gelu (aten.gelu.default) in Sequential.1 (GELU)" in text
        if unit_side == "target":
            assert "gelu = aten.gelu.default" in text  # the unit expanded: its nodes
        else:  # the other eager ops of the region: compared as part of the unit, not one by one
            other = next(i for i in unit.eager if i != row)
            assert app.model.status[other] == "skipped" and app.model.severity[other] is None  # no heat
            app.select(other)
            await settle(app, pilot)
            assert f"compiled unit ref #{unit.unit}" in app.main.detail.text


@sync
async def test_x_expands_a_compiled_unit_in_the_op_list_to_its_nodes_and_collapses_it(tmp_path):
    _mlp_step(tmp_path / "t", compiled=True)
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    fw = next(op for op in r if op.name == "compiled.unit.forward")
    calls = fw.unit.calls()
    app = ReplaydiffApp(replaydiff.open_trace(tmp_path / "t"))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        ol = app.main.op_list
        n = ol.row_count
        app.select(fw.index)
        await settle(app, pilot)
        await press(app, pilot, "x")
        assert ol.row_count == n + len(calls)  # aot_eager names no kernels: a row per node
        row = ol.model.row_of(fw.index) + 1 - int(ol.scroll_y)
        lines = [ol.render_line(row + 1 + k).text for k in range(len(calls))]
        assert [line.split("├ ")[-1].split("└ ")[-1].rstrip() for line in lines] == [
            f"{c.name} = {c.target}  {c.module}" if c.module else f"{c.name} = {c.target}" for c in calls]
        await press(app, pilot, "j", "j")  # onto the unit's node rows: the unit stays selected
        assert app.selected_op == fw.index and "compiled unit" in app.main.detail.text
        last = len(r) - 1  # jumps land on their op's own row past the expanded unit
        app.select(last)
        await settle(app, pilot)
        assert app.selected_op == last and ol.entry(ol.cursor_row) == (last, -1)
        app.select(fw.index)
        await settle(app, pilot)
        await press(app, pilot, "x")
        assert ol.row_count == n and app.selected_op == fw.index
        nxt = fw.index + 1  # after collapsing, rows are ops again
        await press(app, pilot, "j")
        assert app.selected_op == nxt
        await press(app, pilot, "x")  # not a unit: nothing expands
        assert ol.row_count == n
    torch._dynamo.reset()


# -- trend of a multi-step trace (t) ------------------------------------------------------------------------------
PLANT_STEP = 8  # of 12 recorded steps: a weight is multiplied by 100 just before this step's forward


@pytest.fixture(scope="module")
def multistep(tmp_path_factory):
    """(trace path, path of the changed module): a 12-step statistics trace of the tiny transformer whose first MLP
    weight in block 1 is x100 from step 8."""
    out = tmp_path_factory.mktemp("tui-trend") / "trace"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second intra-op thread costs more than it saves on a shared machine
    try:
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = make_step(model, model.example_batch(), opt)
        with replaydiff.record(out, tensors="stats", steps="1-12"):
            for k in range(1, 13):
                if k == PLANT_STEP:
                    with torch.no_grad():
                        model.blocks[1].mlp[0].weight.mul_(100.0)
                step()
    finally:
        torch.set_num_threads(before)
    changed = next(n for n, m in model.named_modules(prefix=type(model).__name__) if m is model.blocks[1].mlp[0])
    return out, changed


@sync
async def test_t_shows_the_trend_and_enter_on_the_first_change_selects_its_op(multistep):
    from replaydiff.trend import compute_trend
    from replaydiff.tui.screens.trend import TrendScreen

    path, changed = multistep
    r = replaydiff.open_trace(path).rank(0)
    change = compute_trend(r).first_change
    assert change is not None and (change.step, change.module) == (PLANT_STEP, changed)
    app = ReplaydiffApp(replaydiff.open_trace(path))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "t")
        screen = app.screen
        assert isinstance(screen, TrendScreen)
        top = screen.text.splitlines()[0]
        assert f"step {change.step}, module {change.module}, op #{change.index}" in top
        # one row per module series, the changed module's marked
        assert f"*{change.module}" in screen.text
        await press(app, pilot, "enter")
        assert not isinstance(app.screen, TrendScreen)
        assert app.selected_op == change.index
        assert (r[change.index].step, r[change.index].module) == (change.step, change.module)
        # j jumps as well, from anywhere in the screen
        app.select(0)
        await press(app, pilot, "t", "down", "down", "j")
        assert app.selected_op == change.index


@sync
async def test_t_on_a_single_step_trace_says_there_is_no_trend(traced):
    from replaydiff.tui.screens.trend import TrendScreen

    app = new_app(traced)
    said: list[str] = []
    app.notify = lambda message, **kw: said.append(str(message))  # type: ignore[method-assign]
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "t")
        assert not isinstance(app.screen, TrendScreen)
        assert len(said) == 1 and said[0].startswith("no trend: this trace has one step")


@sync
async def test_R_during_a_diff_leaves_the_new_replay_s_progress_to_the_new_replay(diffed, monkeypatch):
    """An old worker that keeps running after R (a diff, here) must not move the new replay's progress bar."""
    import types

    import replaydiff.diff

    ref, target = diffed
    diff_started, diff_gate, diff_posted = threading.Event(), threading.Event(), threading.Event()
    replay_half, replay_gate = threading.Event(), threading.Event()

    def slow_diff(ref_path, target_path, progress_total=None, progress=None, **kw):
        progress_total(7)
        diff_started.set()
        assert diff_gate.wait(30)
        try:  # the old diff goes on reporting after R replaced it
            progress_total(1000)
            progress(500)
        finally:
            diff_posted.set()
        raise RuntimeError("the old diff's failure")

    def runner(path, settings, progress_total=None, progress=None, on_result=None):
        progress_total(10)
        progress(3)
        replay_half.set()
        assert replay_gate.wait(30)
        progress(7)
        return types.SimpleNamespace(ops=[])

    monkeypatch.setattr(replaydiff.diff, "diff_traces", slow_diff)
    app = ReplaydiffApp(replaydiff.open_trace(target), diff=ref, runner=runner)
    bar = None
    async with app.run_test(size=SIZE) as pilot:
        try:
            await pilot.pause()
            assert await asyncio.to_thread(diff_started.wait, 30)
            await press(app, pilot, "R")
            assert isinstance(app.screen, ReplayForm)
            await press(app, pilot, "enter")
            assert await asyncio.to_thread(replay_half.wait, 30)
            diff_gate.set()
            assert await asyncio.to_thread(diff_posted.wait, 30)
            for _ in range(4):
                await pilot.pause(0.05)
            bar = app.main.query_one("#progress")
            assert app.replay_state == "running" and app.diff_ref is None
            assert (bar.total, bar.progress) == (10, 3)
            assert "replay failed" not in str(app.main.query_one("#status").visual)
        finally:
            diff_gate.set()
            replay_gate.set()
        await app.workers_done(replay=True)
        await settle(app, pilot)
        assert app.replay_state == "done"


def test_the_model_holds_rows_as_replaydiff_s_statuses_and_a_string_names_the_same_member(traced):
    from replaydiff.diff.result import PairStatus
    from replaydiff.tui.model import Presence, TraceModel, row_status

    path, report = traced
    model = TraceModel(replaydiff.open_trace(path).rank(0))
    model.add_results(report.ops)
    assert model.status == [r.status for r in report.ops if r.rank == 0]
    assert all(type(s) is Status for s in model.status)
    assert model.counts()["divergent"] == len(problems(report))
    assert [row_status(s) for s in ("ok", "divergent", "inherited", "target_only", None)] == \
        [Status.OK, Status.DIVERGENT, PairStatus.INHERITED, Presence.TARGET_ONLY, None]


def test_replay_and_diff_rows_are_one_row_type(traced, diffed):
    from replaydiff.diff import diff_traces
    from replaydiff.diff.result import PairStatus
    from replaydiff.tui.diff_mode import diff_results
    from replaydiff.tui.model import RowResult, TraceModel

    path, report = traced
    model = TraceModel(replaydiff.open_trace(path).rank(0))
    model.add_results(report.ops)
    culprit = planted_backward(report)
    row = model.results[culprit.index]
    assert type(row) is RowResult and row.source is culprit and not row.in_diff and row.pair is None
    assert (row.status, row.severity, row.reason) == (Status.DIVERGENT, culprit.severity, culprit.reason)

    ref, target = diffed
    rows = diff_results(diff_traces(ref, target))
    assert {type(r) for r in rows} == {RowResult} and all(r.in_diff and r.ref_rank == 0 for r in rows)
    divergent = [r for r in rows if r.status is Status.DIVERGENT]
    assert len(divergent) == 1 and divergent[0].pair.status is PairStatus.DIVERGENT
    assert divergent[0].index == divergent[0].pair.target


@sync
async def test_t_shows_the_cause_and_the_next_commands_and_c_selects_the_causing_op(multistep):
    from replaydiff.tui.screens.trend import TrendScreen

    path, changed = multistep
    r = replaydiff.open_trace(path).rank(0)
    # the op that made the change: the x100 mul_ before step 8's forward, outside any module (no history of its own)
    (made,) = [op.index for op in r if op.name == "aten.mul_.Tensor" and op.step == PLANT_STEP
               and op.module is None and op.phase != "optimizer"]
    out = shlex.quote(f"{path}-step{PLANT_STEP}")
    # recorded from Python: the record command stops at `--` (the line after it says what goes there)
    # the cause runs outside any module, which --module never selects: the zoom holds it and the first change by
    # their op names
    from replaydiff.trend import compute_trend
    first = compute_trend(r).first_change
    record = (f"replaydiff record --tensors full --steps {PLANT_STEP - 1}-{PLANT_STEP} --op aten.mul_.Tensor "
              f"--op {first.op} -o {out} --")
    app = ReplaydiffApp(replaydiff.open_trace(path))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await press(app, pilot, "t")
        screen = app.screen
        assert isinstance(screen, TrendScreen)
        lines = screen.text.splitlines()
        assert lines[0].startswith(f"▶ first change: step {PLANT_STEP}, module {changed}")
        assert lines[1].startswith(f"▶ cause: op #{made} aten.mul_.Tensor (no module, forward)") and \
            f"step {PLANT_STEP}: made the change" in lines[1] and lines[1].endswith(f"(Enter or c: go to #{made})")
        assert lines[2].startswith(f"Next: record steps {PLANT_STEP - 1}-{PLANT_STEP} in full around the change")
        assert lines[3:5] == [f"  {record}", f"  replaydiff replay {out}"]
        assert lines[6].split() == ["module", "kind", "l2", "first", "l2", "last", "absmax", "max", "nan+inf", "l2",
                                    "by", "step", "(log)"]
        # Enter on the record command copies it
        await press(app, pilot, "down", "down", "down", "enter")
        assert app.clipboard == record and isinstance(app.screen, TrendScreen)
        await press(app, pilot, "c")
        assert not isinstance(app.screen, TrendScreen)
        assert app.selected_op == made


def _left_out_trace(path, **options) -> None:
    """Forward and backward of two 256x256 Linear layers (256 KiB weights): a 1M budget holds only some of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    x = torch.randn(64, 256)
    with replaydiff.record(path, **options):
        model(x).sum().backward()


@sync
async def test_ops_whose_data_was_left_out_say_why_and_never_look_clean(tmp_path):
    for name, options, reason, label, said in (
            ("budget", {"budget": "1M"}, "budget", "budget", "past the record --budget"),
            ("filter", {"modules": "Sequential.2"}, "filtered", "filter", "outside the record --module/--op filter")):
        path = tmp_path / name
        _left_out_trace(path, **options)
        r = replaydiff.open_trace(path).rank(0)
        left = [op.index for op in r if op.data_left_out is not None]
        assert left and {r[i].data_left_out for i in left} == {reason}
        report = replay_trace(str(path), ReplayOptions())
        ok = [x.index for x in report.ops if x.status is Status.OK]
        assert ok and not problems(report)
        app = ReplaydiffApp(replaydiff.open_trace(path), report=report)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            status = str(app.main.query_one("#status").visual)
            assert "0 divergent" in status
            what = "outside the record filter" if reason == "filtered" else f"data left out: {reason}"
            assert f"{len(left)} not judged ({what})" in status
            app.select(left[0])
            await settle(app, pilot)
            row = _row_text(app, left[0]).split()
            assert label in row and "skip" not in row
            text = app.main.detail.text
            assert f"NOT JUDGED  tensor data left out: {said}" in text and "SKIPPED" not in text
            if reason == "budget":
                assert "a replay of this trace is never clean; record again with a larger --budget" in text
            app.select(ok[0])
            await settle(app, pilot)
            assert "ok" in _row_text(app, ok[0]).split() and "NOT JUDGED" not in app.main.detail.text


@sync
async def test_the_figures_are_labelled_and_are_the_severity_replay_gives(traced):
    """The tree's `backward 2.4×` and the op list's unlabelled error column were explained nowhere, and the column
    gave max_abs/(eps·absmax) while the tree gave how far over the limit. Both now give the severity (err/lim),
    each under a header, and `?` explains them."""
    path, report = traced
    culprit = planted_backward(report)
    app = new_app(traced)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        ol = app.main.op_list
        assert ol.render_line(0).text.split()[-1] == "err/lim"
        assert str(app.main.query_one("#tree-header").visual).startswith("module  worst err/lim")
        app.select(culprit.index)
        await settle(app, pilot)
        figure = f"{culprit.severity:.3g}".replace("e+0", "e").replace("e+", "e")
        assert _row_text(app, culprit.index).split()[-1] == figure + "×"
        assert f"error / limit        {figure}  " in app.main.detail.text
        node = app.main.tree.node_for("backward", "")
        worst = max(r.severity for r in report.ops if r.rank == 0 and r.phase == "backward"
                    and r.severity is not None)
        assert str(node.label).split()[1] == f"{worst:.2g}".replace("e+0", "e").replace("e+", "e") + "×"
        await press(app, pilot, "question_mark")
        from rich.console import Console

        console = Console(width=200, record=True, file=io.StringIO())
        console.print(app.screen.query_one("#help-figures").content)
        legend = {ln.split()[0]: ln for ln in console.export_text().splitlines() if ln.strip()}
        assert "how far the op's error is over its divergence limit" in legend["err/lim"]
        assert "the worst err/lim of its ops" in legend["0.31×"]


@sync
async def test_a_stats_trace_says_it_is_never_replayed_and_what_to_record_instead(tmp_path):
    """A --tensors stats trace showed "verdict not replayed (yet)" and a failed background replay; it holds no
    tensor data, so it says so, starts no replay, and names what to record instead."""
    path = tmp_path / "stats"
    _left_out_trace(path, tensors="stats")
    app = make_app(path)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await app.workers_done(replay=True)
        await settle(app, pilot)
        status = str(app.main.query_one("#status").visual)
        assert status.startswith("--tensors stats: statistics only, never replayed (record --tensors full to "
                                 "judge ops)"), status
        assert "failed" not in status and not [w for w in app.workers if w.group == "replay"]
        text = app.main.detail.text
        assert "not replayed (yet)" not in text
        assert "NOT REPLAYABLE  recorded with --tensors stats: per-tensor statistics" in text
        assert "record with --tensors full (the default) to judge each op" in text
