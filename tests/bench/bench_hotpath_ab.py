"""An A/B of the recorder's per-op path inside one process: one step's aten calls captured once and handed to
``Recorder.before``/``after`` (as bench_hotpath.py), the passes alternating (A B B A A B ...) between the per-op
functions of another ``record/mode.py`` (exec'd from a file: ``OpBuilder.ref``/``encode``/``encode_list``/``add_op``/
``__init__``, ``select``, ``record_before``, ``record_after``) and the live ones.

Why: on the shared 2-core machine the load moves a whole process's timings by more than a per-op change is worth
(alternating processes gave 24.8 against 24.2 us an op, then 20.2 for the same tree); passes interleaved in one
process see the same load, so the difference of their minima and medians is the change's. Only ``mode.py`` may
differ between the two trees (every other module is the live one).

Usage: ``git show REV:replaydiff/record/mode.py > /tmp/old_mode.py; python tests/bench/bench_hotpath_ab.py
/tmp/old_mode.py [meta|stats|full] [PASSES] [MODEL]`` (MODEL as bench_hotpath.py: tiny, t5, scan, unet, ...).

Whole trees: ``mkdir /tmp/old && git archive REV replaydiff | tar -x -C /tmp/old; python
tests/bench/bench_hotpath_ab.py /tmp/old ...`` (a directory holding ``replaydiff/``): that tree is copied under the
package name ``replaydiff_old`` (its imports renamed) and imported beside the live package, and A's passes run its
own recorder, so every module differs (the context, statistics, storage table and writer too), not ``mode.py``
alone.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replaydiff  # noqa: E402
import replaydiff.record.mode  # noqa: E402,F401
from bench_hotpath import _Capture  # noqa: E402

live = sys.modules["replaydiff.record.mode"]  # (replaydiff.record is also the name of the record() function)
FUNCTIONS = ("select", "record_before", "record_after")
METHODS = ("ref", "encode", "encode_list", "add_op", "__init__")


def load_old(path: str) -> tuple[dict, dict]:
    old = types.ModuleType("replaydiff.record.mode_old")
    old.__file__ = path
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), old.__dict__)
    return ({n: getattr(old, n) for n in FUNCTIONS if n in old.__dict__},
            {n: old.OpBuilder.__dict__[n] for n in METHODS if n in old.OpBuilder.__dict__})


def use(fns: dict, meths: dict) -> None:
    for n, f in fns.items():
        setattr(live, n, f)
    for n, f in meths.items():
        setattr(live.OpBuilder, n, f)


def import_tree(tree: str) -> types.ModuleType:
    """The replaydiff package of another tree, imported as ``replaydiff_old`` from a renamed copy."""
    dst = tempfile.mkdtemp(prefix="rdab-tree-")
    atexit.register(shutil.rmtree, dst, True)
    shutil.copytree(os.path.join(tree, "replaydiff"), os.path.join(dst, "replaydiff_old"))
    for root, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    text = f.read()
                text = re.sub(r"\b(from|import) replaydiff\b", r"\1 replaydiff_old", text)
                text = re.sub(r"\breplaydiff\.(?=[a-z_])", "replaydiff_old.", text)
                with open(path, "w") as f:
                    f.write(text)
    sys.path.insert(0, dst)
    import replaydiff_old  # noqa: F401

    return sys.modules["replaydiff_old"]


def main() -> None:
    old_path = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "meta"
    passes = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    model = sys.argv[4] if len(sys.argv) > 4 else "scan"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model == "tiny":
        from replaydiff.models import TinyTransformer, TransformerConfig, make_step

        m = TinyTransformer(TransformerConfig())
        step = make_step(m, m.example_batch(seed=0), torch.optim.AdamW(m.parameters(), lr=1e-3))
    else:
        from bench_real_models import build

        step = build(model)
    step()
    cap = _Capture()
    with cap:
        step()
    tree = os.path.isdir(old_path)
    new = ({n: getattr(live, n) for n in FUNCTIONS}, {n: live.OpBuilder.__dict__[n] for n in METHODS})
    old = None if tree else load_old(old_path)
    record_a = import_tree(old_path).record if tree else replaydiff.record
    got: dict[str, list[float]] = {"A (old)": [], "B (live)": []}
    for i in range(2 * passes):
        key = "A (old)" if (i % 2 == 0) ^ (i // 2 % 2 == 1) else "B (live)"
        if not tree:
            use(*(old if key == "A (old)" else new))
        path = tempfile.mkdtemp(prefix="rdab-")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                record = record_a if key == "A (old)" else replaydiff.record
                rec = record(path, tensors=mode, compress=False)
                rec.__enter__()
                with _disable_current_modes():
                    t0 = time.thread_time()
                    for func, types_, args, kwargs, out in cap.calls:
                        pending = rec.before(func, types_, args, kwargs)
                        if pending is not None:
                            rec.after(pending, func, args, kwargs, out)
                    t1 = time.thread_time()
                rec.__exit__(None, None, None)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        got[key].append(1e6 * (t1 - t0) / len(cap.calls))
    if not tree:
        use(*new)
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    for key, v in got.items():
        print(f"{model} {mode} {key}: min {min(v):.2f}, median {statistics.median(v):.2f} us an op "
              f"(recording thread CPU, {len(v)} passes, {len(cap.calls)} calls; load {load})")


if __name__ == "__main__":
    main()
