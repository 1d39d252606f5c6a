"""Replay throughput of one process on one core, and where each op's microseconds go (against replay's speed goal).

``python tests/bench/bench_replay.py [--trace DIR] [--rounds 7]`` replays a ``full`` + zstd trace of the tiny
transformer's step (recorded first, as ``bench.py`` records it, unless ``--trace`` names one) with ``replay_trace`` in
this process, rounds of fp64 and ``--precision same`` interleaved, after one warm-up replay of each; it prints the
median wall and CPU seconds (``time.process_time``: a preempted process does not accrue it, so it suffers less from
the other processes on a shared machine) and ops/s of both, and the load average.

``--parts`` instead times the functions that do each part of replaying one op (in place, with the thread's CPU clock,
the wrapper's own cost subtracted) and prints microseconds per op by part. Parts nest (say so in the table), the
fastest of ``--rounds`` replays counts, and "the rest" is the total minus the top-level parts.

Compare two versions of the code by running this script under each (``PYTHONPATH=/tmp/old python ...``), alternating.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.replay.result import Status


def record_tiny(path: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench import MODELS, record_replay_trace  # the trace bench.py's replay section reads

    torch.manual_seed(0)
    record_replay_trace(MODELS["tiny"], path)


def replay_once(path: str, precision: str) -> tuple[float, float, int, int]:
    """(wall s, CPU s, ops, replayed ops) of one replay_trace in this process."""
    w, c = time.perf_counter(), time.process_time()
    report = replay_trace(path, ReplayOptions(precision=precision))
    cpu, wall = time.process_time() - c, time.perf_counter() - w
    return wall, cpu, len(report.ops), sum(r.status is not Status.SKIPPED for r in report.ops)


def throughput(path: str, rounds: int, precisions: list[str]) -> None:
    for p in precisions:
        replay_once(path, p)  # warm-up: lazy imports, reference settings, kernels' first calls
    got: dict[str, list[tuple[float, float]]] = {p: [] for p in precisions}
    counts = {}
    la0 = os.getloadavg()
    for _ in range(rounds):
        for p in precisions:
            wall, cpu, n, replayed = replay_once(path, p)
            got[p].append((wall, cpu))
            counts[p] = (n, replayed)
    la1 = os.getloadavg()
    print(f"trace {path}: torch threads as the engine sets them; {rounds} rounds interleaved; load average "
          f"{la0[0]:.1f} at start, {la1[0]:.1f} at end\n")
    print("| precision | ops (replayed) | wall s, median (min-max) | CPU s, median | replayed ops/s wall | "
          "replayed ops/s CPU | us/op CPU |")
    print("|---|---|---|---|---|---|---|")
    for p in precisions:
        walls, cpus = [w for w, _ in got[p]], [c for _, c in got[p]]
        n, replayed = counts[p]
        mw, mc = statistics.median(walls), statistics.median(cpus)
        print(f"| {p} | {n} ({replayed}) | {mw:.3f} ({min(walls):.3f}-{max(walls):.3f}) | {mc:.3f} | "
              f"{replayed / mw:,.0f} | {replayed / mc:,.0f} | {1e6 * mc / n:.0f} |")


# -- --parts ----------------------------------------------------------------------------------------------------------
class Clock:
    """CPU seconds and calls per part, accumulated by wrappers around the functions that do the part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: Any, attr: str, part: str) -> Callable[[], None]:
        original = getattr(owner, attr)
        clock = time.thread_time
        seconds, calls = self.seconds, self.calls
        seconds.setdefault(part, 0.0)
        calls.setdefault(part, 0)

        @functools.wraps(original)
        def timed(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return original(*a, **k)
            finally:
                seconds[part] += clock() - t
                calls[part] += 1

        setattr(owner, attr, timed)
        return lambda: setattr(owner, attr, original)


def wrapper_cost() -> float:
    """CPU seconds one timed call adds around the function it wraps (two clock reads and the bookkeeping)."""
    class Box:
        @staticmethod
        def f() -> None:
            return None
    plain_n = 20000
    t = time.thread_time()
    for _ in range(plain_n):
        Box.f()
    plain = time.thread_time() - t
    c = Clock()
    c.wrap(Box, "f", "x")
    t = time.thread_time()
    for _ in range(plain_n):
        Box.f()
    return max(0.0, (time.thread_time() - t - plain) / plain_n)


# (owner module path, attribute path, part label); the label's indentation says which part it is inside.
PARTS = [
    ("replaydiff.replay.runner", "OpReplayer.replay", "total (OpReplayer.replay)"),
    ("replaydiff.trace.reader", "RankTrace._chunk", "read + unpack op chunks (RankTrace._chunk)"),
    ("replaydiff.trace.schema.ops", "OpRecord._decode", "decode op fields (OpRecord._decode)"),
    ("replaydiff.replay.runner", "OpReplayer._runs", "run the op (_runs)"),
    ("replaydiff.replay.runner", "_Inputs.build", "  rebuild inputs (_Inputs.build)"),
    ("replaydiff.replay.runner", "OpReplayer._judge", "judge the outputs (_judge)"),
    ("replaydiff.replay.runner", "_pairs", "  pair outputs (_pairs)"),
    ("replaydiff.replay.runner", "compared_outputs", "  which outputs (compared_outputs, in _pairs)"),
    ("replaydiff.trace.reader", "RankTrace.tensor", "  recorded outputs (RankTrace.tensor)"),
    ("replaydiff.trace.reader", "RankTrace.data", "  storage bytes: read, zstd, CRC (RankTrace.data; in build and tensor)"),
    ("replaydiff.compare.verdict", "measure", "  metrics (compare.metrics.measure)"),
    ("replaydiff.compare.verdict", "judge_measure", "  verdict (judge_measure)"),
    ("replaydiff.replay.runner", "OpReplayer._uninitialised", "  uninitialised inputs? (_uninitialised)"),
    ("replaydiff.replay.runner", "OpReplayer._nonfinite_origin", "NaN/Inf origin (_nonfinite_origin)"),
    ("replaydiff.replay.runner", "OpReplayer._result", "OpResult (_result)"),
]


def parts(path: str, rounds: int, precisions: list[str]) -> None:
    import importlib

    cost = wrapper_cost()
    for p in precisions:
        replay_once(path, p)  # warm-up
        best: dict[str, float] | None = None
        calls: dict[str, int] = {}
        n_ops = 0
        for _ in range(rounds):
            clock = Clock()
            undo = []
            for mod, attr, label in PARTS:
                owner: Any = importlib.import_module(mod)
                *outer, name = attr.split(".")
                for o in outer:
                    owner = getattr(owner, o)
                undo.append(clock.wrap(owner, name, label))
            # the kernel: the op's own call, inside _runs
            try:
                _, _, n_ops, _ = replay_once(path, p)
            finally:
                for u in reversed(undo):
                    u()
            # each wrapper's cost lands in every part that encloses the call: subtract it where it was counted
            net = {k: v - clock.calls[k] * cost for k, v in clock.seconds.items()}
            net["total (OpReplayer.replay)"] -= cost * sum(c for k, c in clock.calls.items()
                                                          if not k.startswith(("total", "read + unpack")))
            if best is None or net["total (OpReplayer.replay)"] < best["total (OpReplayer.replay)"]:
                best, calls = net, dict(clock.calls)
        assert best is not None
        ops = max(1, n_ops)
        total = best["total (OpReplayer.replay)"]
        top = [k for k in best if not k.startswith((" ", "total", "read + unpack"))]
        rest = total - sum(best[k] for k in top)
        print(f"\n{p}: {ops} ops, best of {rounds}; wrapper cost {1e6 * cost:.2f} us per call subtracted\n")
        print("| part | us/op | calls/op | share of total |")
        print("|---|---|---|---|")
        for _, _, label in PARTS:
            print(f"| {label.replace('  ', '&nbsp;&nbsp;of which: ')} | {1e6 * best[label] / ops:.1f} | "
                  f"{calls[label] / ops:.2f} | {100 * best[label] / total:.0f}% |")
        kernel = best["run the op (_runs)"] - best["  rebuild inputs (_Inputs.build)"]
        print(f"| derived: the kernel call and _runs' own Python (_runs minus build) | {1e6 * kernel / ops:.1f} | - | "
              f"{100 * kernel / total:.0f}% |")
        print(f"| the rest: _replay's own Python (checks, _reference, Judgement) | {1e6 * rest / ops:.1f} | - | "
              f"{100 * rest / total:.0f}% |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="a full trace to replay (default: record the tiny step into a temporary folder)")
    p.add_argument("--rounds", type=int, default=7, help="timed replays per precision (default 7)")
    p.add_argument("--precisions", default="fp64,same", help="comma-separated (default fp64,same)")
    p.add_argument("--parts", action="store_true", help="microseconds per op by part instead of throughput")
    args = p.parse_args(argv)
    precisions = [x for x in args.precisions.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="rdbench-") as tmp:
        path = args.trace
        if path is None:
            path = os.path.join(tmp, "tiny-trace")
            record_tiny(path)
        (parts if args.parts else throughput)(path, args.rounds, precisions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
