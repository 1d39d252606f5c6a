"""What a parallel diff says in its JSON summary and in its words for an op's arguments: small results built in code,
no trace. The summary is the rank-by-rank diff's (a check of ``summary.divergent`` finds a parallel departure as it
finds a rank-by-rank one) with the figures the text says."""
from __future__ import annotations

from collections import Counter
from fractions import Fraction

from replaydiff.compare.layout import Layout, LayoutKind
from replaydiff.diff.parallel import Departure, Mapped, MappedOp, ParallelDeparture, ParallelDiff
from replaydiff.diff.parallel.arguments import arguments_text
from replaydiff.diff.parallel.settings import SettingDifference
from replaydiff.diff.result import DiffReport
from replaydiff.report.diff_json import diff_to_json


def _departure(ref: int, inherited: int, kind: Departure = Departure.SCALED) -> ParallelDeparture:
    op = MappedOp(ref, (ref + 2, ref + 2), "aten.mul.Tensor", None, "forward", "job.py:5", ())
    t = Mapped("out", 0, "float32[4]", Layout(LayoutKind.PARTIAL, 2, factor=Fraction(1, 4)), 0.0)
    return ParallelDeparture(op, t, kind, "at 2x", inherited)


def _mapping(departure: ParallelDeparture | None) -> ParallelDiff:
    # 12 ops in the single process, 10 run by every rank (2 not), 8 of them compared: 2 read another rank's dropout
    # mask (not judged), 3 part (the departure, 1 op that reads it, 1 value that cancels before the sinks), 3 map
    return ParallelDiff(2, 12, 10, 8, not_aligned=[3, 7],
                        layout_ops=Counter({"c10d.allreduce_.default": 2, "aten.copy_.default": 6}),
                        random_parted=[9, 10], parted={4, 5, 6} if departure else set(), departure=departure,
                        sinks=3)


def test_a_parallel_diff_s_json_summary_counts_what_its_text_says() -> None:
    report = DiffReport("single", "ddp", {}, parallel=_mapping(_departure(4, 1)))
    summary = diff_to_json(report)["summary"]
    assert summary == {"same": 3, "divergent": 1, "inherited": 1, "not_compared": 2 + 2, "ref_only": 2,
                       "target_only": 8, "units": 0, "units_divergent": 0, "ref_ops": 12, "aligned": 10,
                       "compared": 8, "parted": 3, "cancelled": 0, "amplified": 0, "not_judged_random": 2,
                       "sinks": 3}
    # every op every rank runs is counted once: it maps, it parts, or it is not judged
    assert summary["same"] + summary["parted"] + summary["not_compared"] == summary["aligned"]


def test_a_clean_parallel_diff_s_summary_has_nothing_divergent_and_every_compared_op_same() -> None:
    summary = DiffReport("single", "ddp", {}, parallel=ParallelDiff(2, 12, 10, 10)).counts()
    assert (summary["same"], summary["divergent"], summary["inherited"], summary["parted"]) == (10, 0, 0, 0)


def test_step_inputs_that_differ_are_no_divergent_op_and_a_reference_of_ranks_sums_its_groups() -> None:
    inputs = _mapping(_departure(0, 5, Departure.INPUTS))
    assert inputs.counts()["divergent"] == 0 and inputs.counts()["inherited"] == 5
    groups = [_mapping(_departure(4, 1)), _mapping(None)]
    whole = ParallelDiff(4, 24, 20, 16, ref_world=2, groups=groups, departure=groups[0].departure)
    summary = whole.counts()
    assert (summary["aligned"], summary["compared"], summary["parted"], summary["same"]) == (20, 16, 3, 3 + 6)
    assert (summary["divergent"], summary["inherited"], summary["target_only"]) == (1, 1, 16)


def test_an_argument_the_ranks_give_otherwise_is_said_with_six_digits_and_its_plain_ratio() -> None:
    # AdamW's addcdiv_ value -lr * bias correction: 0.1 * 2 in floating point is 0.20000000000000004
    found = [("value", -0.1 * 1.0000000000000002, -0.1 * 2 * 1.0000000000000002, (0, 1))]
    assert arguments_text(found, 2) == "value -0.2 on the ranks, -0.1 in the single process (2x: the world size)"
    # exact ints and bools; no ratio of bools, none that is no plain fraction
    assert arguments_text([("argument 1", 1, 2, (1,))], 2) == \
        "argument 1 2 on rank 1, 1 in the single process (2x: the world size)"
    assert arguments_text([("training", False, True, (0, 1))], 2) == \
        "training True on the ranks, False in the single process"
    assert arguments_text([("eps", 1e-5, 3.14159e-5, (0, 1))], 2) == \
        "eps 3.14159e-05 on the ranks, 1e-05 in the single process"
    assert arguments_text([("alpha", 0.25, 0.125, (0, 1))], 2) == \
        "alpha 0.125 on the ranks, 0.25 in the single process (1/2x: 1 over the world size)"


def test_two_values_six_digits_would_show_alike_get_the_digits_that_tell_them_apart() -> None:
    said = arguments_text([("alpha", 0.1, 0.1000001, (0, 1))], 2)
    assert said == "alpha 0.1000001 on the ranks, 0.1 in the single process", said
    said = arguments_text([("alpha", 0.1, 0.1 + 2 ** -55, (0, 1))], 2)
    assert said == f"alpha {0.1 + 2 ** -55!r} on the ranks, 0.1 in the single process", said


def test_an_optimizer_setting_is_said_as_people_read_it() -> None:
    lr = SettingDifference("AdamW", 0, "lr", 0.1, 0.1 * 3, 1, 2)  # 0.30000000000000004
    assert lr.describe() == "AdamW group 0: lr 0.3 on rank 1, 0.1 in the single process (3x)"
    betas = SettingDifference("AdamW", 0, "betas", (0.9, 0.999), (0.9, 0.95), 0, 2)
    assert betas.describe() == "AdamW group 0: betas (0.9, 0.95) on rank 0, (0.9, 0.999) in the single process"
