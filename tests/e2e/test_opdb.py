"""The OpInfo sweep in CI: a fixed, diverse subset of op_db recorded and replayed clean (tests/opdb_sweep.py).

Every pass (float32, float32 with backward, bfloat16) is replayed by a fresh process, as a user would, and must give
0 divergent, 0 error, 0 nondeterministic ops at fp64 and at same, skip only uninitialised outputs, lose no
recording, and leave results bitwise unchanged by recording. The OpInfos of each bug class the sweep found (docs/design/opdb-triage.md)
run again, one test per class, and must be clean too now that the classes are fixed; what is still not clean
(sparse layouts, which are not recorded; MKL's non-deterministic gelsy) is listed in NOT_CLEAN with its cause.
The full sweep (every OpInfo, about a minute) is ``python tests/opdb_sweep.py``; its figures are in
tests/bench/OPDB.md and the causes in docs/design/opdb-triage.md.
"""
from __future__ import annotations

import pytest
import torch

import opdb_sweep as sweep
import replaydiff
from replaydiff.replay import ReplayOptions, replay_trace

# Chosen to cover what a recorder and a replayer can get wrong, not for op count: broadcasting and scalar arguments,
# reductions (and their sqrt(K) tolerance scaling), matmul and LAPACK-backed linalg, nn layers with their backward,
# views and aliasing (stride and offset), in-place and indexed writes (every OpInfo here with an in-place variant
# runs it too), random ops (generator state), data-dependent shapes, sorting ties, integer outputs, FFT.
CI_OPINFOS = [
    # elementwise, broadcasting, Python scalars
    "add", "mul", "div.no_rounding_mode", "exp", "tanh", "where", "clamp", "pow", "addcmul",
    # reductions
    "sum", "mean", "var", "amax", "cumsum", "logsumexp", "argmax",
    # matmul and linalg
    "mm", "addmm", "bmm", "linalg.solve", "linalg.cholesky", "linalg.qr", "linalg.det",
    # nn layers
    "nn.functional.conv2d", "nn.functional.layer_norm", "softmax", "nn.functional.cross_entropy",
    "nn.functional.gelu", "nn.functional.max_pool2d", "nn.functional.embedding",
    "nn.functional.scaled_dot_product_attention",
    # views and aliasing
    "transpose", "as_strided", "expand", "unfold", "split", "diagonal",
    # indexed and in-place writes
    "index_put", "index_add", "scatter_add", "masked_fill",
    # random ops
    "bernoulli", "normal", "nn.functional.dropout", "multinomial", "uniform", "randn_like",
    # sorting, gathering, data-dependent shapes
    "sort", "topk", "gather", "nonzero", "unique",
    # FFT, concatenation
    "fft.rfft", "cat",
]

# OpInfo -> (passes it failed in, cause fixed). The sections of docs/design/opdb-triage.md give the reproduction and the root cause.
FIXED: dict[str, tuple[tuple[str, ...], str]] = {
    "native_batch_norm": (("f32", "grad", "bf16"), "unseen write: running_mean/var written, schema marks nothing"),
    "nn.functional.batch_norm": (("f32", "grad", "bf16"), "unseen write through aten.native_batch_norm"),
    "nn.functional.instance_norm": (("f32", "grad", "bf16"), "unseen write through aten.native_batch_norm"),
    "fft.hfft2": (("f32", "grad"), "conj bit lost when inputs are rebuilt"),
    "fft.hfftn": (("f32", "grad"), "conj bit lost when inputs are rebuilt"),
    "linalg.eig": (("grad",), "conj bit lost when inputs are rebuilt (backward uses conjugate views)"),
    "nn.functional.ctc_loss": (("f32", "grad"), "_ctc_loss log_alpha output partly uninitialised"),
    "nn.functional.embedding_bag": (("f32", "grad", "bf16"), "_embedding_bag aux outputs change shape at fp64"),
    "chalf": (("f32", "grad", "bf16"), "complex32 output: exact compare has no ComplexHalf kernel"),
    "sgn": (("grad",), "_efficientzerotensor output stops the recording"),
    "matrix_exp": (("bf16",), "bf16 overflow to Inf at its own dtype called divergent at fp64"),
    "nn.functional.linear_cross_entropy.chunked": (("f32", "grad", "bf16"), "torch_nn:: custom op skipped as 'not "
                                                   "registered here' by a replay in a fresh process"),
    "nn.functional.linear_cross_entropy.chunked_none": (("f32", "grad", "bf16"), "torch_nn:: custom op skipped as "
                                                        "'not registered here' by a replay in a fresh process"),
}

# OpInfo -> (passes, why it is not clean): kept out of the clean subset.
NOT_CLEAN: dict[str, tuple[tuple[str, ...], str]] = {
    # Sparse tensors are not recorded: skipped, now with that reason.
    "sparse.sampled_addmm": (("f32", "grad"), "sparse input: skipped, 'sparse_coo tensors are not supported'"),
    "sparse.mm.reduce": (("f32", "grad", "bf16"), "sparse input: skipped, 'sparse_csr tensors are not supported'"),
    "to_sparse": (("f32", "grad", "bf16"), "sparse output: skipped, 'output not recorded'"),
    # Not replaydiff's: MKL's gelsy gives other bits from call to call (docs/design/opdb-triage.md, class 12).
    "linalg.lstsq": (("f32", "grad"), "driver='gelsy' samples are not deterministic without replaydiff"),
    "linalg.lstsq.grad_oriented": (("f32", "grad"), "driver='gelsy' samples are not deterministic"),
}

# One test per bug class found by the sweep: (pass, OpInfos).
BUG_CLASSES = {
    "unseen_write_native_batch_norm": ("f32", ["native_batch_norm", "nn.functional.batch_norm",
                                               "nn.functional.instance_norm"]),
    "conj_bit_lost": ("f32", ["fft.hfft2", "fft.hfftn"]),
    "conj_bit_lost_in_backward": ("grad", ["linalg.eig"]),
    "ctc_loss_uninitialised_output": ("f32", ["nn.functional.ctc_loss"]),
    "embedding_bag_aux_output_shapes": ("f32", ["nn.functional.embedding_bag"]),
    "complex32_exact_compare": ("f32", ["chalf"]),
    "zerotensor_stops_recording": ("grad", ["sgn"]),
    "bf16_overflow_called_divergent": ("bf16", ["matrix_exp"]),
    "torch_custom_op_not_registered_in_fresh_process": ("f32", ["nn.functional.linear_cross_entropy.chunked"]),
}

PROBLEMS = ("divergent", "error", "nondeterministic", "lost", "raised_under_record", "changed_by_record")


@pytest.fixture(scope="module")
def op_db():
    """op_db, and torch's backend flags as they were before importing it: the import freezes them
    (torch.backends.disable_global_flags), which would leak into every later test module of this process.
    test_replay_under_frozen_backend_flags_judges_the_op_ok checks replay with frozen flags on purpose."""
    flags = torch.backends.flags_frozen.__globals__  # torch.backends' own module dict (the module is wrapped)
    was = flags["__allow_nonbracketed_mutation_flag"]
    db = sweep.load_op_db()
    flags["__allow_nonbracketed_mutation_flag"] = was
    return db


def _problems(res: sweep.PassResult) -> list[str]:
    """Every failure of a pass, one line each (empty when the pass is clean)."""
    out = [f"{r.precision} {r.opinfo} {r.variant}/{r.sample} #{r.index} {r.op}: {r.status} {r.reason}"
           for r in res.rows if r.status in ("divergent", "error", "nondeterministic")]
    for u in res.units:
        for kind, what in (("lost", u.lost), ("raised", u.raised), ("changed", u.changed)):
            if what and not (kind == "changed" and sweep.explained(what)):
                out.append(f"{u.opinfo} {u.variant}/{u.sample}: {kind}: {what}")
    out += sorted({f"{r.precision} {r.opinfo} {r.op}: skipped: {r.reason}" for r in res.rows
                   if r.status == "skipped" and r.reason != sweep.UNINITIALISED_SKIP})
    return out + [f"attribution: {a}" for a in res.unattributed]


def test_ci_subset_and_the_other_lists_are_disjoint(op_db):
    names = {o.full_name for o in op_db}
    assert set(CI_OPINFOS) <= names, set(CI_OPINFOS) - names
    assert set(FIXED) | set(NOT_CLEAN) <= names, (set(FIXED) | set(NOT_CLEAN)) - names
    assert not set(CI_OPINFOS) & (set(FIXED) | set(NOT_CLEAN))
    assert {n for _, ns in BUG_CLASSES.values() for n in ns} <= set(FIXED)


@pytest.fixture(scope="module")
def ci_results(op_db):
    """The subset's three passes, recorded here and replayed together by one fresh process."""
    return {res.name: res for res in sweep.run_passes(op_db, list(sweep.PASSES.values()), only=CI_OPINFOS)}


@pytest.mark.parametrize("pass_name", list(sweep.PASSES))
@pytest.mark.slow
def test_ci_subset_replays_clean(ci_results, pass_name):
    p, res = sweep.PASSES[pass_name], ci_results[pass_name]
    assert _problems(res) == []
    eligible = [n for n in CI_OPINFOS if n not in res.excluded]
    assert sorted(res.opinfos) == sorted(eligible), "every eligible OpInfo of the subset was recorded"
    assert all(why.startswith(("does not support", "no backward"))
               for why in res.excluded.values()), res.excluded
    # Attribution is sound: every replayed op belongs to one sample, and every sample produced ops.
    assert all(u.end > u.first for u in res.units)
    for prec in sweep.PRECISIONS:
        s = sweep.summary(res, prec)
        assert {k: s[k] for k in PROBLEMS} == dict.fromkeys(PROBLEMS, 0)
        assert s["ops"] > 2 * len(res.units)
        assert s["ok"] + s["skipped"] == s["ops"]
        assert set(s["skipped_by_reason"]) <= {sweep.UNINITIALISED_SKIP}, s["skipped_by_reason"]
    if p.inplace:
        assert {u.opinfo for u in res.units if u.variant == "inplace"} >= {"add", "index_put", "masked_fill"}
    if p.grad:
        assert sum(r.op.endswith("_backward.default") for r in res.rows) > 10, "backward ops were recorded"


@pytest.mark.parametrize("bug", list(BUG_CLASSES))
@pytest.mark.slow
def test_fixed_bug_class_replays_clean(op_db, bug):
    pass_name, names = BUG_CLASSES[bug]
    # In-process replay is faster; only the class that is about the replaying process needs a fresh one.
    res = sweep.run_pass(op_db, sweep.PASSES[pass_name], only=names, fresh_process="fresh_process" in bug)
    assert res.opinfos, "the OpInfos ran"
    assert _problems(res) == []


def test_replay_under_frozen_backend_flags_judges_the_op_ok(tmp_path):
    x = torch.randn(3)
    with replaydiff.record(tmp_path / "t"):
        x.exp()
    flags = torch.backends.flags_frozen.__globals__
    was = flags["__allow_nonbracketed_mutation_flag"]
    torch.backends.disable_global_flags()
    try:
        report = replay_trace(str(tmp_path / "t"), ReplayOptions(precision="fp64"))
    finally:
        flags["__allow_nonbracketed_mutation_flag"] = was
    assert [r.status for r in report.ops] == ["ok"]
