"""Write a trace of at least 100,000 ops for the TUI benchmark: many training steps of the tiny transformer recorded
in one session (not committed: run it, then bench_tui.py; the benchmark colours rows from a synthetic report, since a
"stats" trace keeps no tensor data to replay).

    python tests/bench/make_big_trace.py /tmp/big-trace            # ~100k ops, tensors="stats"
    python tests/bench/make_big_trace.py /tmp/big-trace --ops 20000 --tensors meta
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import replaydiff
from replaydiff.models import TinyTransformer, make_step


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="trace directory to write (replaced if it exists)")
    p.add_argument("--ops", type=int, default=100_000, help="about how many ops (default 100000)")
    p.add_argument("--tensors", default="stats", choices=("full", "stats", "meta"),
                   help="what to keep of each tensor (default stats: small on disk, statistics in the detail pane)")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = make_step(model, model.example_batch(), opt)
    step()  # the first step also creates the optimizer's state: count a later one
    with _Count() as count:  # one unrecorded step: how many ops a step dispatches
        step()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    steps = max(1, math.ceil(args.ops / count.n))
    t0 = time.perf_counter()
    with replaydiff.record(out, tensors=args.tensors):
        for _ in range(steps):
            step()
    took = time.perf_counter() - t0
    n = len(replaydiff.open_trace(out).rank(0))
    print(f"recorded {steps} steps, {n} ops into {out} ({args.tensors}) in {took:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
