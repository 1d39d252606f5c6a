"""What a ``--tensors full`` recording would write, worked out from a ``--tensors meta`` trace of the same step
(``record --estimate``).

A meta trace holds every tensor's storage version and size, so the recorder's own rule gives the bytes full would
store: each storage version once, at the first op that reads or writes it (outputs of empty* ops are not stored
there: their bytes are the allocator's), plus a header entry per storage and the generator state of random ops.
The same rule with a --module/--op selection gives what a zoomed recording would store; the budget's rule
(record/budget.py) gives where data would stop in step order (``RankEstimate.fit``), and, the budget being per
rank, which ranks of a multi-process job fit it whole (``ranks_that_fit``). Bytes are raw: zstd saves 8-20% of
float data, and is used only where it costs the job no time.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from replaydiff import aten
from replaydiff.record.budget import BLOB_OVERHEAD, format_size, records_reserve
from replaydiff.record.options import in_filter
from replaydiff.trace.format import OPS_DIR
from replaydiff.trace.reader import RankTrace, open_trace
from replaydiff.trace.schema import OpRecord

RNG_STATE_BYTES = {"cpu": 5056, "cuda": 16}  # the CPU generator's state / a CUDA generator's (Philox seed, offset)
OUTSIDE = "(outside any module)"
FITS = 8  # module selections listed as fitting a budget, largest first


@dataclass(frozen=True)
class WriteRate:
    """The disk's write rate where the trace would go, as measured (None, with the error, when it could not be)."""

    bytes_per_s: float | None
    directory: Path
    error: str | None = None

    @property
    def how(self) -> str:
        return f"{PROBE_BYTES >> 20} MiB written and synced to disk in {self.directory}"

    def seconds(self, nbytes: int) -> float | None:
        return nbytes / self.bytes_per_s if self.bytes_per_s else None


@dataclass(frozen=True)
class Estimate:
    """``record --estimate``: what a full recording of ``what`` ("step 3", "steps 1-4") would write on each rank, at
    the disk's write ``rate``; with a --module/--op selection what that stores (``selection``: rank -> bytes), and
    with a ``budget`` where it would stop each rank (``fits``), the ranks that fit it whole and the flags that
    record them."""

    what: str
    rate: WriteRate
    ranks: list[RankEstimate]
    modules: list[str] | None
    ops: list[str] | None
    selection: dict[int, int]
    budget: int | None
    fits: dict[int, BudgetFit]
    ranks_that_fit: list[int]
    rank_flags: list[str] | None  # the flags that fit the budget by ranks (None: no rank fits it whole)

    @property
    def total_bytes(self) -> int:
        return sum(e.data_bytes + e.records_bytes for e in self.ranks)


def build_estimate(estimates: list[RankEstimate], what: str, rate: WriteRate, modules: list[str] | None = None,
                   ops: list[str] | None = None, budget: int | None = None) -> Estimate:
    selection = {e.rank: e.stored(modules, ops) + e.records_bytes for e in estimates} if modules or ops else {}
    fits = {e.rank: e.fit(budget) for e in estimates} if budget else {}
    fitting = ranks_that_fit(estimates, budget) if budget else []
    flags = None
    if fitting and budget:  # just --budget when every rank fits it whole
        flags = ["--budget", format_size(budget)] if len(fitting) == len(estimates) else ranks_flags(fitting, budget)
    return Estimate(what, rate, estimates, modules, ops, selection, budget, fits, fitting, flags)


@dataclass
class OpData:
    """One op of the meta trace: where it ran, and the storage versions (id, bytes) it reads or writes."""

    index: int
    name: str
    module: str | None
    phase: str | None
    storages: list[tuple[int, int]]
    extra: int  # bytes stored with the op itself (a random op's generator state)


@dataclass
class ModuleFit:
    """A module whose ops' tensor data, with every op's record, fits a budget whole: ``flags`` select it."""

    module: str
    nbytes: int
    flags: list[str]


@dataclass
class BudgetFit:
    """What ``--budget`` would keep of one rank's full recording."""

    budget: int
    reserve: int  # kept for op records and statistics
    fits: bool  # every storage would be stored
    stop: int | None  # in step order, the first op that would get statistics instead of data
    stored: int  # tensor data stored in step order
    modules: list[ModuleFit]  # the largest --module selections that fit whole (empty when everything fits)

    @property
    def no_room(self) -> bool:
        """The reserve takes the whole budget: no tensor data at all."""
        return self.budget <= self.reserve


@dataclass
class RankEstimate:
    rank: int
    ops: list[OpData]
    records_bytes: int  # op records as the meta trace stores them (full's carry no statistics: about the same)
    by_place: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (module, phase) -> [ops, bytes]
    data_bytes: int = 0

    def stored(self, modules: list[str] | None = None, ops: list[str] | None = None) -> int:
        """Tensor data full would store with these --module/--op globs (None: every op)."""
        return sum(n for _, n in _first_stores(o for o in self.ops if _selected(o, modules, ops)))

    def budget_stop(self, budget: int) -> tuple[int | None, int]:
        """Under ``--budget`` in step order: the first op that would get statistics instead of data (None: all fit),
        and the data bytes stored."""
        limit = budget - max(records_reserve(budget), self.records_bytes + records_reserve(budget) // 2)
        used, first = 0, None
        for op, n in _first_stores(self.ops):
            if n and used + n > limit:
                first = op.index if first is None else first
                continue  # later, smaller storages may still fit (budget.py)
            used += n
        return first, used

    def fit(self, budget: int) -> BudgetFit:
        """Where ``--budget`` would stop this rank's data, and the module selections that fit it whole."""
        reserve = records_reserve(budget)
        if budget <= reserve:
            return BudgetFit(budget, reserve, False, None, 0, [])
        stop, stored = self.budget_stop(budget)
        if stop is None:
            return BudgetFit(budget, reserve, True, None, stored, [])
        fitting = []
        for module in self.module_subtrees():
            globs = module_globs(module)
            n = self.stored(globs) + self.records_bytes
            if n <= budget - reserve:
                fitting.append(ModuleFit(module, n, [f for g in globs for f in ("--module", g)]))
        # the largest selections that fit whole are the useful ones; nested modules of one that fits fit too
        fitting.sort(key=lambda f: -f.nbytes)
        return BudgetFit(budget, reserve, False, stop, stored, fitting[:FITS])

    def module_subtrees(self, depth: int = 3) -> list[str]:
        """Modules (and their ancestors) down to ``depth`` levels below the root, each once."""
        found: set[str] = set()
        for o in self.ops:
            if o.module:
                parts = o.module.split(".")
                for k in range(1, min(len(parts), depth + 1) + 1):
                    found.add(".".join(parts[:k]))
        return sorted(found)


def ranks_that_fit(estimates: list[RankEstimate], budget: int) -> list[int]:
    """The ranks whose whole full recording fits ``--budget`` (which is per rank)."""
    if budget <= records_reserve(budget):
        return []
    return [e.rank for e in estimates if e.budget_stop(budget)[0] is None]


def ranks_flags(ranks: list[int], budget: int) -> list[str]:
    """``record`` flags that record only these ranks, each under the budget."""
    return ["--rank", ",".join(map(str, ranks)), "--budget", format_size(budget)]


def module_globs(module: str) -> list[str]:
    """The --module globs that select a module and everything inside it."""
    return [module, f"{module}.*"]


def _selected(o: OpData, modules: list[str] | None, ops: list[str] | None) -> bool:
    return in_filter(o.name, o.module, modules, ops)


def _first_stores(ops: Iterable[OpData]) -> Iterable[tuple[OpData, int]]:
    """Each op with the bytes full would store at it: storage versions not stored before, plus header entries."""
    seen: set[int] = set()
    for o in ops:
        n = o.extra
        for version, nbytes in o.storages:
            if version not in seen:
                seen.add(version)
                if nbytes:
                    n += nbytes + BLOB_OVERHEAD
        yield o, n


def _op_data(op: OpRecord, max_tensor_bytes: int | None) -> OpData:
    refs = list(op.inputs()) + ([] if op.uninitialised else op.outputs_refs())
    storages = [(x.version, x.nbytes) for x in refs if x.version is not None and not x.zero and not x.meta
                and not x.unsupported and (max_tensor_bytes is None or x.nbytes <= max_tensor_bytes)]
    extra = 0
    if aten.is_random(op.name):
        dev = next((x.device for x in refs if isinstance(x.device, str)), "cpu").split(":")[0]
        extra = RNG_STATE_BYTES.get(dev, 0)
    return OpData(op.index, op.name, op.module, op.phase, storages, extra)


def estimate_rank(rt: RankTrace, max_tensor_bytes: int | None = None) -> RankEstimate:
    """What ``--tensors full`` would have written of this meta trace's ops."""
    records = sum(p.stat().st_size for p in (rt.root / OPS_DIR).iterdir() if p.is_file())
    est = RankEstimate(rt.rank, [_op_data(op, max_tensor_bytes) for op in rt], records)
    for o, n in _first_stores(est.ops):
        row = est.by_place.setdefault((o.module or OUTSIDE, o.phase or "-"), [0, 0])
        row[0] += 1
        row[1] += n
        est.data_bytes += n
    return est


PROBE_BYTES = 64 << 20  # written by measure_write_rate: enough to pass the page cache's first burst


def estimate_trace(path: Path, max_tensor_bytes: int | None = None) -> list[RankEstimate]:
    """The estimate of every rank of the meta trace at ``path``."""
    return [estimate_rank(rt, max_tensor_bytes) for rt in open_trace(path)]


def measure_write_rate(directory: Path, nbytes: int = PROBE_BYTES) -> float:
    """Bytes per second of writing a file in ``directory`` and syncing it to disk (the probe file is removed)."""
    block = os.urandom(1 << 20) * 4  # 4 MiB, incompressible, like float data
    fd, name = tempfile.mkstemp(prefix=".replaydiff-write-probe-", dir=directory)
    try:
        started = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, block)
        os.fsync(fd)
        return written / max(time.perf_counter() - started, 1e-9)
    finally:
        os.close(fd)
        os.unlink(name)
