"""Replay options and the reference numerics: which dtype each recorded dtype runs at, and the reference settings.

The reference is meant to be boring: deterministic algorithms on, TF32 off for matmul and cuDNN, cudnn.benchmark off,
float32 matmul precision "highest". The caller's settings are put back afterwards.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from replaydiff.compare.tolerance import Tolerances
from replaydiff.replay.references import REFERENCES

PRECISIONS = ("fp64", "fp32", "same")

_UPCAST = {
    "fp64": {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
             torch.complex32: torch.complex128, torch.complex64: torch.complex128},
    "fp32": {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64},
    "same": {},
}


# The precision to try next when an op has no kernel at the current one.
FALLBACKS = {"fp64": ("fp64", "fp32", "same"), "fp32": ("fp32", "same"), "same": ("same",)}


def target_dtype(precision: str, dtype: torch.dtype) -> torch.dtype:
    return _UPCAST[precision].get(dtype, dtype)


@dataclass
class ReplayOptions:
    device: str = "cpu"
    precision: str = "fp64"
    repeat: int = 1
    ops: list[str] | None = None  # op-name globs to replay; the rest are skipped
    first: int | None = None
    last: int | None = None
    ranks: list[int] | None = None
    tolerances: Tolerances = field(default_factory=Tolerances)
    # CPU intra-op threads; None: the recorded count at `same` on the CPU (what makes it bitwise), else 1
    threads: int | None = None
    # Python modules to import before replaying: they register the custom ops of the trace (torch's own, such as
    # torch.distributed.fsdp's, are imported without asking; a trace never makes replay import anything else)
    imports: list[str] = field(default_factory=list)
    # What ops are replayed against: "kernel" (their own, the default) or "decomp" (their torch._decomp
    # decomposition where one exists); references registered with replaydiff.register_reference come first.
    reference: str = "kernel"
    # Modules to import that register references (replaydiff.register_reference) for custom ops
    reference_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, not {self.reference!r}")

    def target_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return target_dtype(self.precision, dtype)

    def as_dict(self) -> dict:
        return {"device": self.device, "precision": self.precision, "repeat": self.repeat, "ops": self.ops,
                "from": self.first, "to": self.last, "ranks": self.ranks,
                "tolerances": {k: list(v) for k, v in self.tolerances.limits.items()},
                "scale_reductions": self.tolerances.scale_reductions,
                **({"threads": self.threads} if self.threads is not None else {}),
                **({"imports": self.imports} if self.imports else {}),
                **({"reference": self.reference} if self.reference != "kernel" else {}),
                **({"reference_modules": self.reference_modules} if self.reference_modules else {})}


@contextmanager
def reference_settings(num_threads: int | None = None) -> Iterator[None]:
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.get_num_threads(),
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        # warn_only: an op with no deterministic kernel is still replayed (and --repeat will tell if it wobbles).
        # The C setter, not torch.use_deterministic_algorithms: that also imports torch._inductor's config (1.5-2 s
        # per process) to set a flag only compiled code reads.
        torch._C._set_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        if num_threads:
            torch.set_num_threads(num_threads)
        # cuDNN through torch's own context manager: it also works after torch.backends.disable_global_flags()
        # (which torch's testing utilities call at import), where assigning the flags raises.
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False, deterministic=True,
                                        allow_tf32=False):
            yield
    finally:
        torch._C._set_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cuda.matmul.allow_tf32 = saved[2]
        torch.set_float32_matmul_precision(saved[3])
        torch.set_num_threads(saved[4])
