"""Replaying a whole trace: every selected op of every rank, on one process or several.

Ops are independent once each has its recorded inputs, so work is split into contiguous ranges of op numbers and
the results are merged in (rank, index) order: the report is the same whatever the number of workers.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from typing import Callable

import torch

from replaydiff.errors import EnvironmentProblem, UsageError
from replaydiff.replay.policy import ReplayOptions, reference_settings
from replaydiff.replay.collectives import CollectiveChecker
from replaydiff.replay.result import OpResult, ReplayReport
from replaydiff.replay.runner import COLLECTIVE_SKIP, OpReplayer
from replaydiff.trace.reader import RankReader, TraceReader, open_trace

Progress = Callable[[int], None]


def check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"--device {device!r} is not a device: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EnvironmentProblem(f"device {device} asked for, but this machine has no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise EnvironmentProblem(f"device {device} asked for, but only {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise EnvironmentProblem(f"device type {dev.type!r} is not supported for replay (use cpu or cuda[:N])")


def _selected(reader: RankReader, opts: ReplayOptions) -> list[int]:
    out = []
    for op in reader:
        i = op["i"]
        if (opts.first is None or i >= opts.first) and (opts.last is None or i <= opts.last):
            out.append(i)
    return out


def _threads(reader: RankReader, opts: ReplayOptions) -> int | None:
    if opts.precision == "same" and torch.device(opts.device).type == "cpu":
        # CPU reductions (LayerNorm, convolution backward) are only bitwise under the recorded parallelism
        n = reader.environment.get("num_threads")
        return int(n) if isinstance(n, int) and n > 0 else None
    # Replayed ops are small and independent: an intra-op thread pool costs more in wake-ups than it saves (4x
    # slower on a busy 2-core machine), so each process replays on one thread and --workers gives parallelism.
    return 1


def replay_range(reader: RankReader, opts: ReplayOptions, indices: list[int],
                 progress: Progress | None = None) -> list[OpResult]:
    replayer = OpReplayer(reader, opts)
    wanted = set(indices)
    lo, hi = (min(indices), max(indices)) if indices else (0, -1)
    results = []
    with reference_settings(_threads(reader, opts)), torch.inference_mode():
        for op in reader.iter_from(lo):
            i = op["i"]
            if i > hi:
                break
            if i in wanted:
                results.append(replayer.replay(op))
                if progress:
                    progress(1)
    return results


def _pool_context() -> mp.context.BaseContext:
    """Fresh processes (fork after torch has started threads is unsafe), started from a server that has already
    imported torch and replaydiff, so each worker starts in a fraction of a second instead of seconds."""
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["replaydiff.replay.engine"])
        return ctx
    except ValueError:  # no forkserver on this platform
        return mp.get_context("spawn")


def _worker(path: str, rank: int, opts: ReplayOptions, indices: list[int], workers: int) -> list[dict]:
    reader = open_trace(path).rank(rank)
    return [r.to_dict() for r in replay_range(reader, opts, indices)]


def replay_trace(path: str, opts: ReplayOptions, workers: int = 1,
                 progress_total: Callable[[int], None] | None = None, progress: Progress | None = None) -> ReplayReport:
    check_device(opts.device)
    trace: TraceReader = open_trace(path)
    report = ReplayReport(trace=str(path), options=opts.as_dict())
    ranks = opts.ranks if opts.ranks is not None else sorted(trace.ranks)
    plan: list[tuple[RankReader, list[int]]] = []
    for r in ranks:
        reader = trace.rank(r)
        if reader.truncated_after is not None:
            report.warnings.append(f"rank {r}: the recording did not finish (truncated after op "
                                   f"{reader.truncated_after}); replaying the complete prefix")
        for lost in reader.lost:
            report.warnings.append(f"rank {r}: recording lost data: {lost}")
        plan.append((reader, _selected(reader, opts)))
    if progress_total:
        progress_total(sum(len(ix) for _, ix in plan))
    if workers <= 1:
        for reader, indices in plan:
            report.ops.extend(replay_range(reader, opts, indices, progress))
        _check_collectives(trace, opts, report)
        _link_forward_sources(trace, report)
        return report
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context()) as pool:
        futures = []
        for reader, indices in plan:
            n = max(1, -(-len(indices) // workers))
            for k in range(0, len(indices), n):
                part = indices[k:k + n]
                futures.append((pool.submit(_worker, str(reader.root), reader.rank, opts, part, workers), len(part)))
        for fut, n in futures:
            report.ops.extend(OpResult(**d) for d in fut.result())
            if progress:
                progress(n)
    report.ops.sort(key=lambda r: (r.rank, r.index))
    _check_collectives(trace, opts, report)
    _link_forward_sources(trace, report)
    return report


def _link_forward_sources(trace: TraceReader, report: ReplayReport) -> None:
    """A backward op's own source line is the backward() call; the forward op's line says which code it is."""
    for r in report.ops:
        if r.status in ("divergent", "nondeterministic", "error") and r.forward_index is not None:
            try:
                r.forward_source = trace.rank(r.rank).op(r.forward_index).get("src")
            except Exception:  # a damaged chunk elsewhere: the hint is optional
                pass


def _check_collectives(trace: TraceReader, opts: ReplayOptions, report: ReplayReport) -> None:
    coll = {(r.rank, r.index): r for r in report.ops if r.status == "skipped" and r.reason == COLLECTIVE_SKIP}
    if coll:
        CollectiveChecker(trace, opts).check(coll)
