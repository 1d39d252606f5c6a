"""The recorder's hot path alone: one tiny training step's aten calls, captured once, handed to
``Recorder.before``/``after`` again and again (no op runs), timed with the recording thread's CPU clock.

Why: on a shared machine the wall time of a whole recorded step moves by more than a change to the per-op path can
(see tests/bench/README.md); this isolates that path. The mode is taken off the stack while the calls are handed
over, as ``__torch_dispatch__`` does. ``REPLAYDIFF_SRC=DIR`` runs the replaydiff found in DIR instead (an older
tree from ``git archive``), for an A/B in alternating processes.

Usage: ``python tests/bench/bench_hotpath.py [meta|stats|full] [PASSES] [MODEL]``; MODEL is ``tiny`` (the default) or
one of ``bench_real_models.py``'s (``t5``, ``gpt2``, ``llama``, ``mid``).
"""
from __future__ import annotations

import os
import sys

if os.environ.get("REPLAYDIFF_SRC"):
    sys.path.insert(0, os.environ["REPLAYDIFF_SRC"])

import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

import replaydiff  # noqa: E402
from replaydiff.models import TinyTransformer, TransformerConfig, make_step  # noqa: E402


class _Capture(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, types, args, kwargs, out))
        return out


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "meta"
    passes = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    model_name = sys.argv[3] if len(sys.argv) > 3 else "tiny"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model_name == "tiny":
        model = TinyTransformer(TransformerConfig())
        step = make_step(model, model.example_batch(seed=0), torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_real_models import build

        step = build(model_name)
    step()
    cap = _Capture()
    with cap:
        step()
    best = float("inf")
    for _ in range(passes):
        path = tempfile.mkdtemp(prefix="rdhot-")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rec = replaydiff.record(path, tensors=mode, compress=False)
            rec.__enter__()
            with _disable_current_modes():
                t0 = time.thread_time()
                for func, types, args, kwargs, out in cap.calls:
                    pending = rec.before(func, types, args, kwargs)
                    if pending is not None:
                        rec.after(pending, func, args, kwargs, out)
                t1 = time.thread_time()
            rec.__exit__(None, None, None)
        shutil.rmtree(path)
        best = min(best, t1 - t0)
    print(f"{model_name} {mode}: {len(cap.calls)} calls, {1e6 * best / len(cap.calls):.1f} us/op "
          f"(recording thread CPU, best of {passes}; replaydiff from {os.path.dirname(replaydiff.__file__)})")


if __name__ == "__main__":
    main()
