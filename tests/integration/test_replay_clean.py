"""A clean step replays clean: no false alarm on a healthy fp32 transformer (dropout on), a CNN (conv, batch norm, max
pool), a bf16-autocast step, and bit for bit at the recorded precision on the recording backend."""
from __future__ import annotations

import pytest

import replay_helpers as rh
from replaydiff.replay import Status
from replaydiff.trace import OpRecord, TensorRef

SKIP_UNINITIALISED = "uninitialised output (empty*)"
SKIP_MARKER = "non-aten op (profiler)"
_EMPTY_PACKETS = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


def _packet(name: str) -> str:
    return name.split(".")[1]


def _should_skip(op: OpRecord) -> str | None:
    """The reason a clean replay may skip this op, read from the trace alone."""
    ns = op.name.split(".")[0]
    if ns == "profiler":
        return SKIP_MARKER
    if _packet(op.name) in _EMPTY_PACKETS:
        assert op.uninitialised, f"#{op.index} {op.name} is not marked uninitialised in the trace"
        return SKIP_UNINITIALISED
    return None


def _only_aliases_or_scalars(op: OpRecord) -> bool:
    """Every output of the op is a view of one of its inputs or a Python scalar: nothing of its own to compare."""
    ins = rh.input_versions(op)
    outs = op.outputs
    flat = outs if isinstance(outs, list) else [outs]
    for o in flat:
        if isinstance(o, TensorRef):
            if o.version not in ins:
                return False
        elif isinstance(o, list):
            if not all(isinstance(x, TensorRef) and x.version in ins for x in o):
                return False
        elif not isinstance(o, (int, float, bool)):
            return False
    return True


def _assert_clean(path, report) -> None:
    ops = rh.trace_ops(path)
    assert [r.index for r in report.ops] == [op.index for op in ops], "every recorded op gets one result, in order"
    c = report.counts()
    assert c["divergent"] == 0, rh.describe(rh.by_status(report, Status.DIVERGENT))
    assert c["error"] == 0, rh.describe(rh.by_status(report, Status.ERROR))
    assert c["nondeterministic"] == 0
    assert report.first_divergent is None and not report.found_problem
    assert report.warnings == []

    expected_skips = {op.index: _should_skip(op) for op in ops if _should_skip(op)}
    skipped = {r.index: r.reason for r in rh.by_status(report, Status.SKIPPED)}
    assert skipped == expected_skips, "exactly the empty* outputs and the profiler markers are skipped"
    assert set(skipped.values()) == {SKIP_UNINITIALISED, SKIP_MARKER}

    by_index = {op.index: op for op in ops}
    for r in report.ops:
        if r.status is Status.SKIPPED:
            continue
        assert r.status is Status.OK, f"#{r.index} {r.op}: {r.status} {r.reason}"
        if r.metrics is None:  # nothing compared: only legitimate for views of inputs and scalar results
            assert _only_aliases_or_scalars(by_index[r.index]), f"#{r.index} {r.op} was not compared: {r.reason}"
        else:
            assert r.metrics.get("nonfinite_mismatch", 0) == 0
            assert r.metrics.get("mismatches", 0) == 0


@pytest.fixture(scope="module")
def transformer():
    return rh.step_trace("transformer")


def test_clean_transformer_fp64_replay_has_no_false_alarm(transformer):
    ops = rh.trace_ops(transformer)
    phases = {op.phase for op in ops}
    assert phases == {"forward", "backward", "optimizer"}
    assert any(op.name == "aten.bernoulli_.float" for op in ops), "dropout must be on (CPU dropout is bernoulli_)"
    report = rh.replay(transformer)
    _assert_clean(transformer, report)
    # The attention mask fills -inf from a Python scalar: that is not where a NaN/Inf came from.
    assert any(op.name == "aten.masked_fill.Scalar" for op in ops)
    assert report.nonfinite_origin is None
    assert report.nonfinite_entry is None  # nor does a -inf that no tensor brought in
    # Compared in float64, each op well within the fp32 limits (brief: healthy fp32 ops reach ~6).
    worst = max(r.metrics["norm_max"] for r in report.ops if r.metrics and "norm_max" in r.metrics)
    assert worst < 16


def test_clean_cnn_fp64_replay_has_no_false_alarm():
    path = rh.step_trace("cnn")
    names = {op.name for op in rh.trace_ops(path)}
    for needed in ("aten.convolution.default", "aten.convolution_backward.default",
                   "aten.native_batch_norm.default", "aten.native_batch_norm_backward.default",
                   "aten.max_pool2d_with_indices.default", "aten.max_pool2d_with_indices_backward.default"):
        assert needed in names
    _assert_clean(path, rh.replay(path))


def test_clean_bf16_autocast_step_has_no_false_alarm():
    path = rh.step_trace("transformer_bf16")
    ops = rh.trace_ops(path)
    assert any(rh.output_dtypes(op) == {"bfloat16"} and op.name in rh.MATMULS for op in ops), \
        "autocast must have run the matmuls in bf16"
    report = rh.replay(path)
    c = report.counts()
    assert c["divergent"] == 0, rh.describe(rh.by_status(report, Status.DIVERGENT))
    assert c["error"] == 0, rh.describe(rh.by_status(report, Status.ERROR))
    assert report.first_divergent is None


def test_same_precision_on_the_recording_backend_is_bitwise(transformer):
    report = rh.replay(transformer, precision="same")
    c = report.counts()
    assert c["divergent"] == 0, rh.describe(rh.by_status(report, Status.DIVERGENT))
    assert c["error"] == 0, rh.describe(rh.by_status(report, Status.ERROR))
    compared = [r for r in report.ops if r.metrics]
    assert compared
    for r in compared:  # bit for bit: every compared output judged exactly, with no differing element
        assert r.metrics.get("mismatches") == 0, f"#{r.index} {r.op}: {r.metrics}"


def test_fp32_precision_replay_of_the_bf16_step_has_no_false_alarm():
    """fp32 as the reference for bf16 ops (fp32 ops replay as they are): still no false alarm."""
    path = rh.step_trace("transformer_bf16")
    report = rh.replay(path, precision="fp32")
    c = report.counts()
    assert c["divergent"] == 0, rh.describe(rh.by_status(report, Status.DIVERGENT))
    assert c["error"] == 0, rh.describe(rh.by_status(report, Status.ERROR))
