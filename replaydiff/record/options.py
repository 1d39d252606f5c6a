"""Record options: one dataclass shared by ``replaydiff.record()``, the ``record`` CLI verb, the ``--step`` hook and
the manifest (which stores ``to_json()``), so an option is defined, defaulted and checked in one place."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from replaydiff import aten
from replaydiff.record.budget import parse_size
from replaydiff.record.step_range import StepRange
from replaydiff.trace.modes import TENSOR_MODES, TensorMode
from replaydiff.trace.schema import wire_options

COMPILED_MODES = ("capture", "eager")  # capture: compiled regions run compiled, each graph call one unit record
GRANULARITIES = ("op", "module")  # op: every aten op; module: each module call's outputs and their gradients
DEFAULT_ZSTD_LEVEL = 1


def _globs(v: Any) -> list[str] | None:
    if v is None or v == [] or v == ():
        return None
    return [v] if isinstance(v, str) else [str(x) for x in v]


def in_filter(name: str, module: str | None, modules: list[str] | None, ops: list[str] | None) -> bool:
    """The --module/--op rule: the op name matches an --op glob (any, without one) and, with --module globs, its
    module path matches one."""
    return aten.matches_any(name, ops) and (not modules or aten.matches_any(module, modules))


@dataclass(frozen=True)
class RecordOptions:
    tensors: TensorMode = TensorMode.FULL  # what is stored of each tensor (also given as its name: "stats")
    compress: int | None = DEFAULT_ZSTD_LEVEL  # zstd level, None for raw bytes
    # zstd only while the writer keeps up with the job; blobs written while the job waits for the writer are stored
    # raw (trace/writer.py). compress=True sets it; an explicit level compresses every blob.
    compress_auto: bool = True
    # Byte-shuffle before zstd: measured on the tiny transformer step it saves 1.6% of the bytes (13.61 -> 13.39 MB)
    # for ~0.5 ms per 128 KiB each way, so it is off unless asked for.
    shuffle: bool = False
    # Module-path globs: ops outside them are recorded with statistics only (data_left_out "filtered"); with a
    # budget, they say which ops get data first (record/budget.py).
    modules: list[str] | None = None
    ops: list[str] | None = None  # op-name globs, e.g. "aten.mm.*"
    max_tensor_bytes: int | None = None  # larger storages get statistics instead of data
    source_lines: bool = True
    chunk_ops: int = 256
    chunk_bytes: int = 64 << 20
    # Host memory for tensor copies waiting to be written (full): at most this many bytes at once, in memory of the
    # recorder's own (trace/staging.py); a copy that would pass it waits for the writer. Copies from a GPU count their
    # pinned memory here. A single storage larger than this is copied alone.
    queue_bytes: int = 256 << 20
    # A chunk is also handed to the writer once this many seconds have passed since the last one, so a job killed
    # mid-step leaves a trace that reaches at most this far back.
    flush_seconds: float = 0.5
    # Checksum every stored CPU storage and check it each time the storage is read again, so that writes torch's
    # dispatcher never sees (through .numpy(), a C extension's pointer) become new versions. Costs a CRC32 pass
    # (~3 GB/s) per re-read: off by default.
    verify_writes: bool = False
    # Record only these ranks of a multi-process job (None: every rank); the others run untouched.
    ranks: list[int] | None = None
    # A planted fault, OP[:N[:REL]] (replaydiff.faults.PlantSpec): the N-th call of OP returns its output times
    # 1 + REL, from a dispatch mode below the recorder, so a user can check on their own job that replay names it.
    plant: str | None = None
    # Many steps (multi_step.py): "A", "A-B", "A-B:K" or "A-:K", optimizer steps counted from 1; each op gets its step.
    steps: str | None = None
    granularity: str = "op"
    # Flight recorder (flight.py): keep the last `flight` steps in memory (at most flight_mib MiB, encoded) and write
    # them only when a gradient or the loss turns NaN/Inf, on SIGTERM/SIGUSR1, or when the script raises. With
    # tensors="full" and a modules/ops filter: full tensors of the matching ops, statistics of the others.
    flight: int | None = None
    flight_mib: float = 64.0
    flight_at_exit: bool = False  # also write the last steps when the process ends normally
    # Bytes the rank's trace may take on disk (record/budget.py): tensor data in step order (the ops of modules/ops
    # first) while it fits, statistics for the rest. An int, or "500M", "2G" in make().
    budget: int | None = None
    # torch.compile regions (record/unit_capture.py): "capture" runs them compiled, as the job does, and records each
    # call of a compiled graph as one unit (its inputs, outputs and aten graph); "eager" runs them as eager aten ops,
    # each recorded (what replaydiff did before units: not the compiled code the job runs otherwise).
    compiled: str = "capture"

    def selects(self, name: str, module: str | None) -> bool:
        """Whether an op (or compiled unit) of this name and module path is inside the --module/--op filter."""
        return in_filter(name, module, self.modules, self.ops)

    def __post_init__(self) -> None:
        if self.tensors not in TENSOR_MODES:
            raise ValueError(f"tensors must be one of {TENSOR_MODES}, not {self.tensors!r}")
        object.__setattr__(self, "tensors", TensorMode(self.tensors))  # "stats" from the CLI or a caller
        if self.compress is not None and not isinstance(self.compress, int):
            raise ValueError(f"compress must be a zstd level or None, not {self.compress!r}")
        if self.chunk_ops < 1 or self.chunk_bytes < 1 or self.queue_bytes < 1:
            raise ValueError("chunk_ops, chunk_bytes and queue_bytes must be positive")
        if self.max_tensor_bytes is not None and self.max_tensor_bytes < 0:
            raise ValueError("max_tensor_bytes must be >= 0")
        if self.ranks is not None and not all(isinstance(r, int) and r >= 0 for r in self.ranks):
            raise ValueError(f"ranks must be a list of ranks (>= 0), not {self.ranks!r}")
        if self.plant is not None:
            from replaydiff.faults import PlantSpec

            PlantSpec.parse(self.plant)  # ValueError with the accepted form
        if self.compiled not in COMPILED_MODES:
            raise ValueError(f"compiled must be one of {COMPILED_MODES}, not {self.compiled!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, not {self.granularity!r}")
        if self.steps is not None:
            StepRange.parse(self.steps)  # ValueError with the reason
        if self.flight is not None:
            if self.flight < 1 or self.flight_mib <= 0:
                raise ValueError("flight needs a positive number of steps and flight_mib > 0 (--flight K, --flight-mib MIB)")
            if self.tensors.stores_data and not (self.modules or self.ops):
                raise ValueError("the flight recorder keeps full tensors only for a filter (modules=/ops=, --module/--op: "
                                 "the suspect), statistics for the rest; without one use tensors='stats' "
                                 "(--tensors stats) or 'meta'")
        if self.budget is not None:
            if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget <= 0:
                raise ValueError(f"budget must be a positive number of bytes, not {self.budget!r}")
            if not self.tensors.stores_data:
                raise ValueError("budget limits the tensor data a trace stores: use tensors='full' (--tensors full)")
        if self.granularity == "module" and self.tensors.stores_data:
            raise ValueError("granularity='module' records statistics: use tensors='stats' (--tensors stats)")

    @classmethod
    def make(cls, tensors: TensorMode | str = TensorMode.FULL, compress: bool | int | None = True,
             **kw: Any) -> "RecordOptions":
        """The friendly form: ``compress`` True (zstd at a fast level), False/None (raw) or a level; ``modules`` and
        ``ops`` a glob or a list of globs."""
        auto = compress is True
        if compress is True:
            level: int | None = DEFAULT_ZSTD_LEVEL
        elif compress is False or compress is None:
            level = None
        else:
            level = int(compress)
        if isinstance(kw.get("steps"), int):
            kw["steps"] = str(kw["steps"])
        for k in ("modules", "ops"):
            if k in kw:
                kw[k] = _globs(kw[k])
        if kw.get("budget") is not None:
            kw["budget"] = parse_size(kw["budget"])
        if isinstance(kw.get("ranks"), int):
            kw["ranks"] = [kw["ranks"]]
        unknown = set(kw) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown record option(s): {', '.join(sorted(unknown))}")
        return cls(tensors=tensors, compress=level, compress_auto=auto, **kw)

    def to_json(self) -> dict[str, Any]:
        """The options as the manifest stores them (RankTrace.options reads them back, typed)."""
        return wire_options(asdict(self))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RecordOptions":
        """Inverse of to_json; keys this version does not know (a newer writer's) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
