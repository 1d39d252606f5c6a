"""Provides replay_in_background: a whole-trace replay run in a separate process, handing results back shard by shard.

Headless (no textual). Replaying is Python-heavy; in a thread of the UI's own process it would hold the GIL the
event loop needs, and keys would wait behind it. In a worker process the UI only takes results in. The work is cut
into shards of a few hundred ops so that rows take their colour as the replay goes, and a newer replay can stop an
older one between shards.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
from typing import Any, Callable

SHARD_OPS = 256


_niced = False


def _replay_shard(path: str, opts: Any, shard: Any) -> list:
    global _niced
    if not _niced:  # the person at the keyboard comes first: on a busy machine the UI gets the CPU before we do
        _niced = True
        try:
            os.nice(10)
        except OSError:
            pass
    from replaydiff.replay.engine import replay_piece

    return replay_piece(path, opts, shard)  # what replay_trace's workers run


def _context() -> mp.context.BaseContext:
    from replaydiff.replay.engine import pool_context

    return pool_context()


def prepare() -> None:
    """Start multiprocessing's helper processes (resource tracker, fork server) now. Call it from the main thread:
    they are spawned with the process's stderr, and a UI that captures stderr has none to give them (this function
    borrows the real one for the moment)."""
    import sys
    from multiprocessing import forkserver, resource_tracker

    saved = sys.stderr
    if sys.__stderr__ is not None:
        sys.stderr = sys.__stderr__
    try:
        resource_tracker.ensure_running()
        if _context().get_start_method() == "forkserver":
            forkserver.ensure_running()
    finally:
        sys.stderr = saved


def replay_in_background(path: str, opts: Any, progress_total: Callable[[int], None] | None = None,
                         progress: Callable[[int], None] | None = None,
                         on_result: Callable[[Any], None] | None = None) -> Any:
    """replay_trace's contract (the same report), computed in one worker process, ``SHARD_OPS`` ops at a time.
    An exception raised by a callback stops the replay after the shard in flight."""
    from replaydiff.replay import Shard, finish, plan
    from replaydiff.trace import open_trace

    trace = open_trace(path)
    p = plan(trace, opts)
    if progress_total:
        progress_total(p.total)
    pieces = [Shard(s.rank, s.indices[k:k + SHARD_OPS]) for s in p.shards
              for k in range(0, len(s.indices), SHARD_OPS)]
    results: list = []
    pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=_context())
    try:
        # two shards in flight: the worker starts the next while this process hands the last one over
        futures = [pool.submit(_replay_shard, str(trace.rank(s.rank).root), opts, s) for s in pieces[:2]]
        nxt = 2
        while futures:
            part = futures.pop(0).result()
            if nxt < len(pieces):
                s = pieces[nxt]
                futures.append(pool.submit(_replay_shard, str(trace.rank(s.rank).root), opts, s))
                nxt += 1
            results += part
            for r in part:
                if on_result:
                    on_result(r)
            if progress:
                progress(len(part))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return finish(trace, p, results)
