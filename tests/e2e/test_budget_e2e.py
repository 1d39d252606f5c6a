"""``record --budget`` and ``record --estimate`` of a job run as a process: what the estimate prints, the warning
and show's line when the budget left data out, and a budget over named modules (the quick ones are
tests/integration/test_budget.py)."""
from __future__ import annotations

import re
import sys

import pytest

from replaydiff.cli.main import main
from replaydiff.replay import ReplayOptions, Status, replay_trace
from replaydiff.trace import open_trace

from budget_helpers import _bytes_on_disk, _named_ops


SCRIPT = """
import torch
from replaydiff.models.tiny import TinyTransformer, make_step
torch.manual_seed(0)
model = TinyTransformer()
step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
for _ in range(2):
    step()
"""


_ROW = re.compile(r"^  (\S+(?: any module\))?)\s+(forward|backward|optimizer|-)\s+(\d+)\s+([\d.]+) (MB|KB)$")


def _written_per_place(r) -> dict[tuple[str, str], int]:
    """Bytes a full trace stored, by the module and phase of the op that stored each storage version."""
    seen, per = set(), {}
    for op in r:
        place = (op.module or "(outside any module)", op.phase)
        for x in [*op.inputs(), *op.outputs_refs()]:
            if x.chunk is not None and x.nbytes and (x.chunk, x.version) not in seen:
                seen.add((x.chunk, x.version))
                per[place] = per.get(place, 0) + x.nbytes
        if op.rng is not None:
            per[place] = per.get(place, 0) + op.rng.data.nbytes
    return per


def test_estimate_prints_what_a_full_recording_writes(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    capsys.readouterr()
    assert main(["record", "--estimate", "--budget", "8M", "-o", str(tmp_path / "none"), "--", sys.executable,
                 str(script)]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "none").exists()  # nothing written where the trace would go
    rows = {(m.group(1), m.group(2)): float(m.group(4)) * (1e6 if m.group(5) == "MB" else 1e3)
            for line in out.splitlines() if (m := _ROW.match(line))}
    assert len(rows) >= 10
    assert re.search(r"write rate here: \d+ MB/s", out)

    assert main(["record", "--no-compress", "-o", str(tmp_path / "full"), "--", sys.executable, str(script)]) == 0
    full = open_trace(tmp_path / "full").rank(0)
    actual = _written_per_place(full)
    for place, estimated in rows.items():
        assert estimated == pytest.approx(actual[place], rel=0.03), place
    data = _bytes_on_disk(tmp_path / "full" / "rank0" / "data")
    (said,) = re.findall(r"rank 0: \d+ ops; full would write [\d.]+ MB \(([\d.]+) MB tensor data", out)
    assert float(said) * 1e6 == pytest.approx(data, rel=0.02)
    # what fits the budget: in step order part of the data; whole modules listed with their globs
    assert "--budget 8M: in step order, tensor data stops at about op #" in out
    fits = re.findall(r"^\s+([\d.]+) MB  --module '(\S+)' --module '(\S+)'$", out, re.M)
    assert fits and all(float(mb) * 1e6 <= 8 << 20 and star == f"{m}.*" for mb, m, star in fits)
    assert ("TinyTransformer.blocks.0", "TinyTransformer.blocks.0.*") in {(m, s) for _, m, s in fits}


def test_budget_with_module_names_exactly_the_ops_not_judged(tmp_path, capsys):
    """--budget with --module: the ops left out for the budget are interleaved with ops that were judged. record,
    replay and show each name the exact runs left out, never one range ("#7-#719") holding judged ops."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    capsys.readouterr()
    assert main(["record", "--budget", "1M", "--module", "TinyTransformer.blocks.1*", "-o", str(tmp_path / "t"),
                 "--", sys.executable, str(script)]) == 0
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "--budget 1M was reached" in ln]
    r = open_trace(tmp_path / "t").rank(0)
    left = {op.index for op in r if op.data_left_out == "budget"}
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    judged = {x.index for x in report.ops if x.status is not Status.SKIPPED}
    assert left and judged and min(left) < max(judged) < max(left)  # judged ops lie between the left-out ones
    assert main(["replay", str(tmp_path / "t")]) == 1
    (replayed,) = [ln for ln in capsys.readouterr().out.splitlines() if "not judged: tensor data left out" in ln]
    assert main(["show", str(tmp_path / "t")]) == 0
    (shown,) = [ln for ln in capsys.readouterr().out.splitlines() if "LEFT OUT:" in ln]
    for line in (*warned, replayed, shown):
        named, n = _named_ops(line)
        assert n == len(left) and named <= left and max(left) in named and not named & judged, line
    assert len(warned) == 1


def test_record_warns_once_when_the_budget_left_data_out_and_show_says_so(tmp_path, capsys):
    """`record --budget` that leaves tensor data out warns once at the end with what was left out and a --budget
    that fits it all, show says `budget reached` (not `complete`); recorded again with that budget, nothing is left
    out."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    capsys.readouterr()
    assert main(["record", "--budget", "1M", "--no-compress", "-o", str(tmp_path / "t"), "--", sys.executable,
                 str(script)]) == 0
    err = capsys.readouterr().err
    (lo,) = open_trace(tmp_path / "t").rank(0).data_left_out
    assert lo.reason == "budget" and lo.ops > 0
    said = re.findall(r"replaydiff: warning: --budget 1M was reached: (\d+) op\(s\) \(#(\d+)[^)]*?#?(\d*)\) kept with "
                      r"statistics only: past the record --budget, ([\d.]+) MB of tensor data not stored; --budget (\S+) would fit everything",
                      err)
    assert len(said) == 1, err
    ops, first, last, mb, fits = said[0]
    assert (int(ops), int(first), int(last or first)) == (lo.ops, lo.first, lo.last)
    assert float(mb) == pytest.approx(lo.nbytes / 1e6, rel=0.01)
    assert main(["show", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "budget reached" in out and "complete" not in out, out

    assert main(["record", "--budget", fits, "--no-compress", "-o", str(tmp_path / "fits"), "--", sys.executable,
                 str(script)]) == 0
    assert "was reached" not in capsys.readouterr().err
    assert open_trace(tmp_path / "fits").rank(0).data_left_out == []
