"""Benchmark of watching many steps: steady-state cost per step of one long multi-step recording.

Why: bench.py times one step per ``with`` block, so each sample also pays for starting and finishing a recorder
(environment snapshot, writer thread, final manifest). A job watched with ``--steps`` or ``--flight`` pays those
once; what it pays every step is what this script measures: N training steps of TinyTransformer plain, then the same
N steps inside one ``replaydiff.record(..., steps="1-", ...)`` (or ``flight=8``), for each variant on its own model
from the same seed, the blocks interleaved round-robin; the median per-step time of each block is compared with the
plain block of the same round.

Usage: ``python tests/bench/bench_steps.py [--model mid] [--steps 10] [--rounds 3] [--threads 1]``.
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replaydiff  # noqa: E402
from bench import MODELS, build_step, md_table  # noqa: E402

VARIANTS = {
    "plain": None,
    "stats, every op": dict(tensors="stats"),
    "stats, granularity module": dict(tensors="stats", granularity="module"),
    "flight K=8, every op": dict(tensors="stats", flight=8),
    "flight K=8, module": dict(tensors="stats", flight=8, granularity="module"),
}


def run_block(step, options: dict | None, n: int) -> list[float]:
    """n steps, each timed; recorded variants inside one multi-step recording into a fresh directory."""
    out = tempfile.mkdtemp(prefix="rdsteps-")
    times = []
    try:
        ctx = contextlib.nullcontext() if options is None else replaydiff.record(out, steps="1-", **options)
        with ctx:
            for _ in range(n):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mid", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = {k: build_step(MODELS[args.model]) for k in VARIANTS}
    for k, opts in VARIANTS.items():  # warm-up: optimizer state, first-call costs
        run_block(steps[k], opts, 2)
    per_step: dict[str, list[float]] = {k: [] for k in VARIANTS}
    ratios: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(args.rounds):
        medians = {k: statistics.median(run_block(steps[k], opts, args.steps)) for k, opts in VARIANTS.items()}
        for k, m in medians.items():
            per_step[k].append(m)
            ratios[k].append(m / medians["plain"])
    print(f"{args.model}: {args.steps} steps per block, {args.rounds} rounds, torch threads "
          f"{torch.get_num_threads()}\n")
    rows = [[k, f"{1e3 * statistics.median(per_step[k]):.1f}", f"{statistics.median(ratios[k]):.2f}x",
             f"{min(ratios[k]):.2f}x-{max(ratios[k]):.2f}x"] for k in VARIANTS]
    print(md_table(["variant", "ms/step (median of round medians)", "vs plain (median)", "range over rounds"],
                   rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
