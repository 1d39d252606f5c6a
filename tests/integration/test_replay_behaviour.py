"""How replay behaves, trap by trap: reference settings in and out, --repeat, random ops, ops that write into their
arguments, views, an op that fails, and several workers (a trace cut short by SIGKILL:
tests/e2e/test_replay_behaviour_e2e.py)."""
from __future__ import annotations

import dataclasses
import io
import os
import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import replay_helpers as rh
from replaydiff import open_trace
from replaydiff.errors import EnvironmentProblem, TraceError, UsageError
from replaydiff.faults import PlantedFault
from replaydiff.replay import OpReplayer, Status
from replaydiff.report import render_replay
from replaydiff.trace import RankTrace, TensorRef


# -- reference settings -----------------------------------------------------------------------------------------
def _flags() -> dict:
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "num_threads": torch.get_num_threads(),
    }


@pytest.fixture
def caller_flags():
    """Caller settings opposite to the reference ones; whatever happens, the test leaves torch as it found it."""
    saved = _flags()
    torch.use_deterministic_algorithms(False)
    torch.set_float32_matmul_precision("medium")  # also turns cuda.matmul.allow_tf32 on
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = False
    torch.set_num_threads(saved["num_threads"] + 1)
    caller = _flags()
    assert caller["cuda.matmul.allow_tf32"] and caller["float32_matmul_precision"] == "medium"
    yield caller
    torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["deterministic_warn_only"])
    torch.set_float32_matmul_precision(saved["float32_matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = saved["cuda.matmul.allow_tf32"]
    torch.backends.cudnn.allow_tf32 = saved["cudnn.allow_tf32"]
    torch.backends.cudnn.benchmark = saved["cudnn.benchmark"]
    torch.backends.cudnn.deterministic = saved["cudnn.deterministic"]
    torch.set_num_threads(saved["num_threads"])


def _fp32_flags() -> dict:
    """What a replay holds, through torch's per-backend TF32 API (its legacy getters refuse a read once the new API
    set a value that differs from a legacy one: the caller's here)."""
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        **{f"fp32.{b}.{o}": torch._C._get_fp32_precision_getter(b, o)
           for b, o in (("cuda", "matmul"), ("cuda", "conv"), ("mkldnn", "matmul"))},
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "num_threads": torch.get_num_threads(),
    }


def _spy_flags(monkeypatch, fail_at: int | None = None, fp32_api: bool = False) -> list[dict]:
    seen: list[dict] = []
    real = OpReplayer.replay

    def spy(self, rec):
        seen.append(_fp32_flags() if fp32_api else _flags())
        if fail_at is not None and len(seen) > fail_at:
            raise _Interrupted("stop here")
        return real(self, rec)

    monkeypatch.setattr(OpReplayer, "replay", spy)
    return seen


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("precision", ["fp64", "same"])
def test_reference_settings_during_replay_and_restored_after(caller_flags, monkeypatch, precision):
    path = rh.step_trace("mlp")
    env = open_trace(path).rank(0).environment
    seen = _spy_flags(monkeypatch, fp32_api=True)
    report = rh.replay_trace_uncached(path, precision=precision)
    assert report.counts()["error"] == 0 and report.counts()["divergent"] == 0
    assert len(seen) == len(report.ops) > 0
    if precision == "fp64":
        inside = {
            "deterministic": True,
            "deterministic_warn_only": True,  # an op without a deterministic kernel is still replayed
            "fp32.cuda.matmul": "ieee", "fp32.cuda.conv": "ieee", "fp32.mkldnn.matmul": "ieee",
            "cudnn.benchmark": False,
            "cudnn.deterministic": True,
            "num_threads": 1,  # small independent ops: no intra-op pool (engine.replay_threads)
        }
    else:  # the recorded dtypes run under the job's own settings, to redo its kernels bit for bit
        f = env.flags
        inside = {
            "deterministic": True,  # replay's own need (rebuild_and_judge.Numerics)
            "deterministic_warn_only": True,
            "fp32.cuda.matmul": "tf32" if f.matmul_tf32 else "ieee",
            "fp32.cuda.conv": "tf32" if f.cudnn_tf32 else "ieee",
            # "medium" ran the job's CPU float32 matmuls in bf16 (oneDNN): so does the replay at its dtypes
            "fp32.mkldnn.matmul": next((v for v in (f.mkldnn_matmul_fp32_precision, f.mkldnn_fp32_precision,
                                                    f.fp32_precision) if v not in (None, "none")), "ieee"),
            "cudnn.benchmark": f.cudnn_benchmark,
            "cudnn.deterministic": f.cudnn_deterministic,
            "num_threads": env.num_threads,  # bitwise CPU replay needs the recording's parallelism
        }
    for flags in seen:
        assert flags == inside
    assert _flags() == caller_flags


def test_settings_restored_when_replay_is_interrupted(caller_flags, monkeypatch):
    seen = _spy_flags(monkeypatch, fail_at=3, fp32_api=True)
    with pytest.raises(_Interrupted):
        rh.replay_trace_uncached(rh.step_trace("mlp"))
    assert len(seen) == 4 and seen[-1]["deterministic"] and not seen[-1]["cudnn.benchmark"]
    assert _flags() == caller_flags


def test_reference_settings_entered_by_two_threads_at_once_are_restored_once(caller_flags, monkeypatch):
    """The TUI replays in one thread while its detail pane replays one op in another: whichever leaves last, the
    caller's settings (and its environment) come back, and neither thread runs outside the reference settings."""
    import threading

    from replaydiff.replay.policy import reference_settings

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    inside: dict[str, dict] = {}

    def first() -> None:  # enters first, leaves first
        with reference_settings(1):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second() -> None:  # enters while the first holds the settings, leaves after it
        a_in.wait(10)
        with reference_settings(1):
            b_in.set()
            a_out.wait(10)
            inside["second"] = _fp32_flags()  # the first has left: the second still replays under the reference
            inside["env"] = {"CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert inside["second"]["deterministic"] and inside["second"]["fp32.cuda.matmul"] == "ieee"
    assert not inside["second"]["cudnn.benchmark"] and inside["second"]["num_threads"] == 1
    assert inside["env"] == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert _flags() == caller_flags
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # put back as it was: unset


# -- --repeat: nondeterminism ----------------------------------------------------------------------------------
@torch.library.custom_op("rdtest::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    """x times (1 + a relative wobble of ~1e-12 from the OS's entropy, never seeded): below fp32's resolution, so
    the recorded output is x exactly, but every fp64 run of it differs from the last."""
    u = int.from_bytes(os.urandom(4), "little") / 2 ** 32
    return x * (1.0 + 1e-12 * (1.0 + u))


@noisy.register_fake
def _noisy_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class NoisyMLP(rh.TinyMLP):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(noisy(x), y)


@pytest.fixture(scope="module")
def noisy_trace(tmp_path_factory):
    """A step using the custom op, with a planted fault in the first forward matmul as well."""
    torch.manual_seed(0)
    model = NoisyMLP()
    step = rh.make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    clean_path = tmp_path_factory.mktemp("noisy-clean") / "trace"
    rh.record_fn(clean_path, step)
    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(clean_path), rh.MATMULS, "forward")
    torch.manual_seed(0)
    model = NoisyMLP()
    step = rh.make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    path = tmp_path_factory.mktemp("noisy") / "trace"
    rh.record_fn(path, step, PlantedFault(name, rel=1e-3, call=occurrence + 1))
    ops = rh.trace_ops(path)
    return path, rh.occurrence_index(ops, "rdtest.noisy.default"), rh.occurrence_index(ops, name, occurrence)


def test_repeat_flags_the_op_whose_runs_disagree_and_nothing_else(noisy_trace):
    path, noisy_index, planted_index = noisy_trace
    once = rh.replay_trace_uncached(path, repeat=1)
    thrice = rh.replay_trace_uncached(path, repeat=3)
    assert rh.result_at(once, noisy_index).status is Status.OK  # within tolerance of what was recorded
    r = rh.result_at(thrice, noisy_index)
    assert r.status is Status.NONDETERMINISTIC and r.op == "rdtest.noisy.default"
    assert "disagree" in r.reason
    assert thrice.first_nondeterministic is r and thrice.found_problem
    # every other op keeps its status: ok stays ok, the planted fault stays the only divergent op
    assert [(x.index, x.status) for x in once.ops if x.index != noisy_index] == \
        [(x.index, x.status) for x in thrice.ops if x.index != noisy_index]
    rh.assert_only_culprit(thrice, planted_index)
    assert thrice.counts()["nondeterministic"] == 1


# -- random ops --------------------------------------------------------------------------------------------------
def test_dropout_draws_replay_exactly_from_the_recorded_generator_state():
    path = rh.step_trace("transformer")
    ops = {op.index: op for op in rh.trace_ops(path)}
    report = rh.replay(path)
    draws = [r for r in report.ops if r.op == "aten.bernoulli_.float"]
    assert draws, "CPU dropout draws with bernoulli_"
    for r in draws:
        assert ops[r.index].rng is not None, "the generator state is recorded before the draw"
        assert r.status is Status.OK, r.reason
        assert r.metrics["mismatches"] == 0  # compared bit for bit, at the recorded dtype, even in an fp64 replay


def test_random_draws_are_judged_exactly(monkeypatch):
    """Without the recorded generator state the redrawn mask differs, and the exact comparison says so."""
    path = rh.step_trace("transformer")
    # Every generator state read back from the trace is replaced by another one.
    monkeypatch.setattr(RankTrace, "rng_state", lambda self, rng: torch.Generator().manual_seed(12345).get_state())
    report = rh.replay_trace_uncached(path, ops=["aten.bernoulli_*"])
    draws = [r for r in report.ops if r.op == "aten.bernoulli_.float"]
    assert draws and all(r.status is Status.DIVERGENT and r.metrics["mismatches"] > 0 for r in draws)
    assert {r.status for r in report.ops if r.op != "aten.bernoulli_.float"} == {Status.SKIPPED}


def _random_fn() -> None:
    a = torch.randn(6, 5)
    torch.native_dropout(a, 0.3, True)
    torch.randperm(9)
    torch.empty(7).normal_()
    torch.rand(3, 4, dtype=torch.float64)


def test_random_factories_and_native_dropout_replay_exactly(tmp_path):
    path = rh.record_fn(tmp_path / "trace", _random_fn)
    report = rh.replay_trace_uncached(path)
    names = {"aten.randn.default", "aten.native_dropout.default", "aten.randperm.default", "aten.normal_.default",
             "aten.rand.default"}
    seen = {r.op: r for r in report.ops if r.op in names}
    assert set(seen) == names
    for r in seen.values():
        assert r.status is Status.OK, f"{r.op}: {r.reason}"
        assert r.metrics["mismatches"] == 0


def _generator_fn() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 5, generator=g)
    x.bernoulli_(0.5, generator=g)
    torch.randperm(11, generator=g)


def test_random_ops_with_an_explicit_generator_replay_exactly(tmp_path):
    """The recorder saves the state of a generator passed as an argument; replay must hand the op one in that
    state (a data sampler's randperm(generator=g) is the common case)."""
    path = rh.record_fn(tmp_path / "trace", _generator_fn)
    ops = rh.trace_ops(path)
    assert all(op.rng is not None for op in ops)
    report = rh.replay_trace_uncached(path)
    assert [(r.op, r.status, r.reason) for r in report.ops] == [(op.name, Status.OK, None) for op in ops]
    assert all(r.metrics["mismatches"] == 0 for r in report.ops)


# -- ops that write: in-place, out=, _foreach_; views -------------------------------------------------------
def _writes_fn() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(8, 8, generator=g), torch.rand(8, 8, generator=g)
    c = torch.empty(8, 8)
    torch.mm(a, b, out=c)  # out=: the result exists only as the written argument
    c.mul_(0.5)  # in-place
    c.add_(a, alpha=2.0)
    d = torch.empty(8, 8)
    torch.add(c, b, out=d)
    d.sum()


@pytest.mark.parametrize("op", ["aten.mm.out", "aten.mul_.Tensor", "aten.add_.Tensor", "aten.add.out"])
def test_fault_in_what_an_op_wrote_is_caught(tmp_path, op):
    path = rh.record_fn(tmp_path / "trace", _writes_fn, PlantedFault(op, rel=1e-3))
    ops = rh.trace_ops(path)
    index = rh.occurrence_index(ops, op)
    assert {o.index: o for o in ops}[index].writes, f"{op} is recorded with the argument it wrote"
    report = rh.replay_trace_uncached(path)
    rh.assert_only_culprit(report, index)


def test_ops_that_write_are_compared_on_what_they_wrote(tmp_path):
    path = rh.record_fn(tmp_path / "trace", _writes_fn)
    report = rh.replay_trace_uncached(path)
    for name in ("aten.mm.out", "aten.mul_.Tensor", "aten.add_.Tensor", "aten.add.out"):
        (r,) = [x for x in report.ops if x.op == name]
        assert r.status is Status.OK and r.metrics is not None and "norm_max" in r.metrics, (name, r)



@pytest.mark.parametrize("precision", ["same", "fp64"])
def test_an_in_place_op_that_grows_its_argument_replays(tmp_path, precision):
    """addbmm_ of a [1] tensor resizes it to [5, 10] (torch allows it, with a warning): its rebuilt input must be a
    storage torch can grow, at either precision (op_db's addbmm inplace sample)."""
    torch.manual_seed(0)
    b1, b2 = torch.randn(5, 5, 5), torch.randn(5, 5, 10)

    def fn():
        x = torch.ones(1)
        x.addbmm_(b1, b2)
        return x

    path = rh.record_fn(tmp_path / "trace", fn)
    report = rh.replay_trace_uncached(path, precision=precision)
    (r,) = [x for x in report.ops if x.op == "aten.addbmm_.default"]
    assert r.status is Status.OK, r

def test_foreach_fault_is_caught_on_the_lists_it_wrote():
    op = "aten._foreach_mul_.Scalar"
    clean = rh.trace_ops(rh.step_trace("mlp_foreach"))
    assert op in {o.name for o in clean}
    path = rh.step_trace("mlp_foreach", op, rel=1e-3, occurrence=0)
    ops = rh.trace_ops(path)
    index = rh.occurrence_index(ops, op)
    rec = {o.index: o for o in ops}[index]
    assert rec.writes and rec.outputs is None  # returns None: only the written list can be compared
    rh.assert_only_culprit(rh.replay(path), index)


def _weight_read_twice_then_written():
    w = torch.randn(16, 16)
    x = torch.randn(4, 16)
    a = x @ w
    b = x @ w  # the same version of w: its input base is rebuilt once and kept for this op
    w.mul_(2.0)  # writes w: it gets a copy of its own, so the kept base stays as recorded
    c = x @ w
    (a + b + c).sum()


def test_an_input_read_by_several_ops_is_rebuilt_once_and_never_written(tmp_path, monkeypatch):
    """Replay keeps the inputs it rebuilt (decoded, upcast) for the next ops that read them: only ops that
    write none of their arguments are given those, so an op that writes in place never changes what others read."""
    from replaydiff.replay import ReplayOptions
    from replaydiff.replay.policy import reference_settings

    path = rh.record_fn(tmp_path / "trace", _weight_read_twice_then_written)
    rt = open_trace(path).rank(0)
    ops = [op for op in rt if op.name in ("aten.mm.default", "aten.mul_.Tensor")]
    assert [op.name for op in ops] == ["aten.mm.default"] * 2 + ["aten.mul_.Tensor", "aten.mm.default"]
    w0 = ops[0].args[1].version
    assert ops[1].args[1].version == w0 == ops[2].args[0].version != ops[3].args[1].version
    reads = []
    data = RankTrace.data
    monkeypatch.setattr(RankTrace, "data", lambda self, ref: reads.append(ref.version) or data(self, ref))
    replayer = OpReplayer(rt, ReplayOptions())
    with reference_settings(1), torch.inference_mode():
        results = [replayer.replay(op) for op in ops]
        again = replayer.replay(ops[0])  # after the in-place op replayed: w's kept base is still as recorded
    assert [r.status for r in results] == [Status.OK] * 4, [r.reason for r in results]
    # w as recorded: read by the first mm, then by mul_, which must have a copy of its own; not by the second mm
    assert reads.count(w0) == 2
    assert again.status is Status.OK and again.verdict == results[0].verdict


class _TransposeWithOtherStrides(TorchDispatchMode):
    """Below the recorder, a transpose kernel that returns its view of the input with the other (row-major) strides:
    the recorded view's geometry is not what aten.t computes."""

    planted = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.t.default and out.dim() == 2 and not self.planted:
            self.planted = True
            out = out.as_strided(out.shape, (out.shape[1], 1), out.storage_offset())
        return out


def test_view_ops_are_checked_by_shape_stride_and_offset(tmp_path):
    """A view's bytes are its input's; what the op decides is the view's geometry, and that is checked."""
    src = rh.step_trace("mlp")
    ops = rh.trace_ops(src)
    view = next(op for op in ops if op.name == "aten.t.default" and isinstance(op.outputs, TensorRef))
    clean = rh.replay_trace_uncached(src, first=view.index, last=view.index)
    (r,) = clean.ops
    assert r.status is Status.OK and r.metrics is None and "nothing to compare" in r.reason

    path = rh.record_fn(tmp_path / "trace", rh.mlp_step(), _TransposeWithOtherStrides())
    ops = rh.trace_ops(path)
    view = next(op for op in ops if op.name == "aten.t.default" and isinstance(op.outputs, TensorRef))
    assert view.outputs.version in rh.input_versions(view)  # still a view of its input, with other strides
    (r,) = rh.replay_trace_uncached(path, first=view.index, last=view.index).ops
    assert r.status is Status.DIVERGENT and "stride" in r.reason


# -- selection -------------------------------------------------------------------------------------------------
def test_ops_globs_select_what_is_replayed():
    path = rh.step_trace("mlp")
    ops = rh.trace_ops(path)
    report = rh.replay_trace_uncached(path, ops=["aten.addmm.*", "aten.mm.default"])
    assert [r.index for r in report.ops] == [o.index for o in ops]  # every op is listed, the rest as skipped
    for r in report.ops:
        if r.op in ("aten.addmm.default", "aten.mm.default"):
            assert r.status is Status.OK and r.metrics is not None
        else:
            assert r.status is Status.SKIPPED, r


def test_first_and_last_bound_the_replayed_range():
    path = rh.step_trace("mlp")
    ops = rh.trace_ops(path)
    lo, hi = ops[5].index, ops[20].index
    report = rh.replay_trace_uncached(path, first=lo, last=hi)
    assert [r.index for r in report.ops] == [o.index for o in ops if lo <= o.index <= hi]
    full = rh.replay(path)
    assert [dataclasses.asdict(r) for r in report.ops] == \
        [dataclasses.asdict(r) for r in full.ops if lo <= r.index <= hi]


# -- failures ----------------------------------------------------------------------------------------------------
_FRAGILE = {"fail": False}


@torch.library.custom_op("rdtest::fragile", mutates_args=())
def fragile(x: torch.Tensor) -> torch.Tensor:
    """A kernel that works while recording and raises once the test flips the switch: a replay-time failure."""
    if _FRAGILE["fail"]:
        raise RuntimeError("planted kernel failure\nsecond line of the message")
    return x.clone()


@fragile.register_fake
def _fragile_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class FragileMLP(rh.TinyMLP):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(fragile(x), y)


def test_one_failing_op_never_stops_the_replay(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = FragileMLP()
    step = rh.make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    path = rh.record_fn(tmp_path / "trace", step)
    ops = rh.trace_ops(path)
    target = "rdtest.fragile.default"
    index = rh.occurrence_index(ops, target)
    assert [o.name for o in ops].count(target) == 1

    monkeypatch.setitem(_FRAGILE, "fail", True)
    report = rh.replay_trace_uncached(path)
    assert [r.index for r in report.ops] == [o.index for o in ops]
    failed = rh.by_status(report, Status.ERROR)
    assert [r.index for r in failed] == [index]
    assert failed[0].reason == "RuntimeError: planted kernel failure"  # the exception's first line only
    assert {r.status for r in report.ops if r.index != index} == {Status.OK, Status.SKIPPED}
    assert report.first_divergent is None
    text = io.StringIO()
    render_replay(report, text)
    assert f"error   #{index} {target}" in text.getvalue()
    assert "every replayed op matches" not in text.getvalue()  # an op that failed was not checked


# -- workers -----------------------------------------------------------------------------------------------------
def test_two_workers_give_exactly_the_same_report_as_one():
    clean = rh.trace_ops(rh.step_trace("mlp"))
    name, occurrence, _ = rh.first_in_phase(clean, rh.MATMULS, "backward")
    path = rh.step_trace("mlp", name, rel=1e-3, occurrence=occurrence)
    one = rh.replay(path)
    two = rh.replay(path, workers=2)
    assert one.counts()["divergent"] == 1
    assert [dataclasses.asdict(r) for r in two.ops] == [dataclasses.asdict(r) for r in one.ops]
    assert two.warnings == one.warnings
    assert two.first_divergent == one.first_divergent


@pytest.mark.parametrize("error", [TraceError("/some/trace/rank0/data/000000.safetensors", "corrupt (checksum)"),
                                   EnvironmentProblem("device cuda asked for, but this machine has no CUDA device"),
                                   UsageError("--repeat must be at least 1")], ids=lambda e: type(e).__name__)
def test_errors_survive_the_trip_back_from_a_worker_process(error):
    """With --workers, an error raised while replaying in a worker is pickled back to the parent: it must arrive
    as the same error (same type, message and exit code), or the CLI shows a BrokenProcessPool traceback."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and back.exit_code == error.exit_code


