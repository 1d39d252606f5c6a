"""Planted faults are found exactly: the planted op is the first divergent op and no other op diverges, although every
op after it computed on the error (replay feeds each op its own recorded inputs).

A PlantedFault sits below the recorder and multiplies the output (or the first written argument) of the
``occurrence``-th call of one op by 1 + rel, as a buggy kernel would. The planted op's number is read back from the
trace: the ``occurrence``-th op of that name.
"""
from __future__ import annotations

import math

import pytest

import replay_helpers as rh
from replaydiff.replay import Status


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
