"""The quick tier: pure functions with inline expected values (the arithmetic in a comment, as in torch's own
test_flop_counter), and properties that the docstrings promise. No trace, no recording; the whole file runs in about
a second (`python -m pytest -m "not slow"` runs this tier with every other test that is not marked slow)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from replaydiff.compare.metrics import ExactMismatch, FloatError, NonfiniteMismatch, ShapeMismatch, measure
from replaydiff.compare.notes import VerdictReason, render
from replaydiff.compare.tolerance import Tolerances, reduction_length
from replaydiff.diff.pairs import stats_measure, tensor_stats
from replaydiff.diff.notes import CarriedFromStep, DiffFact, InputDiffered
from replaydiff.replay.notes import FellBack, Judgement, LeftOut, RepeatsDisagree, ReplayFact
from replaydiff.replay.result import Status
from replaydiff.trace.op_runs import OpRuns, op_runs
from replaydiff.trace.writer import CodecChoice

EPS32 = 2.0 ** -23  # torch.finfo(torch.float32).eps
EPS16B = 2.0 ** -7  # bfloat16


def test_measure_of_a_float_error_gives_its_max_abs_and_ulp_scaled_figures() -> None:
    rec = torch.tensor([1.0, 2.0, 4.0])
    ref = torch.tensor([1.0, 2.0, 4.0 + 8 * 4.0 * EPS32], dtype=torch.float64)  # 8 ulps of absmax 4 at the last element
    m = measure(rec, ref)
    assert isinstance(m, FloatError)
    # max_abs = 32 eps; norm_max = max_abs / (eps * absmax 4) = 8
    assert m.max_abs == pytest.approx(32 * EPS32)
    assert m.norm_max == pytest.approx(8.0)
    # rel_l2 = 32 eps / |ref|_2, |ref|_2 = sqrt(1 + 4 + 16) (to first order); norm_rel = rel_l2 / eps
    assert m.norm_rel == pytest.approx(32 / math.sqrt(21), rel=1e-6)


def test_measure_bfloat16_uses_its_own_epsilon() -> None:
    rec = torch.tensor([2.0], dtype=torch.bfloat16)
    ref = torch.tensor([2.0 + 2 * EPS16B], dtype=torch.float64)  # one bf16 ulp at 2 is 2 * eps
    m = measure(rec, ref)
    assert m.norm_max == pytest.approx(1 / (1 + EPS16B))  # max_abs 2 eps / (eps * absmax of the reference, 2 + 2 eps)


def test_measure_tells_shape_exact_and_nonfinite_mismatches_from_a_bf16_overflow() -> None:
    assert measure(torch.ones(2), torch.ones(3)) == ShapeMismatch([2], [3])
    assert measure(torch.tensor([1, 2, 3]), torch.tensor([1, 5, 3])) == ExactMismatch(1)
    m = measure(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert isinstance(m, NonfiniteMismatch) and m.positions == 1 and m.finite.max_abs == 0.0
    # bf16 overflows to Inf where fp64 does not: correct rounding, not a mismatch
    big = torch.tensor([3.5e38], dtype=torch.float64)
    assert isinstance(measure(big.to(torch.bfloat16), big), FloatError)


def test_limit_for_scales_by_sqrt_of_reduction_length_beyond_256() -> None:
    tol = Tolerances()
    assert tol.limit_for(torch.float32, 1) == (16.0, 8.0)
    assert tol.limit_for(torch.float32, 256) == (16.0, 8.0)
    assert tol.limit_for(torch.float32, 1024) == (32.0, 16.0)  # sqrt(1024 / 256) = 2
    assert tol.limit_for("bfloat16", 4096) == (4.0, 2.0)  # sqrt(16) = 4
    assert tol.limit_for("float8_e4m3fn", 1) == (1.0, 0.5)  # narrow types: one rounding
    assert Tolerances(scale_reductions=False).limit_for(torch.float32, 1024) == (16.0, 8.0)
    assert Tolerances.parse_overrides(["float32=32"]).limit_for(torch.float32, 1) == (32.0, 16.0)


def test_reduction_length_per_op_kind() -> None:
    assert reduction_length("mm", [[8, 300], [300, 4]], 32) == 300  # the contracted dimension
    assert reduction_length("addmm", [[4], [8, 300], [300, 4]], 32) == 300  # the first matrix argument's last dim
    # conv weight [out 16, in 3, 5, 5]: each output sums 3 * 5 * 5 = 75 products
    assert reduction_length("convolution", [[2, 3, 10, 10], [16, 3, 5, 5]], 2 * 16 * 6 * 6) == 75
    assert reduction_length("sum", [[10, 1000]], 10) == 1000  # 10,000 inputs into 10 outputs
    assert reduction_length("add", [[10, 10], [10, 10]], 100) == 1


floats = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(floats, floats), min_size=1, max_size=64))
def test_statistics_lower_bound_never_exceeds_the_full_measure(pairs: list[tuple[float, float]]) -> None:
    """diff/pairs.py's promise: the error read from two tensors' statistics is a lower bound on the real error,
    so a difference that statistics show is real."""
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    full = measure(a, b.to(torch.float64))
    low = stats_measure(tensor_stats(a), tensor_stats(b), "float32")
    assert isinstance(full, FloatError) and isinstance(low, FloatError)
    slack = 1e-9 * (float(a.abs().max()) + float(b.abs().max()) + 1.0)  # float64 rounding of the statistics
    assert low.max_abs <= full.max_abs + slack
    nb = float(torch.linalg.vector_norm(b.double()))
    if nb > 0:
        assert low.rel_l2 <= full.rel_l2 + math.sqrt(len(pairs)) * slack / nb
    else:  # the reference is all zeros: any difference is infinitely large relative to it
        assert low.rel_l2 == 0 or full.rel_l2 == math.inf


def test_codec_choice_compresses_only_where_it_costs_the_job_no_time() -> None:
    choice = CodecChoice()
    assert choice.compress(behind=False) and choice.compress(behind=True)  # nothing measured yet: compress, measure
    mb = 1 << 20
    # zstd at 400 MB/s (2.5 ns/B) to 80% of the bytes; the disk takes 1 GB/s (1 ns/B).
    choice.note_compressed(mb, int(0.8 * mb), 2.5e-9 * mb)
    choice.note_written(mb, 1e-9 * mb)
    assert choice.compress(behind=False)  # the writer keeps up: compressing costs the job nothing
    # behind: zstd takes 2.5 + 0.8 * 1 = 3.3 ns per byte against 1 ns raw: raw, except one blob in PROBE (measuring)
    decisions = [choice.compress(behind=True) for _ in range(2 * CodecChoice.PROBE)]
    assert decisions.count(True) == 2 and choice.raw_blobs == 2 * CodecChoice.PROBE - 2
    # a slow disk (100 MB/s, 10 ns/B) and data that halves: 2.5 + 0.5 * 10 = 7.5 < 10 ns: zstd is the faster choice
    slow = CodecChoice()
    slow.note_compressed(mb, mb // 2, 2.5e-9 * mb)
    slow.note_written(mb, 10e-9 * mb)
    assert all(slow.compress(behind=True) for _ in range(CodecChoice.PROBE)) and slow.raw_blobs == 0
    # ... but float data that shrinks by 20% only: 2.5 + 0.8 * 10 = 10.5 > 10 ns: raw
    floats = CodecChoice()
    floats.note_compressed(mb, int(0.8 * mb), 2.5e-9 * mb)
    floats.note_written(mb, 10e-9 * mb)
    assert not floats.compress(behind=True)


def test_notes_render_as_the_reason_line() -> None:
    assert render(()) is None
    assert Judgement(Status.OK, notes=(ReplayFact.SCALAR_EXACT, LeftOut(3, uninitialised=False))).reason == \
        "scalar result compared exactly; 3 output positions the kernel leaves unwritten were not compared"
    assert render((RepeatsDisagree(2), FellBack("fp32", "fp64", "RuntimeError: no kernel"))) == \
        "2 replays of the op disagree with each other; replayed at fp32: at fp64 the op failed (RuntimeError: no kernel)"
    assert render((VerdictReason("max_abs/(eps*absmax) 40 > 16"), InputDiffered(2))) == \
        "max_abs/(eps*absmax) 40 > 16; input 2 already differed"
    assert render((CarriedFromStep(None), DiffFact.OUTPUTS_DIFFER)) == \
        "inputs could not be compared, and descend from step inputs that already differed; outputs differ"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 13)), max_size=4), st.booleans())
def test_dense_is_true_exactly_when_a_view_covers_numel_consecutive_elements(dims, row_major) -> None:
    """``record.stats.dense``: its statistics are those of the flat range. Oracle: the element offsets the view
    reaches, written out (a row-major view as strides would be computed, or arbitrary strides)."""
    import itertools

    from replaydiff.record.stats import dense

    shape = [d for d, _ in dims]
    stride = [s for _, s in dims]
    if row_major:
        step = 1
        for i in range(len(shape) - 1, -1, -1):
            stride[i] = step
            step *= max(shape[i], 1)
    numel = math.prod(shape)
    assume(numel > 0)  # an empty tensor's statistics are the same either way
    offsets = {sum(i * s for i, s in zip(idx, stride)) for idx in itertools.product(*(range(d) for d in shape))}
    assert dense(shape, stride) == (offsets == set(range(numel)))


def test_op_runs_are_exact_and_a_long_list_is_counted_never_widened() -> None:
    assert op_runs([]) == ""
    assert op_runs([7]) == "#7"
    # 695..701 and 900..903 are runs; 710 stands alone; order and repeats do not matter
    assert op_runs([903, 710, 695, 696, 697, 698, 699, 700, 701, 900, 901, 902, 710]) == "#695-#701, #710, #900-#903"
    # seven runs (every other number from 4 to 14, and 20-21): six written out, the seventh counted, and the last op
    assert op_runs([4, 6, 8, 10, 12, 14, 20, 21], shown=6) == "#4, #6, #8, #10, #12, #14 and 1 more run up to #21"
    assert op_runs(range(0, 40, 2), shown=3) == "#0, #2, #4 and 17 more runs up to #38"


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 300), min_size=1))
def test_op_runs_never_name_an_op_outside_the_set(ops: set[int]) -> None:
    text = op_runs(ops, shown=1000)  # every run written out: they give back exactly the set
    named = set()
    for part in text.split(", "):
        a, _, b = part.partition("-")
        named |= set(range(int(a[1:]), int((b or a)[1:]) + 1))
    assert named == ops
    runs = OpRuns(keep=2)  # kept in constant memory, the same count and last op
    for i in sorted(ops):
        runs.add(i)
    assert runs.ops == len(ops) and runs.last == max(ops) and len(runs.runs) <= 2
    assert runs.count == sum(1 for i in ops if i - 1 not in ops)
