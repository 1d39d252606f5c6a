"""The typed read API (open_trace, RankTrace, OpRecord, the index) and the typed verdicts, tested as a user meets
them: edges agree with an independent oracle, the index written when recording ends equals the one rebuilt from
the chunks, and reads from several threads agree with serial reads (the documented example run as written:
tests/e2e/test_read_api_e2e.py)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import replaydiff
from replaydiff.compare import ExactMismatch, FloatError, NonfiniteMismatch, ShapeMismatch, Tolerances, judge
from replaydiff.replay import ReplayOptions, Status, replay_op, replay_trace
from replaydiff.report import load_replay_json, report_to_json

from read_api_helpers import _tiny_step, tiny_trace  # noqa: F401 (tiny_trace: a fixture)


class _EdgeOracle(TorchDispatchMode):
    """Below the recorder: which earlier op first returned the very tensor (storage, dtype, view) each op reads.
    Valid for steps without in-place ops, where a storage's bytes never change."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[tuple, int] = {}
        self.edges: list[list[int | None]] = []
        self.keep: list = []  # outputs held, so no storage address is reused during the step

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (t.untyped_storage()._cdata, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in replaydiff.aten.iter_tensors([list(args), list(kwargs.values())])]
        self.edges.append([self.made.get(self._key(t)) for t in ins])
        self.keep.append(out)
        for t in replaydiff.aten.iter_tensors(out if isinstance(out, (list, tuple)) else [out]):
            self.made.setdefault(self._key(t), len(self.edges) - 1)
        return out


def test_producers_and_consumers_agree_with_an_independent_oracle(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 6)
    oracle = _EdgeOracle()
    with torch.no_grad(), oracle, replaydiff.record(tmp_path / "t"):
        y = net(x).softmax(-1).sum(0)
        (y * 2).abs().max()
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    assert len(r) == len(oracle.edges) > 5
    for i, expected in enumerate(oracle.edges):
        assert list(r.producers(i).values()) == expected, f"op #{i} {r[i].name}"
    for i in range(len(r)):  # consumers are exactly the inverted producer edges
        for pos, consumers in r.consumers(i).items():
            for c in consumers:
                assert i in r.producers(c).values()
    mm = next(op for op in r if op.name == "aten.addmm.default")
    assert any(r[c].name == "aten.gelu.default" for cs in r.consumers(mm.index).values() for c in cs)


def test_index_written_at_record_end_equals_the_rebuilt_one(tiny_trace: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_trace, copy)
    (copy / "rank0" / "index.rdt").unlink()
    written = replaydiff.open_trace(tiny_trace).rank(0)
    rebuilt = replaydiff.open_trace(copy).rank(0)
    assert (tiny_trace / "rank0" / "index.rdt").exists() and not (copy / "rank0" / "index.rdt").exists()
    a, b = written.index, rebuilt.index
    assert len(a) == len(b) == len(written) > 500
    for col in ("name", "phase", "module", "source", "forward", "output", "cheap", "recorded", "collective"):
        assert list(getattr(a, col)) == list(getattr(b, col)), col
    for i in range(len(a)):
        assert a.producers(i) == b.producers(i) and a.consumers(i) == b.consumers(i)
    # and the columns say what the records say
    for i in range(0, len(written), 37):
        op = written[i]
        assert (a.name[i], a.phase[i], a.module[i], a.forward[i]) == (op.name, op.phase, op.module,
                                                                      op.forward_index)


def test_rank_trace_is_a_sequence_of_typed_records(tiny_trace: Path) -> None:
    t = replaydiff.open_trace(tiny_trace)
    assert t.ranks == [0]
    r = t.rank(0)
    ops = list(r)
    assert [op.index for op in ops] == list(range(len(r)))
    assert r[-1].index == len(r) - 1 and [op.index for op in r[3:6]] == [3, 4, 5]
    with pytest.raises(IndexError):
        r[len(r)]
    phases = {op.phase for op in ops}
    assert phases == {"forward", "backward", "optimizer"}
    bwd = next(op for op in ops if op.phase == "backward" and op.forward_index is not None)
    assert r[bwd.forward_index].phase == "forward"
    add_ = next(op for op in ops if op.name == "aten.add_.Tensor")
    (path, after), = add_.writes
    assert path == ("arg", 0) and after.version != add_.args[0].version  # a write makes a new storage version
    assert all(isinstance(ref, replaydiff.trace.TensorRef) for ref in add_.inputs())


def test_modules_tree_covers_forward_and_backward(tiny_trace: Path) -> None:
    r = replaydiff.open_trace(tiny_trace).rank(0)
    root = r.modules()
    block = root.find("TinyTransformer.blocks.0")
    assert block is not None and {"forward", "backward"} <= set(block.ops)
    for phase, ranges in block.ops.items():
        for a, b in ranges:
            for i in range(a, b + 1):
                assert (r.index.module[i] or "").startswith("TinyTransformer.blocks.0")
    inside = sum(1 for i in range(len(r)) if (r.index.module[i] or "").startswith("TinyTransformer.blocks.0"))
    assert block.count == inside
    assert root.count == len(r)


def test_filtered_ops_keep_their_numbers(tmp_path: Path) -> None:
    step = _tiny_step()
    with replaydiff.record(tmp_path / "t", ops="aten.mm.*"):
        step()
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    names = [r.index.name[i] for i in range(len(r))]
    assert len(r) == r.manifest["ops_seen"]
    kept = [op for op in r if op.data_left_out is None]
    assert kept and all(op.name.startswith("aten.mm.") for op in kept)
    # the others are recorded too, with statistics for their tensors and the reason their data is not there
    others = [op for op in r if op.data_left_out is not None]
    assert len(kept) + len(others) == len(r) and all(op.data_left_out == "filtered" for op in others)
    assert "aten.addmm.default" in names  # numbered and named, though not stored


def test_reads_from_threads_agree_with_serial_reads(tiny_trace: Path) -> None:
    r0 = replaydiff.open_trace(tiny_trace).rank(0)
    picks = list(range(0, len(r0), 3))
    serial = {i: repr([float(r0.tensor(x).double().sum()) for x in r0[i].inputs() if x.stored]) for i in picks}
    r = replaydiff.open_trace(tiny_trace).rank(0)  # a fresh reader, shared by the threads
    got: dict[int, str] = {}  # repr: a NaN sum (masked attention scores) equals itself
    errors: list[BaseException] = []

    def work(part: list[int]) -> None:
        try:
            for i in part:
                got[i] = repr([float(r.tensor(x).double().sum()) for x in r[i].inputs() if x.stored])
                r.producers(i), r.consumers(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(picks[k::4],)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and got == serial


def test_judge_is_pure_and_typed() -> None:
    tol = Tolerances()
    a = torch.tensor([1.0, 2.0, 3.0])
    v = judge(a, a.double() * (1 + 1e-3), tol)
    assert v.divergent and isinstance(v.measure, FloatError) and v.limit_max == 16.0
    assert judge(a, a.double(), tol).divergent is False
    assert isinstance(judge(a, torch.tensor([1.0, float("nan"), 3.0]), tol).measure, NonfiniteMismatch)
    assert isinstance(judge(a, a[:2], tol).measure, ShapeMismatch)
    ex = judge(a, a.clone(), tol, exact=True)
    assert isinstance(ex.measure, ExactMismatch) and ex.measure.mismatches == 0
    assert tol.limits == Tolerances().limits  # judging changed nothing


def test_replay_op_and_json_report_round_trip(tmp_path: Path) -> None:
    from replaydiff.faults import PlantedFault

    step = _tiny_step()
    with PlantedFault("aten.mm.default", rel=1e-3, call=4), replaydiff.record(tmp_path / "t"):
        step()
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    first = report.first_divergent
    assert first is not None and first.status is Status.DIVERGENT and isinstance(first.verdict.measure, FloatError)
    (tmp_path / "r.json").write_text(json.dumps(report_to_json(report)))
    back = load_replay_json(tmp_path / "r.json")
    assert [(o.index, o.status) for o in back.ops] == [(o.index, o.status) for o in report.ops]
    assert back.first_divergent.metrics == pytest.approx(first.metrics)
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    res, pairs = replay_op(r, r[first.index])
    assert res.status is Status.DIVERGENT and res.verdict.measure == first.verdict.measure
    recorded, reference = next((a, b) for a, b in pairs if isinstance(b, torch.Tensor))
    assert reference.dtype == torch.float64 and tuple(reference.shape) == recorded.shape


