"""Benchmark: diff two traces of the tiny training step (the brief's reference step: 2 layers, d_model 64, seq 32,
batch 8, AdamW; ~724 ops per trace).

    python tests/bench/bench_diff.py [--repeat 5]

Records, into a temporary directory: two clean full traces, one with a planted LayerNorm-backward fault, one with
bf16 autocast, and two ``stats`` traces (clean and faulted). Times ``diff_traces`` in this process (median of
``--repeat``; each run opens the traces afresh, the OS page cache is warm) and the whole CLI (``python -m replaydiff
diff``, a fresh process: torch import included). Goal (the diff issue): the diff of two tiny-step traces under 1 s
(msprobe's compare took 11 s on a similar pair). Also times the alignment alone on longer op streams, made by
repeating the step's keys (with and without distinct layer names), to show how it scales.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from replaydiff.diff import align, diff_traces, op_keys
from replaydiff.diff.align import OpKeys
from replaydiff.faults import PlantedFault
from replaydiff.models import TinyTransformer, make_step
from replaydiff.record import record
from replaydiff.trace import open_trace


def _record(path: Path, fault: PlantedFault | None = None, autocast: torch.dtype | None = None,
            tensors: str = "full") -> Path:
    torch.manual_seed(0)
    model = TinyTransformer()
    step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3),
                     autocast_dtype=autocast)
    if fault is not None:
        with fault, record(path, tensors=tensors):
            step()
    else:
        with record(path, tensors=tensors):
            step()
    return path


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="replaydiff-bench-diff-"))
    ln = "aten.native_layer_norm_backward.default"
    a, b = _record(d / "a"), _record(d / "b")
    fault = _record(d / "fault", PlantedFault(ln))
    bf16 = _record(d / "bf16", autocast=torch.bfloat16)
    sa, sb = _record(d / "sa", tensors="stats"), _record(d / "sb", PlantedFault(ln), tensors="stats")
    n = len(open_trace(a).rank(0))
    print(f"tiny step: {n} ops per trace; torch threads {torch.get_num_threads()}")
    for label, x, y in (("clean vs clean (full)", a, b), ("clean vs planted fault (full)", a, fault),
                        ("fp32 vs bf16 autocast (full)", a, bf16), ("clean vs planted fault (stats)", sa, sb)):
        report = diff_traces(x, y)
        t = _median(lambda: diff_traces(x, y), args.repeat)
        c = report.counts()
        print(f"  diff_traces {label:<32} {t:6.3f} s  ({c['same']} same, {c['divergent']} divergent, "
              f"{c['inherited']} inherited, {c['ref_only']}+{c['target_only']} unaligned)")
    t = _median(lambda: diff_traces(a, fault, baseline=b), args.repeat)
    print(f"  diff_traces {'with --baseline (3 traces)':<32} {t:6.3f} s")
    for x, y in ((a, fault),):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "replaydiff", "diff", str(x), str(y)], stdout=subprocess.DEVNULL,
                       check=False)
        t1 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import replaydiff.cli.main"], check=True)
        t2 = time.perf_counter()
        print(f"  CLI `replaydiff diff` clean vs fault, fresh process: {t1 - t0:.2f} s "
              f"(of which starting Python and importing torch: {t2 - t1:.2f} s)")

    keys = [op_keys(op) for op in open_trace(a).rank(0)]
    keys_b = [op_keys(op) for op in open_trace(bf16).rank(0)]
    for reps in (10, 40):
        for distinct in (True, False):
            def grow(ks: list[OpKeys]) -> list[OpKeys]:
                out = []
                for r in range(reps):
                    tag = r if distinct else 0
                    out += [OpKeys(len(out) + k, (*key.strict, tag), (*key.loose, tag)) for k, key in enumerate(ks)]
                return out
            ga, gb = grow(keys), grow(keys_b)
            t = _median(lambda: align(ga, gb), 1)
            print(f"  align {len(ga)} vs {len(gb)} ops (fp32 vs bf16 keys, "
                  f"{'each repeat distinct' if distinct else 'repeats identical'}): {t:.2f} s")


if __name__ == "__main__":
    main()
