"""Peak host memory that recording adds to a step that makes and frees many large temporaries.

Why: glibc serves blocks of a few MB from the heap once one such block has been freed (its mmap threshold follows
the largest freed block), so a job that makes and frees many temporaries reuses the same holes in its heap. Anything
the recorder leaves in such a hole (a small object that outlives the tensor, a copy waiting for the writer) makes
the next tensor go to the top of the heap instead, and the heap grows by one tensor per op. This script measures
the peak RSS a recording adds, per mode and per number of temporaries, so that growth shows up as a column that
rises with the count.

Each measurement runs in a fresh process (started through /bin/sh: ru_maxrss survives exec, so a child forked from
this process would start at this process's RSS): imports, one plain warm-up step of the same shape, then the
measured step, plain or recorded into a temporary directory. "added" is the peak RSS (VmHWM; ru_maxrss as a
check) after the measured step minus the peak after the warm-up step, so the job's own peak is not counted.

Steps: ``chain``: x = randn(size); then x = x * 1.0001, n times (each op makes one temporary and frees the last);
``mixed``: random temporaries of 1 to 8 MB in turn (the mean is about ``--mb``), each also summed into a small
running total.

Recording imports nothing into the job: torch wraps every dispatch mode's ``__torch_dispatch__`` in a wrapper whose
first call imports ``torch._dynamo`` (about 70 MiB), and the recorder's mode marks its code for dynamo instead
(``record/mode.py``). ``--preimport`` imports it before the warm-up step, as a job that uses ``torch.compile`` or
steps a ``torch.optim`` optimizer has.

Peak RSS does not depend on how loaded the machine is (timings do; none are printed here).

Usage: ``python tests/bench/bench_memory.py [--counts 30,300] [--modes plain,meta,stats,full,full-raw]
[--pattern chain|mixed] [--mb 4] [--queue-mib 256] [--preimport] [--jobs 2]``.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

MODES = ("plain", "meta", "stats", "full", "full-raw")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def make_step(pattern: str, count: int, mb: float):
    import torch

    numel = int(mb * (1 << 20)) // 4

    def chain() -> float:
        x = torch.randn(numel)
        for _ in range(count):
            x = x * 1.0001
        return float(x[0])

    def mixed() -> float:
        total = torch.zeros(())
        for i in range(count):
            x = torch.rand(numel * (1 + i % 8) // 4)
            total = total + x.sum()
        return float(total)

    return {"chain": chain, "mixed": mixed}[pattern]


def child(mode: str, pattern: str, count: int, mb: float, queue_mib: float, preimport: bool) -> None:
    """One measurement, in a fresh process: prints one JSON line."""
    import torch

    import replaydiff

    if preimport:
        import torch._dynamo  # noqa: F401
    torch.set_num_threads(1)
    step = make_step(pattern, count, mb)
    step()
    warm_hwm, warm_max = _status_kib("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = tempfile.mkdtemp(prefix="bench_memory_")
    trace_bytes = 0
    try:
        if mode == "plain":
            step()
        else:
            tensors = "full" if mode.startswith("full") else mode
            extra = {"queue_bytes": int(queue_mib * (1 << 20))} if queue_mib else {}
            with replaydiff.record(os.path.join(out, "trace"), tensors=tensors, compress=mode != "full-raw", **extra):
                step()
            trace_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
        hwm, maxrss = _status_kib("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"added_mib": (hwm - warm_hwm) / 1024, "added_maxrss_mib": (maxrss - warm_max) / 1024,
                      "base_mib": warm_hwm / 1024, "trace_mb": trace_bytes / 1e6}))


def measure(mode: str, pattern: str = "chain", count: int = 300, mb: float = 4.0, queue_mib: float = 0.0,
            preimport: bool = False, env: dict | None = None) -> dict:
    """Run ``child`` in a fresh process (through /bin/sh, so that ru_maxrss starts small) and return its JSON."""
    cmd = ["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, os.path.abspath(__file__), "--_child", mode,
           pattern, str(count), str(mb), str(queue_mib), str(int(preimport))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{mode} x{count}: child failed (rc {proc.returncode}): {tail}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="30,100,300", help="numbers of temporaries, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--pattern", default="chain", choices=("chain", "mixed"))
    ap.add_argument("--mb", type=float, default=4.0, help="MB per temporary (mixed: the mean is about this)")
    ap.add_argument("--queue-mib", type=float, default=0.0, help="record option queue_bytes, in MiB (0: default)")
    ap.add_argument("--preimport", action="store_true", help="import torch._dynamo before the warm-up step")
    ap.add_argument("--jobs", type=int, default=2, help="measurements at a time (peak RSS is per process)")
    ap.add_argument("--_child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        mode, pattern, count, mb, queue_mib, preimport = args._child
        child(mode, pattern, int(count), float(mb), float(queue_mib), preimport == "1")
        return
    counts = [int(c) for c in args.counts.split(",")]
    modes = args.modes.split(",")
    started = time.time()
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {(m, c): pool.submit(measure, m, args.pattern, c, args.mb, args.queue_mib, args.preimport)
                   for m in modes for c in counts}
        results = {k: f.result() for k, f in futures.items()}
    print(f"Peak RSS added by one step (MiB; VmHWM after the step minus after a plain warm-up step), pattern "
          f"{args.pattern}, {args.mb:g} MB temporaries, queue_bytes {f'{args.queue_mib:g} MiB' if args.queue_mib else 'default'}, torch._dynamo "
          f"{'imported before' if args.preimport else 'not imported'}, one fresh process per cell "
          f"({time.time() - started:.0f} s)\n")
    print("| mode | " + " | ".join(f"{c} temporaries" for c in counts) + " | trace MB (largest count) |")
    print("|---|" + "---|" * len(counts) + "---|")
    for m in modes:
        cells = [f"{results[m, c]['added_mib']:+.0f}" for c in counts]
        print(f"| {m} | " + " | ".join(cells) + f" | {results[m, counts[-1]]['trace_mb']:.2f} |")
    base = results[modes[0], counts[0]]["base_mib"]
    print(f"\nRSS peak of the job itself (after its warm-up step): {base:.0f} MiB. ru_maxrss agrees with VmHWM within "
          f"{max(abs(r['added_mib'] - r['added_maxrss_mib']) for r in results.values()):.0f} MiB.")


if __name__ == "__main__":
    main()
