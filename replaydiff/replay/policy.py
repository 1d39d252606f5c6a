"""Replay options and the reference numerics: which dtype each recorded dtype runs at, and the reference settings.

The reference is meant to be boring: deterministic algorithms on, TF32 off for matmul and cuDNN, cudnn.benchmark off,
float32 matmul precision "highest", CUBLAS_WORKSPACE_CONFIG set when it is not. The settings are held once per
process however many replays overlap, and the caller's (environment included) are put back when the last one ends.
"""
from __future__ import annotations

import os
import threading
from contextlib import ExitStack, contextmanager
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
        """Refuse options no replay can run with, from Python as from the CLI (which says the message as a usage
        error): the messages name the CLI's flags, which the fields are named after."""
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or self.repeat < 1:
            raise ValueError(f"--repeat must be at least 1, not {self.repeat!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"--threads must be at least 1, not {self.threads!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, not {self.reference!r}")

    def target_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return target_dtype(self.precision, dtype)

    def to_json(self) -> dict:
        return {"device": self.device, "precision": self.precision, "repeat": self.repeat, "ops": self.ops,
                "from": self.first, "to": self.last, "ranks": self.ranks,
                "tolerances": {k: list(v) for k, v in self.tolerances.limits.items()},
                "scale_reductions": self.tolerances.scale_reductions,
                **({"threads": self.threads} if self.threads is not None else {}),
                **({"imports": self.imports} if self.imports else {}),
                **({"reference": self.reference} if self.reference != "kernel" else {}),
                **({"reference_modules": self.reference_modules} if self.reference_modules else {})}


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
        self.cudnn: ExitStack | None = None

    def enter(self) -> None:
        with self.lock:
            self.holders += 1
            if self.holders > 1:
                return
            self.saved = (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled(),
                          torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
                          os.environ.get(_CUBLAS))
            try:
                if self.saved[4] is None:  # deterministic cuBLAS needs a fixed workspace (set before cuBLAS starts)
                    os.environ[_CUBLAS] = ":4096:8"
                # warn_only: an op with no deterministic kernel is still replayed (and --repeat will tell if it
                # wobbles). The C setter, not torch.use_deterministic_algorithms: that also imports
                # torch._inductor's config (1.5-2 s per process) to set a flag only compiled code reads.
                torch._C._set_deterministic_algorithms(True, warn_only=True)
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.set_float32_matmul_precision("highest")
                # cuDNN through torch's own context manager: it also works after
                # torch.backends.disable_global_flags() (which torch's testing utilities call at import), where
                # assigning the flags raises.
                self.cudnn = ExitStack()
                self.cudnn.enter_context(torch.backends.cudnn.flags(
                    enabled=torch.backends.cudnn.enabled, benchmark=False, deterministic=True, allow_tf32=False))
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
        cudnn, self.cudnn = self.cudnn, None
        if cudnn is not None:
            cudnn.close()
        if saved is None:
            return
        torch._C._set_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cuda.matmul.allow_tf32 = saved[2]
        torch.set_float32_matmul_precision(saved[3])
        if saved[4] is None:
            os.environ.pop(_CUBLAS, None)
        else:
            os.environ[_CUBLAS] = saved[4]


_CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
_HELD = _Held()


@contextmanager
def reference_settings(num_threads: int | None = None) -> Iterator[None]:
    """Replay under the reference settings; the caller's come back when the last holder in the process leaves.

    Enter it once per replaying process or worker (the engine's ``run_shard`` and ``replay_op`` do); entering it
    again, nested or from another thread, shares the one set of settings. ``num_threads`` (torch's intra-op
    threads: OpenMP keeps that count per calling thread) is set by each holder in its own thread and put back there
    when it leaves; the engine and ``replay_op`` both take it from ``replay_threads``.
    """
    _HELD.enter()
    threads_before = torch.get_num_threads()
    try:
        if num_threads:
            torch.set_num_threads(num_threads)
        yield
    finally:
        try:
            if num_threads and torch.get_num_threads() != threads_before:
                torch.set_num_threads(threads_before)
        finally:
            _HELD.leave()
