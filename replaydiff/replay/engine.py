"""Replaying a whole trace in three steps every launcher shares: plan, run shards, finish.

``plan`` picks the ops of each rank to replay and collects the trace's warnings; ``run_shard`` replays one
contiguous range of one rank's ops (in this process, a pool worker, or a torchrun process); ``finish`` merges the
results in (rank, index) order and does what needs every rank at once (the cross-rank collective check, links from
backward ops to their forward source lines). Ops are independent once each has its recorded inputs, so the report
is the same whatever the number of shards.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import importlib
import multiprocessing as mp
import os
import sys
import threading
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from replaydiff import device as seam
from replaydiff.replay.recomputes import check_recomputes
from replaydiff.aten import matches_any
from replaydiff.errors import EnvironmentProblem, TraceError, UsageError
from replaydiff.replay.collectives import CollectiveChecker
from replaydiff.replay.replicas import first_replica_break
from replaydiff.replay.policy import Precision, ReplayOptions, reference_settings, replay_numerics
from replaydiff.replay.result import OpResult, ReplayReport, Status
from replaydiff.replay.runner import OpReplayer
from replaydiff.trace.damage import CutShort, MissingOps
from replaydiff.trace.modes import TensorMode
from replaydiff.trace.index import check_op_range
from replaydiff.trace.summary import trace_uses
from replaydiff.trace.sync import calls_unknown_from
from replaydiff.trace.reader import RankTrace, Trace, open_trace
from replaydiff.trace.schema import PlantedFaultInfo
from replaydiff.trace.sync import earliest

if TYPE_CHECKING:
    from replaydiff.replay.journal import Journal

Progress = Callable[[int], None]
OnResult = Callable[[OpResult], None]


def keep_freed_memory() -> None:
    """Let this process's heap keep and reuse the blocks replay frees (glibc only; a no-op elsewhere).

    Replay allocates and frees tensors of a few MB for every op (inputs upcast to float64, decoded storages). With
    glibc's defaults such blocks are mmapped and unmapped each time, so every page of every input is faulted in and
    zeroed by the kernel again: on a 1.8 GB trace that was 0.8M minor page faults and a sixth of the replay's CPU
    time as system time. Blocks up to 64 MiB (twice glibc's own ceiling for its adaptive threshold) come from the heap
    instead, and the heap's top is returned to the system only beyond 256 MiB. Larger thresholds fault less but
    grow the peak RSS (256/512 MiB: +600 MiB on an 11 GB trace; these: 7% under the peak before). Called only where
    replay owns the process (the CLI, pool workers), never inside a user's job that imports replaydiff."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 64 << 20)
    mallopt(m_trim_threshold, 256 << 20)


def check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"--device {device!r} is not a device: {exc}") from None
    problem = seam.replay_device_problem(dev)
    if problem is not None:
        raise EnvironmentProblem(problem)


@dataclass(frozen=True)
class Shard:
    """Ops of one rank to replay, by number, in order."""

    rank: int
    indices: tuple[int, ...]

    def split(self, parts: int) -> list["Shard"]:
        n = max(1, -(-len(self.indices) // max(1, parts)))
        return [Shard(self.rank, self.indices[k:k + n]) for k in range(0, len(self.indices), n)]


@dataclass
class ReplayPlan:
    path: str
    options: ReplayOptions
    shards: list[Shard] = field(default_factory=list)  # one per rank
    warnings: list[str] = field(default_factory=list)
    planted: list[str] = field(default_factory=list)
    plants: list[PlantedFaultInfo] = field(default_factory=list)
    # Ops asked for whose records are gone (an ops file deleted or cut short): never judged, never clean.
    missing: list[MissingOps] = field(default_factory=list)
    # Ranks whose recording ended before what it was asked for: the trace is partial, never clean.
    cut_short: list[CutShort] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(len(s.indices) for s in self.shards)

    def split(self, parts: int) -> list[Shard]:
        """Every rank's ops cut into ``parts`` contiguous shards (for ``parts`` workers)."""
        return [piece for s in self.shards for piece in s.split(parts)]


def import_modules(modules: list[str]) -> None:
    """Import what the user named (--import): modules that register custom ops, found as ``python -m`` would
    (the current directory first)."""
    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as exc:
            raise EnvironmentProblem(f"--import {m}: {type(exc).__name__}: {exc}") from None


def check_replayable(rt: RankTrace, where: object) -> None:
    """UsageError unless ``rt`` holds the tensor data replay runs ops on. A trace of statistics or shapes would have
    nearly every op skipped ("inputs not stored") and then read as "no divergent op"."""
    if "replay" in trace_uses(rt):
        return
    mode = rt.options.tensors or TensorMode.FULL
    raise UsageError(f"{where} cannot be replayed: it was recorded with --tensors {mode} ({mode.holds}, no tensor "
                     f"data; record with --tensors full to replay); use it with " + _either(trace_uses(rt)))


def _either(words: list[str]) -> str:
    return " or ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " or " + words[-1]


def plan(trace: Trace, opts: ReplayOptions) -> ReplayPlan:
    check_device(opts.device)
    import_modules(opts.imports + opts.reference_modules)
    p = ReplayPlan(str(trace.path), opts)
    ranks = opts.ranks if opts.ranks is not None else trace.ranks
    for r in ranks:
        check_replayable(trace.rank(r), trace.path if len(trace.ranks) == 1 else f"{trace.path} (rank {r})")
    check_op_range(opts.first, opts.last, max((len(trace.rank(r)) for r in ranks), default=0))
    for r in ranks:
        rt = trace.rank(r)
        if rt.truncated_after is not None:
            p.warnings.append(f"rank {r}: the recording did not finish (truncated after op {rt.truncated_after}); "
                              f"replaying the complete prefix")
        if rt.cut_short is not None:
            p.cut_short.append(rt.cut_short)
        planted = rt.planted
        if planted is not None:
            p.planted.append(planted.describe())
            p.plants.append(planted)
        for lost in rt.lost:
            p.warnings.append(f"rank {r}: recording lost data: {lost}")
        for region in rt.compiled_regions:
            if region.units:  # recorded as compiled units: replayed as such, nothing to warn of
                continue
            p.warnings.append(f"rank {r}: compiled region {region.region} ran {region.how} while "
                              f"recording ({region.calls} call(s))")
        idx = rt.index
        gone = [c for c in (m.clip(opts.first, opts.last) for m in rt.missing_ops) if c is not None]
        p.missing += gone
        p.shards.append(Shard(r, tuple(i for i in range(len(idx)) if idx.recorded[i]
                                       and (opts.first is None or i >= opts.first)
                                       and (opts.last is None or i <= opts.last)
                                       and not any(m.first <= i <= m.last for m in gone))))
    for r in trace.ranks:
        # a rank not replayed (--rank) whose missing ops held collectives: the replayed ranks' calls of its groups
        # cannot be checked against it, so the replay is not clean either
        rt = trace.rank(r)
        if r not in ranks and calls_unknown_from(rt) is not None:
            p.missing += rt.missing_ops
    check_ops_selected(trace, opts, p.shards)
    return p


def check_ops_selected(trace: Trace, opts: ReplayOptions, shards: list[Shard]) -> None:
    """UsageError when ``--op`` matches no op that would be replayed: a replay of nothing would say that every
    replayed op matches (exit 0), as --from/--to with no op in range already refuses."""
    if not opts.ops:
        return
    for shard in shards:
        names = trace.rank(shard.rank).index.name
        if any(matches_any(names[i], opts.ops) for i in shard.indices):
            return
    within = " within --from/--to" if opts.first is not None or opts.last is not None else ""
    raise UsageError(f"--op {' '.join(opts.ops)} matches no op of the trace{within}, so nothing would be replayed "
                     f"(`replaydiff show {trace.path} --list` lists the ops)")


def replay_threads(rt: RankTrace, opts: ReplayOptions) -> int | None:
    """CPU intra-op threads a replay of ``rt`` runs with (None: leave torch's setting)."""
    if opts.threads is not None:
        return opts.threads
    if opts.precision is Precision.SAME and torch.device(opts.device).type == "cpu":
        # CPU reductions (LayerNorm, convolution backward) are only bitwise under the recorded parallelism
        n = rt.environment.num_threads
        return n if n is not None and n > 0 else None
    # Replayed ops are small and independent: an intra-op thread pool costs more in wake-ups than it saves (4x
    # slower on a busy 2-core machine), so each process replays on one thread and --workers gives parallelism.
    return 1


_threshold_lock = threading.Lock()
_raised = 0  # shards inside fewer_collections now
_saved_threshold = gc.get_threshold()


@contextlib.contextmanager
def fewer_collections(young: int = 10_000):
    """Python's cyclic collector run less often while ops are replayed (restored after).

    Replaying an op makes a few hundred short-lived objects (records, references, results), none in cycles, so at
    the default threshold (a young collection every 700 allocations) the collector runs every few ops, and every
    tenth of those scans older objects, the whole heap (torch's ~170 k) now and then: a few per cent of a T5
    replay's CPU (tests/bench/README.md)."""
    global _saved_threshold, _raised
    with _threshold_lock:  # shards replayed on several threads at once: the first in saves, the last out restores
        if _raised == 0:
            _saved_threshold = gc.get_threshold()
            gc.set_threshold(max(young, _saved_threshold[0]), *_saved_threshold[1:])
        _raised += 1
    try:
        yield
    finally:
        with _threshold_lock:
            _raised -= 1
            if _raised == 0:
                gc.set_threshold(*_saved_threshold)


def run_shard(rt: RankTrace, opts: ReplayOptions, shard: Shard, progress: Progress | None = None,
              on_result: OnResult | None = None) -> list[OpResult]:
    """Replay one shard of ``rt``'s ops (its chunks are read from the first op of the shard on)."""
    replayer = OpReplayer(rt, opts)
    if not shard.indices:
        return []
    wanted = set(shard.indices)
    hi = shard.indices[-1]
    results = []
    numerics = replay_numerics(rt.environment.flags, opts.precision)
    with reference_settings(replay_threads(rt, opts), numerics), torch.inference_mode(), fewer_collections():
        for op in rt.iter_from(shard.indices[0]):
            if op.index > hi:
                break
            if op.index in wanted:
                res = replayer.replay(op)
                results.append(res)
                if on_result:
                    on_result(res)
                if progress:
                    progress(1)
    return results


def finish(trace: Trace, p: ReplayPlan, results: list[OpResult]) -> ReplayReport:
    report = ReplayReport(trace=p.path, options=p.options.to_json(), warnings=list(p.warnings),
                          planted=list(p.planted), plants=list(p.plants), missing=list(p.missing),
                          cut_short=list(p.cut_short), fingerprint=trace.fingerprint)
    report.ops = sorted(results, key=lambda r: (r.rank, r.index))
    pending = {(r.rank, r.index): r for r in report.ops if r.collective and r.status is Status.SKIPPED}
    if pending:
        CollectiveChecker(trace, p.options).check(pending)
    if len(trace.ranks) > 1 and (p.options.ranks is None or len(p.options.ranks) > 1):
        try:
            report.replicas = first_replica_break(trace)
        except Exception as exc:  # a damaged chunk elsewhere: the replica comparison is extra, the report stands
            report.warnings.append(f"replicas not compared: {type(exc).__name__}: {exc}")
    recomputes = [(r.rank, r.index) for r in report.ops if r.location is not None and r.location.recompute_of is not None]
    if recomputes:
        try:
            wrong = {(r.rank, r.index) for r in report.ops if r.status is Status.DIVERGENT}
            found = check_recomputes(trace, recomputes, wrong)
            report.recomputes_differ = [d for d in found if not d.state]
            report.recomputes_state = [d for d in found if d.state]  # said, never a problem
        except Exception as exc:  # a damaged chunk elsewhere: the check is extra, the report stands
            report.warnings.append(f"recomputes not compared with their forward ops: {type(exc).__name__}: {exc}")
    candidates = [(r.rank, r.index) for r in report.first_per_rank]
    if len(candidates) > 1:
        first = earliest(trace, candidates)
        report.culprit = first[0]
        report.undecided = first[1:]
    return report


def pool_context() -> mp.context.BaseContext:
    """Fresh processes (fork after torch has started threads is unsafe), started from a server that has already
    imported torch, so each worker starts in a fraction of a second instead of seconds.

    Not replaydiff: the server runs with the current directory first on its sys.path (Python 3.11 leaves out the
    parent's there), so from a directory holding a ``replaydiff/`` folder it would import that as an empty namespace
    package, which every worker would inherit. Each worker imports replaydiff itself, by the parent's sys.path."""
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch"])
        return ctx
    except ValueError:  # no forkserver on this platform
        return mp.get_context("spawn")


# Traces a pool worker has open, by path: a worker replays many small shards of one trace (see replay_trace), and
# its reader's caches (chunks, storages) carry over from one shard to the next.
_OPEN: dict[str, Trace] = {}


def replay_piece(path: str, opts: ReplayOptions, shard: Shard) -> list[OpResult]:
    """A pool worker's job (``pool_context``): one shard of the trace at ``path``, the trace kept open for the next."""
    keep_freed_memory()
    import_modules(opts.imports + opts.reference_modules)
    trace = _OPEN.get(path)
    if trace is None:
        _OPEN.clear()
        trace = _OPEN[path] = open_trace(path)
    return run_shard(trace.rank(shard.rank), opts, shard)


# Shards per worker and rank: small enough that results (the journal, the progress bar) arrive as the replay goes
# and the workers finish together; few enough that the caches a piece starts without (the storages the ops before it
# made) cost little: 8 per worker took 6.0 s of CPU on a 1.8 GB trace, 4 per worker 5.8 s.
_PIECES_PER_WORKER = 4
_MIN_PIECE = 32


def replay_trace(path: str, opts: ReplayOptions, workers: int = 1,
                 progress_total: Callable[[int], None] | None = None, progress: Progress | None = None,
                 on_result: OnResult | None = None, journal: str | os.PathLike | None = None,
                 resume: bool = False, on_resumed: Callable[[int, Path], None] | None = None,
                 on_journal: Callable[[Path], None] | None = None) -> ReplayReport:
    """Replay every selected op of every selected rank; ``on_result`` sees each OpResult as it is made.

    ``journal``: a folder where each op's result is written as it is judged (removed when the replay finishes);
    with ``resume`` the results an interrupted run of the same replay left there are kept and only the other ops
    are replayed (``on_resumed(count, file)`` is told how many), which gives the same report as one whole run.
    ``on_journal(file)`` is told the journal's file once it is open (what an interrupted replay leaves there)."""
    from replaydiff.replay.journal import Journal

    trace = open_trace(path)
    p = plan(trace, opts)
    log: Journal | None = Journal(trace, opts, journal) if journal is not None else None
    done: list[OpResult] = []
    if log is not None:
        if resume:
            planned = {(s.rank, i) for s in p.shards for i in s.indices}
            done = [r for r in log.judged() if (r.rank, r.index) in planned]
            judged = {(r.rank, r.index) for r in done}
            p.shards = [Shard(s.rank, tuple(i for i in s.indices if (s.rank, i) not in judged)) for s in p.shards]
            if on_resumed:
                on_resumed(len(done), log.path)
        try:
            log.start(done)
        except OSError as exc:
            p.warnings.append(f"no journal of judged ops ({log.path.parent}: {exc.strerror or exc}): an interrupted "
                              f"replay cannot be resumed")
            log = None
        if log is not None and on_journal:
            on_journal(log.path)
    if progress_total:
        progress_total(p.total)
    finished = False
    try:
        results = _run(trace, p, opts, workers, progress, on_result, log)
        finished = True
    except TraceError:
        finished = True  # a damaged trace: nothing to resume, so no journal left behind
        raise
    finally:
        if log is not None:
            log.close(finished)
    return finish(trace, p, done + results)


def _run(trace: Trace, p: ReplayPlan, opts: ReplayOptions, workers: int, progress: Progress | None,
         on_result: OnResult | None, log: "Journal | None") -> list[OpResult]:
    def judged(r: OpResult) -> None:
        if log is not None:
            log.add(r)
        if on_result:
            on_result(r)

    results: list[OpResult] = []
    if workers <= 1:
        for shard in p.shards:
            results += run_shard(trace.rank(shard.rank), opts, shard, progress, judged)
        return results
    pieces = [piece for s in p.shards if s.indices
              for piece in s.split(max(1, min(workers * _PIECES_PER_WORKER, len(s.indices) // _MIN_PIECE)))]
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=pool_context())
    try:
        futures = {pool.submit(replay_piece, str(trace.rank(s.rank).root), opts, s): len(s.indices) for s in pieces}
        for fut in cf.as_completed(futures):
            part = fut.result()
            results += part
            for r in part:
                judged(r)
            if progress:
                progress(futures[fut])
    except BrokenProcessPool:
        # A worker died: it could not start (its own error above) or was killed (out of memory, a crashing kernel)
        raise EnvironmentProblem(f"a replay worker process stopped before finishing its ops (--workers {workers}); "
                                 f"--workers 1 replays in this process") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results
