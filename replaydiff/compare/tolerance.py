"""When is a difference a divergence? Per recorded dtype limits on the normalised metrics.

Calibrated on healthy ops (docs/replay.md, "When is an op divergent?"): fp32 replayed in fp64 reaches max_abs/(eps*absmax) of 6 at most
(p99 5.7) and rel_l2/eps of 3.1, so fp32 flags above 16 or 8; bf16 reaches 0.49 and 0.24, so it flags above 1.0 or
0.5 (fp16 follows bf16: its error too is one rounding of an fp32-accumulated value). Reductions over K elements grow
like sqrt(K) and the calibration went up to K=256, so limits scale by sqrt(K/256) beyond that. NaN/Inf in one and not
the other always diverges; integers and bools must be exact; ``exact`` (same precision on the recording backend)
makes every difference divergent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from replaydiff import aten

DEFAULT_LIMITS: dict[str, tuple[float, float]] = {
    "float64": (16.0, 8.0),
    "float32": (16.0, 8.0),
    "complex64": (16.0, 8.0),
    "complex128": (16.0, 8.0),
    "bfloat16": (1.0, 0.5),
    "float16": (1.0, 0.5),
}
_FALLBACK = (1.0, 0.5)  # float8 and other narrow types: one rounding
CALIBRATED_K = 256


def reduction_length(op_packet: str, input_shapes: list[list[int]], out_numel: int) -> int:
    """How many terms the longest sum behind one output element may have (used to scale the limits)."""
    k = 1
    if op_packet in aten.MATMUL_PACKETS:
        mats = [s for s in input_shapes if len(s) >= 2]
        if mats:
            k = max(k, mats[0][-1])
    elif op_packet in aten.CONVOLUTION_PACKETS and len(input_shapes) >= 2:
        w = input_shapes[1]
        k = max(k, math.prod(w[1:]) if len(w) > 1 else 1)
    largest = max((math.prod(s) for s in input_shapes), default=1)
    if out_numel > 0:
        k = max(k, largest // out_numel)
    return k


@dataclass
class Tolerances:
    limits: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    scale_reductions: bool = True
    # An output over its limit is still healthy when its error is within this factor of the error the same op makes
    # at the recorded dtype on the reference device (see replay.runner: calibration).
    conditioning_factor: float = 8.0

    def limit_for(self, dtype: torch.dtype | str, k: int) -> tuple[float, float]:
        name = str(dtype).removeprefix("torch.")
        lim = self.limits.get(name, _FALLBACK)
        s = math.sqrt(k / CALIBRATED_K) if (self.scale_reductions and k > CALIBRATED_K) else 1.0
        return lim[0] * s, lim[1] * s

    @classmethod
    def parse_overrides(cls, items: list[str] | None, scale_reductions: bool = True) -> "Tolerances":
        """``DTYPE=MAX[,REL]`` items, e.g. ``float32=32,16``; DTYPE is a floating dtype's name or one of the short
        names --precision uses (``fp32``). Raises ValueError for any other name (a misspelled dtype would otherwise
        set a limit nothing reads) and for a MAX or REL that is not a number."""
        tol = cls(scale_reductions=scale_reductions)
        for item in items or []:
            name, _, vals = item.partition("=")
            parts = vals.split(",")
            if not name or not vals or len(parts) > 2:
                raise ValueError(f"{item!r} is not DTYPE=MAX[,REL]")
            dtype = tolerance_dtype(name)
            try:
                mx = float(parts[0])
                rel = float(parts[1]) if len(parts) == 2 else mx / 2
            except ValueError:
                raise ValueError(f"{item!r}: MAX and REL must be numbers, e.g. float32=32,16") from None
            if not (mx > 0 and rel > 0):  # a limit of 0 or less makes every rounding a divergence (NaN: nothing)
                raise ValueError(f"{item!r}: MAX and REL must be positive numbers of epsilons, e.g. float32=32,16")
            tol.limits[dtype] = (mx, rel)
        return tol


# The short names --precision and the docs use, as aliases of torch's dtype names.
DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def tolerance_dtype(name: str) -> str:
    """The torch dtype name a --tolerance DTYPE means: a floating or complex torch dtype (``float32``,
    ``torch.float32``, ``float8_e4m3fn``) or an alias of DTYPE_ALIASES; ValueError names the accepted ones."""
    name = name.strip().removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex):
        return str(dtype).removeprefix("torch.")  # torch.half -> float16: the name limit_for looks up
    accepted = ", ".join([*DEFAULT_LIMITS, *DTYPE_ALIASES])
    raise ValueError(f"unknown dtype {name!r}: use one of {accepted} (or another floating dtype such as "
                     f"float8_e4m3fn)")
