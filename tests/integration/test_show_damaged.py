"""``show --list`` of a damaged trace marks the row of each op whose record is gone (which ops file, what is wrong with
it) and exits 3: a list never shows a damaged trace as whole."""
from __future__ import annotations

import json

import pytest
import torch

import replaydiff


@pytest.fixture
def trace(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with replaydiff.record(tmp_path / "t", chunk_ops=8):
        model(torch.randn(3, 4)).square().mean().backward()
    return tmp_path / "t"


@pytest.mark.parametrize("index_too", [False, True])
def test_show_list_marks_missing_ops_and_exits_3(cli_here, trace, index_too):
    n = len(replaydiff.open_trace(trace).rank(0))
    assert n > 16
    chunk = trace / "rank0" / "ops" / "000000008.rdt"  # the middle chunk: ops #8-#15
    chunk.unlink()
    if index_too:  # the index rebuilt from what is on disk: the rows are still there, marked
        (trace / "rank0" / "index.rdt").unlink()
    proc = cli_here("show", trace, "--list")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    rows = proc.stdout.splitlines()
    assert len(rows) == n
    gone = [r for r in rows if r.endswith(f"missing: ops file {chunk} (deleted or never copied)")]
    assert [int(r.split()[0]) for r in gone] == list(range(8, 16))
    assert not any("missing" in r for r in rows[:8] + rows[16:])
    assert f"replaydiff: rank 0 is damaged: 8 op(s) (#8-#15) missing: ops file {chunk} (deleted or never copied)" \
        in proc.stderr

    proc = cli_here("show", trace, "--list", "--json")
    assert proc.returncode == 3
    ops = json.loads(proc.stdout)["ops"]
    assert [o["index"] for o in ops if o["missing"]] == list(range(8, 16))


def test_show_list_of_a_whole_trace_exits_0(cli_here, trace):
    proc = cli_here("show", trace, "--list")
    assert proc.returncode == 0 and "missing" not in proc.stdout, proc.stdout + proc.stderr
