"""Error metrics between a recorded tensor and a reference, normalised by the recorded dtype.

rel_l2 = |out - ref|_2 / |ref|_2 and max_abs = max|out - ref| are computed in float64 over positions where both are
finite; NaN/Inf positions must match exactly. The normalised forms max_abs / (eps * max|ref|) and rel_l2 / eps put
every dtype on one scale (element-wise ULP distance is misleading near zero: cancellation gives millions of ulps on
healthy outputs). Integer and bool tensors are compared exactly.
"""
from __future__ import annotations

import math

import torch


def _exact(rec: torch.Tensor, ref: torch.Tensor) -> dict:
    if torch.equal(rec, ref):  # the common case, one call; NaNs make it False and take the slow path
        out = {"mismatches": 0}
        if rec.dtype.is_floating_point or rec.is_complex():
            out["nonfinite_recorded"] = 0
        return out
    if rec.dtype.is_floating_point or rec.is_complex():
        same = (rec == ref) | (torch.isnan(rec) & torch.isnan(ref))
    else:
        same = rec == ref
    n = int(same.numel() - int(same.sum()))
    out = {"mismatches": n}
    if rec.dtype.is_floating_point or rec.is_complex():
        out["nonfinite_recorded"] = int((~torch.isfinite(rec)).sum())
    return out


def tensor_metrics(rec: torch.Tensor, ref: torch.Tensor, exact: bool = False) -> dict:
    """Metrics of ``ref`` (the reference) against ``rec`` (recorded). ``exact`` compares bit for bit."""
    if tuple(rec.shape) != tuple(ref.shape):
        return {"shape_mismatch": [list(rec.shape), list(ref.shape)]}
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
        rec, ref = torch.view_as_real(rec), torch.view_as_real(ref.to(rec.dtype))
    a = rec.to(torch.float64)
    b = ref.to(torch.float64)
    if a.numel():
        # Fast path: when every difference is finite, both tensors are finite and no masking is needed.
        # Two batched norm calls give all five reductions; the dot product for the cosine follows from the norms
        # (2 a.b = |a|^2 + |b|^2 - |a-b|^2), which is exact enough for a similarity reported to a few digits.
        d = a - b
        l2d, l2b, l2a = torch._foreach_norm([d, b, a], 2)
        mx_d, mx_b = torch._foreach_norm([d, b], math.inf)
        vals = torch.stack([mx_d, mx_b, l2d, l2b, l2a]).tolist()
        if all(map(math.isfinite, vals)):
            dot = (vals[4] ** 2 + vals[3] ** 2 - vals[2] ** 2) / 2
            return _finish(vals + [dot, 0.0, 0.0, 0.0], eps)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    nonfinite_bad = (~both) & ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    d = torch.where(both, a - b, 0.0)
    bf = torch.where(fb, b, 0.0)
    af = torch.where(fa, a, 0.0)
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


def _finish(vals: list[float], eps: float) -> dict:
    max_abs, absmax, l2d, l2b, l2a, dot, bad, nf_rec, nf_ref = vals
    rel_l2 = (l2d / l2b) if l2b > 0 else (0.0 if l2d == 0 else math.inf)
    norm_max = (max_abs / (eps * absmax)) if absmax > 0 else (0.0 if max_abs == 0 else math.inf)
    cosine = dot / (l2a * l2b) if l2a > 0 and l2b > 0 else (1.0 if l2a == l2b else 0.0)
    return {
        "max_abs": max_abs,
        "rel_l2": rel_l2,
        "norm_max": norm_max,
        "norm_rel": rel_l2 / eps,
        "cosine": cosine,
        "nonfinite_mismatch": int(bad),
        "nonfinite_recorded": int(nf_rec),
        "nonfinite_reference": int(nf_ref),
    }
