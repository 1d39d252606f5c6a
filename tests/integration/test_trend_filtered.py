"""A trace recorded with a ``--module`` filter: in ``--tensors full`` the filter's ops hold tensor data and no
statistics, which trend does not read, so trend says which records it could not score (text and JSON); in
``--tensors stats`` every op keeps its statistics and nothing goes unscored."""
from __future__ import annotations

import json

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main as cli_main
from replaydiff.trace import open_trace
from replaydiff.trend import compute_trend
from steps_helpers import one_thread  # noqa: F401 (autouse: one intra-op thread, restored afterwards)


def _record(path, tensors: str) -> None:
    """An MLP whose first layer's weight is multiplied by 100 at step 7 (in the loop, outside any module); steps
    1-8 recorded with ``--module Sequential.0``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with replaydiff.record(path, tensors=tensors, steps="1-8", modules="Sequential.0"):
        for step in range(1, 9):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
            if step == 7:
                with torch.no_grad():
                    model[0].weight.mul_(100)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()


def test_trend_of_a_full_trace_says_the_filters_ops_were_not_scored(tmp_path, capsys):
    path = tmp_path / "t"
    _record(path, "full")
    r = open_trace(path).rank(0)
    assert r.options.modules == ("Sequential.0",) and r.options.ops is None
    in_filter = [op for op in r if op.module == "Sequential.0" and op.step is not None]
    assert in_filter and all(ref.stats is None for op in in_filter for ref in op.outputs_refs())
    t = compute_trend(r)
    u = t.unscored
    assert u is not None and (u.modules, u.filter_modules, u.filter_ops) == (("Sequential.0",), ("Sequential.0",), None)
    assert u.records == sum(1 for op in in_filter if any(ref.torch_dtype.is_floating_point and ref.stored
                                                        for ref in op.outputs_refs()))
    assert all(s.module != "Sequential.0" for s in t.series)  # what the line warns of: the module has no series
    cli_main(["trend", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"not scored: the ops of --module Sequential.0 ({u.records} records, in Sequential.0) hold "
                        f"tensor data without statistics, which trend cannot score: a change made there is not seen, "
                        f"and is named, if at all, where it shows outside them (replay judges those ops: replaydiff "
                        f"replay {path})")
    cli_main(["trend", str(path), "--json", "-"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["not_scored"] == {"records": u.records, "modules": ["Sequential.0"],
                                 "filter": {"modules": ["Sequential.0"], "ops": None}}


def test_trend_of_a_stats_trace_with_the_same_filter_scores_every_op(tmp_path, capsys):
    path = tmp_path / "t"
    _record(path, "stats")
    t = compute_trend(open_trace(path).rank(0))
    assert t.unscored is None and any(s.module == "Sequential.0" for s in t.series)
    assert t.first_change is not None and t.first_change.step == 7
    cli_main(["trend", str(path), "--json", "-"])
    assert json.loads(capsys.readouterr().out)["not_scored"] is None
