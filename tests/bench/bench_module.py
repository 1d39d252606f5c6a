"""Where ``granularity="module"`` spends its time on a real model's step: the parts, each timed on its own.

Why: ``bench_real_models.py`` times the whole ``with`` block (a trace opened and closed around one step); the goal of
``--granularity module`` (<= 1.1x the plain step) leaves ~1.5 ms of a T5 step for everything, so each part is
measured separately here, in interleaved rounds (each round runs every variant once, from a rotating start; each
variant owns its model built from the same seed), as the recording thread's CPU time (the figure that holds on a
shared machine), medians:

- ``plain``: the step.
- ``hooks``: torch's global forward pre and post hooks installed, doing nothing (what any module hook costs).
- ``hooks+grad``: the same, and a tensor hook doing nothing on each module output that needs a gradient (the floor
  of module granularity: the hooks it needs, with no work in them).
- ``open/close``: an empty ``record(granularity="module")`` block: the trace directory, its manifests and index, the
  writer thread.
- ``meta`` and ``stats``: the step recorded, the recording started before the clock and stopped after it (the hooks'
  work, the records, their statistics), with the garbage collector's collections a recorded step.

With ``--long N``: N steps of the model in one ``stats`` recording of every step (``steps="1-N"``, one trace) and then
N plain steps: the collections of each generation a step and the CPU time they took (``gc.callbacks``); a full
collection of the job's heap is rare, long and only seen over many steps.

Usage: ``python tests/bench/bench_module.py [--model t5] [--rounds 20] [--long 200]``; ``REPLAYDIFF_SRC=DIR`` runs the
replaydiff of another tree (an A/B from ``git archive``, in alternating processes).
"""
from __future__ import annotations

import os
import sys

if os.environ.get("REPLAYDIFF_SRC"):
    sys.path.insert(0, os.environ["REPLAYDIFF_SRC"])

import argparse  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.nn.modules import module as nn_module  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replaydiff  # noqa: E402
from bench import md_table  # noqa: E402
from bench_real_models import build, load_note  # noqa: E402

VARIANTS = ("plain", "hooks", "hooks+grad", "open/close", "meta", "stats")


def _nothing(*args: object) -> None:
    return None


def _grad_hook_on_output(module: torch.nn.Module, inputs: object, output: object) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad and output.grad_fn is not None:
        output.register_hook(_nothing)


class Collections:
    """The garbage collector's collections by generation while counting, and their thread CPU seconds."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.on = False
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.thread_time() - self._t0


def long_run(model: str, n: int) -> None:
    """Collections a step over ``n`` steps recorded in one trace, then over ``n`` plain steps."""
    step = build(model)
    step()
    out = tempfile.mkdtemp(prefix="rdmodule-long-")
    rows = []
    try:
        for label in ("stats, every step in one trace", "plain"):
            counter = Collections()
            gc.collect()
            counter.on = True
            if label == "plain":
                for _ in range(n):
                    step()
            else:
                with replaydiff.record(f"{out}/t", tensors="stats", granularity="module", steps=f"1-{n}"):
                    for _ in range(n):
                        step()
            counter.on = False
            gc.callbacks.remove(counter._cb)
            rows.append([label] + [f"{c / n:.3f} ({1e3 * t / n:.2f} ms)"
                                   for c, t in zip(counter.count, counter.seconds)])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"\n## Collections a step over {n} steps of {model} (thread CPU a step in brackets; {load_note()})\n")
    print(md_table(["steps", "generation 0", "generation 1", "generation 2 (full)"], rows))


def timed(key: str, step, trace_dir: str, counter: Collections) -> float:
    """The recording thread's CPU seconds of one sample of ``key``."""
    gc.collect()
    handles = []
    rec = None
    if key in ("hooks", "hooks+grad"):
        handles = [nn_module.register_module_forward_pre_hook(_nothing),
                   nn_module.register_module_forward_hook(_grad_hook_on_output if key == "hooks+grad" else _nothing)]
    elif key in ("meta", "stats"):
        rec = replaydiff.record(trace_dir, tensors=key, granularity="module").start()
    try:
        if key == "open/close":
            c0 = time.thread_time()
            with replaydiff.record(trace_dir, tensors="stats", granularity="module"):
                pass
            return time.thread_time() - c0
        counter.on = rec is not None
        c0 = time.thread_time()
        step()
        c = time.thread_time() - c0
        counter.on = False
        return c
    finally:
        for h in handles:
            h.remove()
        if rec is not None:
            rec.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="t5")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--long", type=int, default=0, help="also the collections over this many steps in one trace")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    steps = {k: build(args.model) for k in VARIANTS}
    out = tempfile.mkdtemp(prefix="rdmodule-")
    counter = Collections()
    try:
        n = 0
        for k in VARIANTS:  # warm-up: optimizer state, first-call caches, the recorder's imports
            steps[k]()
            timed(k, steps[k], f"{out}/{n}", counter)
            n += 1
        counter.count = [0, 0, 0]
        before = load_note()
        samples: dict[str, list[float]] = {k: [] for k in VARIANTS}
        for r in range(args.rounds):
            for k in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
                samples[k].append(timed(k, steps[k], f"{out}/{n}", counter))
                n += 1
    finally:
        shutil.rmtree(out, ignore_errors=True)
    plain = statistics.median(samples["plain"])
    rows = []
    for k in VARIANTS:
        m = statistics.median(samples[k])
        over = m if k == "open/close" else m - plain
        rows.append([k, f"{1e3 * m:.2f}", f"{1e3 * over:+.2f}", f"{over / plain:+.3f}x"])
    print(f"# granularity=\"module\" on {args.model} ({torch.__version__}, 1 thread, {args.rounds} rounds; replaydiff "
          f"from {os.path.dirname(replaydiff.__file__)}); {before} before, {load_note()} after\n")
    print(md_table(["variant", "thread CPU ms (median)", "ms over plain", "of the plain step"], rows))
    per = [round(c / (2 * args.rounds), 2) for c in counter.count]
    print(f"\ncollections of the garbage collector a recorded step (meta and stats), generations 0/1/2: {per}")
    if args.long:
        long_run(args.model, args.long)
    return 0


if __name__ == "__main__":
    sys.exit(main())
