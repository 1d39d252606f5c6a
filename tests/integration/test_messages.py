"""Messages that agree with the trace and the command line: trend on fewer steps than it needs says what it needs, a
fault planted from Python is said as the CLI says it, the CLI takes options spelled whole only, and a command given
without ``--`` that holds one of record's own options is refused."""
from __future__ import annotations

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main
from replaydiff.trace import open_trace


def _steps(path, n: int) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with replaydiff.record(path, tensors="stats", steps=f"1-{n}"):
        for _ in range(n):
            net(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()


def test_trend_on_fewer_steps_than_it_needs_says_what_it_needs(tmp_path, capsys):
    _steps(tmp_path / "one", 1)
    _steps(tmp_path / "three", 3)
    capsys.readouterr()
    main(["trend", str(tmp_path / "one")])
    out = capsys.readouterr().out
    assert "nothing judged: trend compares each step with the steps before it, and this trace holds 1 step" in out
    assert "no sudden change" not in out
    main(["trend", str(tmp_path / "three")])
    out = capsys.readouterr().out
    assert "a jump in a statistic was not judged: it needs 6 steps" in out and "this trace holds 3" in out
    assert "no sudden change" not in out


def test_a_fault_planted_from_python_is_said_with_where_it_landed(tmp_path):
    with pytest.warns(RuntimeWarning, match="PLANTED FAULT") as said:
        with replaydiff.record(tmp_path / "t", plant="aten.tanh.default:2"):
            torch.tanh(torch.tanh(torch.randn(3)))
    second = [op.index for op in open_trace(tmp_path / "t").rank(0) if op.name == "aten.tanh.default"][1]
    assert [str(w.message) for w in said if "PLANTED" in str(w.message)] == [
        f"replaydiff: PLANTED FAULT (plant='aten.tanh.default:2'): aten.tanh.default call 2 x(1+0.001), "
        f"op #{second} on rank 0; every report on this trace names it"]


@pytest.mark.parametrize("argv, said", [
    (["record", "--tensor", "stats", "--", "python", "t.py"], "unrecognized arguments: --tensor (did you mean "
                                                               "--tensors?)"),
    (["replay", "t", "--precisio", "fp32"], "unrecognized arguments: --precisio fp32 (did you mean --precision?)"),
    (["record", "-o", "t", "python", "train.py", "--steps", "5"],
     "--steps comes after the command, so it would go to the command, not to replaydiff: put -- before the command"),
])
def test_the_cli_refuses_abbreviations_and_a_command_without_the_separator(tmp_path, capsys, monkeypatch, argv, said):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "t").exists()  # nothing was run nor recorded
