"""What recording costs a compiled training step, beside the eager recording of the same model.

For each model (TinyTransformer ``tiny`` / ``mid``) and backend: the compiled step alone, the compiled step recorded
with ``compiled="capture"`` (units) at ``full`` + zstd, ``stats`` and ``meta``, and, for comparison, the eager step
alone and recorded op by op (``full`` + zstd). Every variant owns a model built from the same seed. Warm-up: two
plain steps (the job's compile) and one recorded step (the capture backend's compile, once per process) per
variant; then the variants are timed round-robin, one step per sample, median reported. Recording samples include
the whole ``with`` block, each into a fresh temporary directory.

Usage: ``python tests/bench/bench_compiled.py [--models tiny,mid] [--backend inductor] [--repeats N]``.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Callable

import torch

import replaydiff
from replaydiff.models import TinyTransformer, TransformerConfig, make_step

SEED, LR = 0, 1e-3


def build(cfg: TransformerConfig, backend: str | None) -> Callable[[], torch.Tensor]:
    torch.manual_seed(SEED)
    model = TinyTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    run = torch.compile(model, backend=backend) if backend else model
    return make_step(run, model.example_batch(seed=SEED), opt)


def timed(step: Callable[[], torch.Tensor], tensors: str | None) -> float:
    if tensors is None:
        t = time.perf_counter()
        step()
        return time.perf_counter() - t
    d = tempfile.mkdtemp(prefix="rd-bench-")
    try:
        t = time.perf_counter()
        with replaydiff.record(f"{d}/t", tensors=tensors):
            step()
        return time.perf_counter() - t
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,mid")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    for name in args.models.split(","):
        cfg = TransformerConfig() if name == "tiny" else TransformerConfig.mid()
        variants = [("compiled step", args.backend, None), ("compiled, record full + zstd (units)", args.backend,
                                                            "full"),
                    ("compiled, record stats (units)", args.backend, "stats"),
                    ("compiled, record meta (units)", args.backend, "meta"),
                    ("eager step", None, None), ("eager, record full + zstd", None, "full")]
        steps = {}
        t0 = time.perf_counter()
        for label, backend, tensors in variants:
            steps[label] = build(cfg, backend)
            for _ in range(2):
                steps[label]()
            if tensors is not None:
                timed(steps[label], tensors)
        warm = time.perf_counter() - t0
        samples: dict[str, list[float]] = {label: [] for label, _, _ in variants}
        for _ in range(args.repeats):
            for label, _, tensors in variants:
                samples[label].append(timed(steps[label], tensors))
        base = {None: statistics.median(samples["eager step"]),
                args.backend: statistics.median(samples["compiled step"])}
        print(f"\n### {name}: {cfg}, backend {args.backend}, {args.repeats} rounds, warm-up {warm:.0f} s\n")
        print("| variant | ms/step (median) | min-max ms | vs its plain step |")
        print("|---|---|---|---|")
        for label, backend, _ in variants:
            s = samples[label]
            med = statistics.median(s)
            print(f"| {label} | {med * 1e3:.1f} | {min(s) * 1e3:.1f}-{max(s) * 1e3:.1f} | "
                  f"{med / base[backend]:.2f}x |")


if __name__ == "__main__":
    main()
