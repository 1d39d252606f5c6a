"""GPU check, for a session that has a CUDA device: record a CUDA step in bf16 autocast with TF32 on, replay it on
the CPU and on the GPU with TF32 off, and print a short table.

    python tests/bench/gpu_check.py [--out DIR]

What it shows: the recorder's CUDA path (pinned, stream-ordered copies) produces a trace that replays clean on the
CPU at fp64 and on the GPU at fp64 (TF32 off); a fault planted in one CUDA matmul is named exactly on both; and what
`--precision same` on the GPU says about a TF32 step (bit for bit against the GPU's own kernels). Exits 4 without
a CUDA device. Not a test: it needs hardware CI does not have.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from replaydiff import record
from replaydiff.faults import PlantedFault
from replaydiff.models import TinyTransformer, TransformerConfig, make_step
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.trace import open_trace


def _record(out: Path, fault: PlantedFault | None) -> float:
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = TinyTransformer(TransformerConfig.mid()).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    step = make_step(model, model.example_batch("cuda"), opt, autocast_dtype=torch.bfloat16)
    step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    if fault is not None:
        with fault, record(out):
            step()
    else:
        with record(out):
            step()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="keep the traces here (default: a temporary directory)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 4
    root = Path(args.out or tempfile.mkdtemp(prefix="replaydiff-gpu-"))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = []
    clean, faulty = root / "clean", root / "faulty"
    rec_s = _record(clean, None)
    fault = PlantedFault("aten.mm.default", rel=1e-2, call=3)
    _record(faulty, fault)
    planted = [op.index for op in open_trace(faulty).rank(0) if op.name == "aten.mm.default"][2]
    for trace, label in ((clean, "clean"), (faulty, f"fault #{planted}")):
        for device, precision in (("cpu", "fp64"), ("cuda", "fp64"), ("cuda", "same")):
            t = time.perf_counter()
            rep = replay_trace(str(trace), ReplayOptions(device=device, precision=precision))
            dt = time.perf_counter() - t
            c = rep.counts()
            first = rep.first_divergent
            rows.append((label, device, precision, c["ok"], c["divergent"], c["skipped"], c["error"],
                         f"#{first.index} {first.op}" if first else "-", f"{len(rep.ops) / dt:,.0f}"))
    print(f"recorded one bf16-autocast, TF32-on step of the mid transformer in {rec_s:.2f} s")
    head = ("trace", "replay on", "precision", "ok", "divergent", "skipped", "error", "first divergent", "ops/s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
