"""Fidelity bugs found on PyTorch's own operator database (the fidelity issue), each replayed as a user would hit it:
recorded with replaydiff.record, replayed at fp64 and at same, and required to be clean (or named, for a fault)."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode

import replaydiff
from replaydiff.replay import ReplayOptions, Status, replay_trace


def _replay_clean(path: Path, *precisions: str) -> None:
    for p in precisions or ("fp64", "same"):
        report = replay_trace(str(path), ReplayOptions(precision=p))
        bad = [(r.index, r.op, r.status.value, r.reason) for r in report.ops
               if r.status in (Status.DIVERGENT, Status.ERROR, Status.NONDETERMINISTIC)]
        assert bad == [], p
        assert report.counts()["ok"] > 0


def test_running_statistics_written_by_batch_norm_get_new_versions(tmp_path: Path) -> None:
    # native_batch_norm updates running_mean/var in training though its schema does not mark them written;
    # instance_norm reads them back through a later op.
    x, rm, rv = torch.randn(2, 3, 5), torch.zeros(3), torch.ones(3)
    with replaydiff.record(tmp_path / "t"):
        F.instance_norm(x, running_mean=rm, running_var=rv, use_input_stats=True)
        F.batch_norm(x, rm, rv, training=True)
        rm * 2
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    bn = next(op for op in r if op.name == "aten.native_batch_norm.default")
    assert {p.key for p, _ in bn.writes} == {3, 4}  # running_mean, running_var
    _replay_clean(tmp_path / "t")


def test_conjugate_and_negative_bits_survive(tmp_path: Path) -> None:
    x = torch.randn(3, 4, dtype=torch.complex64)
    with replaydiff.record(tmp_path / "t"):
        x.conj().clone()
        torch._neg_view(x).clone()
        torch.fft.fft(x).conj().abs()
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    clone = next(op for op in r if op.name == "aten.clone.default")
    assert clone.inputs()[0].conj and torch.equal(r.tensor(clone.inputs()[0]), x.conj())
    _replay_clean(tmp_path / "t")


def test_complex32_outputs_replay_clean_at_fp64_and_same(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        x = torch.randn(4, dtype=torch.complex64)
        with replaydiff.record(tmp_path / "t"):
            x.to(torch.complex32).clone()
        _replay_clean(tmp_path / "t")


def test_zero_tensors_are_stored_as_markers(tmp_path: Path) -> None:
    x = torch.randn(3)
    with replaydiff.record(tmp_path / "t"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a recorder warning here would mean the op could not be recorded
        z = torch._efficientzerotensor((3,))
        (z + x).sum()
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    ref = r[0].outputs_refs()[0]
    assert r.lost == [] and ref.zero
    assert ref.chunk is None  # a marker: no bytes in any data file
    assert r.tensor(ref).eq(0).all() and tuple(r.tensor(ref).shape) == (3,)  # rebuilt from the marker: zeros
    _replay_clean(tmp_path / "t")


def test_overflow_that_the_recorded_dtype_explains_is_not_divergent(tmp_path: Path) -> None:
    x = torch.tensor([[3e38, 1.0], [2.0, 3e38]], dtype=torch.bfloat16)
    with replaydiff.record(tmp_path / "t"):
        y = x * 2  # bf16 overflows to inf; the fp64 reference is finite but beyond bf16's largest value
    assert torch.isinf(y).sum() == 2
    _replay_clean(tmp_path / "t", "fp64")


def test_an_op_the_recorder_cannot_describe_costs_that_op_alone(tmp_path: Path, monkeypatch) -> None:
    from replaydiff.record import mode

    real_ref = mode.OpBuilder.ref

    def ref(self, t, store):  # fault injection into the recorder: it cannot describe 7x7 tensors
        if tuple(t.shape) == (7, 7):
            raise RuntimeError("cannot describe this tensor")
        return real_ref(self, t, store)

    monkeypatch.setattr(mode.OpBuilder, "ref", ref)
    a = torch.randn(3)
    with pytest.warns(RuntimeWarning, match="could not be recorded"):
        with replaydiff.record(tmp_path / "t"):
            b = torch.ones(7, 7)  # not recordable
            c = b.sum(0)[:3] + a  # reads b: sum is not recordable either; its output is fine
            a.add_(b[0, :3])  # writes a: not recordable, but a's next reader must not get the old bytes
            d = (a * c).sum()
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    assert r.complete and len(r) == r.manifest["ops_seen"]
    failed = [op for op in r[:] if not op.recorded]
    assert failed and all("could not be recorded" in op.not_recorded_reason for op in failed)
    assert r[len(r) - 1].recorded and r[len(r) - 1].name == "aten.sum.default"
    assert float(d) == pytest.approx(float((a * c).sum()))
    _replay_clean(tmp_path / "t")


def _ctc_inputs():
    torch.manual_seed(0)
    log_probs = torch.randn(50, 3, 15).log_softmax(2)
    targets = torch.randint(1, 15, (3, 30), dtype=torch.long)
    return log_probs, targets, [50, 40, 30], [30, 25, 20]


def test_positions_a_kernel_leaves_unwritten_are_left_out_and_counted(tmp_path: Path) -> None:
    # _ctc_loss's log_alpha is written only up to each sequence's lengths; the rest is allocator garbage
    with replaydiff.record(tmp_path / "t"):
        F.ctc_loss(*_ctc_inputs())
    for p in ("fp64", "same"):
        report = replay_trace(str(tmp_path / "t"), ReplayOptions(precision=p))
        ctc = next(r for r in report.ops if r.op == "aten._ctc_loss.default")
        assert ctc.status is Status.OK, (p, ctc.reason)
        assert "2800 output positions the kernel leaves unwritten were not compared" in ctc.reason


def test_a_fault_in_a_partly_unwritten_output_is_still_found(tmp_path: Path) -> None:
    from replaydiff.faults import PlantedFault

    with PlantedFault("aten._ctc_loss.default", rel=1e-2), replaydiff.record(tmp_path / "t"):
        F.ctc_loss(*_ctc_inputs())
    report = replay_trace(str(tmp_path / "t"), ReplayOptions(precision="fp64"))
    assert report.first_divergent is not None and report.first_divergent.op == "aten._ctc_loss.default"


# -- memory an empty* op handed out is no produced value ----------------------------------------------------------
def _record_into_empty(path: Path, fn) -> None:
    """Record ``fn`` with deterministic algorithms on, so torch.empty fills floating memory with NaN: the worst
    garbage an all-gather buffer's other-rank parts can hold until the collective fills them."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (registers fsdp:: ops)

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with replaydiff.record(path):
            fn()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _fsdp_copy_in() -> None:
    # rank 1 of 2 copies its shards (a weight and a bias) into its half of the all-gather buffer; rank 0's half stays
    # the allocator's until the all-gather (not in this trace) fills it
    w, b = torch.arange(12.0).reshape(3, 4) / 7, torch.arange(4.0) - 1.5
    numel = w.numel() + b.numel()
    buf = torch.empty(2 * numel)
    torch.ops.fsdp.all_gather_copy_in([w.reshape(-1), b], buf, [w.numel(), b.numel()], numel, 1)


def test_uninitialised_part_of_an_all_gather_buffer_is_no_nan_origin_and_not_compared(tmp_path: Path, capsys) -> None:
    from replaydiff.cli.main import main

    _record_into_empty(tmp_path / "t", _fsdp_copy_in)
    op = next(o for o in replaydiff.open_trace(tmp_path / "t").rank(0) if o.name.startswith("fsdp."))
    assert not bool(torch.isfinite(replaydiff.open_trace(tmp_path / "t").rank(0).tensor(op.outputs_refs()[-1])).all())
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    copy_in = next(r for r in report.ops if r.index == op.index)
    assert copy_in.status is Status.OK and not copy_in.nonfinite_origin, copy_in
    assert report.nonfinite_origin is None
    assert report.nonfinite_entry is None  # nor did NaN come in: the garbage is the allocator's, in the trace
    assert copy_in.verdict.left_out == 16  # rank 0's half of the buffer: 12 + 4 elements, not compared
    assert copy_in.verdict.measure.nonfinite_recorded == 0
    # an op the replay skips (here: not selected) is no origin either: the part the op left as it was is no value
    skipped = replay_trace(str(tmp_path / "t"), ReplayOptions(ops=["aten.*"]))
    assert next(r for r in skipped.ops if r.index == op.index).status is Status.SKIPPED
    assert skipped.nonfinite_origin is None
    assert main(["replay", str(tmp_path / "t"), "--json", str(tmp_path / "r.json")]) == 0
    assert main(["report", str(tmp_path / "t"), "--replay", str(tmp_path / "r.json")]) == 0
    assert "| NaN/Inf origin | none | none | pass |" in capsys.readouterr().out


def test_nan_made_in_the_written_part_of_an_uninitialised_buffer_is_the_origin(tmp_path: Path) -> None:
    def fn() -> None:
        buf = torch.empty(8)  # NaN-filled: a NaN made below where NaN already was must still count
        torch.sqrt(torch.tensor([4.0, -1.0, 9.0, 16.0]), out=buf.narrow(0, 4, 4))

    _record_into_empty(tmp_path / "t", fn)
    sqrt = next(o for o in replaydiff.open_trace(tmp_path / "t").rank(0) if o.name == "aten.sqrt.out")
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    assert report.nonfinite_origin is not None and report.nonfinite_origin.index == sqrt.index
    assert [r.index for r in report.ops if r.nonfinite_origin] == [sqrt.index]


class _ScaleBagSums(TorchDispatchMode):
    """Below the recorder: a wrong embedding_bag kernel whose bag sums (output 0) are off by 1e-3."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._embedding_bag_forward_only.default:
            out = (out[0] * (1 + 1e-3), *out[1:])
        return out


def test_embedding_bag_bookkeeping_outputs_are_compared_only_at_recorded_dtypes(tmp_path: Path) -> None:
    w, idx, offsets, psw = torch.randn(10, 3), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4]), \
        torch.randn(8)

    def bag_result(path: Path, precision: str):
        report = replay_trace(str(path), ReplayOptions(precision=precision))
        return next(r for r in report.ops if r.op == "aten._embedding_bag_forward_only.default")

    with replaydiff.record(tmp_path / "t"):
        F.embedding_bag(idx, w, offsets, mode="sum", per_sample_weights=psw)
    _replay_clean(tmp_path / "t")
    for precision in ("fp64", "same"):  # replayed and judged, not skipped: the bag sums were compared
        r = bag_result(tmp_path / "t", precision)
        assert r.status == Status.OK and r.verdict is not None, precision
    # ... and a wrong bag sum is found at fp64, where the bookkeeping outputs (another kernel path) are left aside
    with _ScaleBagSums(), replaydiff.record(tmp_path / "f"):
        F.embedding_bag(idx, w, offsets, mode="sum", per_sample_weights=psw)
    assert bag_result(tmp_path / "f", "fp64").status == Status.DIVERGENT


def test_sparse_tensors_are_skipped_with_the_true_reason(tmp_path: Path) -> None:
    x = torch.randn(3, 3)
    s = x.to_sparse()
    with replaydiff.record(tmp_path / "t"):
        x.to_sparse()
        torch.sparse.mm(s, x)
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    reasons = {r.op: r.reason for r in report.ops if r.status is Status.SKIPPED}
    assert "sparse_coo" in reasons["aten._to_sparse.default"] and "not supported" in reasons["aten._to_sparse.default"]
    assert "sparse_coo" in reasons["aten._sparse_addmm.default"]
    assert all(r.status is not Status.OK or "nothing to compare" not in (r.reason or "") for r in report.ops)


