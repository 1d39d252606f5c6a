"""Error measures between a recorded tensor and a reference, normalised by the recorded dtype.

rel_l2 = |out - ref|_2 / |ref|_2 and max_abs = max|out - ref| are computed in float64 over positions where both are
finite; NaN/Inf positions must match exactly. The normalised forms max_abs / (eps * max|ref|) and rel_l2 / eps put
every dtype on one scale (element-wise ULP distance is misleading near zero: cancellation gives millions of ulps on
healthy outputs). Integer and bool tensors are compared exactly.

Each kind of difference is its own type, so callers match on the type instead of probing dict keys: FloatError,
NonfiniteMismatch (NaN/Inf in one and not the other, with the error over the finite positions), ExactMismatch (a
count of differing elements) and ShapeMismatch; ViewMismatch and ScalarMismatch describe outputs that are not data.
"""
from __future__ import annotations

from typing import Any

# Measuring is defined with the rest of rebuilding and judging a recorded op, which the standalone repro script
# shares with replay: the script measures by these very functions.
from replaydiff.rebuild_and_judge import (ExactMismatch, FloatError, Measure, NonfiniteMismatch, ScalarMismatch,
                                          ShapeMismatch, ViewMismatch, measure)

__all__ = ["ExactMismatch", "FloatError", "Measure", "NonfiniteMismatch", "ScalarMismatch", "ShapeMismatch",
           "ViewMismatch", "measure", "measure_from_json"]


def measure_from_json(d: dict) -> Measure:
    """Inverse of ``to_json`` (reading a JSON report back)."""
    if "shape_mismatch" in d:
        return ShapeMismatch(*d["shape_mismatch"])
    if "mismatches" in d:
        return ExactMismatch(d["mismatches"], d.get("nonfinite_recorded"))
    if "norm_max" in d:
        fe = FloatError(**{k: _num(d[k]) for k in ("max_abs", "rel_l2", "norm_max", "norm_rel", "cosine")},
                        nonfinite_recorded=d.get("nonfinite_recorded", 0),
                        nonfinite_reference=d.get("nonfinite_reference", 0))
        return NonfiniteMismatch(d["nonfinite_mismatch"], fe) if d.get("nonfinite_mismatch") else fe
    if isinstance(d.get("recorded"), dict):
        return ViewMismatch(d["recorded"], d["reference"])
    return ScalarMismatch(d.get("recorded"), d.get("reference"))


def _num(v: Any) -> float:
    return float(v) if isinstance(v, str) else v  # "inf" / "nan" as the JSON report writes them
