"""How fast ``replaydiff invariance`` checks a real model's step: ops a second on T5 and GPT-2 (transformers, tiny
configs, the batch and sequence of bench_real_models.py: 4 x 32), beside a replay of the same trace at
``--precision same`` (the same rebuilding of inputs, one run of each op).

Why: the check runs each op that reads the batch twice (one row, the first half) and walks the whole trace to follow
the batch; this says what that costs against a plain bitwise replay. One torch thread, the trace recorded once per
model (``full``, zstd), each figure the median of ``--rounds`` runs in this process after one warm-up run (startup
excluded). Printed: ops in the trace, ops judged (run on slices), the check's wall time and ops a second (all ops of
the trace / wall), and replay's.

Usage: ``python tests/bench/bench_invariance.py [--models t5,gpt2] [--rounds 5]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replaydiff  # noqa: E402
from bench_real_models import build  # noqa: E402
from replaydiff.invariance import Finding, check_invariance  # noqa: E402
from replaydiff.replay import ReplayOptions, replay_trace  # noqa: E402
from replaydiff.trace import open_trace  # noqa: E402


def _median_s(fn, rounds: int) -> float:
    fn()  # warm-up: imports, kernels' first calls
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="t5,gpt2")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            step = build(name)
            step()  # the optimizer's state exists: the recorded step is a steady one
            path = Path(tmp) / name
            with replaydiff.record(path):
                step()
            rt = open_trace(path).rank(0)
            result = check_invariance(rt)
            judged = result.count(Finding.INVARIANT) + result.count(Finding.VARIANT) + result.count(Finding.MEAN)
            check_s = _median_s(lambda: check_invariance(open_trace(path).rank(0)), a.rounds)
            replay_s = _median_s(lambda: replay_trace(str(path), ReplayOptions(precision="same")), a.rounds)
            n = len(rt)
            rows.append((name, n, judged, len(result.variant), check_s, replay_s))
    print("| model | ops | run on slices | named | invariance check | ops/s | replay --precision same | ops/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, judged, named, check_s, replay_s in rows:
        print(f"| {name} | {n:,} | {judged:,} | {named} | {check_s * 1e3:.0f} ms | {n / check_s:,.0f} | "
              f"{replay_s * 1e3:.0f} ms | {n / replay_s:,.0f} |")


if __name__ == "__main__":
    main()
