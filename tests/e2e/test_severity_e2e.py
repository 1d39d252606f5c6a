"""The repro scripts of a batch-norm step agree with replay on its ill-conditioned op (the rest:
tests/integration/test_severity.py)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from replaydiff.cli.main import main

from severity_helpers import _ill, reports, traces  # noqa: F401 (reports, traces: fixtures)


def _run_repro(trace: Path, index: int, out: Path, capsys) -> subprocess.CompletedProcess:
    """`repro` of op ``index`` into ``out``, and its script run on ``out`` in this process (the script's code is
    replaydiff.rebuild_and_judge; test_repro runs the written scripts alone, as ``python -I repro.py``)."""
    from replaydiff import rebuild_and_judge

    assert main(["repro", str(trace), str(index), "-o", str(out)]) == 0
    capsys.readouterr()
    code = rebuild_and_judge.main([], directory=str(out))
    stdout, stderr = capsys.readouterr()
    return subprocess.CompletedProcess(["repro.py"], code, stdout, stderr)


def test_repro_agrees_with_replay(traces, reports, tmp_path, capsys):
    (ill,) = _ill(reports["clean"])
    p = _run_repro(traces["clean"], ill.index, tmp_path / "ill", capsys)
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(l for l in p.stdout.splitlines() if "recorded vs reference:" in l)
    assert line.endswith(ill.reason) and "  ok " in line, line
    assert re.search(r"cpu run vs reference:.*  ok", p.stdout), p.stdout
    culprit = reports["planted"].first_divergent
    p = _run_repro(traces["planted"], culprit.index, tmp_path / "culprit", capsys)
    assert p.returncode == 1, p.stdout + p.stderr
    line = next(l for l in p.stdout.splitlines() if "recorded vs reference:" in l)
    assert "  DIVERGENT - " in line and culprit.reason.endswith(line.split("  DIVERGENT - ", 1)[1]), line
