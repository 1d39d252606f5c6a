"""Benchmark: diff a 4-rank data-parallel step against the single-process step (the parallel diff's mapping).

    python tests/bench/bench_parallel_diff.py [--ranks 4] [--repeat 3]

Records the tiny transformer's step (2 layers, d_model 64, seq 32, batch 8, AdamW, dropout off) once as one process on the
whole batch and once under torchrun with ``--ranks`` gloo processes, each its slice of the batch, gradients
all-reduced and averaged by hand; then times ``diff_traces`` in this process (median of ``--repeat``, the traces
opened afresh each time, the page cache warm) and prints the trace bytes read per second and whether the runs agree.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from replaydiff.diff import diff_traces

STEP = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    import replaydiff
    from replaydiff.models import TinyTransformer
    from replaydiff.models.tiny import TransformerConfig
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(dropout=float(sys.argv[2])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = model.example_batch()
    xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
    with replaydiff.record(sys.argv[1]):
        loss = model(xs, ys)
        loss.backward()
        for p in model.parameters():
            if world > 1 and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
''')


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="the model's dropout (each rank draws its own masks: ops after them are not judged)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = root / "step.py"
        script.write_text(STEP)
        single, multi = root / "single", root / "multi"
        dropout = str(args.dropout)
        subprocess.run([sys.executable, str(script), str(single), dropout], check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(args.ranks), str(script), str(multi), dropout], check=True, capture_output=True)
        times, report = [], None
        for _ in range(args.repeat):
            started = time.perf_counter()
            report = diff_traces(single, multi)
            times.append(time.perf_counter() - started)
        pd = report.parallel
        nbytes = _bytes(single) + _bytes(multi)
        t = statistics.median(times)
        verdict = f"part at ref #{pd.departure.op.ref} {pd.departure.op.name}" if pd.departure is not None else \
            f"{len(pd.random_parted)} ops after dropout not judged" if pd.random_parted else "agree"
        print(f"| {args.ranks} ranks against 1 process, tiny step | {pd.ref_ops} ref ops, {pd.compared} compared | "
              f"{nbytes / 1e6:.1f} MB of traces | {t:.2f} s | {nbytes / 1e6 / t:.1f} MB/s | {verdict} |")


if __name__ == "__main__":
    main()
