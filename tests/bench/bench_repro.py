"""Benchmark of the culprit-to-fix tools: replay speed against decompositions, and what a repro and a report cost.

Why: ``--reference decomp`` runs most aten ops through Python decompositions instead of one kernel call, and the
health report may re-run the culprit; these are the figures that say what that costs on the tiny transformer step.

Prints: replay_trace ops/s of the tiny transformer's trace at fp64 with the ops' own kernels and with
``--reference decomp`` (median of N runs each, after one warm-up run that also pays torch._decomp's import); the time
to write a repro of the step's largest-input matmul and its bytes; and the time of build_health (with and without the
thread-count probe) on a trace with a planted fault.

Usage: ``python tests/bench/bench_repro.py [--repeats N]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import replaydiff  # noqa: E402
from replaydiff.models import TinyTransformer, make_step  # noqa: E402
from replaydiff.replay import ReplayOptions, replay_trace  # noqa: E402
from replaydiff.health import build_health  # noqa: E402
from replaydiff.repro.write import write_repro  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="replaydiff-bench-repro-"))
    torch.manual_seed(0)
    model = TinyTransformer()
    step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    with replaydiff.record(tmp / "t", plant="aten.native_layer_norm_backward.default:1:1e-3"):
        step()
    path = str(tmp / "t")
    n = None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, tiny transformer step")
    print("| what | figure |\n|---|---|")
    for ref in ("kernel", "decomp"):
        last = {}

        def run(ref=ref):
            last["r"] = replay_trace(path, ReplayOptions(reference=ref))

        t = _median_time(run, a.repeats)
        n = len(last["r"].ops)
        print(f"| replay fp64, reference {ref} | {n / t:,.0f} ops/s ({n} ops, {t:.2f} s) |")
    rt = replaydiff.open_trace(path).rank(0)
    mm = max((op for op in rt if op.name in ("aten.mm.default", "aten.addmm.default")),
             key=lambda op: sum(r.nbytes for r in op.inputs()))
    written = []
    t = _median_time(lambda: written.append(write_repro(rt, mm, tmp / "repro")), a.repeats)
    print(f"| write a repro of #{mm.index} {mm.name} | {t * 1e3:.1f} ms, {written[-1].nbytes:,} bytes of tensor "
          f"data |")
    report = replay_trace(path, ReplayOptions())
    trace = replaydiff.open_trace(path)
    for probe in (False, True):
        t = _median_time(lambda: build_health(trace, report, probe=probe), a.repeats)
        print(f"| build_health, probe={probe} | {t * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
