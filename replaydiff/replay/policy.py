"""Replay options and the reference numerics: which dtype each recorded dtype runs at, and the reference settings.

The reference is meant to be boring: deterministic algorithms on, TF32 off for matmul and cuDNN, cudnn.benchmark off,
float32 matmul precision "highest", CUBLAS_WORKSPACE_CONFIG set when it is not. The settings are held once per
process however many replays overlap, and the caller's (environment included) are put back when the last one ends.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from replaydiff.compare.tolerance import Tolerances
# The dtypes replayed at and the reference settings are defined with rebuilding and judging a recorded op, which the
# standalone repro script shares: it runs its reference as replay does.
from replaydiff.rebuild_and_judge import FP32_PRECISIONS, UPCAST, Numerics, Precision, reference_numerics
from replaydiff.trace.schema.environment import EnvFlags
from replaydiff.replay.references import REFERENCES

PRECISIONS = tuple(p.value for p in Precision)  # the CLI's choices

# The precisions to try in turn when an op has no kernel at the one asked.
FALLBACKS = {Precision.FP64: (Precision.FP64, Precision.FP32, Precision.SAME),
             Precision.FP32: (Precision.FP32, Precision.SAME), Precision.SAME: (Precision.SAME,)}


def target_dtype(precision: Precision | str, dtype: torch.dtype) -> torch.dtype:
    return UPCAST[Precision(precision)].get(dtype, dtype)


@dataclass
class ReplayOptions:
    device: str = "cpu"
    precision: Precision = Precision.FP64  # also given by its name ("fp32")
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
        self.precision = Precision(self.precision)
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


def recorded_numerics(flags: EnvFlags) -> Numerics:
    """The TF32 and cuDNN settings a rank recorded, as ``--precision same`` applies them (``Numerics`` says why
    torch's deterministic algorithms stay on)."""
    fp32 = tuple((name, getattr(flags, name)) for name, _, _ in FP32_PRECISIONS if getattr(flags, name) is not None)
    return Numerics(fp32=fp32, matmul_tf32=flags.matmul_tf32, cudnn_tf32=flags.cudnn_tf32,
                    float32_matmul_precision=flags.float32_matmul_precision,
                    cudnn_deterministic=flags.cudnn_deterministic, cudnn_benchmark=flags.cudnn_benchmark)


def replay_numerics(flags: EnvFlags, precision: Precision) -> Numerics | None:
    """The settings a replay at ``precision`` holds: the recorded ones at ``same`` (the recorded dtypes, meant to
    redo the job's kernels bit for bit), the reference ones (None) otherwise."""
    return recorded_numerics(flags) if precision is Precision.SAME else None


# how far a random kernel's draw is the same on another device: Philox kernels launch at most this many elements'
# worth of threads per multiprocessor; past processors x this, which element gets which number depends on the count
RANDOM_ELEMENTS_PER_PROCESSOR = 2048


def random_draw_caveat(numel: int, recorded: int | None, here: int | None) -> str | None:
    """Why a random op of ``numel`` elements, drawn on a device with ``recorded`` multiprocessors, cannot be redone
    bit for bit on one with ``here`` (None: it can, or a count is unknown and nothing can be said)."""
    if recorded is None or here is None or recorded == here:
        return None
    limit = min(recorded, here) * RANDOM_ELEMENTS_PER_PROCESSOR
    if numel <= limit:
        return None
    return (f"random op drawn on a device with {recorded} multiprocessors, replayed on one with {here}: past "
            f"{limit:,} elements ({numel:,} here) the kernel maps numbers to elements by that count, so its draw "
            f"cannot be redone here (replay on the recording's device model)")


@contextmanager
def reference_settings(num_threads: int | None = None, numerics: Numerics | None = None) -> Iterator[None]:
    """Replay under the reference settings; the caller's come back when the last holder in the process leaves.

    Enter it once per replaying process or worker (the engine's ``run_shard`` and ``replay_op`` do); entering it
    again, nested or from another thread, shares the one set of settings. ``num_threads`` (torch's intra-op
    threads: OpenMP keeps that count per calling thread) is set by each holder in its own thread and put back there
    when it leaves; the engine and ``replay_op`` both take it from ``replay_threads``. ``numerics``: the job's own
    TF32 and determinism settings instead of the reference's (``replay_numerics``).
    """
    with reference_numerics(numerics):
        threads_before = torch.get_num_threads()
        try:
            if num_threads:
                torch.set_num_threads(num_threads)
            yield
        finally:
            if num_threads and torch.get_num_threads() != threads_before:
                torch.set_num_threads(threads_before)
