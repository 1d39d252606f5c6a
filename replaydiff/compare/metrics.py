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

import math
from dataclasses import dataclass
from typing import Any, Union

import torch


@dataclass(frozen=True)
class FloatError:
    max_abs: float
    rel_l2: float
    norm_max: float  # max_abs / (eps * max|ref|)
    norm_rel: float  # rel_l2 / eps
    cosine: float
    nonfinite_recorded: int = 0
    nonfinite_reference: int = 0

    def to_json(self) -> dict:
        return {"max_abs": self.max_abs, "rel_l2": self.rel_l2, "norm_max": self.norm_max, "norm_rel": self.norm_rel,
                "cosine": self.cosine, "nonfinite_mismatch": 0, "nonfinite_recorded": self.nonfinite_recorded,
                "nonfinite_reference": self.nonfinite_reference}


@dataclass(frozen=True)
class NonfiniteMismatch:
    """``positions`` elements are NaN/Inf on one side only; ``finite`` measures the positions finite on both."""

    positions: int
    finite: FloatError

    def to_json(self) -> dict:
        return dict(self.finite.to_json(), nonfinite_mismatch=self.positions)


@dataclass(frozen=True)
class ExactMismatch:
    """A bit-for-bit comparison: how many elements differ (NaN equals NaN)."""

    mismatches: int
    nonfinite_recorded: int | None = None  # for floating tensors

    def to_json(self) -> dict:
        d: dict[str, Any] = {"mismatches": self.mismatches}
        if self.nonfinite_recorded is not None:
            d["nonfinite_recorded"] = self.nonfinite_recorded
        return d


@dataclass(frozen=True)
class ShapeMismatch:
    recorded: list
    reference: list

    def to_json(self) -> dict:
        return {"shape_mismatch": [self.recorded, self.reference]}


@dataclass(frozen=True)
class ViewMismatch:
    """A view output whose shape, stride or offset differ from the recorded ones (dicts of the three)."""

    recorded: dict
    reference: dict

    def to_json(self) -> dict:
        return {"recorded": self.recorded, "reference": self.reference}


@dataclass(frozen=True)
class ScalarMismatch:
    recorded: Any
    reference: Any

    def to_json(self) -> dict:
        return {"recorded": self.recorded, "reference": self.reference}


Measure = Union[FloatError, NonfiniteMismatch, ExactMismatch, ShapeMismatch, ViewMismatch, ScalarMismatch]


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


def _exact(rec: torch.Tensor, ref: torch.Tensor) -> ExactMismatch:
    floating = rec.dtype.is_floating_point or rec.is_complex()
    if rec.dtype in _WIDEN:  # no comparison kernels for these (complex32): compare through a wider view
        rec, ref = rec.to(_WIDEN[rec.dtype]), ref.to(_WIDEN[rec.dtype])
    if torch.equal(rec, ref):  # the common case, one call; NaNs make it False and take the slow path
        return ExactMismatch(0, 0 if floating else None)
    if floating:
        same = (rec == ref) | (torch.isnan(rec) & torch.isnan(ref))
    else:
        same = rec == ref
    n = int(same.numel() - int(same.sum()))
    return ExactMismatch(n, int((~torch.isfinite(rec)).sum()) if floating else None)


# Widening loses nothing (every complex32 value is a complex64 value), so equality is unchanged.
_WIDEN = {torch.complex32: torch.complex64}


def measure(rec: torch.Tensor, ref: torch.Tensor, exact: bool = False) -> Measure:
    """How far ``ref`` (the reference) is from ``rec`` (recorded). ``exact`` compares bit for bit."""
    if tuple(rec.shape) != tuple(ref.shape):
        return ShapeMismatch(list(rec.shape), list(ref.shape))
    if rec.device != ref.device:
        rec = rec.to(ref.device)
    if exact or not (rec.dtype.is_floating_point or rec.is_complex()):
        if ref.dtype != rec.dtype:
            if rec.dtype.is_floating_point or rec.is_complex():
                ref = ref.to(rec.dtype)
            else:  # an integer output whose reference came out floating is a mismatch unless values agree
                rec = rec.to(ref.dtype)
        return _exact(rec, ref)
    eps = torch.finfo(rec.dtype).eps
    if rec.is_complex():
        rec, ref = torch.view_as_real(rec.resolve_conj()), torch.view_as_real(ref.to(rec.dtype).resolve_conj())
    a = rec.to(torch.float64)
    b = ref.to(torch.float64)
    if a.numel():
        # Fast path: when every difference is finite, both tensors are finite and no masking is needed.
        # Two batched norm calls give all five reductions; the dot product for the cosine follows from the norms
        # (2 a.b = |a|^2 + |b|^2 - |a-b|^2), which is exact enough for a similarity reported to a few digits.
        # The largest magnitudes come from aminmax (one vectorised pass): _foreach_norm's inf-norm is ~15x slower
        # on the CPU and took 60% of the replay of a large trace.
        d = a - b
        l2d, l2b, l2a = torch._foreach_norm([d, b, a], 2)
        (lo_d, hi_d), (lo_b, hi_b) = torch.aminmax(d), torch.aminmax(b)
        raw = torch.stack([lo_d, hi_d, lo_b, hi_b, l2d, l2b, l2a]).tolist()
        if all(map(math.isfinite, raw)):
            vals = [max(-raw[0], raw[1]), max(-raw[2], raw[3])] + raw[4:]
            dot = (vals[4] ** 2 + vals[3] ** 2 - vals[2] ** 2) / 2
            return _finish(vals + [dot, 0.0, 0.0, 0.0], eps)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    # An Inf recorded where the reference, rounded to the recorded dtype, overflows too is correct rounding
    # (bf16 overflows long before fp64 does), not a divergence.
    rounded = b.to(rec.dtype).to(torch.float64)
    nonfinite_bad = (~both) & ~((a == b) | (torch.isinf(a) & (a == rounded)) | (torch.isnan(a) & torch.isnan(b)))
    d = torch.where(both, a - b, 0.0)
    bf = torch.where(both, b, 0.0)  # norms over the positions finite on both sides, like the differences
    af = torch.where(both, a, 0.0)
    vals = torch.stack([
        d.abs().max() if d.numel() else d.new_zeros(()),
        bf.abs().max() if bf.numel() else bf.new_zeros(()),
        torch.linalg.vector_norm(d),
        torch.linalg.vector_norm(bf),
        torch.linalg.vector_norm(af),
        (af * bf).sum(),
        nonfinite_bad.sum().to(torch.float64),
        (~fa).sum().to(torch.float64),
        (~fb).sum().to(torch.float64),
    ]).tolist()
    return _finish(vals, eps)


def _finish(vals: list[float], eps: float) -> FloatError | NonfiniteMismatch:
    max_abs, absmax, l2d, l2b, l2a, dot, bad, nf_rec, nf_ref = vals
    rel_l2 = (l2d / l2b) if l2b > 0 else (0.0 if l2d == 0 else math.inf)
    norm_max = (max_abs / (eps * absmax)) if absmax > 0 else (0.0 if max_abs == 0 else math.inf)
    cosine = dot / (l2a * l2b) if l2a > 0 and l2b > 0 else (1.0 if l2a == l2b else 0.0)
    fe = FloatError(max_abs, rel_l2, norm_max, rel_l2 / eps, cosine, int(nf_rec), int(nf_ref))
    return NonfiniteMismatch(int(bad), fe) if bad else fe
