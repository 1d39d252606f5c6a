"""Write throughput of a ``full`` recording: MB of tensor data per second, raw against zstd.

Why: once a step stores more than the writer can keep up with, the writer sets the pace of the job (the staging
memory is bounded, so a copy waits for room), and compressing every blob made that pace about half of raw writing
while saving 8-15% of the bytes of float data. This script records one step that stores ``--count`` temporaries of
``--mb`` MB (a mix of dense floats and ReLU outputs, half zeros) and reports, per variant, the wall time of the
whole ``with`` block (the step, and the exit that waits for the writer), the MB of tensor data stored per second of
it, the trace's size, and the seconds of the plain step for scale.

Variants: ``raw`` (``compress=False``); ``zstd`` (``compress=True``, the default: zstd level 1 while the writer keeps
up, raw for blobs written while the job waits for room or the recording ends); ``zstd always`` (``compress=1``: every
blob at level 1, the former default). Rounds alternate between variants (the order rotates: each
variant follows a different one in each round, as dirty pages of the last trace may still be written back); the
median is reported.

Timings depend on the machine's load (printed); sizes do not.

Usage: ``python tests/bench/bench_write.py [--count 200] [--mb 4] [--rounds 3] [--dir DIR]``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import replaydiff
from replaydiff.trace.format import DATA_DIR, rank_dir_name

VARIANTS = {"raw": False, "zstd (default)": True, "zstd always (level 1)": 1}


def make_step(count: int, mb: float):
    numel = int(mb * (1 << 20)) // 4

    def step() -> float:
        torch.manual_seed(0)
        x = torch.randn(numel)
        total = torch.zeros(())
        for _ in range(count // 2):
            x = x * 1.0001  # stores x (dense floats)
            total = total + torch.relu(x).sum()  # stores the ReLU output (half zeros), as in activations
        return float(total)

    return step


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200, help="temporaries stored by the step")
    ap.add_argument("--mb", type=float, default=4.0, help="MB per temporary")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where traces are written (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    step = make_step(args.count, args.mb)
    step()
    plain = []
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    sizes: dict[str, int] = {}
    raw_blobs: dict[str, list[int | None]] = {v: [] for v in VARIANTS}
    data_bytes = 0
    load = os.getloadavg()
    root = tempfile.mkdtemp(prefix="bench_write_", dir=args.dir)
    try:
        for r in range(args.rounds):
            t0 = time.perf_counter()
            step()
            plain.append(time.perf_counter() - t0)
            names = list(VARIANTS)
            for name in names[r % len(names):] + names[:r % len(names)]:  # each variant first in some round
                compress = VARIANTS[name]
                path = os.path.join(root, f"r{r}")
                t0 = time.perf_counter()
                with replaydiff.record(path, tensors="full", compress=compress) as rec:
                    step()
                times[name].append(time.perf_counter() - t0)
                choice = rec.writer.codec_choice
                raw_blobs[name].append(choice.raw_blobs if choice is not None else None)
                sizes[name] = tree_bytes(path)
                if compress is False:  # the tensor data stored: what the raw trace's data files hold
                    data_bytes = tree_bytes(os.path.join(path, rank_dir_name(0), DATA_DIR))
                shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"One step storing {args.count} temporaries of {args.mb:g} MB ({data_bytes / 1e6:.0f} MB of tensor data), "
          f"{args.rounds} rounds, median; plain step {statistics.median(plain):.2f} s; torch threads 1; "
          f"CPUs {os.cpu_count()}; load average at start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n")
    print("| variant | record s (with block; median, min-max) | MB/s of tensor data (median) | trace MB | vs raw bytes | blobs the default "
          "stored raw (per round) |")
    print("|---|---|---|---|---|---|")
    for name in VARIANTS:
        t = statistics.median(times[name])
        raw = "-" if raw_blobs[name][0] is None else ", ".join(map(str, raw_blobs[name]))
        print(f"| {name} | {t:.2f} ({min(times[name]):.2f}-{max(times[name]):.2f}) | {data_bytes / t / 1e6:.0f} | {sizes[name] / 1e6:.0f} | "
              f"{sizes[name] / sizes['raw']:.3f} | {raw} |")


if __name__ == "__main__":
    main()
