"""The recorder and replay on GPT-2 at growing sizes: a ladder of model sizes.

For each size: the step time of a recorded step against a plain one (``full``, ``stats``, ``stats`` at module
granularity), the trace's bytes, the peak host memory the recording adds (+RSS), and the rate at which ``replay``
reads the ``full`` trace (MB of trace per second of wall time, and per second of the replay process's CPU time,
which a busy machine disturbs less), with one and with two workers.

Each size's recording runs in a fresh process (``--child``): imports, the model, two plain steps (the first creates
AdamW's state), then per variant a plain step and a recorded step, with the kernel's peak-RSS mark reset before each
(``/proc/self/clear_refs``), so ``+RSS`` is the recorded step's peak minus the plain step's. The replay runs as the
CLI in a fresh process (``python -m replaydiff replay``), timed with its own resource usage.

Models (``transformers.GPT2LMHeadModel``, random weights, one thread, AdamW, seed 0):

    size 1: n_embd 64,  2 layers, vocab 12288, batch 4 x 64 tokens    (~0.9M parameters)
    size 2: n_embd 256, 4 layers, vocab 8192,  batch 4 x 128 tokens   (~5M)
    size 3: n_embd 512, 6 layers, vocab 8192,  batch 4 x 128 tokens   (~23M)
    size 4: n_embd 768, 12 layers, vocab 16384, batch 4 x 256 tokens  (~98M)

Usage: ``python tests/bench/bench_scale.py [--sizes 1,3] [--workers 1,2] [--dir DIR] [--keep]``. Traces are
written under DIR (default: a temporary directory) and removed unless ``--keep``; size 4 needs ~10 GB of disk.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    1: dict(n_embd=64, n_layer=2, vocab=12288, batch=4, seq=64),
    2: dict(n_embd=256, n_layer=4, vocab=8192, batch=4, seq=128),
    3: dict(n_embd=512, n_layer=6, vocab=8192, batch=4, seq=128),
    4: dict(n_embd=768, n_layer=12, vocab=16384, batch=4, seq=256),
}
VARIANTS = {"full": dict(tensors="full"), "stats": dict(tensors="stats"),
            "module": dict(tensors="stats", granularity="module")}


# -- the child: one size's recordings -----------------------------------------------------------------------------
def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak-RSS mark is set to the RSS of now


def build(size: int):
    import torch
    import transformers

    c = SIZES[size]
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=c["n_embd"], n_layer=c["n_layer"], n_head=max(1, c["n_embd"] // 64),
                                  vocab_size=c["vocab"], n_positions=c["seq"], bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]))

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    return model, step


def child(size: int, out: str, variants: list[str]) -> None:
    import warnings

    import torch

    import replaydiff

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, step = build(size)
    step()
    step()
    res: dict = {"params": sum(p.numel() for p in model.parameters())}
    for name in variants:
        _reset_hwm()
        t0 = time.perf_counter()
        step()
        plain_s = time.perf_counter() - t0
        plain_kib = _hwm_kib()
        path = Path(out) / name
        _reset_hwm()
        t0 = time.perf_counter()
        with replaydiff.record(path, **VARIANTS[name]):
            step()
        rec_s = time.perf_counter() - t0
        res[name] = {"plain_s": plain_s, "recorded_s": rec_s, "added_mib": (_hwm_kib() - plain_kib) / 1024,
                     "bytes": tree_bytes(path)}
    print(json.dumps(res))


# -- the parent -----------------------------------------------------------------------------------------------------
def tree_bytes(path: str | Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def replay_rate(path: Path, workers: int) -> dict:
    """The CLI's replay of ``path``: wall seconds, the CPU seconds of the process and its workers, its peak RSS
    (os.wait4: this child's figures only)."""
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "replaydiff", "replay", str(path), "--workers", str(workers),
                                 "--journal", str(path.parent / "journal")], stdout=out, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    summary = next((line for line in text.splitlines() if line.startswith("replayed ")), text[-300:])
    return {"wall_s": wall, "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "maxrss_mib": ru.ru_maxrss / 1024,
            "rc": proc.returncode, "summary": summary}


def fmt_bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,3", help="comma-separated sizes from 1 to 4")
    ap.add_argument("--workers", default="1,2", help="replay worker counts to time")
    ap.add_argument("--dir", default=None, help="where the traces are written")
    ap.add_argument("--keep", action="store_true", help="keep the traces")
    ap.add_argument("--child", nargs=2, metavar=("SIZE", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], args.variants.split(","))
        return
    workers = [int(w) for w in args.workers.split(",")]
    print(f"- load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; CPUs: {os.cpu_count()}")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        root = Path(tempfile.mkdtemp(prefix=f"bench_scale{size}_", dir=args.dir))
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", str(size), str(root),
                                   "--variants", args.variants], capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"size {size}: the recording failed:\n{proc.stderr[-2000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            replays = {w: replay_rate(root / "full", w) for w in workers} if "full" in r else {}
            full_bytes = r.get("full", {}).get("bytes", 0)
            row = [str(size), f"{r['params'] / 1e6:.1f}M"]
            for name in ("full", "stats"):
                v = r.get(name)
                row.append("-" if v is None else f"{v['recorded_s'] / v['plain_s']:.1f}x / {fmt_bytes(v['bytes'])} / "
                                                 f"{v['added_mib']:+.0f} MB")
            m = r.get("module")
            row.append("-" if m is None else f"{m['recorded_s'] / m['plain_s']:.2f}x")
            for w in workers:
                rp = replays.get(w)
                if rp is None or rp["rc"] not in (0, 1):
                    row.append("failed" if rp else "-")
                    continue
                # With workers the replaying processes are the forkserver's children, not the CLI's: their CPU
                # time and memory are not in the CLI's figures, so only the wall time says anything.
                cpu = "" if w > 1 else (f", {full_bytes / 1e6 / (rp['user_s'] + rp['sys_s']):.0f} MB/s CPU; sys "
                                        f"{rp['sys_s']:.1f} s, peak RSS {rp['maxrss_mib']:.0f} MiB")
                row.append(f"{full_bytes / 1e6 / rp['wall_s']:.0f} MB/s ({rp['wall_s']:.1f} s{cpu})")
                print(f"  size {size}, {w} worker(s): {rp['summary']}", file=sys.stderr)
            rows.append(row)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    headers = ["size", "params", "full: ratio / trace / +RSS", "stats: ratio / trace / +RSS", "module granularity"]
    headers += [f"replay of full, {w} worker(s)" for w in workers]
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
