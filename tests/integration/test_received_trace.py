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


# -- strings from a trace are shown, never obeyed ---------------------------------------------------------------
# A terminal title (OSC ... BEL), a clear screen (CSI 2J), a C1 CSI, a carriage return and a newline that would
# forge a line of the verdict.
EVIL = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x7f\rFORGED no divergent op\nFORGED line\x85FORGED\u2028FORGED"


def _crafted_trace(tmp_path: Path, name: str = "t", **record: object) -> Path:
    """Recorded steps whose module path, source file name and recorded source text carry EVIL: a module named
    with it, code in a file whose name holds it, and that file's line holding it in a comment."""
    import importlib.util

    import torch
    from torch import nn

    src = tmp_path / f"code{EVIL.replace('/', '_')}.py"
    src.write_text("import torch\n\n\ndef work(m, x):\n    return m(x).relu().sum()  # " +
                   EVIL.replace("\n", " ").replace("\r", " ").replace("\x85", " ").replace("\u2028", " ") + "\n")
    spec = importlib.util.spec_from_file_location("crafted_code", src)
    code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code)
    model = nn.Sequential()
    model.add_module(f"blk{EVIL}", nn.Linear(3, 2))
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / name
    with replaydiff.record(path, steps="1-3", **record):  # three steps: trend has series to show
        for _ in range(3):
            code.work(model, x).backward()
            opt.step()
            opt.zero_grad()
    return path


def _raw_controls(text: str) -> list[str]:
    return sorted({repr(c) for c in text if c != "\n" and (ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0
                                                           or c in "\u2028\u2029")})


def test_every_verb_shows_a_trace_strings_escaped(tmp_path, capsys):
    path = _crafted_trace(tmp_path)
    rt = replaydiff.open_trace(path).rank(0)
    op = next(o for o in rt if o.module and "blk" in o.module and o.source)
    assert EVIL in op.module and "\x1b]0;pwned" in op.source and "\x1b]0;pwned" in (op.source_text or "")
    (tmp_path / "r.json").unlink(missing_ok=True)
    runs = {
        "show": ["show", str(path)],
        "show --list": ["show", str(path), "--list"],
        "show --op": ["show", str(path), "--op", str(op.index)],
        "replay": ["replay", str(path), "--json", str(tmp_path / "r.json")],
        "diff": ["diff", str(path), str(path)],
        "trend": ["trend", str(_crafted_trace(tmp_path, "stats", tensors="stats"))],
        "report": ["report", str(path), "--replay", str(tmp_path / "r.json"), "--no-probe"],
    }
    for verb, argv in runs.items():
        main(argv)
        said = capsys.readouterr()
        for stream, text in (("stdout", said.out), ("stderr", said.err)):
            assert _raw_controls(text) == [], f"{verb} {stream}: {text}"
            forged = [line for line in text.splitlines() if line.lstrip().startswith("FORGED")]
            assert forged == [], f"{verb} {stream}: {forged}"
        if verb in ("show --list", "show --op"):
            assert "\\x1b]0;pwned\\x07" in said.out, said.out  # shown, as a visible escape
    for fmt in ("md", "html"):
        out = tmp_path / f"report.{fmt}"
        main(["report", str(path), "--replay", str(tmp_path / "r.json"), "--no-probe", "-o", str(out)])
        capsys.readouterr()
        text = out.read_text()
        assert _raw_controls(text) == [], f"{fmt}: {_raw_controls(text)}"
        assert [line for line in text.splitlines() if line.lstrip().startswith("FORGED")] == []
    # the JSON keeps the strings exact
    main(["show", str(path), "--op", str(op.index), "--json", "-"])
    assert __import__("json").loads(capsys.readouterr().out)["module"] == op.module


def test_the_tui_details_show_a_trace_strings_escaped(tmp_path):
    from replaydiff.tui.details import op_markup

    path = _crafted_trace(tmp_path)
    rt = replaydiff.open_trace(path).rank(0)
    texts = [op_markup(rt, op.index, None, [None] * len(rt)) for op in rt]
    for text in texts:
        assert _raw_controls(text) == [], text
        assert [line for line in text.splitlines() if line.lstrip().startswith("FORGED")] == []
    assert any("x1b]0;pwned" in text for text in texts)  # shown, as a visible escape (markup-escaped)
