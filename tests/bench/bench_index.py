"""Benchmark: open the index of a 100,000-op trace and read 1,000 random rows, in a fresh process.

    python tests/bench/bench_index.py [--ops 100000] [--trace DIR] [--keep]

The trace is generated (steps of the built-in tiny transformer recorded in ``meta`` mode into one trace until it
holds ``--ops`` ops), never committed. Each timing runs in a new Python process so nothing is cached in memory:
import (torch included), open the trace, load the index, read 1,000 random rows (name, phase, module, output, and
the producers and consumers of each), and, for comparison, the same rows decoded from the op chunks instead.
Goal (the read-API issue): index open + 1,000 rows under 0.3 s.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import json, random, sys, time
t0 = time.perf_counter()
import replaydiff
t1 = time.perf_counter()
r = replaydiff.open_trace(sys.argv[1]).rank(0)
n = len(r)
t2 = time.perf_counter()
idx = r.index
t3 = time.perf_counter()
rows = random.Random(0).sample(range(n), 1000)
for i in rows:
    (idx.name[i], idx.phase[i], idx.module[i], idx.output[i], idx.producers(i))
t4 = time.perf_counter()
for i in rows:
    idx.consumers(i)
t5 = time.perf_counter()
if sys.argv[2] == "chunks":
    for i in rows:
        op = r[i]
        (op.name, op.phase, op.module, op.inputs())
t6 = time.perf_counter()
print(json.dumps({"ops": n, "import": t1 - t0, "open": t2 - t1, "index": t3 - t2, "rows": t4 - t3,
                  "consumers_first": t5 - t4, "chunks": t6 - t5}))
"""


def make_trace(path: Path, ops: int) -> float:
    import torch

    import replaydiff
    from replaydiff.models.tiny import TinyTransformer, make_step

    torch.manual_seed(0)
    model = TinyTransformer()
    step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    t0 = time.perf_counter()
    with replaydiff.record(path, tensors="meta", source_lines=False) as rec:
        while rec.next_index < ops:
            step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--trace", help="use (or create) this trace directory")
    ap.add_argument("--keep", action="store_true", help="keep the generated trace")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tmp = None
    path = Path(args.trace) if args.trace else Path(tempfile.mkdtemp(prefix="rd-bigtrace-")) / "trace"
    if not args.trace:
        tmp = path.parent
    try:
        if not (path / "rank0").exists():
            secs = make_trace(path, args.ops)
            print(f"generated {path} in {secs:.1f} s")
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        index_size = (path / "rank0" / "index.rdt").stat().st_size
        runs = []
        for k in range(args.runs):
            out = subprocess.run([sys.executable, "-c", _CHILD, str(path), "chunks" if k == 0 else "no"],
                                 capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out))
        best = min(runs, key=lambda d: d["open"] + d["index"] + d["rows"])
        print(f"\ntrace: {best['ops']:,} ops, {size / 1e6:.1f} MB on disk, index.rdt {index_size / 1e3:.0f} kB "
              f"(fresh process per run, file cache warm, best of {args.runs})\n")
        print("| step | seconds |\n|---|---|")
        print(f"| import replaydiff (torch included) | {best['import']:.3f} |")
        print(f"| open_trace + rank(0) + len() | {best['open']:.3f} |")
        print(f"| load the index | {best['index']:.3f} |")
        print(f"| 1,000 random rows: name, phase, module, output, producers | {best['rows']:.3f} |")
        print(f"| **index open + 1,000 rows (goal < 0.3 s)** | **{best['open'] + best['index'] + best['rows']:.3f}** |")
        print(f"| 1,000 random rows: consumers | {best['consumers_first']:.3f} |")
        print(f"| the same 1,000 rows decoded from op chunks instead (first run) | {runs[0]['chunks']:.3f} |")
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
