"""A trace received from someone else is data: nothing it names is imported or read from this disk, an op it holds
that replay cannot run is never called clean, and its strings are shown (escaped), never obeyed by a terminal."""
from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main

# A module that registers a custom op and, when imported, leaves a mark beside itself: a file shipped with a trace.
SHIPPED = '''
import pathlib, torch
pathlib.Path(__file__).with_name("imported.txt").write_text("ran")


@torch.library.custom_op("rdtrust::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _fake(x):
    return torch.empty_like(x)
'''


@pytest.fixture(scope="module")
def custom_trace(tmp_path_factory) -> Path:
    """A trace of a step calling a custom op whose module (rdtrust_shipped) sits in a directory of its own."""
    home = tmp_path_factory.mktemp("shipped")
    (home / "rdtrust_shipped.py").write_text(SHIPPED)
    sys.path.insert(0, str(home))
    try:
        mod = importlib.import_module("rdtrust_shipped")
    finally:
        sys.path.remove(str(home))
    path = tmp_path_factory.mktemp("custom") / "trace"
    with replaydiff.record(path):
        (mod.twice(torch.randn(4, 3)) @ torch.randn(3, 2)).sum()
    return path


def _op_index(path: Path, name: str) -> int:
    return next(op.index for op in replaydiff.open_trace(path).rank(0) if op.name == name)


def test_repro_imports_no_module_the_trace_names_unless_asked(custom_trace, tmp_path, capsys):
    index = _op_index(custom_trace, "rdtrust.twice.default")
    assert main(["repro", str(custom_trace), str(index), "-o", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "custom op" in line]
    assert len(said) == 1 and "rdtrust_shipped" in said[0] and "--import" in said[0], out
    # the module the trace names, beside where the user runs the script
    work = tmp_path / "work"
    work.mkdir()
    (work / "rdtrust_shipped.py").write_text(SHIPPED)
    p = subprocess.run([sys.executable, str(tmp_path / "r" / "repro.py")], cwd=work, capture_output=True, text=True,
                       timeout=120)
    assert not (work / "imported.txt").exists(), "the script imported a module named by the trace"
    assert p.returncode == 4 and p.stdout == "", p.stderr + p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--import rdtrust_shipped" in lines[0], p.stderr
    # with the user's word, the module runs (from the working directory) and the op is judged
    p = subprocess.run([sys.executable, str(tmp_path / "r" / "repro.py"), "--import", "rdtrust_shipped"], cwd=work,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr + p.stdout
    assert (work / "imported.txt").exists() and "rdtrust.twice.default" in p.stdout


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
