"""A trace received from someone else is data: nothing it names is imported or read from this disk, an op it holds
that replay cannot run is never called clean, and its strings are shown (escaped), never obeyed by a terminal."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import replay_helpers as rh

import replaydiff
from replaydiff.cli.main import main

@pytest.fixture(scope="module")
def custom_trace(tmp_path_factory) -> Path:
    return rh.record_shipped_custom_op(tmp_path_factory.mktemp("shipped"), tmp_path_factory.mktemp("custom") / "t")


def _op_index(path: Path, name: str) -> int:
    return next(op.index for op in replaydiff.open_trace(path).rank(0) if op.name == name)


def test_repro_refuses_a_directory_holding_a_module_the_script_would_import(custom_trace, tmp_path, capsys):
    """`python DIR/repro.py` puts DIR first on sys.path: a torch.py there would run in place of torch."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "torch.py").write_text("raise SystemExit('shadowed')\n")
    index = _op_index(custom_trace, "aten.mm.default")
    assert main(["repro", str(custom_trace), str(index), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch.py" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["torch.py"]


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """replaydiff in a process of its own (one that never imported the trace's custom op module)."""
    return subprocess.run([sys.executable, "-m", "replaydiff", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_an_op_replay_cannot_run_is_not_judged_and_never_clean(custom_trace, tmp_path, capsys, monkeypatch):
    """The custom op is not registered where replay runs: counted and said, exit 1; benign skips stay benign."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rdtrust_shipped.py").write_text(rh.SHIPPED_MODULE)  # beside the user: still not imported without --import
    index = _op_index(custom_trace, "rdtrust.twice.default")
    assert main(["replay", str(custom_trace)]) == 1
    out = capsys.readouterr().out
    not_judged = [line for line in out.splitlines() if line.strip().startswith("not judged")]
    assert len(not_judged) == 1 and f"#{index} (rdtrust.twice.default)" in not_judged[0], out
    assert "--import rdtrust_shipped" in not_judged[0]
    assert "no divergent op: every replayed op matches" not in out
    assert out.splitlines()[-1].startswith("not clean"), out
    assert not (tmp_path / "imported.txt").exists()
    # every other op was judged (ok) or benignly skipped: no other op counted as not judged
    assert main(["replay", str(custom_trace), "--json", "-"]) == 1
    ops = __import__("json").loads(capsys.readouterr().out)["ops"]
    assert [o["index"] for o in ops if o.get("unjudged")] == [index]
