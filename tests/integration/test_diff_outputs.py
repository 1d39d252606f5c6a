"""Which output an op is judged on, outputs whose size is set by cancellation, and runs at different precisions.

An op with several results (native_layer_norm: out, mean, rstd) is named with the output judged, in diff, replay and
the report. A pair whose outputs differ beyond the fixed limits while each side's op, replayed alone from its own
inputs, is right (the mean of an input already centred; bf16 rounding carried through an fp32-against-autocast
step) introduced nothing: no divergence. Faults are planted below the recorder, and the op numbers they land on are
read back from the traces.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import replay_helpers as rh
from replaydiff import record
from replaydiff.diff import PairStatus, diff_traces
from replaydiff.faults import PlantedFault

from diff_outputs_helpers import _both_units_aligned, _Centred, _index, _run, LN


LN_BACKWARD = "aten.native_layer_norm_backward.default"


class _ScaleOutput(TorchDispatchMode):
    """Below the recorder: output ``position`` of the first call of ``op`` times 1 + ``rel`` (a kernel wrong in one
    of its results only)."""

    def __init__(self, op: str, position: int, rel: float) -> None:
        super().__init__()
        self.op, self.position, self.rel, self.planted = op, position, rel, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) == self.op and not self.planted:
            self.planted = True
            out[self.position].mul_(1 + self.rel)
        return out


class _RoundsDifferently(TorchDispatchMode):
    """Below the recorder: every other element of ``op``'s output one ulp up, as a kernel that sums in another
    order rounds (a difference far within tolerance)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) == self.op and out.is_floating_point():
            self.calls += 1
            flat = out.view(-1)
            flat[::2] = torch.nextafter(flat[::2], torch.full_like(flat[::2], float("inf")))
        return out


def _centred_step(path: Path, mode: TorchDispatchMode | None = None) -> Path:
    model = _Centred()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    if mode is None:
        return rh.record_fn(path, lambda: model(x).square().mean().backward())
    with mode:
        with record(path):
            model(x).square().mean().backward()
    return path


# -- which output ------------------------------------------------------------------------------------------------
def test_replay_and_diff_name_the_output_of_a_planted_layer_norm_backward(tmp_path, capsys):
    """The demo's fault: native_layer_norm_backward's output 0 (grad_input) times 1 + 1e-3."""
    clean = _centred_step(tmp_path / "clean")
    fault = PlantedFault(LN_BACKWARD, rel=1e-3)
    faulty = tmp_path / "faulty"
    rh.record_fn(faulty, lambda: _Centred()(torch.randn(32, 8, generator=torch.Generator().manual_seed(1)))
                 .square().mean().backward(), fault)
    culprit = _index(faulty, LN_BACKWARD)
    proc = _run(capsys, "replay", str(faulty), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    at = next(n for n, line in enumerate(lines) if line.startswith("first divergent op "))
    assert lines[at].startswith(f"first divergent op #{culprit} {LN_BACKWARD}"), lines[at]
    assert lines[at + 1].startswith("  output 0 (grad_input): error / limit "), lines[at + 1]
    op = next(o for o in json.loads((tmp_path / "r.json").read_text())["ops"] if o["index"] == culprit)
    assert op["metrics"]["output"] == {"index": 0, "role": "grad_input", "outputs": 3}

    proc = _run(capsys, "diff", str(clean), str(faulty), "--json", str(tmp_path / "d.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    at = next(n for n, line in enumerate(lines) if "first divergence" in line)
    assert f"target #{culprit} {LN_BACKWARD}" in lines[at], lines[at]
    assert lines[at + 1].startswith("    output 0 (grad_input): max_abs/(eps*absmax) "), lines[at + 1]
    first = json.loads((tmp_path / "d.json").read_text())["first_divergent"]
    assert first["index"]["target"] == culprit
    assert first["metrics"]["output"] == {"index": 0, "role": "grad_input", "outputs": 3}


def test_a_fault_in_one_output_is_named_with_that_output(tmp_path, capsys):
    """rstd (output 2) of the LayerNorm wrong, its out and mean right: replay, diff and the report say rstd."""
    clean = _centred_step(tmp_path / "clean")
    fault = _ScaleOutput(LN, 2, 1e-3)
    faulty = _centred_step(tmp_path / "faulty", fault)
    assert fault.planted
    ln = _index(faulty, LN)
    proc = _run(capsys, "replay", str(faulty), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"first divergent op #{ln} {LN}" in proc.stdout
    assert "\n  output 2 (rstd): error / limit " in proc.stdout, proc.stdout
    proc = _run(capsys, "report", str(faulty), "--replay", str(tmp_path / "r.json"), "-o", str(tmp_path / "r.html"))
    assert "output 2 (rstd): error / limit" in (tmp_path / "r.html").read_text()

    report = diff_traces(clean, faulty)
    rd, first = report.first_divergent
    assert (first.ref, first.target, first.op) == (_index(clean, LN), ln, LN)
    assert (first.verdict.output.index, first.verdict.output.role) == (2, "rstd")
    proc = _run(capsys, "diff", str(clean), str(faulty))
    assert proc.returncode == 1
    assert "\n    output 2 (rstd): max_abs/(eps*absmax) " in proc.stdout, proc.stdout


def test_the_tui_detail_names_the_output_judged(tmp_path):
    from replaydiff.tui.details import verdict_lines
    from replaydiff.tui.model import RowResult

    fault = _ScaleOutput(LN, 1, 1e-2)
    faulty = _centred_step(tmp_path / "faulty", fault)
    result = next(r for r in rh.replay(faulty).ops if r.index == _index(faulty, LN))
    lines = verdict_lines(RowResult.of_replay(result))
    assert any("judged: [bold]output 1 (mean)[/] of 3" in line for line in lines), lines


# -- cancellation: the mean of a centred input -------------------------------------------------------------------
def test_a_near_zero_mean_that_rounds_differently_is_no_divergence(tmp_path, capsys):
    """The centring rounds differently in the target (one ulp, far within tolerance): the LayerNorm's mean of it,
    ~1e-8, then differs by ~1e7 eps of its own size, and each side's op is right given its own inputs."""
    clean = _centred_step(tmp_path / "clean")
    mode = _RoundsDifferently("aten.sub.Tensor")
    other = _centred_step(tmp_path / "other", mode)
    assert mode.calls == 1
    report = diff_traces(clean, other)
    rd = report.ranks[0]
    assert report.first_divergent is None, report.first_divergent[1].reason
    ln = rd.by_target[_index(other, LN)]
    assert ln.status is PairStatus.SAME and ln.explained, ln.reason
    assert ln.verdict.output.role == "mean" and ln.verdict.measure.norm_max > 1e4  # over the fixed limit, explained
    assert "each side's op replayed here from its own inputs is right" in ln.reason
    proc = _run(capsys, "diff", str(clean), str(other), "--json", str(tmp_path / "d.json"))
    assert proc.returncode == 0, proc.stdout
    assert f"target #{ln.target} {LN}" in proc.stdout and "output 1 (mean)" in proc.stdout
    assert json.loads((tmp_path / "d.json").read_text())["ranks"][0]["explained"] >= 1


def test_a_real_fault_after_a_differently_rounded_input_is_still_named(tmp_path):
    clean = _centred_step(tmp_path / "clean")
    fault = PlantedFault("aten.addmm.default", rel=1e-3, call=2)  # the head, after the LayerNorm
    faulty = tmp_path / "faulty"
    with _RoundsDifferently("aten.sub.Tensor"):
        rh.record_fn(faulty, lambda: _Centred()(torch.randn(32, 8, generator=torch.Generator().manual_seed(1)))
                     .square().mean().backward(), fault)
    report = diff_traces(clean, faulty)
    rd, first = report.first_divergent
    assert (first.target, first.op) == (_index(faulty, "aten.addmm.default", 1), "aten.addmm.default")
    assert "replayed here from its own inputs, the target's op is divergent" in first.reason, first.reason


# -- fp32 against bf16 autocast ---------------------------------------------------------------------------------
def test_fp32_against_bf16_autocast_is_judged_at_bf16_limits_and_names_no_op(tmp_path, capsys):
    ref, target = rh.step_trace("transformer"), rh.step_trace("transformer_bf16")
    report = diff_traces(ref, target)
    rd = report.ranks[0]
    assert report.first_divergent is None, report.first_divergent[1].reason
    assert not [p for p in rd.pairs if p.status is not PairStatus.SAME and p.status is not PairStatus.NOT_COMPARED]
    (prec,) = rd.precision
    assert (prec.ref, prec.target, prec.judged_at) == ("float32", "bfloat16", "bfloat16")
    assert prec.pairs == sum(p.dtypes == ("float32", "bfloat16") for p in rd.pairs) > 10
    proc = _run(capsys, "diff", str(ref), str(target), "--json", str(tmp_path / "d.json"))
    assert proc.returncode == 0, proc.stdout
    said = [line for line in proc.stdout.splitlines() if line.startswith("  precision: ")]
    assert said == [f"  precision: {prec.pairs} aligned pair(s) compute in float32 in ref, bfloat16 in target: "
                    f"judged at bfloat16's limits (max_abs/(eps*absmax) 1, rel_l2/eps 0.5)"], proc.stdout
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["ranks"][0]["precision"] == [{"ref": "float32", "target": "bfloat16", "judged_at": "bfloat16",
                                             "pairs": prec.pairs, "limit_max": 1.0, "limit_rel": 0.5}]


def test_a_fault_in_a_bf16_matmul_against_fp32_is_named(capsys):
    """5e-2 is ~6 bf16 epsilons: a fault bf16 can tell apart from its rounding."""
    ref = rh.step_trace("transformer")
    target = rh.step_trace("transformer_bf16", fault_op="aten.bmm.default", rel=5e-2, occurrence=1)
    report = diff_traces(ref, target)
    rd, first = report.first_divergent
    assert (first.target, first.op) == (_index(target, "aten.bmm.default", 1), "aten.bmm.default")
    assert first.dtypes == ("float32", "bfloat16")
    assert [p.key for p in rd.pairs if p.status is PairStatus.DIVERGENT] == [first.key]


def test_eager_against_aot_eager_aligns_both_units_of_a_model_with_layer_norm(tmp_path, capsys):
    _both_units_aligned(tmp_path, capsys, "aot_eager")


def test_a_compiled_layer_norm_of_a_differently_rounded_centred_input_is_no_divergence(tmp_path, capsys):
    """The LayerNorm compiled alone (aot_eager: one unit per call, its mean a getitem of native_layer_norm), the
    centring before it summing the other way round in the target (its mean rounds otherwise): the unit's mean output,
    ~1e-8, differs far beyond the fixed limits from the eager mean, and the unit and the eager op are each right
    given their own inputs."""
    def step(path: Path, compiled: bool) -> Path:
        model = _Centred()
        ln = torch.compile(model.ln, backend="aot_eager") if compiled else model.ln
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        torch._dynamo.reset()
        try:
            with record(path):
                h = model.inp(x)
                centre = h.flip(-1).mean(-1, keepdim=True) if compiled else h.mean(-1, keepdim=True)
                model.head(ln(h - centre)).square().mean().backward()
        finally:
            torch._dynamo.reset()
        return path

    eager, compiled = step(tmp_path / "eager", False), step(tmp_path / "compiled", True)
    rd = diff_traces(eager, compiled).ranks[0]
    fw = next(u for u in rd.units if u.op == "compiled.unit.forward")
    assert fw.eager == (_index(eager, LN),) and fw.status is PairStatus.SAME, (fw.status, fw.reason)
    assert fw.verdict.output.role == "mean" and fw.verdict.measure.norm_max > 1e4, fw.verdict
    assert "each side's op replayed here from its own inputs is right" in fw.reason
    bw = next(u for u in rd.units if u.op == "compiled.unit.backward")
    assert bw.eager == (_index(eager, LN_BACKWARD),) and bw.status is PairStatus.SAME, (bw.status, bw.reason)
    proc = _run(capsys, "diff", str(eager), str(compiled))
    assert proc.returncode == 0, proc.stdout
