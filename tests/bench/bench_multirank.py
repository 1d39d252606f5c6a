"""Benchmark: what recording costs each rank of a multi-process job (2 CPU ranks, gloo).

    python tests/bench/bench_multirank.py [--nproc 2] [--steps 5]

Starts a torchrun job of ``--nproc`` ranks. Each rank times, as medians over rounds interleaved plain/recorded:
one FSDP2 training step (fully_shard per layer and at the root of a 4-layer MLP, width 256, AdamW), one DDP step of
the same model, and a small all-reduce (16 floats: the per-collective bookkeeping, including the entered-collective
marker, without data cost), each plain and under ``replaydiff.record``; and the bytes one recorded FSDP2 step leaves
in the rank's directory. Recorded times are of the block's body (leaving the block flushes the trace and writes its
index; that is not counted). Rank 0 prints one table per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

_CHILD = textwrap.dedent(r'''
    import json, os, statistics, sys, tempfile, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import replaydiff

    dist.init_process_group("gloo")
    rank, steps, out = dist.get_rank(), int(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)

    def mlp():
        torch.manual_seed(0)
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
        return torch.nn.Sequential(*layers)

    fsdp = mlp()
    for layer in fsdp:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(fsdp)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(mlp())
    ddp_opt = torch.optim.AdamW(ddp.parameters())
    x = torch.randn(32, 256)

    def fsdp_step():
        fsdp(x).pow(2).mean().backward(); fsdp_opt.step(); fsdp_opt.zero_grad()

    def ddp_step():
        ddp(x).pow(2).mean().backward(); ddp_opt.step(); ddp_opt.zero_grad()

    small = torch.ones(16)
    def allreduces():
        for _ in range(50):
            dist.all_reduce(small)

    tmp = Path(tempfile.mkdtemp(prefix=f"rd-bench-mr{rank}-"))
    n = 0
    def timed(fn, recorded):
        """Seconds ``fn`` takes on this rank (recorded: inside the record block; its exit, which flushes and
        writes the index, is not counted)."""
        global n
        n += recorded
        rec = replaydiff.record(tmp / f"t{n}") if recorded else None
        if rec is not None:
            rec.__enter__()
        dist.barrier()
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        if rec is not None:
            rec.__exit__(None, None, None)
        dist.barrier()
        return dt

    rows = {}
    for name, fn, per in (("FSDP2 step", fsdp_step, 1), ("DDP step", ddp_step, 1), ("all_reduce of 16 floats", allreduces, 50)):
        fn(); timed(fn, True)  # warm-up, both ways
        plain, rec = [], []
        for _ in range(steps):
            plain.append(timed(fn, False) / per)
            rec.append(timed(fn, True) / per)
        rows[name] = (statistics.median(plain), statistics.median(rec))
    first_fsdp = tmp / "t1" / f"rank{rank}"
    size = sum(p.stat().st_size for p in first_fsdp.rglob("*") if p.is_file())
    ops = len(replaydiff.open_trace(tmp / "t1").rank(rank))
    (out / f"rank{rank}.json").write_text(json.dumps({"rows": rows, "bytes": size, "ops": ops}))
    dist.destroy_process_group()
''')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        child = Path(d) / "child.py"
        child.write_text(_CHILD)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(a.nproc), str(child), str(a.steps), d], check=True, env=env)
        for r in range(a.nproc):
            res = json.loads((Path(d) / f"rank{r}.json").read_text())
            print(f"\nrank {r}: one recorded FSDP2 step = {res['ops']} ops, {res['bytes'] / 1024:.0f} KiB on disk")
            print("| what | plain | recorded | ratio |\n|---|---|---|---|")
            for name, (plain, rec) in res["rows"].items():
                unit, k = ("us", 1e6) if plain < 1e-3 else ("ms", 1e3)
                print(f"| {name} | {plain * k:.1f} {unit} | {rec * k:.1f} {unit} | {rec / plain:.1f}x |")


if __name__ == "__main__":
    main()
