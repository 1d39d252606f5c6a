#!/usr/bin/env python3
# replaydiff.repro/1: written by `replaydiff repro`, whose --force replaces it
"""Rebuilding and judging one recorded op: the one definition replaydiff and the standalone repro script share.

replaydiff's trace reader, replayer and verdicts import from here how a stored tensor is rebuilt over its storage's
bytes (``typed_storage``, ``as_recorded``), how a result is picked out of an op's outputs and arguments (``pick``),
how a result is measured against its reference (``measure``) and judged (``how_far_over``, ``calibrate``,
``float_severity``, ``ill_conditioned_note``, ``same_scalar``), which dtype each recorded dtype is replayed at
(``UPCAST``), the reference settings (``reference_numerics``) and what a compiled unit's graph may call
(``graph_operator``). ``replaydiff repro`` copies this module, unchanged, as the standalone script ``DIR/repro.py``,
so the script rebuilds and judges by these very definitions; it runs where replaydiff is not installed, so this
module imports nothing but the standard library, torch and (when run as the script) safetensors.

As the script (``python repro.py [--device cuda] [--import MODULE]``) it reads ``DIR/repro.json`` (the op: its
name, how each argument sits on its storage, what is compared and the limits replay applies; plain JSON) and
``DIR/inputs.safetensors`` (the raw bytes of every storage version the op read or wrote, and a random op's
generator state). It runs the op on --device at its recorded dtypes and on the CPU at float64 (a random op: at its
recorded dtypes, from its recorded generator state, compared exactly), and prints the error of the recorded output
and of the device run against that reference, in the units of `replaydiff replay`: max_abs/(eps*absmax) and
rel_l2/eps, eps being the recorded dtype's machine epsilon, with the limits replay applies, and replay's verdict: an
output over those limits is still ok when the op run at its recorded dtypes on the CPU errs as much itself (within
FACTOR times: the op is ill-conditioned). Exit code 1 when the recorded output or the device run is divergent, as
replay judges it, 4 when --device is not available here.

A compiled unit (one call of a torch.compile graph) is described by its graph: repro.json's "unit" holds the node
list (each node's kind, name, target op name and arguments, {"node": i} naming an earlier node's value). The script
builds an FX graph from that list, resolving each target by name among aten and prims ops and the few ``operator``
functions replay allows (``graph_operator``), runs it eagerly on the CPU at float64 (the reference) and at the
recorded dtypes (its own error), and compiled with the recorded backend on --device at the recorded dtypes (the
device run).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import operator
import os
import sys
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator, Union

import torch

FORMAT = "replaydiff.repro/1"
DATA = "repro.json"  # the op's description, next to this script
INPUTS = "inputs.safetensors"


# -- showing a string read from a trace (the one definition: every terminal, report and TUI line, and this script) --
# Every C0 control (newline, tab and ESC among them), DEL, every C1 control, the line and paragraph separators
# (``str.splitlines`` splits at them) and the bidirectional overrides: shown as visible escapes, never obeyed.
_SHOWN = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}
_SHOWN.update({0x0a: "\\n", 0x0d: "\\r", 0x09: "\\t"})
_SHOWN.update({c: f"\\u{c:04x}" for c in (0x2028, 0x2029, *range(0x202a, 0x202f), *range(0x2066, 0x206a))})


def shown(text: object) -> str:
    """``text`` (a string from a trace: a module path, an op name, a source line) as it may reach a terminal, a
    Markdown or HTML report or the TUI: each control character as a visible escape (``\\x1b``, ``\\n``), so it
    is shown, never obeyed, and stays on its one line. JSON keeps the string exact instead."""
    return str(text).translate(_SHOWN)


def shown_lines(text: str) -> str:
    """``text`` written for a terminal, each of its lines ``shown``: its own newlines kept, every other control
    character a visible escape (the last guard of a stream whose lines may hold strings from a trace)."""
    return "\n".join(shown(part) for part in text.split("\n"))


# -- rebuilding a stored tensor (the one definition: trace reader, replayer and this script) ---------------------
def typed_storage(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A storage's raw bytes (a flat uint8 tensor) as elements of ``dtype``: a view, trailing partial element
    dropped. Views of one storage are then taken of one such base, so they alias each other as when recorded."""
    m = raw.numel()
    n = m - m % dtype.itemsize
    return (raw if n == m else raw[:n]).view(dtype)


def as_recorded(base: torch.Tensor, shape: Any, stride: Any, offset: int, conj: bool = False,
                neg: bool = False) -> torch.Tensor:
    """The tensor as recorded over its storage's elements ``base``: its size, stride and offset, and its conj and
    neg bits (the stored bytes are the values without them; the bits are lazy, as they were when recorded)."""
    t = base.as_strided(shape, stride, offset)
    if conj:
        t = t.conj()
    if neg:
        t = torch._neg_view(t)
    return t


def pick(result: Any, args: Any, kwargs: Any, where: Any, sizes: Any = None) -> Any:
    """The value at ``where`` of one run of an op: ("out", i...) in its result, ("arg", n, i...) or
    ("kwarg", name, i...) among its (written) arguments; the i are list positions. ``sizes``: the recorded length
    of each list stepped into (a run returning another structure is an error, not a silent index into a tensor)."""
    kind, rest = where[0], list(where[1:])
    if kind == "out":
        v = result
    else:
        v = args[rest[0]] if kind == "arg" else kwargs.get(rest[0])
        rest = rest[1:]
    for n, i in enumerate(rest):
        size = sizes[n] if sizes is not None else None
        if size is not None and (not isinstance(v, (list, tuple)) or len(v) != size):
            raise RuntimeError(f"op returned {type(v).__name__} where {size} values were recorded")
        v = v[i]
    return v


# -- measuring a result against its reference (replaydiff.compare.metrics re-exports these) -----------------------
# rel_l2 = |out - ref|_2 / |ref|_2 and max_abs = max|out - ref| are computed in float64 over positions where both
# are finite; NaN/Inf positions must match exactly. The normalised forms max_abs / (eps * max|ref|) and rel_l2 / eps
# put every dtype on one scale (element-wise ULP distance is misleading near zero: cancellation gives millions of
# ulps on healthy outputs). Integer and bool tensors are compared exactly. Each kind of difference is its own type.
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


# -- the verdict's pure judging functions (replaydiff.compare.verdict imports them from here) ----------------------
def how_far_over(errors: tuple[float, float], limits: tuple[float, float]) -> float:
    """How far a pair of errors is over its pair of limits, in units of the limits: the larger ratio (1.0 is at the
    limit). An error over a zero limit, or one that is NaN, is infinitely far."""
    worst = 0.0
    for error, limit in zip(errors, limits):
        if error != error:  # NaN
            return math.inf
        worst = max(worst, error / limit if limit > 0 else (0.0 if error == 0 else math.inf))
    return worst


def calibrated_limits(own: tuple[float, float], ill: bool, factor: float) -> tuple[float, float] | None:
    """The limits on (max_abs, rel_l2) of an ill-conditioned op: ``factor`` times its own error at its recorded
    dtype (the op run there, against the same reference). None for an op whose own error is within the fixed
    limits (``ill`` False): it keeps those, or its rounding would hide a fault a few times that size."""
    return (factor * own[0], factor * own[1]) if ill else None


@dataclass(frozen=True)
class Calibration:
    """The op's own error at its recorded dtype: the op run there (on the CPU) against the same reference.

    An op whose own error already breaks the fixed limits is ill-conditioned (a gradient sum that cancels to almost
    zero, a LayerNorm of an input with a large mean): its recorded output is then held to ``factor`` times that
    error instead of the fixed limits."""

    max_abs: float
    rel_l2: float
    dtype: str  # the recorded dtype it was run at, e.g. "float32"
    factor: float  # Tolerances.conditioning_factor
    ill: bool  # its own error is over the fixed limits

    @property
    def limits(self) -> tuple[float, float] | None:
        """The limits on (max_abs, rel_l2) that apply, or None when the fixed ones do (a well-conditioned op)."""
        return calibrated_limits((self.max_abs, self.rel_l2), self.ill, self.factor)

    def explanation(self, error: FloatError) -> str:
        """Why an output over the fixed limits is ok: within ``factor`` times the op's own error at its dtype."""
        return ill_conditioned_note(self.dtype, (self.max_abs, self.rel_l2), (error.max_abs, error.rel_l2),
                                    self.factor)

    def excess(self, error: FloatError) -> str:
        """Why an output over its limits stays divergent, knowing the op's own error: how many times that it is."""
        return (f"{error.max_abs / self.max_abs:.3g}x the op's own error" if self.max_abs
                else "while the op itself is exact") + " at its recorded dtype"


def calibrate(own: FloatError, limits: tuple[float, float], dtype: str, factor: float) -> Calibration:
    """The calibration of an op whose output is over its fixed ``limits`` (on norm_max, norm_rel), from ``own``,
    its own error at its recorded ``dtype``: ill-conditioned when that error already breaks the fixed limits."""
    ill = how_far_over((own.norm_max, own.norm_rel), limits) > 1
    return Calibration(own.max_abs, own.rel_l2, dtype, factor, ill)


def float_severity(error: FloatError, limits: tuple[float, float], calibration: Calibration | None = None) -> float:
    """How far ``error`` is over its limits, in units of the limits: of max_abs and rel_l2 over ``factor`` times
    the op's own error for an ill-conditioned op, else of norm_max and norm_rel over the fixed ``limits``."""
    own = calibration.limits if calibration is not None else None
    if own is not None:
        return how_far_over((error.max_abs, error.rel_l2), own)
    return how_far_over((error.norm_max, error.norm_rel), limits)


def ill_conditioned_note(dtype: str, own: tuple[float, float], error: tuple[float, float], factor: float) -> str:
    """Why an output over the fixed limits is ok: it is within ``factor`` times the op's own error at ``dtype``."""
    return (f"within its own {dtype} error (ill-conditioned: the op run at {dtype} is off by max_abs {own[0]:.3g}, "
            f"rel_l2 {own[1]:.3g}; the recorded output by {error[0]:.3g}, {error[1]:.3g}, within {factor:g}x that)")


def same_scalar(recorded: Any, reference: Any) -> bool:
    """A scalar output equals its recorded value (NaN equals NaN)."""
    if isinstance(recorded, float) and isinstance(reference, float) and recorded != recorded \
            and reference != reference:
        return True
    return bool(recorded == reference)


# -- the reference numerics ----------------------------------------------------------------------------------------
class Precision(str, Enum):
    """The dtypes replay runs an op at (``replay --precision``); the value is the CLI's and the reports' spelling."""

    FP64 = "fp64"  # floating dtypes at float64 (complex at complex128): the reference (the script's too)
    FP32 = "fp32"  # half-precision dtypes at float32
    SAME = "same"  # the recorded dtypes

    def __str__(self) -> str:
        return self.value

    __format__ = lambda self, spec: format(self.value, spec)  # noqa: E731  (f"{precision}" -> "fp64" everywhere)

    def upcast(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor recorded in ``dtype`` is run at."""
        return UPCAST[self].get(dtype, dtype)


# The dtype each recorded floating dtype is replayed at, by precision; every other dtype stays as recorded.
UPCAST: dict[Precision, dict[torch.dtype, torch.dtype]] = {
    Precision.FP64: {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
                     torch.complex32: torch.complex128, torch.complex64: torch.complex128},
    Precision.FP32: {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64},
    Precision.SAME: {},
}

# What a compiled unit's graph may call when replayed: registered aten/prims ops by name, and these Python operators
# (getitem on multi-output ops, arithmetic on symbolic sizes). Nothing else is ever looked up.
GRAPH_NAMESPACES = frozenset({"aten", "prims"})
GRAPH_OPERATORS = ("getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt",
                   "le", "gt", "ge", "and_", "or_", "not_")


def graph_operator(name: str) -> Callable | None:
    """A graph node's target by its name when it is one of the allowed ``operator`` functions; None for an aten or
    prims op (looked up among the registered ops by the caller); ValueError for anything else, so that a trace can
    never make replay or the script call other code."""
    ns, _, rest = name.partition(".")
    if ns == "operator" and rest in GRAPH_OPERATORS:
        return getattr(operator, rest)
    if ns not in GRAPH_NAMESPACES:
        raise ValueError(f"{name} is not an aten or prims op (a unit's graph is replayed through those only)")
    if ns == "prims" and rest.startswith("inductor_"):
        # inductor's own prims (its random seeds and draws) are registered when inductor is imported, which a
        # replay of an inductor unit in a fresh process has not done yet
        import torch._inductor.inductor_prims  # noqa: F401
    return None


# TF32 through torch's two APIs. torch 2.9 added a per-backend ``fp32_precision`` ("ieee", "tf32", "none": defer to
# the level above) beside the legacy ``allow_tf32`` flags and ``set_float32_matmul_precision``. Once a job sets the new
# one (transformers' ``tf32`` option does), torch refuses to read a legacy one ("a mix of the legacy and new APIs"),
# and ``torch.backends.cudnn.flags()`` raises too. So each legacy value is read where torch allows it and worked out
# from the new one where it does not, and the reference settings are set and restored through the C setters of
# whichever API this torch has, never through a getter that can raise.
# (name as stored, backend, op) of the new API's settings.
FP32_PRECISIONS = (("fp32_precision", "generic", "all"), ("matmul_fp32_precision", "cuda", "matmul"),
                   ("cudnn_fp32_precision", "cuda", "all"), ("cudnn_conv_fp32_precision", "cuda", "conv"),
                   ("cudnn_rnn_fp32_precision", "cuda", "rnn"), ("mkldnn_fp32_precision", "mkldnn", "all"),
                   ("mkldnn_matmul_fp32_precision", "mkldnn", "matmul"))
# The new API's settings that decide what the reference runs: a float32 matmul, convolution or RNN in IEEE fp32, on
# the GPU and in oneDNN on the CPU (which runs float32 matmuls in bf16 or TF32 where the new API asks it to).
_REFERENCE_FP32 = tuple((b, o) for b in ("cuda", "mkldnn") for o in ("matmul", "conv", "rnn"))


def _new_fp32_api() -> bool:
    return hasattr(torch._C, "_get_fp32_precision_getter") and hasattr(torch._C, "_set_fp32_precision_setter")


def fp32_precisions() -> dict[str, str | None]:
    """The new API's settings by their stored name; None each where this torch lacks the API or the setting."""
    out: dict[str, str | None] = {}
    for name, backend, op in FP32_PRECISIONS:
        try:
            out[name] = torch._C._get_fp32_precision_getter(backend, op) if _new_fp32_api() else None
        except (RuntimeError, ValueError, TypeError):
            out[name] = None
    return out


def _legacy_or(read: Callable[[], Any], new_value: str | None, derived: dict[str, Any]) -> Any:
    """A legacy setting as torch reads it, or, where torch refuses because the job used the new API, what the new
    setting means for it (None when it does not say: unknown stays unknown)."""
    try:
        return read()
    except RuntimeError:
        return derived.get(new_value) if new_value is not None else None


def tf32_settings() -> dict[str, Any]:
    """The TF32 state of this process, whichever API set it, without raising: the legacy views (``matmul_tf32``,
    ``cudnn_tf32``, ``float32_matmul_precision``) and the new API's settings (``fp32_precisions``)."""
    new = fp32_precisions()
    as_bool = {"tf32": True, "ieee": False}
    return {
        "matmul_tf32": _legacy_or(lambda: torch.backends.cuda.matmul.allow_tf32, new["matmul_fp32_precision"],
                                  as_bool),
        "cudnn_tf32": _legacy_or(lambda: torch.backends.cudnn.allow_tf32, new["cudnn_conv_fp32_precision"], as_bool),
        "float32_matmul_precision": _legacy_or(torch.get_float32_matmul_precision, new["matmul_fp32_precision"],
                                               {"tf32": "high", "ieee": "highest"}),
        **new,
    }


@dataclass(frozen=True)
class Numerics:
    """Settings a job ran with that decide its kernels' numbers, as ``replay --precision same`` applies them on the
    device the op is replayed on (None each: as the reference has it). ``fp32`` holds the new TF32 API's settings by
    their stored name (``FP32_PRECISIONS``); the legacy flags are applied where the job did not use the new API.
    torch's deterministic algorithms stay on whatever the job had: replay needs them (they fill an output's
    uninitialised memory, so positions a kernel leaves unwritten are found, and make --repeat's runs agree); an op
    whose kernel has a deterministic variant is then replayed through it, as ``--repeat`` would show anyway."""

    fp32: tuple[tuple[str, str], ...] = ()
    matmul_tf32: bool | None = None
    cudnn_tf32: bool | None = None
    float32_matmul_precision: str | None = None
    cudnn_deterministic: bool | None = None
    cudnn_benchmark: bool | None = None


def _hold_fp32(numerics: Numerics | None = None) -> Callable[[], None]:
    """Float32 matmuls, convolutions and RNNs in IEEE fp32 (TF32 off), or as ``numerics`` recorded them; returns
    what puts the caller's back."""
    if _new_fp32_api():
        saved = [(b, o, torch._C._get_fp32_precision_getter(b, o)) for b, o in _REFERENCE_FP32]
        n = numerics or Numerics()
        recorded = {(b, o): dict(n.fp32).get(name) for name, b, o in FP32_PRECISIONS}
        for b, o in _REFERENCE_FP32:
            if any(v is not None for v in recorded.values()):
                # the job's own setting as it took effect: "none" defers to the backend's, then to the generic one
                chain = (recorded.get((b, o)), recorded.get((b, "all")), recorded[("generic", "all")])
                value = next((v for v in chain if v not in (None, "none")), "ieee")
            else:  # IEEE, or TF32 where the job's legacy flags asked for it
                tf32 = (n.matmul_tf32 if o == "matmul" else n.cudnn_tf32) if b == "cuda" else False
                value = "tf32" if tf32 else "ieee"
            torch._C._set_fp32_precision_setter(b, o, value)

        def restore() -> None:
            for b, o, v in saved:
                torch._C._set_fp32_precision_setter(b, o, v)
        return restore
    legacy = (torch._C._get_cublas_allow_tf32(), torch._C._get_float32_matmul_precision(),
              torch._C._get_cudnn_allow_tf32())
    n = numerics or Numerics()
    torch._C._set_cublas_allow_tf32(bool(n.matmul_tf32))
    torch._C._set_float32_matmul_precision(n.float32_matmul_precision or "highest")
    torch._C._set_cudnn_allow_tf32(bool(n.cudnn_tf32))

    def restore_legacy() -> None:
        torch._C._set_cublas_allow_tf32(legacy[0])
        torch._C._set_float32_matmul_precision(legacy[1])
        torch._C._set_cudnn_allow_tf32(legacy[2])
    return restore_legacy


class _Held:
    """The reference settings as this process holds them: applied by the first holder, restored by the last.

    Every flag here is process-wide (and CUBLAS_WORKSPACE_CONFIG is the process's environment), so saving and
    restoring them per call breaks as soon as two calls overlap: the TUI replays in one thread while its detail pane
    replays one op in another, and whichever left last put back the other's reference settings. Holders are
    counted instead: the caller's settings are saved once, when the first holder enters, and put back once, when
    the last one leaves, whichever thread that is.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.saved: tuple | None = None
        self.restore_fp32: Callable[[], None] | None = None

    def enter(self, numerics: Numerics | None = None) -> None:
        """Hold the reference settings, or ``numerics`` (a job's own, for ``--precision same``). The first holder's
        settings are those every overlapping holder gets: one process replays at one precision (the TUI's detail
        pane, at another, then shares the first's; float64 ops are the same under either)."""
        with self.lock:
            self.holders += 1
            if self.holders > 1:
                return
            # The C getters and setters throughout: they work after torch.backends.disable_global_flags() (which
            # torch's testing utilities call at import), where assigning torch.backends' attributes raises, and
            # they never refuse a read the way the legacy Python getters do once the new TF32 API is in use.
            self.saved = (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled(),
                          torch._C._get_cudnn_benchmark(), torch._C._get_cudnn_deterministic(),
                          os.environ.get(_CUBLAS))
            try:
                if self.saved[4] is None:  # deterministic cuBLAS needs a fixed workspace (set before cuBLAS starts)
                    os.environ[_CUBLAS] = ":4096:8"
                # warn_only: an op with no deterministic kernel is still replayed (and --repeat will tell if it
                # wobbles). The C setter, not torch.use_deterministic_algorithms: that also imports
                # torch._inductor's config (1.5-2 s per process) to set a flag only compiled code reads.
                n = numerics or Numerics()
                torch._C._set_deterministic_algorithms(True, warn_only=True)
                torch._C._set_cudnn_benchmark(bool(n.cudnn_benchmark))
                torch._C._set_cudnn_deterministic(True if n.cudnn_deterministic is None else n.cudnn_deterministic)
                self.restore_fp32 = _hold_fp32(numerics)
            except BaseException:
                self.holders -= 1
                self._restore()
                raise

    def leave(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                self._restore()

    def _restore(self) -> None:
        saved, self.saved = self.saved, None
        restore_fp32, self.restore_fp32 = self.restore_fp32, None
        if restore_fp32 is not None:
            restore_fp32()
        if saved is None:
            return
        torch._C._set_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch._C._set_cudnn_benchmark(saved[2])
        torch._C._set_cudnn_deterministic(saved[3])
        if saved[4] is None:
            os.environ.pop(_CUBLAS, None)
        else:
            os.environ[_CUBLAS] = saved[4]


_CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
_HELD = _Held()


@contextlib.contextmanager
def reference_numerics(numerics: Numerics | None = None) -> Iterator[None]:
    """The settings references run under: deterministic algorithms on, TF32 off for matmul and cuDNN,
    cudnn.deterministic on and cudnn.benchmark off, float32 matmul precision "highest", CUBLAS_WORKSPACE_CONFIG set
    when it is not; with ``numerics``, the TF32 and determinism settings a job recorded instead (a replay at the
    recorded dtypes on the recording's device then runs the job's kernels). Held once per process however many
    holders overlap (nested or from other threads); the caller's settings (environment included) come back when
    the last one leaves."""
    _HELD.enter(numerics)
    try:
        yield
    finally:
        _HELD.leave()


# -- the script ---------------------------------------------------------------------------------------------------
class Repro:
    """One op as ``replaydiff repro`` described it in repro.json, with its stored bytes."""

    def __init__(self, data: dict, storages: dict[str, torch.Tensor]) -> None:
        self.data = data
        self.storages = storages
        self.random = bool(data["random"])  # replayed at its recorded dtypes from the recorded generator state
        self.keep_dtypes = bool(data["keep_dtypes"])
        self.explicit_generator = _uses_generator([data["args"], list(data["kwargs"].values())])

    def op(self) -> Any:
        ns, packet, overload = self.data["op"].split(".")
        return getattr(getattr(getattr(torch.ops, ns), packet), overload)

    def tensors(self, device: str, upcast: bool):
        """T(name): the tensor named in repro.json on ``device`` (at float64 if ``upcast``), one base per storage."""
        bases: dict = {}

        def target(dt):
            return Precision.FP64.upcast(dt) if upcast else dt

        def T(name):
            s = self.data["tensors"][name]
            dt = getattr(torch, s["dtype"])
            if s.get("zeros"):
                return torch._efficientzerotensor(s["shape"], dtype=target(dt), device=device)
            if s.get("meta"):
                return torch.empty_strided(s["shape"], s["stride"], dtype=dt, device="meta")
            key = (s["storage"], s["dtype"])
            if key not in bases:  # one base per storage: views of one storage alias each other, as when recorded
                bases[key] = typed_storage(self.storages[s["storage"]], dt).to(device=device, dtype=target(dt),
                                                                                copy=True)
            return as_recorded(bases[key], s["shape"], s["stride"], s["offset"], s["conj"], s["neg"])

        return T, target

    def value(self, v: Any, T: Any, target: Any, device: str, gen: Any) -> Any:
        """An argument from its JSON form: lists, plain values, and {"tensor"|"dtype"|"device"|...: ...}."""
        if isinstance(v, list):
            return [self.value(x, T, target, device, gen) for x in v]
        if not isinstance(v, dict):
            return v
        (kind, x), = v.items()
        if kind == "tensor":
            return T(x)
        if kind == "dtype":
            return target(getattr(torch, x))
        if kind == "device":
            return torch.device(x) if x == "meta" else torch.device(device)
        if kind in ("layout", "memory_format"):
            return getattr(torch, x)
        if kind == "complex":
            return complex(x[0], x[1])
        if kind == "generator":
            return gen
        raise ValueError(f"{DATA}: unknown argument kind {kind!r}")

    def run(self, device: str, upcast: bool, compiled: bool = False) -> tuple:
        """(result, args, kwargs) of one run of the op on ``device``, at float64 if ``upcast``; a compiled unit's
        graph is run eagerly, or ``compiled`` with its recorded backend (its result: the flat list of outputs)."""
        if "unit" in self.data:
            return self.run_unit(device, upcast, compiled)
        T, target = self.tensors(device, upcast)
        gen = None
        if self.random and self.explicit_generator:
            gen = torch.Generator(device=device)
            gen.set_state(self.storages["rng_state"].clone())
        args = [self.value(a, T, target, device, gen) for a in self.data["args"]]
        kwargs = {k: self.value(v, T, target, device, gen) for k, v in self.data["kwargs"].items()}
        if self.random and not self.explicit_generator:  # it drew from the device's default generator: restore it
            dev = torch.device(device)
            with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev]):
                if dev.type == "cpu":
                    torch.set_rng_state(self.storages["rng_state"].clone())
                else:
                    # torch's generic device API: this script imports nothing of replaydiff (not its device seam)
                    torch.get_device_module(dev.type).set_rng_state(self.storages["rng_state"].clone(), dev)
                return self.op()(*args, **kwargs), args, kwargs
        return self.op()(*args, **kwargs), args, kwargs


    # -- a compiled unit: its graph rebuilt from the node list in repro.json ---------------------------------------
    def graph(self, T: Any, target: Any, device: str) -> torch.fx.GraphModule:
        """The unit's graph as an FX graph built from repro.json's node list (inputs, constants as buffers, one call
        per node by its target's name, the output); constant arguments as ``value`` reads them."""
        root = torch.nn.Module()
        g = torch.fx.Graph()
        env: list = []

        def arg(v: Any) -> Any:
            if isinstance(v, list):
                return [arg(x) for x in v]
            if isinstance(v, dict) and set(v) == {"node"}:
                return env[v["node"]]
            return self.value(v, T, target, device, None)

        unit = self.data["unit"]
        for n in unit["nodes"]:
            kind = n["kind"]
            if kind == "input":
                env.append(g.placeholder(f"in{len(env)}"))
            elif kind == "const":
                name = f"const{n['target']}"
                value = arg(unit["consts"][int(n["target"])])
                if isinstance(value, torch.Tensor):
                    root.register_buffer(name, value)
                    env.append(g.get_attr(name))
                else:
                    env.append(value)
            elif kind == "call":
                env.append(g.call_function(graph_target(n["target"]), tuple(arg(n["args"])),
                                           {k: arg(v) for k, v in n["kwargs"].items()}))
            elif kind == "output":
                env.append(None)
                g.output(arg(n["args"][0] if n["args"] else []))
            else:
                raise ValueError(f"{DATA}: node {n['name']} is of unknown kind {kind!r}")
        return torch.fx.GraphModule(root, g)

    def run_unit(self, device: str, upcast: bool, compiled: bool) -> tuple:
        T, target = self.tensors(device, upcast)
        args = [self.value(a, T, target, device, None) for a in self.data["args"]]
        fn: Any = self.graph(T, target, device)
        if compiled:
            torch._dynamo.reset()  # a fresh compile of this graph, not one cached by an earlier run
            fn = torch.compile(fn, backend=self.data["unit"]["backend"] or "inductor", dynamic=False)
        with torch.no_grad():
            out = fn(*args)
        return list(_flat(out)), args, {}


def module_name(name: str) -> bool:
    """Whether ``name`` reads as a Python module's dotted name (and so may be typed after ``--import``)."""
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def op_loaded(name: str) -> bool:
    """Whether the op ``namespace.packet.overload`` is registered in this process."""
    ns, _, rest = name.partition(".")
    packet, _, overload = rest.partition(".")
    try:
        getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")
    except (AttributeError, RuntimeError):
        return False
    return True


def graph_target(name: str) -> Any:
    """A graph node's target by its name: an aten or prims op, or one of the ``operator`` functions replay allows
    (``graph_operator``). Nothing else is looked up: the graph is data, never code to run."""
    try:
        f = graph_operator(name)
    except ValueError as exc:
        raise ValueError(f"{DATA}: node target {exc}") from None
    if f is not None:
        return f
    ns, _, rest = name.partition(".")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")


def _flat(v: Any) -> list:
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _flat(item)]
    return [v]


def _uses_generator(v: Any) -> bool:
    if isinstance(v, list):
        return any(_uses_generator(x) for x in v)
    return isinstance(v, dict) and "generator" in v


def mismatches(rec: torch.Tensor, ref: torch.Tensor) -> int:
    """How many elements of ``ref`` differ bit for bit from ``rec`` (same shapes; NaN equals NaN)."""
    m = measure(rec, ref.detach().to(rec.device), exact=True)
    return m.mismatches if isinstance(m, ExactMismatch) else rec.numel()


def same_nonfinite(rec: torch.Tensor, same: Any) -> bool:
    """The op run at its recorded dtypes makes exactly the recorded NaN/Inf itself (replay then judges the rest)."""
    if not isinstance(same, torch.Tensor) or tuple(same.shape) != tuple(rec.shape):
        return False
    same = same.detach().to(rec.device, rec.dtype)
    a, b = ~torch.isfinite(rec), ~torch.isfinite(same)
    return bool(torch.equal(a, b)) and mismatches(rec[a], same[b]) == 0


def figures(rec: torch.Tensor, value: Any, limits: list, exact: bool) -> tuple[str, Measure | None]:
    """One line in replay's units, and the measure behind it (``measure``, as replay takes it); None when it
    cannot be judged by one (not a tensor, another shape: divergent)."""
    if not isinstance(value, torch.Tensor):
        return f"returned {type(value).__name__}, not a tensor", None
    if tuple(value.shape) != tuple(rec.shape):
        return f"shape {list(value.shape)} != recorded {list(rec.shape)}", None
    m = measure(rec, value.detach().to("cpu"), exact=exact)
    if isinstance(m, ExactMismatch):
        return f"mismatches {m.mismatches} of {rec.numel()} (compared exactly)", m
    e = m.finite if isinstance(m, NonfiniteMismatch) else m
    assert isinstance(e, FloatError), m
    norm_max, norm_rel, max_abs, rel_l2 = (x + 0.0 for x in (e.norm_max, e.norm_rel, e.max_abs, e.rel_l2))  # no -0
    line = (f"max_abs/(eps*absmax) {norm_max:.3g} (limit {limits[0]:.3g})  rel_l2/eps {norm_rel:.3g} "
            f"(limit {limits[1]:.3g})  max_abs {max_abs:.3g}  rel_l2 {rel_l2:.3g}")
    if isinstance(m, NonfiniteMismatch):
        line += f"  {m.positions} NaN/Inf mismatches"
    return line, m


def describe(rec: torch.Tensor, value: Any, limits: list, exact: bool, factor: float,
             same: Any = None) -> tuple[str, bool]:
    """The figures and replay's verdict on them, and whether that is divergent: over the limits, unless the op run
    at its recorded dtypes (``same``; None: not asked) errs as much itself (``calibrate``, as replay judges)."""
    line, m = figures(rec, value, limits, exact)
    if m is None or isinstance(m, ExactMismatch):
        over = m is None or m.mismatches > 0
        return line + ("  DIVERGENT" if over else "  ok"), over
    if isinstance(m, NonfiniteMismatch):
        if same is None or not same_nonfinite(rec, same):
            return line + "  DIVERGENT", True
        m = m.finite  # NaN/Inf the op makes itself at its recorded dtypes: judged on the finite positions
    fixed = (limits[0], limits[1])
    severity, why = float_severity(m, fixed), None
    if severity > 1 and isinstance(same, torch.Tensor) and tuple(same.shape) == tuple(rec.shape):
        own = measure(same.detach().to("cpu", rec.dtype), value.detach().to("cpu"))  # its own error at its dtype
        if isinstance(own, FloatError):
            cal = calibrate(own, fixed, str(rec.dtype).removeprefix("torch."), factor)
            severity = float_severity(m, fixed, cal)
            why = cal.explanation(m) if severity <= 1 else cal.excess(m)
    return line + ("  DIVERGENT" if severity > 1 else "  ok") + (f" - {why}" if why else ""), severity > 1


def describe_against(reference: Any, value: Any, dtype: torch.dtype, limits: list, exact: bool, factor: float,
                     same: Any = None) -> tuple[str, bool]:
    """The device run (at the recorded dtype) measured against the reference, with eps of the recorded dtype."""
    if not isinstance(value, torch.Tensor):
        return f"returned {type(value).__name__}, not a tensor", True
    return describe(value.detach().to("cpu", dtype), reference, limits, exact, factor, same)


def main(argv: list[str] | None = None, directory: str | None = None) -> int:
    """Run the repro in ``directory`` (default: the one this file is in); the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--device", default="cpu", help="device to run the op on (default cpu), e.g. cuda or cuda:1")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (the one that defines a custom op)")
    a = p.parse_args(argv)
    try:  # a device this torch lacks is one line, not the device module's AssertionError from deep inside the run
        torch.empty(0, device=a.device)
    except Exception as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"repro.py: device {a.device!r} is not available here: {why}", file=sys.stderr)
        return 4
    from safetensors.torch import load_file

    here = directory or os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, DATA), encoding="utf-8") as fh:
        data = json.load(fh)
    name, custom = data["op"], data.get("custom_module")
    if a.imports and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a module the user named may sit here; last, so it shadows nothing installed
    # Only modules the user named run (--import); torch's own Python-defined ops load from the torch already
    # imported. A module repro.json names is a string from someone else's trace: said, never imported.
    for m in a.imports or ([custom] if custom and custom.startswith("torch.") and module_name(custom) else []):
        try:
            importlib.import_module(m)
        except Exception as exc:
            print(f"repro.py: --import {m}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}",
                  file=sys.stderr)
            return 4
    if data.get("unit") is None and not op_loaded(name):
        named = (f"the trace names {custom!r} as its module: --import {custom} runs that module's code, if you "
                 f"trust it" if custom and module_name(custom) else "--import MODULE imports the module defining it")
        print(f"repro.py: op {name!r} is not registered here (repro.py imports nothing a trace names); {named}",
              file=sys.stderr)
        return 4
    with reference_numerics():
        return _report(a.device, data, Repro(data, load_file(os.path.join(here, INPUTS))))


def _report(device: str, data: dict, r: Repro) -> int:
    """Run the op as ``main`` asked and print what it finds; the exit code."""
    name, factor = data["op"], data["factor"]
    T_rec = r.tensors("cpu", False)[0]
    upcast = not (r.random or r.keep_dtypes)
    rng_device = data.get("rng_device")
    with torch.inference_mode():
        ref = r.run("cpu", upcast)
        # the op's own error at its recorded dtypes, as replay measures it (on the CPU): an ill-conditioned op's limit
        same = r.run("cpu", False) if upcast else None
        dev = torch.device(device)
        if r.random and rng_device and torch.device(rng_device).type != dev.type:
            mine, why = None, f"a random op recorded on {rng_device}: its draw can only be redone there"
        else:
            mine, why = r.run(device, False, compiled=True), None
    if data.get("planted"):
        print(f"PLANTED FAULT (record --plant): {shown(data['planted'])}")
    unit = data.get("unit")
    if unit is not None:
        print(f"unit #{data['index']} {shown(name)} (rank {data['rank']}) of {shown(unit['region'])}: reference = "
              f"its graph run eagerly on the CPU at float64; device run = the graph compiled with "
              f"{shown(unit['backend'])} on {device} "
              f"at the recorded dtypes")
    else:
        print(f"op #{data['index']} {shown(name)} (rank {data['rank']}): reference = CPU at "
              f"{'the recorded dtypes from the recorded generator state' if r.random else 'float64'}; "
              f"device run = {device} at the recorded dtypes")
    failed = False
    width = max(len("recorded vs reference:"), len(device + " run vs reference:"))
    for c in data["checks"]:
        where, sizes = c["where"], c.get("sizes")
        got = pick(*ref, where, sizes)
        if "scalar" in c:
            ok = same_scalar(c["scalar"], got)
            print(f"{c['label']} scalar: recorded {c['scalar']!r}, reference {got!r}"
                  f"{'' if ok else '  DIVERGENT'}")
            failed |= not ok
            continue
        if "view" in c:  # a view of an input (shape, stride, offset) or a meta tensor (shape, stride)
            geo = {"shape": list(got.shape), "stride": list(got.stride()), "offset": got.storage_offset()}
            ok = {k: geo[k] for k in c["view"]} == c["view"]
            print(f"{c['label']}: shape {geo['shape']} stride {geo['stride']} offset {geo['offset']} - "
                  f"{'as recorded' if ok else 'RECORDED ' + str(c['view'])}")
            failed |= not ok
            continue
        rec = T_rec(c["tensor"])
        exact = r.random or r.keep_dtypes
        own = None if same is None else pick(*same, where, sizes)
        print(f"{c['label']} {rec.dtype}{list(rec.shape)}:")
        line, over = describe(rec, got, c["limits"], exact, factor, own)
        print(f"  {'recorded vs reference:':<{width}} {line}")
        failed |= over
        if mine is None:
            print(f"  {device} run: not run ({why})")
            continue
        theirs = pick(*mine, where, sizes)
        # the device run against the reference: the op's own error on this device, at its recorded dtype
        line, over = describe_against(got, theirs, rec.dtype, c["limits"], exact, factor, own)
        print(f"  {device + ' run vs reference:':<{width}} {line}")
        failed |= over
        # and against what was recorded: does this device reproduce the recording (bit for bit, on its backend)?
        if isinstance(theirs, torch.Tensor) and tuple(theirs.shape) == tuple(rec.shape):
            n = mismatches(rec, theirs.detach().to("cpu", rec.dtype))
            # figures only: the recording is no reference to judge the device run by
            line, _ = figures(theirs.detach().to("cpu", rec.dtype), rec, c["limits"], exact)
            print(f"  {device + ' run vs recorded:':<{width}} {line}  ({n} of {rec.numel()} elements "
                  f"differ bit for bit)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
