"""One severity everywhere: how far over its limit an op is, and why an op is ok despite a large raw error, are the
verdict's own, and replay, the health report, the TUI's model and the standalone repro all read them.

The scenario users met: a bias gradient feeding BatchNorm is a sum over the batch of values that cancel to almost
zero (BatchNorm's backward makes them sum to zero per channel), so in float32 it is off by millions of units of
eps*absmax against float64 while being exactly what the op computes at float32. Replay rightly calls it ok (its own
float32 error explains it); nothing may rank it above a real culprit (a planted fault) or call it divergent.
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import replaydiff
from replaydiff.cli.main import main
from replaydiff.replay import ReplayOptions, Status, replay_trace
from replaydiff.report import render_replay, report_to_json
from replaydiff.tui.model import TraceModel

from severity_helpers import _ill, reports, traces  # noqa: F401 (reports, traces: fixtures)


def test_an_ill_conditioned_op_is_ok_with_its_reason_and_below_its_limit(reports):
    for report in reports.values():
        (ill,) = _ill(report)
        assert (ill.op, ill.module, ill.phase) == ("aten.sum.dim_IntList", "BNNet.fc", "backward")
        assert ill.metrics["norm_max"] > 1000 * ill.metrics["limit_max"]  # the raw ratio users saw
        assert ill.reason is not None and ill.reason.startswith("within its own float32 error"), ill.reason
        assert "ill-conditioned" in ill.reason
        assert 0 < ill.severity <= 1 and ill.verdict.severity == ill.severity
        assert all(r.severity <= 1 for r in report.ops if r.status is Status.OK and r.severity is not None)
    planted = reports["planted"]
    culprit = planted.first_divergent
    assert culprit.op == "aten.addmm.default" and culprit.module == "BNNet.out"
    assert culprit.severity > 1 and max(r.severity or 0 for r in planted.ops) == culprit.severity
    doc = report_to_json(planted)
    (ill_json,) = [o for o in doc["ops"] if o["index"] == _ill(planted)[0].index]
    assert ill_json["severity"] <= 1 and ill_json["reason"].startswith("within its own float32 error")
    assert doc["first_divergent"]["severity"] == culprit.severity


def test_replay_text_says_why_ops_over_the_fixed_limit_are_ok(reports):
    (ill,) = _ill(reports["clean"])
    out = io.StringIO()
    render_replay(reports["clean"], out)
    text = out.getvalue()
    assert "no divergent op" in text
    assert f"#{ill.index} aten.sum.dim_IntList" in text and "within its own float32 error" in text


def test_health_report_passes_the_clean_step_and_ranks_the_culprit_first(traces, tmp_path, capsys):
    for name in ("clean", "planted"):
        main(["replay", str(traces[name]), "--json", str(tmp_path / f"{name}.json")])
        capsys.readouterr()
        main(["report", str(traces[name]), "--replay", str(tmp_path / f"{name}.json")])
        md = capsys.readouterr().out
        check = re.search(r"^\| largest error / limit \| (\S+)(?: \(#(\d+)\))? \| 1 \| (\w+) \|$", md, re.M)
        assert check, md
        top = md.split("with the largest error / limit", 1)[1].split("##", 1)[0]
        first_top = [l for l in top.splitlines() if l.startswith("| #")][0]
        modules = md.split("## Error per module", 1)[1].split("##", 1)[0]
        first_module = [l for l in modules.splitlines() if l.startswith("| ") and "---" not in l][1]
        if name == "clean":
            assert check.group(3) == "pass" and float(check.group(1)) <= 1
        else:
            culprit = replaydiff.open_trace(traces[name]).rank(0).planted.index
            assert check.group(3) == "FAIL" and check.group(2) == str(culprit)  # the worst op is named: the culprit
            assert first_top.startswith(f"| #{culprit} | aten.addmm.default | BNNet.out |"), first_top
            assert first_module.startswith("| BNNet.out |"), first_module


def test_tui_model_ranks_the_ok_op_below_the_culprit(traces, reports):
    report = reports["planted"]
    model = TraceModel(replaydiff.open_trace(traces["planted"]).rank(0))
    model.add_results(report.ops)
    (ill,) = _ill(report)
    culprit = report.first_divergent
    assert model.severity[ill.index] <= 1 < model.severity[culprit.index]
    groups = {(g.phase, g.path): g for g in _walk(model.module_groups())}
    assert groups[("backward", "BNNet.fc")].worst <= 1  # not its raw ratio, 1.3e5x, in the module tree
    assert groups[("forward", "BNNet.out")].worst > 1
    assert groups[("backward", "")].worst <= 1 < groups[("forward", "")].worst


def _walk(groups):
    for g in groups:
        yield g
        yield from _walk(g.children)


def _copied_script(d: Path):
    """The repro.py written into ``d``, imported from there (not the installed replaydiff module it was copied
    from)."""
    import importlib.util
    import sys

    name = f"copied_repro_{d.name}"
    spec = importlib.util.spec_from_file_location(name, d / "repro.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as `python repro.py` registers __main__: its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_the_copied_script_judges_every_op_as_replay_does(traces, reports, tmp_path, capsys):
    """Every op replay judged in the planted step (the culprit, the ill-conditioned bias gradient, the rest), its
    repro written and the copied script run on it: each recorded result is divergent in the script exactly where
    replay says so, with replay's reason for the ill-conditioned op and for the culprit."""
    from replaydiff.errors import UsageError
    from replaydiff.repro.write import write_repro

    rt = replaydiff.open_trace(traces["planted"]).rank(0)
    judged = {r.index: r for r in reports["planted"].ops if r.status in (Status.OK, Status.DIVERGENT)}
    seen: dict[int, bool] = {}
    for index, r in judged.items():
        d = tmp_path / f"op{index}"
        try:
            write_repro(rt, rt[index], d)
        except UsageError:
            continue  # nothing it could run alone (uninitialised memory, a marker): replay's own ruling stands
        script = _copied_script(d)
        capsys.readouterr()
        script.main([], directory=str(d))
        lines = [l for l in capsys.readouterr().out.splitlines()
                 if "recorded vs reference:" in l or " scalar: " in l or "(a view of an input)" in l]
        assert lines, index
        seen[index] = any("DIVERGENT" in l or "RECORDED" in l for l in lines)
        if r.verdict is not None and r.verdict.explanation:  # the ill-conditioned op: its reason, word for word
            assert any(l.endswith(f"  ok - {r.verdict.explanation}") for l in lines), (r.reason, lines)
        if r.status is Status.DIVERGENT:
            line = next(l for l in lines if "DIVERGENT - " in l)
            assert r.reason.endswith(line.split("  DIVERGENT - ", 1)[1]), (r.reason, line)
    assert len(seen) > 20 and _ill(reports["planted"])[0].index in seen
    assert {i for i, divergent in seen.items() if divergent} == {reports["planted"].first_divergent.index} == \
        {i for i in seen if judged[i].status is Status.DIVERGENT}


def test_the_copied_script_allows_the_graph_targets_replay_allows(traces, tmp_path):
    """The operator functions a compiled unit's graph may call: the copied script resolves exactly those replay
    resolves (one allowlist), and refuses what replay refuses."""
    import operator

    from replaydiff import aten
    from replaydiff.repro.write import write_repro

    rt = replaydiff.open_trace(traces["clean"]).rank(0)
    write_repro(rt, next(op for op in rt if op.name == "aten.addmm.default"), tmp_path / "r")
    script = _copied_script(tmp_path / "r")
    names = [f"operator.{n}" for n in dir(operator) if not n.startswith("__")] + [
        "builtins.eval", "os.system", "aten.mm.default", "prims.convert_element_type.default", "torch.mm"]

    def allowed(resolve, name):
        try:
            return resolve(name) is not None
        except (ValueError, aten.UnknownOp):
            return False

    replay = {n for n in names if allowed(aten.resolve_graph_target, n)}
    assert {n for n in names if allowed(script.graph_target, n)} == replay
    assert {"operator.getitem", "operator.add", "aten.mm.default", "prims.convert_element_type.default"} <= replay
    assert not replay & {"operator.setitem", "operator.attrgetter", "operator.call", "builtins.eval", "os.system",
                         "torch.mm"}


class ConvBN(nn.Module):
    """conv1 -> ReLU -> conv2 -> BatchNorm -> ReLU: conv2's bias gradient feeds a BatchNorm, so it is a sum that is
    mathematically zero (its recorded float32 values are rounding noise)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), \
            nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv2(torch.relu(self.conv1(x)))))


def _conv_bn_step() -> None:
    torch.manual_seed(0)
    model = ConvBN()
    x = torch.randn(8, 3, 8, 8)
    F.mse_loss(model(x), torch.randn(8, 4, 8, 8)).backward()


def test_fp32_replay_recognises_an_ill_conditioned_op_as_fp64_does(tmp_path):
    """At --precision fp32 a float32 op's reference is its own dtype's run, so its own error cannot be measured
    against it (the conv bias gradient before a BatchNorm would read divergent "while the op itself is exact"):
    it is judged against float64 instead, as at fp64, and is ok; a 1e-3 fault planted in that very op is named."""
    with replaydiff.record(tmp_path / "clean"):
        _conv_bn_step()
    # call 1: the first convolution_backward of the step is conv2's (backward runs in reverse): its grad_input
    with replaydiff.record(tmp_path / "planted", plant="aten.convolution_backward.default:1:1e-3"):
        _conv_bn_step()
    ops = [op for op in replaydiff.open_trace(tmp_path / "clean").rank(0)]
    conv2 = [op.index for op in ops if op.name == "aten.convolution_backward.default"][0]
    clean = replay_trace(str(tmp_path / "clean"), ReplayOptions(precision="fp32"))
    assert clean.first_divergent is None, [(r.index, r.op, r.reason) for r in clean.ops if r.status is Status.DIVERGENT]
    (r,) = [r for r in clean.ops if r.index == conv2]
    assert r.status is Status.OK and r.module == "ConvBN.conv2"
    assert r.reason.startswith("within its own float32 error (ill-conditioned"), r.reason
    assert r.metrics["ill_conditioned"] is True and r.metrics["precision"] == "fp64"  # judged against float64
    assert r.metrics["same_dtype_max_abs"] > 0 and r.metrics["norm_max"] > 1000 * r.metrics["limit_max"]
    assert 0 < r.severity <= 1 and r.verdict.explanation == r.reason
    planted = replay_trace(str(tmp_path / "planted"), ReplayOptions(precision="fp32"))
    culprit = planted.first_divergent
    assert culprit is not None and (culprit.index, culprit.module) == (conv2, "ConvBN.conv2")
    assert [x.index for x in planted.ops if x.status is Status.DIVERGENT] == [conv2]
    assert culprit.severity > 1
