"""Planted faults are found exactly: the planted op is the first divergent op and no other op diverges, although every
op after it computed on the error (replay feeds each op its own recorded inputs).

A PlantedFault sits below the recorder and multiplies the output (or the first written argument) of the N-th call
(from 1) of one op by 1 + rel, as a buggy kernel would. The planted op's number is read back from the trace: the N-th
op of that name. A plant that changes nothing, or no more than rounding does, is said to be so by every report.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import replay_helpers as rh
from replaydiff.cli.main import main
from replaydiff.faults import PlantedFault
from replaydiff.record import record
from replaydiff.replay import Status
from replaydiff.trace import open_trace


def _planted(step: str, op: str, rel: float = 1e-3, occurrence: int = 0, phase: str | None = None):
    path = rh.step_trace(step, op, rel=rel, occurrence=occurrence)
    ops = rh.trace_ops(path)
    index = rh.occurrence_index(ops, op, occurrence)
    if phase is not None:
        assert {o.index: o for o in ops}[index].phase == phase
    return path, index


@pytest.fixture(scope="module")
def forward_matmul() -> tuple[str, int]:
    """(name, occurrence) of the first matmul of the transformer's forward, found in a clean trace."""
    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(rh.step_trace("transformer")), rh.MATMULS, "forward")
    return name, occurrence


def test_forward_matmul_fault_is_named_exactly(forward_matmul):
    name, occurrence = forward_matmul
    path, index = _planted("transformer", name, 1e-3, occurrence, phase="forward")
    report = rh.replay(path)
    rh.assert_only_culprit(report, index)
    culprit = report.first_divergent
    assert culprit.op == name and culprit.phase == "forward"
    assert culprit.module and culprit.module.startswith("TinyTransformer.")
    # 1e-3 relative in fp32 is ~8000 eps: far over the limit, and the metrics say so
    assert culprit.metrics["rel_l2"] == pytest.approx(1e-3, rel=0.2)
    assert culprit.metrics["norm_max"] > culprit.metrics["limit_max"]


def test_layer_norm_backward_fault_is_named_exactly():
    op = "aten.native_layer_norm_backward.default"
    path, index = _planted("transformer", op, 1e-3, 0, phase="backward")
    report = rh.replay(path)
    rh.assert_only_culprit(report, index)
    culprit = report.first_divergent
    assert culprit.phase == "backward"
    assert culprit.forward_index is not None
    fwd = {o.index: o for o in rh.trace_ops(path)}[culprit.forward_index]
    assert fwd.name == "aten.native_layer_norm.default" and fwd.phase == "forward"


@pytest.mark.parametrize("step, op", [
    ("mlp_forloop", "aten.addcdiv_.default"),  # foreach=False: one in-place op per parameter
    ("mlp_foreach", "aten._foreach_addcdiv_.ScalarList"),  # foreach=True: returns None, writes its first list
    ("mlp_fused", "aten._fused_adamw_.default"),  # fused=True: one op writes params and both moments
], ids=["for-loop", "foreach", "fused"])
def test_adamw_fault_is_named_exactly(step, op):
    clean = rh.trace_ops(rh.step_trace(step))
    names = {o.name for o in clean if o.phase == "optimizer"}
    assert op in names, f"{step} ran no {op} in its optimizer phase: {sorted(names)}"
    path, index = _planted(step, op, 1e-3, 0, phase="optimizer")
    report = rh.replay(path)
    rh.assert_only_culprit(report, index)
    assert report.first_divergent.phase == "optimizer"


def test_bf16_autocast_fault_of_1e_2_is_named_exactly():
    """The brief: an fp64 replay caught 1e-2 in bf16 with no false alarm downstream."""
    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(rh.step_trace("transformer_bf16")), rh.MATMULS,
                                            "forward", dtype="bfloat16")
    path, index = _planted("transformer_bf16", name, 1e-2, occurrence, phase="forward")
    report = rh.replay(path)
    rh.assert_only_culprit(report, index)


def test_fault_below_fp64_resolution_is_found_at_same_precision(forward_matmul):
    """1e-7 relative is about one fp32 ulp: an fp64 reference cannot tell it from rounding, but a replay at the
    recorded precision on the recording backend is bitwise, and the planted op is the only one that differs."""
    name, occurrence = forward_matmul
    path, index = _planted("transformer", name, 1e-7, occurrence)
    fp64 = rh.replay(path)
    assert fp64.counts()["divergent"] == 0, rh.describe(rh.by_status(fp64, Status.DIVERGENT))
    assert fp64.counts()["error"] == 0
    same = rh.replay(path, precision="same")
    rh.assert_only_culprit(same, index)
    assert same.first_divergent.metrics["mismatches"] > 0


def test_nan_origin_is_the_op_that_made_the_nan():
    """Every op after the planted one sees NaN, but only the planted op has finite inputs and a NaN output."""
    clean = rh.trace_ops(rh.step_trace("mlp"))
    name, occurrence, _ = rh.first_in_phase(clean, rh.MATMULS, "forward")
    path, index = _planted("mlp", name, float("nan"), occurrence, phase="forward")
    ops = rh.trace_ops(path)
    later_nan = [op for op in ops if op.index > index and op.phase == "backward"]
    assert later_nan, "the NaN must flow on into backward"
    report = rh.replay(path)
    origin = report.nonfinite_origin
    assert origin is not None and origin.index == index and origin.op == name
    assert [r.index for r in report.ops if r.nonfinite_origin] == [index]
    # the planted op's output has NaN where the reference has none: divergent, and the only divergent op (the ops
    # after it get NaN in and give NaN out, as recorded)
    rh.assert_only_culprit(report, index)
    assert report.first_divergent.metrics["nonfinite_mismatch"] > 0
    assert not math.isnan(report.first_divergent.metrics["max_abs"])
    assert report.nonfinite_entry is None  # made inside the step: nothing came in with NaN


@pytest.mark.parametrize("written_inside", [False, True])
def test_nan_from_the_batch_is_named_where_it_enters_the_step(tmp_path, capsys, written_inside):
    """No op makes the NaN: it comes in with the batch. Written before the step, the first op to read the batch
    holds it; written inside (``x[1, 2] = nan``: lift_fresh of a tensor made outside the dispatcher, then copy_), the
    copy_ that reads it through lift_fresh (a view, no new value) is where it enters. The replay stays clean (exit 0)
    and says so in one line; the JSON names the op, the input and the count."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    if not written_inside:
        x[1, 2] = float("nan")
    path = tmp_path / "t"
    with record(path):
        if written_inside:
            x[1, 2] = float("nan")
        lin(x).sum().backward()
    ops = rh.trace_ops(path)
    name, module = ("aten.copy_.default", "no module") if written_inside else ("aten.addmm.default", "Linear")
    position = 1  # copy_(self, src); addmm(bias, input, weight.t())
    index = next(op.index for op in ops if op.name == name)
    report = rh.replay(path)
    assert report.nonfinite_origin is None and report.first_divergent is None
    entry = report.nonfinite_entry
    assert entry is not None and (entry.index, entry.op) == (index, name)
    assert (entry.nonfinite_input.position, entry.nonfinite_input.nan, entry.nonfinite_input.inf,
            entry.nonfinite_input.producer) == (position, 1, 0, None)
    # later ops that read the same batch (the weight's gradient) hold it too; the entry is the first of them
    assert min(r.index for r in report.ops if r.nonfinite_input is not None) == index

    doc_path = tmp_path / "t.json"
    capsys.readouterr()
    assert main(["replay", str(path), "--json", str(doc_path)]) == 0
    out = capsys.readouterr().out
    assert f"NaN enter the step from outside the trace: input {position} of op #{index} {name} " \
           f"({module}, forward) already holds 1 NaN" in out, out
    doc = json.loads(doc_path.read_text())
    assert doc["nonfinite_origin"] is None
    assert (doc["nonfinite_entry"]["index"], doc["nonfinite_entry"]["nonfinite_input"]) == \
        (index, {"position": position, "nan": 1, "inf": 0, "producer": None, "producer_op": None})
    from replaydiff.report.json_report import load_replay_json
    assert load_replay_json(doc_path).nonfinite_entry.nonfinite_input == entry.nonfinite_input
    # the health report's NaN/Inf row says it too (and fails: the step holds NaN), read back from the JSON
    main(["report", str(path), "--replay", str(doc_path)])
    assert f"| NaN/Inf origin | none made; 1 NaN enter through input {position} of #{index} {name} (from outside " \
           f"the trace) | none | FAIL |" in capsys.readouterr().out


def test_an_additive_mask_of_minus_inf_made_before_the_step_is_let_in_and_discarded(tmp_path, capsys):
    """nn.Transformer's causal mask, made once before the steps: -inf comes in from outside on every healthy step and
    the softmax ends it. The line says where it enters and where it ends; no entry is reported, the replay is clean
    and the health report passes its NaN/Inf row."""
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    q = torch.randn(4, 4, requires_grad=True)
    with record(tmp_path / "t"):
        (q @ q.t() + mask).softmax(-1).sum().backward()
    ops = rh.trace_ops(tmp_path / "t")
    add = next(op for op in ops if op.name == "aten.add.Tensor")
    softmax = next(op for op in ops if op.name == "aten._softmax.default")
    report = rh.replay(tmp_path / "t")
    assert report.nonfinite_entry is None and report.nonfinite_origin is None
    assert [(r.index, r.nonfinite_discarded_by) for r in report.nonfinite_discarded] == [(add.index, [softmax.index])]
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "t"), "--json", str(tmp_path / "r.json")]) == 0
    assert f"Inf enter the step from outside the trace and are discarded: input 1 of op #{add.index} aten.add.Tensor " \
           f"(no module, forward) already holds 6 Inf: followed forward, they end at #{softmax.index} " \
           f"aten._softmax.default (finite output), so they reach no loss, gradient, parameter or output of the step " \
           f"(information, not a fault)" in capsys.readouterr().out
    main(["report", str(tmp_path / "t"), "--replay", str(tmp_path / "r.json")])
    assert f"| NaN/Inf origin | none; let in and discarded: #{add.index} aten.add.Tensor | none | pass |" \
           in capsys.readouterr().out


def test_nan_written_by_an_op_outside_the_module_filter_enters_from_that_op(tmp_path, capsys):
    """Recorded with --module Linear, the copy_ that writes the NaN into the batch keeps statistics only (not
    replayed): the NaN enters through the addmm's input 1, from that copy_."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    path = tmp_path / "t"
    with record(path, modules="Linear"):
        x = torch.randn(3, 4)
        x[1, 2] = float("nan")
        lin(x).sum().backward()
    ops = rh.trace_ops(path)
    copy = next(op for op in ops if op.name == "aten.copy_.default")
    addmm = next(op for op in ops if op.name == "aten.addmm.default")
    assert copy.data_left_out == "filtered" and addmm.data_left_out is None
    report = rh.replay(path)
    entry = report.nonfinite_entry
    assert (entry.index, entry.nonfinite_input.position, entry.nonfinite_input.producer,
            entry.nonfinite_input.producer_op) == (addmm.index, 1, copy.index, "aten.copy_.default")
    assert main(["replay", str(path)]) == 0
    assert f"NaN enter the step from op #{copy.index} aten.copy_.default, which was not replayed (its data " \
           f"left out): input 1 of op #{addmm.index} aten.addmm.default (Linear, forward) already holds 1 NaN" \
           in capsys.readouterr().out



def test_a_zoom_in_that_names_where_the_nan_enters_says_it_once(tmp_path, capsys):
    """Two steps recorded with --module Linear, NaN written into the batch at the second: the zoom-in's "the difference
    enters through" line and the NaN entry line named the same input of the same op; only the first is printed."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    path = tmp_path / "t"
    with record(path, modules="Linear", steps="1-2"):
        for step in (1, 2):
            x = torch.randn(3, 4)
            if step == 2:
                x[1, 2] = float("nan")
            lin(x).sum().backward()
            opt.step()
            opt.zero_grad()
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "the difference enters through input 1 of op #" in out, out
    assert "NaN enter the step" not in out, out


# -- plants that change nothing, or less than replay can tell from rounding -------------------------------------------
# A plant made through the public option (record(plant=...), as `record --plant`): the manifest says where it landed
# and what it did, and replay and the health report say so instead of reading like a fault replay failed to find.
def _record_plant(path: Path, fn, plant: str):
    with record(path, plant=plant):
        fn()
    return open_trace(path).rank(0)


def _replay_and_report(path: Path, capsys) -> tuple[int, list[str], dict, str]:
    """Exit code and stdout lines of `replay`, its --json document, and the markdown health report."""
    capsys.readouterr()
    doc_path = path.parent / (path.name + ".json")
    code = main(["replay", str(path), "--json", str(doc_path)])
    text = capsys.readouterr().out.splitlines()
    main(["report", str(path), "--replay", str(doc_path)])
    return code, text, json.loads(doc_path.read_text()), capsys.readouterr().out


def test_planted_fault_counts_calls_from_1_like_record_plant():
    with PlantedFault("aten.relu.default", rel=1.0, call=2) as fault:
        outs = [torch.relu(torch.ones(2)) for _ in range(3)]
    assert [o.tolist() for o in outs] == [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]]
    assert fault.planted and fault.seen == 3
    # 1.0 -> 2.0 in float32 is 2**23 ulps; both elements changed
    assert (fault.effect.elements, fault.effect.changed, fault.effect.max_ulps) == (2, 2, 2.0 ** 23)
    assert PlantedFault.from_spec("relu:2:1e-3").call == 2
    with pytest.raises(ValueError, match="from 1"):
        PlantedFault("aten.relu.default", call=0)


def test_plant_on_an_all_zero_result_changed_nothing_and_every_report_says_so(tmp_path, capsys):
    rt = _record_plant(tmp_path / "t", lambda: (torch.relu(torch.randn(4, 8) - 100.0) * 2.0).sum(),
                       "aten.relu.default")
    op = next(o for o in rt if o.name == "aten.relu.default")
    p = rt.planted
    assert (p.landed, p.index, p.calls_seen) == (True, op.index, 1)
    assert (p.effect.elements, p.effect.nonzero, p.effect.changed) == (32, 0, 0)
    assert p.describe() == (f"aten.relu.default call 1 x(1+0.001), op #{op.index} on rank 0: "
                            f"changed nothing (output 0 is all zeros)")
    code, text, doc, md = _replay_and_report(tmp_path / "t", capsys)
    assert code == 0
    assert text[0] == f"PLANTED FAULT (record --plant): {p.describe()}"
    note = (f"planted fault: op #{op.index} aten.relu.default changed nothing (output 0 is all zeros): there was "
            f"nothing for replay to find")
    assert note in text
    assert not any(w in line for line in text for w in ("missed", "NOT", "not found", "failed to"))
    (plant,) = doc["plants"]
    assert (plant["index"], plant["outcome"], plant["effect"]["changed"]) == (op.index, "no_effect", 0)
    assert doc["planted"] == [p.describe()]
    assert note in md


def test_plant_past_the_last_call_planted_nothing_and_every_report_says_so(tmp_path, capsys):
    rt = _record_plant(tmp_path / "t", lambda: torch.relu(torch.randn(8)).sum(), "relu:3")
    p = rt.planted
    assert (p.landed, p.index, p.calls_seen, p.effect) == (False, None, 1, None)
    assert p.describe() == "aten.relu.default call 3 x(1+0.001), never reached on rank 0 (the recording made 1 call)"
    code, text, doc, md = _replay_and_report(tmp_path / "t", capsys)
    assert code == 0
    note = ("planted fault: the recording made 1 call of aten.relu.default, not 3: nothing was planted, so there was "
            "nothing for replay to find")
    assert note in text and note in md
    assert [q["outcome"] for q in doc["plants"]] == ["not_run"]



def test_a_plant_within_a_limit_the_user_raised_says_the_tolerance_hid_it(tmp_path, capsys):
    """replay --tolerance fp32=1e9 of a 1e-3 plant says the user's limit hid it, never that "a change this small is
    not told apart from rounding error": the change is not small."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    _record_plant(tmp_path / "t", lambda: a @ b, "mm")
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "t"), "--tolerance", "fp32=1e9"]) == 0
    out = capsys.readouterr().out
    assert "limit 1e+09, which --tolerance set for float32 (by default 16)" in out, out
    assert "a change this small" not in out

def test_plant_below_bf16_resolution_counts_the_elements_it_changed_and_their_ulps(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 2, 8, 8, generator=g).bfloat16(), torch.randn(4, 2, 3, 3, generator=g).bfloat16()
    exact = F.conv2d(x, w)  # the kernel's own result, unplanted
    ulp = 2.0 ** (torch.frexp(exact.float()).exponent - 8)  # bfloat16 keeps 8 significant bits
    for rel in (1e-3, 2e-3):  # 2e-3 moves the values with the largest significands by one ulp
        planted = (exact.double() * (1 + rel)).to(torch.bfloat16)
        changed = int((planted != exact).sum())
        rt = _record_plant(tmp_path / f"t{rel}", lambda: F.conv2d(x, w), f"aten.convolution.default:1:{rel}")
        op = next(o for o in rt if o.name == "aten.convolution.default")
        assert torch.equal(rt.tensor(op.outputs), planted)  # the trace holds what the plant left
        e = rt.planted.effect
        assert (e.elements, e.changed, e.dtype) == (exact.numel(), changed, "bfloat16")
        where = f"aten.convolution.default call 1 x(1+{rel:g}), op #{op.index} on rank 0"
        if rel == 1e-3:  # 1e-3 is a quarter of bfloat16's spacing at most: every element rounds back
            assert changed == 0 and e.max_ulps is None
            assert rt.planted.describe() == f"{where}: changed nothing (all 144 elements of output 0 round back to " \
                                            f"their bfloat16 values)"
            continue
        assert 0 < changed < exact.numel()
        assert e.max_ulps == ((planted.float() - exact.float()).abs() / ulp).max().item() == 1.0
        assert rt.planted.describe() == (f"{where}: changed {changed} of 144 elements of output 0 by at most 1 ulp "
                                         f"of bfloat16 (one rounding: replay may not tell it from rounding error)")
        code, text, doc, md = _replay_and_report(tmp_path / f"t{rel}", capsys)
        assert code == 0 and "no divergent op" in "\n".join(text)
        (r,) = [r for r in doc["ops"] if r["index"] == op.index]
        m = r["metrics"]
        note = (f"planted fault: op #{op.index} aten.convolution.default replayed ok: the plant changed {changed} of "
                f"144 elements of output 0 by at most 1 ulp of bfloat16, and replay's error measure for it, "
                f"max_abs/(eps*absmax) {m['norm_max']:.3g}, is within its limit {m['limit_max']:.3g}: a change this "
                f"small is not told apart from rounding error")
        assert note in text and note in md
        assert [q["outcome"] for q in doc["plants"]] == ["within_limit"]


def _conv_bn_step(plant: str, path: Path):
    """One training step of a tiny Conv2d -> BatchNorm2d model, recorded with ``plant``; the input needs no gradient,
    so the conv's backward returns None for it (output 0); the conv has no bias, whose gradient before a batch norm is
    zero but for rounding noise. Returns the trace and the model's running mean."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, bias=False), torch.nn.BatchNorm2d(3))
    x = torch.randn(2, 2, 5, 5)
    with record(path, plant=plant):
        model(x).square().mean().backward()
    return open_trace(path).rank(0), model[1].running_mean.clone()


def test_plant_on_batch_norm_perturbs_its_output_not_its_running_statistics(tmp_path):
    clean, clean_mean = _conv_bn_step("aten.relu.default", tmp_path / "clean")  # relu never runs: nothing planted
    rt, mean = _conv_bn_step("aten.native_batch_norm.default:1:1e-2", tmp_path / "bn")
    op = rt[rt.planted.index]
    clean_op = next(o for o in clean if o.name == op.name)
    assert op.name == "aten.native_batch_norm.default"
    # output 0 (the normalised activations) carries the fault; the running mean the op updates does not
    assert torch.equal(rt.tensor(op.outputs[0]), (clean.tensor(clean_op.outputs[0]).double() * 1.01).float())
    assert torch.equal(mean, clean_mean)
    e = rt.planted.effect
    assert (e.target, e.tensors, e.elements) == ("output 0", 1, 2 * 3 * 3 * 3)
    assert rt.planted.describe().startswith(f"aten.native_batch_norm.default call 1 x(1+0.01), op #{op.index}")
    assert e.describe() == f"changed {e.changed} of 54 elements of output 0 by at most {e.max_ulps:.0f} ulps of " \
                           f"float32"
    rh.assert_only_culprit(rh.replay(tmp_path / "bn"), op.index)


def test_plant_on_a_backward_whose_first_output_is_none_perturbs_its_first_tensor_output(tmp_path):
    rt, _ = _conv_bn_step("aten.convolution_backward.default:1:1e-2", tmp_path / "t")
    op = rt[rt.planted.index]
    assert op.name == "aten.convolution_backward.default" and op.outputs[0] is None
    e = rt.planted.effect
    assert (e.target, e.tensors, e.elements) == ("output 1 (output 0 is None)", 1, 3 * 2 * 3 * 3)
    assert e.changed > 0 and e.describe().startswith(f"changed {e.changed} of 54 elements of output 1 (output 0 is "
                                                     f"None)")
    rh.assert_only_culprit(rh.replay(tmp_path / "t"), op.index)


def test_plant_on_an_in_place_op_names_the_written_argument():
    with PlantedFault("aten.add_.Tensor", rel=1.0) as fault:
        x = torch.ones(3)
        x.add_(1.0)
    assert x.tolist() == [4.0, 4.0, 4.0] and fault.effect.target == "written argument 'self'"
