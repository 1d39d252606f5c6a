"""What ``trend`` tells a user to run next: the zoom-in's record command ends in the job's own command (stored in the
trace by ``replaydiff record -- CMD``), or says in words what goes there; a flight window that may have begun after
the change says so and gives the ``--flight K`` that keeps the steps before it."""
from __future__ import annotations

import json
import shlex

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main as cli_main
from replaydiff.report.trend import describe_late_window, to_json
from replaydiff.trace import open_trace
from replaydiff.trend import compute_trend
from steps_helpers import one_thread  # noqa: F401 (autouse: one intra-op thread, restored afterwards)


def test_a_trace_recorded_from_python_says_in_words_what_follows_the_record_commands_dashes(tmp_path, capsys):
    """No command line to give back: the record line stops at ``--`` and the next line says, in words, what goes
    after it (no placeholder that a shell would run), and the Python call that records the same."""
    path = tmp_path / "t"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with replaydiff.record(path, tensors="stats", steps="1-20"):
        for step in range(1, 21):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
            if step == 15:
                with torch.no_grad():
                    model[2].weight.mul_(100)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert open_trace(path).rank(0).command is None
    # the cause, the mul_, runs outside any module: the zoom-in holds it (and the first change) by their op names
    first = compute_trend(open_trace(path).rank(0)).first_change
    assert first is not None and first.op != "aten.mul_.Tensor"
    assert cli_main(["trend", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    zoom = shlex.quote(f"{path}-step15")
    k = lines.index(f"  replaydiff record --tensors full --steps 14-15 --op aten.mul_.Tensor --op {first.op} "
                    f"-o {zoom} --")
    assert lines[k + 1] == f"  replaydiff replay {zoom}"
    assert lines[k + 2].startswith(f"(after the record command's `--`, type the command that runs your training: "
                                   f"{path} holds none, as it was recorded from Python")
    assert f"replaydiff.record('{path}-step15', tensors='full', steps='14-15', ops=['aten.mul_.Tensor', " \
           f"'{first.op}'])" in lines[k + 2]
    assert not any("COMMAND" in line for line in lines)
    assert cli_main(["trend", str(path), "--json", "-"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["next"]["record"] is None and doc["next"]["replay"] == f"replaydiff replay {zoom}"


LR_JUMP = 12


def _adamw_lr_jump(path, flight: int, steps: int = 19) -> None:
    """AdamW whose learning rate is multiplied by 40 at step LR_JUMP (a warm-up that multiplies instead of setting);
    the flight recorder writes its last ``flight`` steps at exit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with replaydiff.record(path, tensors="stats", flight=flight, flight_at_exit=True):
        for step in range(1, steps + 1):
            if step == LR_JUMP:
                for group in opt.param_groups:
                    group["lr"] *= 40
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_a_flight_window_that_began_after_the_change_says_so_and_the_flight_k_it_gives_finds_it(tmp_path, capsys):
    """--flight 8 holds steps 12..19: the jump of step 12 is the window's first step, and shows first where trend can
    first see a jump (5 steps into the window), with nothing to say it began earlier. trend says the window may have begun too late and gives the
    --flight K that keeps the 10 steps before it; recorded with that K, the change is at step 12 and the cause names
    the learning rate's argument."""
    short = tmp_path / "short"
    _adamw_lr_jump(short, flight=8)
    t = compute_trend(open_trace(short).rank(0))
    assert t.steps == list(range(12, 20))  # the last 8 whole steps (the ops after the last step are no step)
    assert t.first_change is not None and t.first_change.step == t.steps[5]  # the first step with 5 before it
    late = t.late_window
    assert late is not None and (late.step, late.first, late.last, late.keep, late.before) == (17, 12, 19, 18, 10)
    assert cli_main(["trend", str(short)]) == 1
    text = capsys.readouterr().out
    assert "the flight window (12..19) may have begun too late: the change is at step 17, the earliest step where " \
           "trend can see a jump" in text
    assert "record again with --flight 18 (it was 8) to keep the 10 steps before step 12 as well" in text
    assert cli_main(["trend", str(short), "--json", "-"]) == 1
    assert json.loads(capsys.readouterr().out)["late_window"] == {
        "step": 17, "first_step": 12, "last_step": 19, "flight": 18, "steps_before": 10, "flight_mib": None}

    from replaydiff.tui.screens.trend import LATE_ID, TrendScreen

    assert (describe_late_window(late), LATE_ID) in TrendScreen(t, str(short)).lines()  # the TUI's trend screen says it too

    longer = tmp_path / "longer"
    _adamw_lr_jump(longer, flight=late.keep)
    t = compute_trend(open_trace(longer).rank(0))
    assert t.first_change is not None and t.first_change.step == LR_JUMP
    assert t.cause is not None and t.cause.phase == "optimizer" and t.cause.changed_args
    assert t.late_window is None  # the change now sits well inside the window
    assert cli_main(["trend", str(longer)]) == 1
    assert "may have begun too late" not in capsys.readouterr().out


def test_a_steps_trace_never_says_its_window_began_too_late(tmp_path):
    """--steps chooses its steps; only the flight recorder's window is cut by K (a change at a --steps trace's
    earliest judged step says nothing about a flight K)."""
    path = tmp_path / "t"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with replaydiff.record(path, tensors="stats", steps="13-19"):
        for step in range(1, 20):
            if step == LR_JUMP:
                for group in opt.param_groups:
                    group["lr"] *= 40
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    t = compute_trend(open_trace(path).rank(0))
    assert t.first_change is not None and t.first_change.step == 18 and t.late_window is None


def _sgd_lr_jump(path, lr: float, steps: str, schedule: float = 1.0, **options) -> None:
    """24 SGD steps whose learning rate is multiplied by 40 at step LR_JUMP (``schedule`` < 1: a decay instead, by
    that factor every step), recorded from Python."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    g = torch.Generator().manual_seed(1)
    with replaydiff.record(path, steps=steps, **options):
        for step in range(1, 25):
            for group in opt.param_groups:
                group["lr"] *= (40 if step == LR_JUMP else 1) if schedule == 1.0 else schedule
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_the_zoom_in_of_a_learning_rate_jump_replays_to_the_argument_it_entered_through(tmp_path, capsys):
    """The update that shows the jump (step 13) runs a step after the learning rate changed (step 12): trend's cause
    says since when its argument differs, the zoom-in is of that step and the one before, and its replay says the
    difference enters through the optimizer's argument (not "no divergent op" and nothing more)."""
    stats = tmp_path / "s"
    _sgd_lr_jump(stats, 0.05, "1-24", tensors="stats")
    t = compute_trend(open_trace(stats).rank(0))
    cause = t.cause_to_tell
    assert cause is not None and (cause.phase, cause.op, cause.how) == ("optimizer", "aten.add_.Tensor", "made")
    assert cause.step == LR_JUMP + 1 and cause.args_since == LR_JUMP
    assert cause.changed_args == ("alpha=-2.0 from step 12 on (-0.05 before)",)
    zoom = to_json(t, str(stats))["zoom"]
    assert (zoom["steps"], zoom["ops"]) == (f"{LR_JUMP - 1}-{LR_JUMP}", ["aten.add_.Tensor"])

    out = tmp_path / "zoom"
    _sgd_lr_jump(out, 0.05, zoom["steps"], tensors="full", ops=zoom["ops"])
    z = open_trace(out).rank(0)
    first = next(op for op in z if op.step == LR_JUMP and op.name == "aten.add_.Tensor")
    assert cli_main(["replay", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"the difference enters through argument alpha of op #{first.index} aten.add_.Tensor (no module, " \
           f"optimizer) at step {LR_JUMP}: -2.0 where step {LR_JUMP - 1} had -0.05 (a learning rate or other " \
           f"hyperparameter changed)" in text, text
    assert cli_main(["replay", str(out), "--json", "-"]) == 0
    enters = json.loads(capsys.readouterr().out)["enters"]
    assert (enters["index"], enters["argument"], enters["value"], enters["previous"], enters["position"]) == \
        (first.index, "alpha", -2.0, -0.05, None)


def test_a_decaying_learning_rate_is_no_entry_and_a_clean_zoom_in_says_what_it_looked_for(tmp_path, capsys):
    """A schedule's small steps (x0.9 a step) are no entry; a zoom-in where nothing changed 4x says what it looked
    for instead of ending at "no divergent op"."""
    out = tmp_path / "zoom"
    _sgd_lr_jump(out, 0.05, "11-12", schedule=0.9, tensors="full", modules=["Sequential.2"])
    assert cli_main(["replay", str(out), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["enters"] is None
    assert cli_main(["replay", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "no input from outside the replayed ops, and no optimizer argument, changed 4x or more from one step to the "
        "next (steps 11-12): a change that builds up from smaller ones enters unseen here (trend's table and cause "
        "line show how it grew)")


def test_the_record_command_of_a_job_that_ran_in_another_folder_goes_there_first(tmp_path, monkeypatch):
    """The job's command is given back as it was typed (``python train.py``), so it is run in the folder it ran in;
    the zoom-in's trace is then named by its absolute path. From that folder itself, nothing changes."""
    from replaydiff.trend import Zoom

    job = tmp_path / "job dir"
    job.mkdir()
    monkeypatch.chdir(tmp_path)
    z = Zoom("14-15", ["Net.fc"], None, 15)
    here = z.commands("runs/t", ("python", "train.py"), str(tmp_path))
    assert here["record"] == "replaydiff record --tensors full --steps 14-15 --module Net.fc -o runs/t-step15 -- " \
                             "python train.py"
    assert here["replay"] == "replaydiff replay runs/t-step15"
    there = z.commands("runs/t", ("python", "train.py"), str(job))
    out = shlex.quote(f"{tmp_path}/runs/t-step15")
    assert there["record"] == f"cd {shlex.quote(str(job))} && replaydiff record --tensors full --steps 14-15 " \
                              f"--module Net.fc -o {out} -- python train.py"
    assert there["replay"] == f"replaydiff replay {out}"
    assert z.commands("runs/t", None, str(job))["record"] is None
