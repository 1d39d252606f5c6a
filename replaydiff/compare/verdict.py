"""Judging one recorded tensor against a reference: a pure function from two tensors and the limits to a Verdict.

Replay, the cross-rank collective check and the diff of two traces all judge through ``judge``; nothing here keeps
state or changes its arguments. The verdict carries the measure (its type says what kind of difference it is), the
limits applied, the reduction length they were scaled for and why the tensor is divergent, if it is.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from replaydiff.compare.metrics import (ExactMismatch, FloatError, Measure, NonfiniteMismatch, ShapeMismatch,
                                        ScalarMismatch, ViewMismatch, measure, measure_from_json)
from replaydiff.compare.tolerance import Tolerances


@dataclass(frozen=True)
class Verdict:
    divergent: bool
    measure: Measure
    reason: str | None = None  # why it is divergent
    limit_max: float | None = None  # limits on norm_max / norm_rel, for a FloatError
    limit_rel: float | None = None
    reduction_k: int | None = None
    # The op's own error at its recorded dtype (calibration of an ill-conditioned op): max_abs, rel_l2.
    same_dtype: tuple[float, float] | None = None
    precision: str | None = None  # set when the op was replayed at another precision than asked
    left_out: int = 0  # positions not compared: the kernel leaves them unwritten (their value is the allocator's)

    @property
    def score(self) -> float:
        """One number to rank verdicts by: the normalised max error, or the count of differing elements."""
        m = self.measure
        if isinstance(m, FloatError):
            return m.norm_max
        if isinstance(m, NonfiniteMismatch):
            return float("inf")
        if isinstance(m, ExactMismatch):
            return float(m.mismatches)
        return float("inf")

    def to_json(self) -> dict:
        d = self.measure.to_json()
        if self.limit_max is not None:
            d["limit_max"], d["limit_rel"] = self.limit_max, self.limit_rel
        if self.reduction_k is not None:
            d["reduction_k"] = self.reduction_k
        if self.same_dtype is not None:
            d["same_dtype_max_abs"], d["same_dtype_rel_l2"] = self.same_dtype
        if self.precision is not None:
            d["precision"] = self.precision
        if self.left_out:
            d["left_out"] = self.left_out
        return d

    @classmethod
    def from_json(cls, d: dict, divergent: bool = False, reason: str | None = None) -> "Verdict":
        same = (d["same_dtype_max_abs"], d["same_dtype_rel_l2"]) if "same_dtype_max_abs" in d else None
        return cls(divergent, measure_from_json(d), reason, d.get("limit_max"), d.get("limit_rel"),
                   d.get("reduction_k"), same, d.get("precision"), d.get("left_out", 0))


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


def with_calibration(v: Verdict, divergent: bool, reason: str | None, same: tuple[float, float]) -> Verdict:
    return replace(v, divergent=divergent, reason=reason, same_dtype=same)


def with_precision(v: Verdict, precision: str) -> Verdict:
    return replace(v, precision=precision)


def scalar_verdict(recorded: Any, reference: Any) -> Verdict | None:
    """None when a scalar output equals its recorded value (NaN equals NaN), else a divergent verdict."""
    if isinstance(recorded, float) and isinstance(reference, float) and recorded != recorded \
            and reference != reference:
        return None
    if recorded == reference:
        return None
    return judge_measure(ScalarMismatch(recorded, reference), "", Tolerances())
