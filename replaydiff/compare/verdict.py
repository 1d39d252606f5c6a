"""Judging one recorded tensor against a reference: a pure function from two tensors and the limits to a Verdict.

Replay, the cross-rank collective check and the diff of two traces all judge through ``judge``; nothing here keeps
state or changes its arguments. The verdict carries the measure (its type says what kind of difference it is), the
limits applied, the reduction length they were scaled for, the op's own error at its dtype when that was measured,
and why the tensor is divergent, if it is. Its ``severity`` (how far over its limit, in units of the limit) and its
``explanation`` (why an error over the fixed limits is still ok) are the one definition every reader uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from replaydiff.compare.metrics import (ExactMismatch, FloatError, Measure, NonfiniteMismatch, ShapeMismatch,
                                        ScalarMismatch, ViewMismatch, measure, measure_from_json)
from replaydiff.compare.tolerance import Tolerances
# The pure judging functions live with rebuilding and measuring a recorded op, in the module `replaydiff repro` copies
# as the standalone script a kernel owner runs without replaydiff: replay and the script judge by one definition.
from replaydiff.rebuild_and_judge import (Calibration, Precision, calibrate, calibrated_limits, float_severity,
                                          how_far_over, ill_conditioned_note, same_scalar)

__all__ = ["Calibration", "OutputName", "Verdict", "calibrate", "calibrated", "calibrated_limits", "float_severity",
           "how_far_over", "ill_conditioned_note", "judge", "judge_measure", "output_said", "scalar_verdict",
           "with_calibration", "with_precision", "within_fixed_limits"]


@dataclass(frozen=True)
class OutputName:
    """Which result of an op a verdict judges: its position among the op's results (its outputs, then the arguments
    it writes that are not among them), its role (``mean``: the schema's return name, or the written argument's
    name) and how many results the op has. A reader is told which output was judged whenever there are several."""

    index: int
    role: str | None
    outputs: int

    def label(self) -> str:
        """``output 1 (mean)``."""
        return f"output {self.index}" + (f" ({self.role})" if self.role else "")

    def said(self) -> str:
        """The label as a line's prefix (``output 1 (mean): ``), empty for an op with a single result."""
        return f"{self.label()}: " if self.outputs > 1 else ""

    def to_json(self) -> dict:
        return {"index": self.index, "role": self.role, "outputs": self.outputs}

    @classmethod
    def from_json(cls, d: Any) -> "OutputName | None":
        return cls(d["index"], d.get("role"), d.get("outputs", 1)) if isinstance(d, dict) and "index" in d else None


@dataclass(frozen=True)
class Verdict:
    divergent: bool
    measure: Measure
    reason: str | None = None  # why it is divergent
    limit_max: float | None = None  # limits on norm_max / norm_rel, for a FloatError
    limit_rel: float | None = None
    reduction_k: int | None = None
    calibration: Calibration | None = None  # set when the output was over its fixed limits and the op was re-run
    precision: Precision | None = None  # set when the op was replayed at another precision than asked
    left_out: int = 0  # positions not compared: the kernel leaves them unwritten (their value is the allocator's)
    output: OutputName | None = None  # which result of the op was judged (set where the op is known)

    @property
    def severity(self) -> float:
        """How far over its limit the output is, in units of its limit: the one measure of how bad an op is that
        replay, the report, the repro and the TUI rank and label by.

        The larger of max_abs/(eps*absmax) and rel_l2/eps over their limits; for an ill-conditioned op, of max_abs
        and rel_l2 over ``factor`` times its own error at its recorded dtype (the limits its verdict was decided
        by). An exact comparison is 0 when equal; mismatches, NaN/Inf on one side only, a wrong shape, view or
        scalar are infinitely far. The figure never contradicts the decision: at most 1 for a verdict within its
        limits, over 1 for a divergent one (infinite if its figures cannot say how far)."""
        s = self._over()
        if self.divergent:
            return s if s > 1 else math.inf
        return min(s, 1.0)

    def _over(self) -> float:
        m = self.measure
        if isinstance(m, NonfiniteMismatch) and not self.divergent:
            m = m.finite  # NaN/Inf positions the op makes itself at its dtype: judged on the finite ones
        if isinstance(m, FloatError):
            calibrated_by = self.calibration if self.calibration is not None and self.calibration.limits else None
            if calibrated_by is None and (self.limit_max is None or self.limit_rel is None):
                return 0.0 if not self.divergent else math.inf  # judged by no limit (a diff's noise floor)
            return float_severity(m, (self.limit_max or 0.0, self.limit_rel or 0.0), calibrated_by)
        if isinstance(m, ExactMismatch):
            return math.inf if m.mismatches else 0.0
        return math.inf

    @property
    def explanation(self) -> str | None:
        """Why an output within its limits is so although its error is over the fixed per-dtype limits (the op is
        ill-conditioned, and this is its own error at its recorded dtype); None for any other verdict."""
        cal = self.calibration
        m = self.measure
        if self.divergent or cal is None or cal.limits is None or not isinstance(m, FloatError):
            return None
        return cal.explanation(m)

    def to_json(self) -> dict:
        d = self.measure.to_json()
        if self.limit_max is not None:
            d["limit_max"], d["limit_rel"] = self.limit_max, self.limit_rel
        if self.reduction_k is not None:
            d["reduction_k"] = self.reduction_k
        c = self.calibration
        if c is not None:
            d["same_dtype_max_abs"], d["same_dtype_rel_l2"] = c.max_abs, c.rel_l2
            d["same_dtype"], d["conditioning_factor"], d["ill_conditioned"] = c.dtype, c.factor, c.ill
        if self.precision is not None:
            d["precision"] = self.precision
        if self.left_out:
            d["left_out"] = self.left_out
        if self.output is not None:
            d["output"] = self.output.to_json()
        return d

    @property
    def output_said(self) -> str:
        """``output 1 (mean): `` before a verdict's figures when the op has several results, else empty."""
        return self.output.said() if self.output is not None else ""

    @classmethod
    def from_json(cls, d: dict, divergent: bool = False, reason: str | None = None) -> "Verdict":
        cal = None
        if "same_dtype_max_abs" in d:
            # A report written before the calibration was kept whole: an ok verdict over its limits was ill.
            cal = Calibration(d["same_dtype_max_abs"], d["same_dtype_rel_l2"], d.get("same_dtype", "recorded dtype"),
                              d.get("conditioning_factor", Tolerances().conditioning_factor),
                              d.get("ill_conditioned", not divergent))
        return cls(divergent, measure_from_json(d), reason, d.get("limit_max"), d.get("limit_rel"),
                   d.get("reduction_k"), cal, Precision(d["precision"]) if d.get("precision") else None,
                   d.get("left_out", 0),
                   OutputName.from_json(d.get("output")))


def output_said(metrics: dict) -> str:
    """``output 1 (mean): `` for a verdict's JSON figures of one result of an op with several, else empty."""
    name = OutputName.from_json(metrics.get("output"))
    return name.said() if name is not None else ""


def judge_measure(m: Measure, dtype: torch.dtype | str, tolerances: Tolerances, k: int = 1) -> Verdict:
    """The verdict on one measure of a tensor recorded in ``dtype``, from a reduction over ``k`` terms."""
    if isinstance(m, ShapeMismatch):
        return Verdict(True, m, "shape mismatch", reduction_k=k)
    if isinstance(m, ViewMismatch):
        return Verdict(True, m, "view has another shape, stride or offset than recorded")
    if isinstance(m, ScalarMismatch):
        return Verdict(True, m, f"scalar output {m.reference!r} != recorded {m.recorded!r}")
    if isinstance(m, ExactMismatch):
        n = m.mismatches
        return Verdict(n > 0, m, f"{n} elements differ" if n else None, reduction_k=k)
    if isinstance(m, NonfiniteMismatch):
        return Verdict(True, m, "NaN/Inf where the reference has none (or the reverse)", reduction_k=k)
    lmax, lrel = tolerances.limit_for(dtype, k)
    why = None
    if m.norm_max > lmax:
        why = f"max_abs/(eps*absmax) {m.norm_max:.3g} > {lmax:.3g}"
    elif m.norm_rel > lrel:
        why = f"rel_l2/eps {m.norm_rel:.3g} > {lrel:.3g}"
    return Verdict(why is not None, m, why, lmax, lrel, k)


def judge(recorded: torch.Tensor, reference: torch.Tensor, tolerances: Tolerances, k: int = 1,
          exact: bool = False) -> Verdict:
    """Is ``recorded`` divergent from ``reference``? Limits by the recorded dtype, scaled for ``k``-term sums."""
    return judge_measure(measure(recorded, reference, exact=exact), recorded.dtype, tolerances, k)


def with_calibration(v: Verdict, cal: Calibration) -> Verdict:
    """A FloatError verdict over its fixed limits judged again, knowing the op's own error at its recorded dtype:
    within ``cal.factor`` times that error an ill-conditioned op is ok (its ``explanation`` says why)."""
    c = replace(v, calibration=cal)
    if c._over() <= 1:
        return replace(c, divergent=False, reason=None)
    m = v.measure
    excess = cal.excess(m) if isinstance(m, FloatError) else "while the op itself is exact at its recorded dtype"
    return replace(c, divergent=True, reason=f"{v.reason}, {excess}")


def calibrated(v: Verdict, own: Measure, dtype: str, factor: float) -> Verdict:
    """A FloatError verdict over its fixed limits, given ``own``, the op's own error at its recorded ``dtype``
    (the op run there against the same reference): only an op whose own error already breaks the fixed limits is
    ill-conditioned and held to ``factor`` times that error; a well-conditioned op's bf16 rounding must not hide a
    1e-2 fault (only ~6x that rounding). Any other verdict or measure is returned as it is."""
    if not isinstance(own, FloatError) or v.limit_max is None or v.limit_rel is None:
        return v
    return with_calibration(v, calibrate(own, (v.limit_max, v.limit_rel), dtype, factor))


def within_fixed_limits(v: Verdict) -> bool | None:
    """Whether a FloatError verdict's error is within the fixed per-dtype limits (before any calibration for an
    ill-conditioned op); None when it was judged by no such limits."""
    m = v.measure
    if not isinstance(m, FloatError) or v.limit_max is None or v.limit_rel is None:
        return None
    return float_severity(m, (v.limit_max, v.limit_rel)) <= 1


def with_precision(v: Verdict, precision: Precision) -> Verdict:
    return replace(v, precision=precision)


def scalar_verdict(recorded: Any, reference: Any) -> Verdict | None:
    """None when a scalar output equals its recorded value (NaN equals NaN), else a divergent verdict."""
    if same_scalar(recorded, reference):
        return None
    return judge_measure(ScalarMismatch(recorded, reference), "", Tolerances())
