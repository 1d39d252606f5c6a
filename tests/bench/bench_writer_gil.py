"""Where the time of a recorded step goes with the writer thread working during the step, and with it held back
until the recording ends (on two cores the writer competes with training for the GIL and a core).

For each variant, one step per sample inside its own ``with replaydiff.record(...)`` block, variants and the two
writer settings interleaved, medians of ``--rounds``:

- writer on: the defaults (a chunk of ops or data goes to the writer thread every 256 ops, 64 MiB or 0.5 s);
- writer held: ``chunk_ops``, ``chunk_bytes`` and ``flush_seconds`` so large, and ``queue_bytes`` so large (2 GiB),
  that nothing is handed over before the block ends: the step runs without a second Python thread, and all encoding,
  compression and writing happens in the exit.

Columns: the step's body (wall), the exit (wall: flush, the writer's remaining work, index and manifest), the
recording thread's CPU time over the body (``time.thread_time``), and the writer thread's CPU time over the body
(its ``pthread_getcpuclockid`` clock, read just before the exit).

Usage: ``python tests/bench/bench_writer_gil.py [--models tiny,mid] [--rounds 5] [--threads N]``.
"""
from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replaydiff  # noqa: E402
from bench import MODELS, build_step, md_table  # noqa: E402

VARIANTS = {"meta": dict(tensors="meta"), "stats": dict(tensors="stats"),
            "full (raw)": dict(tensors="full", compress=False), "full + zstd": dict(tensors="full", compress=True)}
HELD = dict(chunk_ops=1 << 30, chunk_bytes=1 << 40, flush_seconds=1e9, queue_bytes=2 << 30)


def writer_cpu() -> float:
    for th in threading.enumerate():
        if th.name == "replaydiff-writer" and th.ident is not None:
            try:
                return time.clock_gettime(time.pthread_getcpuclockid(th.ident))
            except Exception:
                return float("nan")
    return float("nan")


def sample(step, options: dict) -> tuple[float, float, float, float]:
    out = tempfile.mkdtemp(prefix="rdgil-")
    gc.collect()
    try:
        t0, c0 = time.perf_counter(), time.thread_time()
        rec = replaydiff.record(out, **options)
        with rec:
            w0 = writer_cpu()
            step()
            t1, c1 = time.perf_counter(), time.thread_time()
            w1 = writer_cpu()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, c1 - c0, w1 - w0
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,mid")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for model in args.models.split(","):
        keys = [(v, held) for v in VARIANTS for held in (False, True)]
        steps = {k: build_step(MODELS[model]) for k in keys}
        plain = build_step(MODELS[model])
        for k in keys:
            steps[k]()
            sample(steps[k], dict(VARIANTS[k[0]], **(HELD if k[1] else {})))
        plain()
        res: dict = {k: [] for k in keys}
        plain_s: list[float] = []
        for r in range(args.rounds):
            t = time.perf_counter()
            plain()
            plain_s.append(time.perf_counter() - t)
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                res[k].append(sample(steps[k], dict(VARIANTS[k[0]], **(HELD if k[1] else {}))))
        pm = statistics.median(plain_s)
        rows = []
        for (v, held), xs in res.items():
            med = [statistics.median(x[i] for x in xs) for i in range(4)]
            rows.append([v, "held to the exit" if held else "on (default)", f"{med[0] * 1e3:.1f}",
                         f"{med[1] * 1e3:.1f}", f"{(med[0] + med[1]) / pm:.2f}x", f"{med[2] * 1e3:.1f}",
                         f"{med[3] * 1e3:.1f}"])
        print(f"\n### {model}: plain step {pm * 1e3:.1f} ms (median of {args.rounds})\n")
        print(md_table(["variant", "writer", "body ms", "exit ms", "body+exit vs plain", "recording thread CPU ms",
                        "writer thread CPU ms (body)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
