"""A replay's JSON belongs to the recording it judged: `report` (and the TUI's --replay) refuse the results of an
earlier recording at the same path (its verdicts would be read as the new one's: a planted fault called clean), and
accept the trace's own results whatever the folder they are named from."""
from __future__ import annotations

import shutil

import torch

import replaydiff


def _record(path, plant=None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shutil.rmtree(path, ignore_errors=True)  # recorded again at the same path, as record --force does
    with replaydiff.record(path, plant=plant):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()


def test_report_refuses_a_replay_of_an_earlier_recording_at_the_same_path(tmp_path, cli_here):
    trace, stale = tmp_path / "t", tmp_path / "stale.json"
    _record(trace)
    assert cli_here("replay", trace, "--json", stale).returncode == 0
    _record(trace, plant="aten.mm.default:2:1e-3")
    proc = cli_here("report", trace, "--replay", stale)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"replaydiff: error: {stale} holds results of an earlier recording of {trace} (it "
                                   f"was recorded again since): replay it again with --json")


def test_report_takes_the_traces_own_replay_named_from_another_folder(tmp_path, cli_here):
    (tmp_path / "runs").mkdir()
    _record(tmp_path / "runs" / "t")
    assert cli_here("replay", "t", "--json", "r.json", cwd=tmp_path / "runs").returncode == 0
    proc = cli_here("report", "runs/t", "--replay", "runs/r.json", cwd=tmp_path)
    assert proc.returncode == 0 and "is a replay of" not in proc.stderr and "health report" in proc.stdout
