"""A bad batch, scaled at one step in the training loop (outside any module), makes a LayerNorm give NaN: the flight
recorder writes the window, ``trend`` names the scaling ``mul`` as the cause, and its zoom-in must hold that ``mul``
(the first change, the ``addmm`` that reads it, is in a module; the ``mul`` is in none, where no ``--module`` filter
reaches). The zoom-in's replay then names the ``mul`` as where the difference comes from, and its NaN line names the
first op whose recorded outputs hold NaN/Inf, in the order ops ran (the forward LayerNorm), not the backward op that
handed them to the first replayed op that reads them. Op numbers are read back from the traces, never typed in.
"""
from __future__ import annotations

import json
import shlex

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main as cli_main
from replaydiff.replay.nonfinite_source import nonfinite_counts_of
from replaydiff.report.json_report import load_replay_json
from replaydiff.trace import open_trace
from replaydiff.trend import compute_trend

from steps_helpers import one_thread  # noqa: F401 (autouse: one intra-op thread, restored afterwards)

BAD = 8  # the step whose batch is scaled




def train(scale: float, steps: int = BAD) -> None:
    """Adam on a Linear-LayerNorm-ReLU-Linear MLP; at step BAD the batch is multiplied by ``scale`` in the loop. At
    1e36 the first Linear's output stays finite (about 2e36 in float32) and the LayerNorm's variance overflows: NaN.
    At 3e38 the mul itself overflows to Inf."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True)
        if step == BAD:
            x = x * scale  # BUG: a bad batch
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _op(r, name: str, module: str | None = None, phase: str = "forward"):
    return next(op for op in r if op.step == BAD and op.name == name and op.module == module and op.phase == phase)


def test_the_zoom_in_holds_the_top_level_mul_trend_names_and_its_replay_names_that_mul(tmp_path, capsys):
    flight = tmp_path / "flight"
    with replaydiff.record(flight, tensors="stats", flight=8):
        train(1e36)
    r = open_trace(flight).rank(0)
    t = compute_trend(r)
    mul = _op(r, "aten.mul.Tensor")
    assert t.cause is not None and (t.cause.index, t.cause.module) == (mul.index, None)
    first = t.first_change
    assert first is not None and first.module == "Sequential.0" and first.op != mul.name

    # The printed record command, the Python call and the JSON's zoom say the same, and hold the mul
    assert cli_main(["trend", str(flight)]) == 1
    text = capsys.readouterr().out
    out = f"{flight}-step{BAD}"
    assert f"\n  replaydiff record --tensors full --steps {BAD - 1}-{BAD} --op aten.mul.Tensor --op {first.op} " \
           f"-o {shlex.quote(out)} --\n" in text, text
    assert f"replaydiff.record('{out}', tensors='full', steps='{BAD - 1}-{BAD}', ops=['aten.mul.Tensor', " \
           f"'{first.op}'])" in text
    assert cli_main(["trend", str(flight), "--json", "-"]) == 1
    zoom = json.loads(capsys.readouterr().out)["zoom"]
    assert zoom == {"tensors": "full", "steps": f"{BAD - 1}-{BAD}", "modules": None,
                    "ops": ["aten.mul.Tensor", first.op], "out": out}

    # Recorded as it says: the cause and the first change keep their data (replay judges them)
    with replaydiff.record(out, tensors=zoom["tensors"], steps=zoom["steps"], ops=zoom["ops"]):
        train(1e36)
    z = open_trace(out).rank(0)
    zmul, zfirst = _op(z, "aten.mul.Tensor"), _op(z, first.op, first.module)
    assert zmul.data_left_out is None and zfirst.data_left_out is None
    norm = _op(z, "aten.native_layer_norm.default", "Sequential.1")
    assert z.producers(zfirst.index)[1] == zmul.index

    assert cli_main(["replay", out]) == 0
    text = capsys.readouterr().out
    # where the difference comes from: the mul, a one-off op that replays right, with its line
    assert f"the difference enters through input 1 of op #{zfirst.index} {first.op} (Sequential.0, forward) at " \
           f"step {BAD}, from op #{zmul.index} aten.mul.Tensor at {zmul.source}, which ran in no earlier step of " \
           f"this trace and replays right: the change is its doing" in text, text
    # where the NaN come from: the forward LayerNorm, though the first replayed op to read them is later
    assert f"NaN enter the step from op #{norm.index} aten.native_layer_norm.default (Sequential.1, forward) at " \
           f"{norm.source}, which was not replayed (its data left out): its recorded outputs are the first to hold " \
           f"them (528 NaN), made from inputs that hold none; they reach input" in text, text
    doc_path = tmp_path / "replay.json"
    assert cli_main(["replay", out, "--json", str(doc_path)]) == 0
    doc = json.loads(doc_path.read_text())
    assert (doc["enters"]["producer"], doc["enters"]["producer_source"]) == (zmul.index, zmul.source)
    held = doc["nonfinite_entry"]["nonfinite_input"]
    assert (held["earliest"], held["earliest_op"], held["earliest_nan"], held["earliest_inf"],
            held["earliest_made"]) == (norm.index, "aten.native_layer_norm.default", 528, 0, True)
    assert load_replay_json(doc_path).nonfinite_entry.nonfinite_input.earliest == norm.index  # read back
    capsys.readouterr()
    cli_main(["report", out, "--replay", str(doc_path), "--no-probe"])  # the health report's NaN/Inf row
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| NaN/Inf origin |"))
    assert f"(from op #{norm.index} aten.native_layer_norm.default, not replayed, the first whose recorded " \
           f"outputs hold them)" in row, row


@pytest.mark.parametrize("scale, module, first_bad, kinds", [
    (1e36, "Sequential.0", ("aten.native_layer_norm.default", "Sequential.1"), "NaN"),
    (1e36, "Sequential.3", ("aten.native_layer_norm.default", "Sequential.1"), "NaN"),
    (3e38, "Sequential.3", ("aten.mul.Tensor", None), "Inf and NaN"),
], ids=["first-linear", "last-linear", "mul-overflows"])
def test_nan_from_ops_replay_did_not_run_are_named_at_the_first_op_whose_recorded_outputs_hold_them(
        tmp_path, capsys, scale, module, first_bad, kinds):
    """A --module zoom-in: the first replayed op to read NaN is a backward ``mm`` (Sequential.0, fed by
    native_layer_norm_backward) or the last Linear's ``addmm`` (fed by the ReLU); the NaN line names the earliest op,
    in the order ops ran, whose recorded outputs hold NaN/Inf: the forward LayerNorm at 1e36 (the first Linear's
    output is still finite), the mul at 3e38 (it overflows to Inf, the LayerNorm turns them into NaN)."""
    path = tmp_path / "z"
    with replaydiff.record(path, tensors="full", steps=f"{BAD - 1}-{BAD}", modules=[module]):
        train(scale)
    z = open_trace(path).rank(0)
    addmm = _op(z, "aten.addmm.default", "Sequential.0")
    if scale == 1e36:  # no Inf before the LayerNorm: its variance overflows, not the matmul
        assert nonfinite_counts_of(z, addmm.outputs_refs()[0]) == (0, 0)
    origin = _op(z, *first_bad)
    assert origin.data_left_out == "filtered"
    assert cli_main(["replay", str(path), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    entry = doc["nonfinite_entry"]
    held = entry["nonfinite_input"]
    reader = z[entry["index"]]
    assert reader.module == module and held["producer"] != origin.index  # the reader got them through other ops
    assert (held["earliest"], held["earliest_op"], held["earliest_made"]) == (origin.index, origin.name, True)
    backward = min(op.index for op in z if op.step == BAD and op.phase == "backward")
    assert origin.phase == "forward" and origin.index < backward  # named in the forward pass ...
    if module == "Sequential.0":  # ... though a backward op handed them to the first replayed op to read them
        assert z[held["producer"]].name == "aten.native_layer_norm_backward.default"
    assert cli_main(["replay", str(path)]) == 0
    where = f"{origin.module or 'no module'}, forward"
    assert f"{kinds} enter the step from op #{origin.index} {origin.name} ({where}) at {origin.source}, which was " \
           f"not replayed" in capsys.readouterr().out


def test_a_log_of_zero_inside_a_module_is_named_by_trend_and_by_its_zoom_ins_replay(tmp_path, capsys):
    """log(|x|) inside a module's forward meets a zero in the batch at step 12 of 20 (-Inf, then NaN from the
    LayerNorm): with --flight 6, trend's cause is the log, the zoom-in is of its module, and its replay names the
    log as the origin and claims nothing else (no "no input changed 4x" line beside the origin)."""
    class LogAbs(torch.nn.Module):
        def forward(self, x):
            return torch.log(x.abs())

    def run(path, **options) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(LogAbs(), torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        with replaydiff.record(path, **options):
            for step in range(1, 21):
                x = torch.randn(16, 8, generator=g)
                y = x.sum(1, keepdim=True)
                if step == 12:
                    x[3, 5] = 0.0  # BUG: one exact zero
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()

    run(tmp_path / "f", tensors="stats", flight=6)
    r = open_trace(tmp_path / "f").rank(0)
    t = compute_trend(r)
    log = next(op for op in r if op.step == 12 and op.name == "aten.log.default")
    assert t.cause is not None and (t.cause.index, t.cause.module, t.cause.from_finite) == \
        (log.index, "Sequential.0", True)
    zoom = t.zoom
    assert (zoom.steps, zoom.modules, zoom.ops) == ("11-12", ["Sequential.0"], None)
    run(tmp_path / "z", tensors="full", steps=zoom.steps, modules=zoom.modules)
    z = open_trace(tmp_path / "z").rank(0)
    zlog = next(op for op in z if op.step == 12 and op.name == "aten.log.default")
    assert cli_main(["replay", str(tmp_path / "z")]) == 0
    text = capsys.readouterr().out
    assert f"NaN/Inf origin: #{zlog.index} aten.log.default  Sequential.0  (forward)  {zlog.source} (finite " \
           f"inputs, non-finite recorded output)" in text, text
    assert "no input from outside the replayed ops" not in text and "enter the step" not in text, text


def test_inf_a_left_out_op_was_passed_as_a_number_are_said_to_be_put_there_not_made(tmp_path, capsys):
    """``x[0].fill_(inf)`` in the loop, recorded with --module Sequential.1: the first replayed op reads Inf/NaN
    through the first Linear (left out); the line names the fill_ and the number it was passed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    path = tmp_path / "t"
    with replaydiff.record(path, modules=["Sequential.1"]):
        x = torch.randn(5, 4)
        x[0].fill_(float("inf"))  # BUG
        model(x).sum().backward()
    r = open_trace(path).rank(0)
    fill = next(op for op in r if op.name == "aten.fill_.Scalar")
    assert fill.data_left_out == "filtered"
    assert cli_main(["replay", str(path), "--json", "-"]) == 0
    held = json.loads(capsys.readouterr().out)["nonfinite_entry"]["nonfinite_input"]
    assert (held["earliest"], held["earliest_argument"], held["earliest_made"], held["earliest_inf"]) == \
        (fill.index, "inf", False, 4)
    assert cli_main(["replay", str(path)]) == 0
    assert f"from op #{fill.index} aten.fill_.Scalar (no module, forward) at {fill.source}, which was not replayed " \
           f"(its data left out): its recorded outputs are the first to hold them (4 Inf), put there by a number " \
           f"passed to it (inf); they reach input" in capsys.readouterr().out
