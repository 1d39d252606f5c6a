"""What the cyclic garbage collector costs a recorded job: steps recorded one after another, as a job runs them (no
``gc.collect()`` in between, unlike bench_real_models.py, which collects before every timed step and so never lets
the oldest generation fill), with the collector's time in the recording thread per generation.

Why: an op record lives until the writer thread has packed its chunk, long enough to reach the collector's oldest
generation, and each time that generation has grown by a quarter the collector walks the whole heap (torch, the
model: ~320,000 objects for the selective scan, 0.2-0.5 s a walk). Recording the scan's ~6,700 ops a step brought
one on every 3-5 steps; records now leave the collector's lists as they go to the writer (native/hotpath.c).

Usage: ``python tests/bench/bench_gc.py [MODEL] [meta|stats|full|plain] [STEPS]`` (MODEL as bench_real_models.py's:
scan, unet, vit, t5, ...). ``REPLAYDIFF_SRC=DIR`` runs the replaydiff of another tree (from ``git archive``).
"""
from __future__ import annotations

import os
import sys

if os.environ.get("REPLAYDIFF_SRC"):
    sys.path.insert(0, os.environ["REPLAYDIFF_SRC"])

import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replaydiff  # noqa: E402
from bench_real_models import build  # noqa: E402


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "scan"
    mode = sys.argv[2] if len(sys.argv) > 2 else "meta"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    torch.set_num_threads(1)
    torch.manual_seed(0)
    step = build(model)
    step()
    step()
    me = threading.get_ident()
    spent: dict[int, list] = {}  # generation -> [thread CPU seconds, collections]
    began: list[float] = [0.0]

    def watch(phase: str, info: dict) -> None:
        if threading.get_ident() != me:  # the writer thread's own collections are not this thread's time
            return
        if phase == "start":
            began[0] = time.thread_time()
        else:
            s = spent.setdefault(info["generation"], [0.0, 0])
            s[0] += time.thread_time() - began[0]
            s[1] += 1

    out = tempfile.mkdtemp(prefix="rdgc-")
    gc.callbacks.append(watch)
    total = 0.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(steps):
                t0 = time.thread_time()
                if mode == "plain":
                    step()
                else:
                    with replaydiff.record(os.path.join(out, str(i)), tensors=mode, compress=False):
                        step()
                total += time.thread_time() - t0
                shutil.rmtree(os.path.join(out, str(i)), ignore_errors=True)
    finally:
        gc.callbacks.remove(watch)
        shutil.rmtree(out, ignore_errors=True)
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    parts = ", ".join(f"gen{g} {1e3 * s / steps:.1f} ms ({n / steps:.2f} a step)" for g, (s, n) in sorted(spent.items()))
    print(f"{model} {mode}: {1e3 * total / steps:.1f} ms a step (recording thread CPU, mean of {steps} steps in a "
          f"row); collector in this thread: {parts or 'none'}; load {load}; replaydiff from "
          f"{os.path.dirname(replaydiff.__file__)}")


if __name__ == "__main__":
    main()
