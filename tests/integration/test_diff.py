"""``replaydiff diff``: two traces of one step aligned op by op, and the op where the runs part ways named.

Faults are planted below the recorder in the target run only; the op numbers they landed on are read back from the
traces (the ``occurrence``-th op of that name), never typed in. Both sides of every diff are recorded in this file
or through replay_helpers' per-process cache.
"""
from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import replay_helpers as rh
from replaydiff import record
from replaydiff.cli.main import main
from replaydiff.diff import DiffOptions, Evidence, PairStatus, align, diff_traces, environment_diff, module_key, rank_pairs
from replaydiff.errors import UsageError
from replaydiff.diff.align import OpKeys
from replaydiff.faults import PlantedFault
from replaydiff.models import make_step
from replaydiff.trace import open_trace

from diff_helpers import _index


LN_BACKWARD = "aten.native_layer_norm_backward.default"


def _assert_culprit(report, ref: Path, target: Path, name: str, occurrence: int = 0) -> None:
    """The planted op is the first divergence (at its own number on each side), no other aligned op introduced a
    difference, and the ops after it that differ are all inherited."""
    assert report.first_divergent is not None, report.counts()
    rd, first = report.first_divergent
    assert (first.ref, first.target) == (_index(ref, name, occurrence), _index(target, name, occurrence))
    assert first.op == name and first.inputs_agree is True
    assert [p.key for p in rd.pairs if p.status is PairStatus.DIVERGENT] == [first.key]
    later = [p for p in rd.pairs if p.target > first.target and p.status is not PairStatus.SAME
             and p.status is not PairStatus.NOT_COMPARED]
    assert later and all(p.status is PairStatus.INHERITED and p.inherited_from is not None for p in later)
    assert all(p.status in (PairStatus.SAME, PairStatus.NOT_COMPARED) for p in rd.pairs if p.target < first.target)


@pytest.fixture(scope="module")
def clean_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Two separate recordings of the same seeded CPU step."""
    d = tmp_path_factory.mktemp("clean")
    return rh.record_fn(d / "a", rh.STEPS["transformer"]()), rh.record_fn(d / "b", rh.STEPS["transformer"]())


def test_two_recordings_of_one_step_have_no_difference(clean_pair, capsys) -> None:
    a, b = clean_pair
    report = diff_traces(a, b)
    counts = report.counts()
    assert counts["divergent"] == counts["inherited"] == counts["ref_only"] == counts["target_only"] == 0
    assert counts["same"] > 300 and report.environment == []
    assert report.ranks[0].evidence == [Evidence.FULL]
    assert main(["diff", str(a), str(b)]) == 0
    assert "no difference" in capsys.readouterr().out


def test_planted_fault_is_the_first_divergence_and_later_ops_inherit(clean_pair, tmp_path, capsys) -> None:
    ref = clean_pair[0]
    target = rh.step_trace("transformer", LN_BACKWARD)
    report = diff_traces(ref, target)
    _assert_culprit(report, ref, target, LN_BACKWARD)
    rd, first = report.first_divergent
    assert first.evidence is Evidence.FULL and first.phase == "backward"
    assert first.verdict.measure.rel_l2 == pytest.approx(1e-3, rel=0.2)
    # inherited marks point back along the data flow, to the culprit or to pairs that inherited from it
    origins = {p.inherited_from.ref for p in rd.pairs if p.status is PairStatus.INHERITED}
    assert first.ref in origins
    # the typed report answers by (ref index, target index) and by either side's index alone
    assert rd.pair(first.ref, first.target) is first and rd.by_target[first.target] is first

    out = tmp_path / "diff.json"
    assert main(["diff", str(ref), str(target), "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert f"first divergence ref #{first.ref} / target #{first.target} {LN_BACKWARD}" in text
    assert "inputs equal bit for bit, outputs differ (full tensors)" in text
    doc = json.loads(out.read_text())
    assert doc["format"] == "replaydiff.diff/1"
    fd = doc["first_divergent"]
    assert fd["index"] == {"ref": first.ref, "target": first.target} and fd["op"] == LN_BACKWARD
    assert fd["module"] == first.module and fd["phase"] == "backward" and fd["metrics"]["norm_max"] > 16
    assert len(doc["pairs"]) == len(rd.pairs)
    assert {p["status"] for p in doc["pairs"] if p["index"]["target"] > first.target} >= {"inherited"}
    assert doc["summary"]["divergent"] == 1


def _build(name: str):
    ids = torch.randint(0, 100, (2, 12))
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
    cfg = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=32, vocab_size=100, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def _record_model(name: str, out: Path, fault: PlantedFault | None = None) -> Path:
    torch.manual_seed(0)
    model, batch = _build(name)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config chatter
        with (fault or contextlib.nullcontext()), record(out):
            model(**batch).loss.backward()
            opt.step()
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_planted_fault_in_a_transformers_model_is_the_culprit(name: str, tmp_path: Path) -> None:
    ref = _record_model(name, tmp_path / "ref")
    fault = PlantedFault("aten.mm.default", rel=1e-3, call=4)
    target = _record_model(name, tmp_path / "target", fault)
    assert fault.planted
    _assert_culprit(diff_traces(ref, target), ref, target, "aten.mm.default", 3)


def test_bf16_autocast_against_fp32_alignment_survives_the_casts() -> None:
    ref, target = rh.step_trace("transformer"), rh.step_trace("transformer_bf16")
    report = diff_traces(ref, target)
    rd = report.ranks[0]
    ref_ops = {op.index: op for op in rh.trace_ops(ref)}
    tgt_ops = {op.index: op for op in rh.trace_ops(target)}
    # every forward matmul of the fp32 run is aligned with the same matmul (name and module) of the bf16 run
    matmuls = [i for i, op in ref_ops.items() if op.name in rh.MATMULS and op.phase == "forward"]
    assert len(matmuls) > 10
    for i in matmuls:
        p = rd.by_ref.get(i)
        assert p is not None, f"ref #{i} {ref_ops[i].name} was not aligned"
        assert tgt_ops[p.target].name == ref_ops[i].name and tgt_ops[p.target].module == ref_ops[i].module
    # what autocast added in the forward is casts, and they are listed as target-only, not fatal
    assert rd.target_only_ops == set(tgt_ops) - set(rd.by_target)  # every target op is aligned or listed
    assert rd.ref_only_ops == set(ref_ops) - set(rd.by_ref)
    added = {n for u in rd.target_only if u.phase == "forward" for n in u.names}
    assert added == {"aten._to_copy.default"}
    assert rd.counts()["target_only"] >= len(matmuls)
    bf16_pairs = [p for p in rd.pairs if p.dtypes == ("float32", "bfloat16")]
    assert bf16_pairs and all(p.ref in ref_ops for p in bf16_pairs)
    # bf16 rounding carried through ops that are each right given their own inputs: no op introduced a difference,
    # and the pairs beyond bf16's fixed limits that say so are bf16 ones
    assert report.first_divergent is None
    assert rd.explained and rd.explained[0].dtypes == ("float32", "bfloat16")


def _mlp_step(autocast_dtype: torch.dtype | None = None, nudge: bool = False, steps_before: int = 0):
    """The TinyMLP step after ``steps_before`` unrecorded steps; ``nudge`` adds 1e-3 to one weight of the second
    layer before anything runs."""
    torch.manual_seed(0)
    model = rh.TinyMLP()
    if nudge:
        with torch.no_grad():
            model.net[2].weight[0, 0] += 1e-3
    step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3),
                     autocast_dtype=autocast_dtype)
    for _ in range(steps_before):
        step()
    return step


def test_inputs_of_the_step_that_already_differ_are_said_first(tmp_path: Path, capsys) -> None:
    ref = rh.record_fn(tmp_path / "ref", _mlp_step())
    target = rh.record_fn(tmp_path / "target", _mlp_step(nudge=True))
    assert main(["diff", str(ref), str(target), "--json", str(tmp_path / "d.json")]) == 1
    lines = capsys.readouterr().out.splitlines()
    # Said on the second line, before the environment and before any op is named.
    assert lines[1].startswith("inputs of the step already differ: 1 of "), lines[:3]
    report = diff_traces(ref, target)
    si = report.ranks[0].step_inputs
    # Only the nudged weight entered the step differing (AdamW's state is created inside a first step).
    assert si.differ == 1 and si.compared > 1
    trace = open_trace(ref).rank(0)
    ref_ops = list(trace)
    # The weight's first reader: the first op reading a [4, 16] tensor that requires grad and no op produced.
    reader = min(op.index for op in ref_ops for pos, r in enumerate(op.inputs())
                 if r.shape == (4, 16) and r.requires_grad and trace.producers(op.index).get(pos) is None)
    first = si.first
    assert (first.ref, first.op, first.module) == (reader, ref_ops[reader].name, ref_ops[reader].module)
    assert first.read_first.index == reader and first.requires_grad
    assert ref_ops[reader].inputs()[first.position].shape == (4, 16)
    assert report.found_difference and report.first_divergent is None

    assert lines[1].startswith(f"inputs of the step already differ: 1 of {si.compared} tensors from outside the "
                               f"trace, first float32[4, 16] (requires grad) at ref #{first.ref} / "
                               f"target #{first.target} {first.op} input {first.position}  TinyMLP.net.2"), lines[:3]
    doc = json.loads((tmp_path / "d.json").read_text())
    assert list(doc)[:6] == ["format", "planted", "ref", "target", "baseline", "step_inputs"]
    assert doc["step_inputs"]["differ"] == 1 and doc["step_inputs"]["first"]["index"] == {
        "ref": first.ref, "target": first.target}
    assert doc["ranks"][0]["step_inputs"]["differ"] == 1


def _second_step_after_printing_the_loss(path: Path, nudge: bool) -> Path:
    """Step 2 of a TinyMLP loop that begins with ``loss.item()`` of step 1's loss (a print): a 0-d tensor that
    requires grad, is no parameter, and is the first thing the step reads."""
    torch.manual_seed(0)
    model = rh.TinyMLP()
    if nudge:
        with torch.no_grad():
            model.net[2].weight[0, 0] += 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = model.example_batch()

    def one() -> torch.Tensor:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        return loss

    prev = one()

    def step() -> None:
        prev.item()
        one()

    return rh.record_fn(path, step)


def test_the_first_differing_step_input_is_what_the_model_reads_not_a_printed_loss(tmp_path: Path, capsys) -> None:
    ref = _second_step_after_printing_the_loss(tmp_path / "ref", nudge=False)
    target = _second_step_after_printing_the_loss(tmp_path / "target", nudge=True)
    ops = list(open_trace(ref).rank(0))
    assert ops[0].name == "aten._local_scalar_dense.default"  # the print comes first
    report = diff_traces(ref, target)
    rd = report.ranks[0]
    si = rd.step_inputs
    printed = [d for d in si.differing if d.read_first.op == "aten._local_scalar_dense.default"]
    assert len(printed) == 1 and printed[0].requires_grad and printed[0].tensor == "float32[]"
    first = si.first
    # The nudged weight (AdamW's first update hardly depends on the gradient: the other parameters agree within
    # tolerance) where the forward reads it, which is where the step's differences are first seen.
    assert first is not printed[0] and first.tensor == "float32[4, 16]" and first.requires_grad
    assert first.read_first.module == "TinyMLP.net.2" and first.read_first.phase == "forward"
    seen = rd.first_difference
    assert seen is not None and seen.ref in (first.read_first.index, first.ref)
    assert main(["diff", str(ref), str(target)]) == 1
    out = capsys.readouterr().out
    line = out.splitlines()[1]
    assert "a parameter" not in out
    assert line.startswith(f"inputs of the step already differ: {si.differ} of {si.compared} tensors from outside "
                           f"the trace, first float32[4, 16] (requires grad) "), line
    assert f"first seen at ref #{seen.ref} / target #{seen.target} {seen.op}  TinyMLP.net.2" in out, out


def test_bf16_against_fp32_after_two_steps_names_no_op_whose_inputs_already_differ(tmp_path: Path,
                                                                                   capsys) -> None:
    """At step 3 every parameter differs between the runs: an op whose inputs agree only within bf16's tolerance is
    carrying that difference, not introducing one."""
    ref = rh.record_fn(tmp_path / "ref", _mlp_step(steps_before=2))
    target = rh.record_fn(tmp_path / "target", _mlp_step(torch.bfloat16, steps_before=2))
    report = diff_traces(ref, target)
    rd = report.ranks[0]
    assert report.first_divergent is None, report.first_divergent[1].reason
    assert not [p for p in rd.pairs if p.status is PairStatus.DIVERGENT and not p.reason.endswith(
        "inputs equal bit for bit, outputs differ")]
    trace = open_trace(ref).rank(0)
    params = {r.version for op in trace for pos, r in enumerate(op.inputs())
              if r.requires_grad and trace.producers(op.index).get(pos) is None}
    assert rd.step_inputs.differ >= 4 == len(params)  # the 4 parameters (and their AdamW state)
    assert main(["diff", str(ref), str(target)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith(f"inputs of the step already differ: {rd.step_inputs.differ} of ")
    assert "first divergence" not in out and "inputs agree within tolerance" not in out


def _mlp_run(path: Path, steps: str | None, run: int = 3) -> Path:
    """``run`` TinyMLP steps from the same seed, recorded with ``record(steps=...)`` (None: the one-step API around
    the first step only, no step numbers)."""
    step = _mlp_step()
    if steps is None:
        return rh.record_fn(path, step)
    with record(path, steps=steps):
        for _ in range(run):
            step()
    return path


def test_traces_of_different_steps_compare_like_with_like(tmp_path: Path, capsys) -> None:
    many = _mlp_run(tmp_path / "many", "1-3")
    two = _mlp_run(tmp_path / "two", "2")
    one = _mlp_run(tmp_path / "one", None)
    two_ops = [op.index for op in open_trace(many).rank(0) if op.step == 2]
    # Steps 1-3 against step 2: step 2 of each is compared (the same seeded run: no difference), said first.
    assert main(["diff", str(many), str(two), "--json", str(tmp_path / "d.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("comparing step 2, the only step both hold (the reference holds steps 1-3, the target "
                        "step 2)"), lines[:3]
    report = diff_traces(many, two)
    rd = report.ranks[0]
    assert rd.ref_ops == len(two_ops) and {p.ref for p in rd.pairs} <= set(two_ops)
    assert rd.counts()["ref_only"] == rd.counts()["target_only"] == 0 and not report.found_difference
    assert json.loads((tmp_path / "d.json").read_text())["steps"] == lines[1]
    # Several steps against one without a step number: nothing says which is like it, so the user picks.
    capsys.readouterr()
    assert main(["diff", str(many), str(one)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["replaydiff: error: the reference holds steps 1-3, the target one step without a step number: "
                   "pick the step to compare with --step N"], err
    assert main(["diff", str(many), str(one), "--step", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("comparing step 1 (the reference holds steps 1-3")
    assert main(["diff", str(many), str(two), "--step", "3"]) == 2
    assert "step 3 is not in the target trace: the reference holds steps 1-3, the target step 2" in \
        capsys.readouterr().err
    # The same steps on both sides: nothing to say.
    assert main(["diff", str(many), str(many)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "environment: same"


def test_foreach_against_for_loop_adamw_differs_only_in_the_optimizer_and_exits_0() -> None:
    ref, target = rh.step_trace("mlp_forloop"), rh.step_trace("mlp_foreach")
    report = diff_traces(ref, target)
    rd = report.ranks[0]
    assert rd.first_difference is None  # forward and backward agree; the optimizers cannot be paired op by op
    ref_ops = rh.trace_ops(ref)
    fwd_bwd = [op.index for op in ref_ops if op.phase in ("forward", "backward")]
    assert all(i in rd.by_ref for i in fwd_bwd)
    assert {n for u in rd.target_only for n in u.names if n.startswith("aten._foreach")} >= {
        "aten._foreach_addcdiv_.ScalarList", "aten._foreach_lerp_.Scalar"}
    assert {u.phase for u in rd.target_only + rd.ref_only} == {"optimizer"}
    assert main(["diff", str(ref), str(target)]) == 0


def test_two_stats_traces_are_compared_through_their_statistics(tmp_path: Path, capsys) -> None:
    ref = rh.record_fn(tmp_path / "ref", rh.STEPS["transformer"](), tensors="stats")
    target = rh.record_fn(tmp_path / "target", rh.STEPS["transformer"](), PlantedFault(LN_BACKWARD),
                          tensors="stats")
    clean = diff_traces(ref, ref)
    assert clean.ranks[0].evidence == [Evidence.STATS] and not clean.found_difference
    report = diff_traces(ref, target)
    _assert_culprit(report, ref, target, LN_BACKWARD)
    assert report.first_divergent[1].evidence is Evidence.STATS
    assert main(["diff", str(ref), str(target)]) == 1
    assert "inputs agree in their statistics, outputs differ (statistics only)" in capsys.readouterr().out


def _layernorm_mlp_step(bf16: bool, plant: str | None = None):
    def step(path: Path) -> None:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 10))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with record(path, tensors="stats", plant=plant):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
    return step


def test_stats_traces_at_two_precisions_judge_what_reads_a_rounded_input_at_the_coarser_dtype(tmp_path: Path,
                                                                                                capsys) -> None:
    """fp32 against bf16 autocast, statistics only: a float32 LayerNorm statistic of a bfloat16 activation (and the
    casts back up in the backward) differs from the fp32 run's by bfloat16's rounding, which no statistic can show
    to be right given its inputs; judged at bfloat16's limits it agrees. A 5% fault planted in a bf16 matmul is
    still where the difference enters."""
    _layernorm_mlp_step(False)(tmp_path / "fp32")
    _layernorm_mlp_step(True)(tmp_path / "bf16")
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "fp32"), str(tmp_path / "bf16")]) == 0, capsys.readouterr().out
    assert " 0 divergent, 0 inherited" in capsys.readouterr().out
    _layernorm_mlp_step(True, "aten.addmm.default:2:5e-2")(tmp_path / "bad")
    planted = open_trace(tmp_path / "bad").rank(0).planted.index
    assert main(["diff", str(tmp_path / "fp32"), str(tmp_path / "bad")]) == 1
    assert f" / target #{planted} aten.addmm.default" in capsys.readouterr().out


def test_baseline_noise_sets_the_limits(capsys) -> None:
    """The baseline only widens the fixed limits. Two bitwise-equal reference runs add no room: a 5e-7 change the
    fixed fp32 limits accept still passes, and a 1e-3 change is still divergent with the fixed limits printed (not
    "limit 0"). Reference runs that differ by 2e-4 at one op (a non-deterministic kernel) let a 1e-4 difference
    there pass."""
    op = "aten.addcdiv_.default"
    ref, ref2 = rh.step_trace("mlp_forloop"), rh.record_fn(rh.cache_dir() / "mlp-again", rh.STEPS["mlp_forloop"]())
    small = rh.step_trace("mlp_forloop", op, rel=5e-7)
    assert not diff_traces(ref, small).found_difference
    assert not diff_traces(ref, small, baseline=ref2).found_difference
    assert main(["diff", str(ref), str(small)]) == 0
    assert main(["diff", str(ref), str(small), "--baseline", str(ref2)]) == 0
    big = rh.step_trace("mlp_forloop", op)
    capsys.readouterr()
    assert main(["diff", str(ref), str(big), "--baseline", str(ref2)]) == 1
    out = capsys.readouterr().out
    fixed = diff_traces(ref, big).first_divergent[1].verdict
    assert f"max_abs/(eps*absmax) {fixed.measure.norm_max:.3g} (limit {fixed.limit_max:.3g})" in out, out
    assert "(limit 0)" not in out

    mm = "aten.mm.default"
    noisy_ref2 = rh.step_trace("mlp_forloop", mm, rel=2e-4)
    target = rh.step_trace("mlp_forloop", mm, rel=1e-4)
    fixed = diff_traces(ref, target)
    assert fixed.first_divergent is not None and fixed.first_divergent[1].target == _index(target, mm)
    assert not diff_traces(ref, target, baseline=noisy_ref2).found_difference
    # and the safety factor is what lets it through: at 0.25x the reference noise, 1e-4 is too much
    strict = diff_traces(ref, target, DiffOptions(safety=0.25), baseline=noisy_ref2)
    assert strict.first_divergent is not None and strict.first_divergent[1].target == _index(target, mm)


def test_environment_diff_hints_at_known_causes() -> None:
    ref = {"torch": "2.13.0", "hostname": "a", "rank": 0, "num_threads": 2,
           "flags": {"cuda.matmul.allow_tf32": False, "cudnn.benchmark": False},
           "variables": {"NCCL_ALGO": "Ring"}, "devices": [{"index": 0, "name": "H100"}]}
    target = {"torch": "2.13.0", "hostname": "b", "rank": 3, "num_threads": 1,
              "flags": {"cuda.matmul.allow_tf32": True, "cudnn.benchmark": False},
              "variables": {"NCCL_ALGO": "Tree", "NCCL_DEBUG": "INFO"}, "devices": [{"index": 0, "name": "A100"}]}
    diffs = {d.key: d for d in environment_diff(ref, target)}
    assert set(diffs) == {"num_threads", "flags.cuda.matmul.allow_tf32", "variables.NCCL_ALGO", "variables.NCCL_DEBUG",
                          "devices.0.name"}
    assert "TF32" in diffs["flags.cuda.matmul.allow_tf32"].hint
    assert "thread" in diffs["num_threads"].hint and "NCCL algorithm" in diffs["variables.NCCL_ALGO"].hint
    assert (diffs["variables.NCCL_DEBUG"].ref, diffs["variables.NCCL_DEBUG"].target) == (None, "INFO")


def test_usage_and_trace_errors_exit_2_and_3(clean_pair, tmp_path, capsys) -> None:
    a, b = clean_pair
    assert main(["diff", str(a), str(b), "--rank", "5"]) == 2
    assert main(["diff", str(a), str(tmp_path / "missing")]) == 3
    assert "missing" in capsys.readouterr().err


# -- alignment alone, on key sequences -------------------------------------------------------------------------
def _keys(names: list[str]) -> list[OpKeys]:
    return [OpKeys(i, (n, "m", "forward", ()), (n, "m", "forward")) for i, n in enumerate(names)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abcde"), max_size=60), st.data())
def test_ops_inserted_on_one_side_are_exactly_the_unaligned_ones(ref: list[str], data) -> None:
    target = list(ref)
    inserted = data.draw(st.lists(st.tuples(st.integers(0, len(ref)), st.sampled_from("XYZ")), max_size=10))
    for pos, name in sorted(inserted, reverse=True):
        target.insert(pos, name)
    al = align(_keys(ref), _keys(target))
    assert al.ref_only == []
    assert [target[j] for j in al.target_only] == [n for n in target if n in "XYZ"]
    assert [ref[i] for i, _ in al.pairs] == ref and all(ref[i] == target[j] for i, j in al.pairs)
    assert all(a < b for (a, _), (b, _) in zip(al.pairs, al.pairs[1:]))
    assert all(a < b for (_, a), (_, b) in zip(al.pairs, al.pairs[1:]))


def test_module_paths_match_through_wrappers() -> None:
    assert module_key("DistributedDataParallel.module.0") == module_key("Sequential.0") == "0"
    assert module_key("OptimizedModule._orig_mod.blocks.1.ln1") == module_key("GPT.blocks.1.ln1")
    assert module_key("GPT.blocks.1") != module_key("GPT.blocks.2")


def test_full_trace_against_stats_trace_compares_statistics(tmp_path: Path) -> None:
    full = rh.step_trace("transformer")
    stats = rh.record_fn(tmp_path / "stats", rh.STEPS["transformer"](), PlantedFault(LN_BACKWARD), tensors="stats")
    report = diff_traces(full, stats)
    _assert_culprit(report, full, stats, LN_BACKWARD)
    assert report.ranks[0].evidence == [Evidence.STATS]


def test_meta_traces_compare_shapes_only(tmp_path: Path) -> None:
    a = rh.record_fn(tmp_path / "a", rh.STEPS["mlp"](), tensors="meta")
    b = rh.record_fn(tmp_path / "b", rh.STEPS["mlp"](), PlantedFault("aten.addmm.default"), tensors="meta")
    report = diff_traces(a, b)
    assert not report.found_difference  # a meta trace holds no values: the fault cannot be seen
    assert report.ranks[0].evidence == [Evidence.SHAPES]
    assert any("tensors=meta" in w for w in report.warnings)


def test_rank_pairs_pair_a_single_process_with_every_rank_and_refuse_ranks_not_shared() -> None:
    assert rank_pairs([0], [0, 1]) == [(0, 0), (0, 1)]  # one process against each rank of a 2-rank run
    assert rank_pairs(list(range(8)), [0]) == [(r, 0) for r in range(8)]
    assert rank_pairs(list(range(8)), [0], only=3) == [(3, 0)]  # --rank names a rank of the multi-rank side
    assert rank_pairs([0, 1], [0, 1]) == [(0, 0), (1, 1)]
    assert rank_pairs([0, 1], [0, 1], only=1) == [(1, 1)]
    with pytest.raises(UsageError):
        rank_pairs([0, 1], [2, 3])
    with pytest.raises(UsageError):
        rank_pairs([0, 1], [0, 1], only=4)
    # A trace of rank 1 of a 2-rank job (record --ranks 1) is no single process: it pairs with rank 1 alone
    assert rank_pairs([0, 1], [1], ref_world=2, target_world=2) == [(1, 1)]
    assert rank_pairs([1], [0, 1], ref_world=2, target_world=2) == [(1, 1)]
    assert rank_pairs([0], [1], ref_world=1, target_world=2) == [(0, 1)]  # a single process still pairs with any
    with pytest.raises(UsageError, match="rank 0 is not in both traces"):
        rank_pairs([0, 1], [1], only=0, ref_world=2, target_world=2)
    with pytest.raises(UsageError, match="share no rank"):
        rank_pairs([0], [1], ref_world=2, target_world=2)


def _mlp_rank_step(rank: int):
    """A data-parallel rank's step: the same model, the rank's own batch."""
    torch.manual_seed(0)
    model = rh.TinyMLP()
    return make_step(model, model.example_batch(seed=rank), torch.optim.AdamW(model.parameters(), lr=1e-3))


def test_a_trace_of_one_rank_of_a_job_pairs_with_that_rank(tmp_path: Path, monkeypatch, capsys) -> None:
    """`record --ranks 1` of a 2-rank job against both ranks of it: rank 1 is diffed against rank 1 (not rank 0
    too, as though the one-rank trace were a single process) and the planted op is the only culprit; rank 0, in
    the reference only, is said once."""
    ref, target = tmp_path / "both", tmp_path / "rank1"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        rh.record_fn(ref, _mlp_rank_step(rank))
    rh.record_fn(target, _mlp_rank_step(1), PlantedFault("aten.addmm.default", call=2))
    assert open_trace(ref).ranks == [0, 1] and open_trace(target).ranks == [1]

    report = diff_traces(ref, target)
    assert [(rd.ref_rank, rd.target_rank) for rd in report.ranks] == [(1, 1)]
    assert report.warnings == [f"rank 0 is only in {ref}: not compared"]
    rd, first = report.first_divergent
    planted = _index(target, "aten.addmm.default", 1, rank=1)
    assert (first.ref, first.target, first.inputs_agree) == (planted, planted, True)
    assert [rd for rd in report.ranks if rd.step_inputs.differ] == []

    assert main(["diff", str(ref), str(target)]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("rank 0 is only in") == 1
    assert f"ref rank 1 / target rank 1: " in captured.out and "ref rank 0" not in captured.out
    assert f"first divergence ref #{planted} / target #{planted} aten.addmm.default" in captured.out
    assert main(["diff", str(ref), str(target), "--rank", "0"]) == 2
    assert "rank 0 is not in both traces" in capsys.readouterr().err


def test_a_planted_fault_is_said_first(tmp_path: Path, capsys) -> None:
    """A trace with a planted fault: diff's first line says so (as replay's does) and its JSON has ``planted``."""
    ref = rh.record_fn(tmp_path / "ref", rh.STEPS["mlp"]())
    target = rh.record_fn(tmp_path / "target", rh.STEPS["mlp"](), plant="aten.addmm.default:1:1e-3")
    index = _index(target, "aten.addmm.default")
    line = f"PLANTED FAULT (record --plant): in the target trace, aten.addmm.default call 1 x(1+0.001), op #{index} " \
           f"on rank 0"
    assert diff_traces(ref, target).planted == [line[len("PLANTED FAULT (record --plant): "):]]
    assert main(["diff", str(ref), str(target)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == line
    assert main(["diff", str(ref), str(target), "--json", "-"]) == 1
    assert json.loads(capsys.readouterr().out)["planted"] == [line[len("PLANTED FAULT (record --plant): "):]]
    assert main(["diff", str(ref), str(ref), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["planted"] == []


def _batches_run(path: Path, scale_step: int | None) -> Path:
    """Four recorded SGD steps of a tiny MLP on batches made before the recording (tensors from outside the trace);
    the batch of step ``scale_step`` times 1.5."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)) for _ in range(4)]
    if scale_step is not None:
        batches[scale_step - 1] = (batches[scale_step - 1][0] * 1.5, batches[scale_step - 1][1])
    with record(path, tensors="stats", steps="1-4"):
        for x, y in batches:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return path


def test_multi_step_traces_that_part_inside_name_the_step_not_an_earlier_recording(tmp_path: Path, capsys) -> None:
    """Both traces begin at step 1 and a tensor from outside them (the batch) differs from step 3: the diff says
    step 3, and does not ask for an earlier step to be recorded."""
    ref, target = _batches_run(tmp_path / "ref", None), _batches_run(tmp_path / "target", 3)
    si = diff_traces(ref, target).ranks[0].step_inputs
    assert (si.first_step, si.first.step, si.first.tensor) == (1, 3, "float32[4, 8]")
    assert main(["diff", str(ref), str(target)]) == 1
    out = capsys.readouterr().out
    assert "  (parameters, optimizer state, batch or buffers: they first differ at step 3, inside the traces (which " \
           "begin at step 1): written between recorded ops, or by the steps before it (see the ops below))\n" in out
    assert "record an earlier step" not in out and "record from an earlier step" not in out
