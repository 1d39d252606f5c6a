"""The recorder's per-op path counted, not timed: Python opcodes, Python calls and C calls per op of one pass of
bench_hotpath.py's harness (one step's aten calls handed to ``Recorder.before``/``after``), by function.

Why: on the shared 2-core machine a timing moves by more than most per-op changes are worth (the same tree measured
15 and 39 us an op an hour apart, the load average below 1 both times: other machines share the host). Counts do not
move: they say what a change removed (a Python frame, a torch call, a dict lookup) whatever the load. They do not say
what each costs: a torch attribute read is one C call here and ~0.1 us, a code object's hash one dict lookup and up
to 2 us.

Usage: ``python tests/bench/bench_hotpath_count.py [meta|stats|full] [MODEL]`` (MODEL as bench_hotpath.py's);
``REPLAYDIFF_SRC=DIR`` counts another tree (from ``git archive``).
"""
from __future__ import annotations

import os
import sys

if os.environ.get("REPLAYDIFF_SRC"):
    sys.path.insert(0, os.environ["REPLAYDIFF_SRC"])

import collections  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replaydiff  # noqa: E402
from bench_hotpath import _Capture  # noqa: E402


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "meta"
    model = sys.argv[2] if len(sys.argv) > 2 else "scan"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from bench_real_models import build

    step = build(model)
    step()
    cap = _Capture()
    with cap:
        step()
    counts: collections.Counter = collections.Counter()
    opcodes: collections.Counter = collections.Counter()  # (file, function) -> opcodes
    c_calls: collections.Counter = collections.Counter()

    def trace(frame, event, arg):  # noqa: ANN001
        frame.f_trace_opcodes = True
        if event == "opcode":
            opcodes[(os.path.basename(frame.f_code.co_filename), frame.f_code.co_name)] += 1
        return trace

    def profile(frame, event, arg):  # noqa: ANN001
        if event == "call":
            counts["Python calls"] += 1
        elif event == "c_call":
            counts["C calls"] += 1
            c_calls[getattr(arg, "__qualname__", str(arg)).split("_v1_system_")[-1]] += 1

    for counted in (False, True):  # the first pass fills the recorder's caches (per op, per dtype, per code object)
        path = tempfile.mkdtemp(prefix="rdcount-")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rec = replaydiff.record(path, tensors=mode, compress=False)
                rec.__enter__()
                with _disable_current_modes():
                    if counted:
                        sys.settrace(trace)
                        sys.setprofile(profile)
                    try:
                        for func, types, args, kwargs, out in cap.calls:
                            pending = rec.before(func, types, args, kwargs)
                            if pending is not None:
                                rec.after(pending, func, args, kwargs, out)
                    finally:
                        sys.settrace(None)
                        sys.setprofile(None)
                rec.__exit__(None, None, None)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    n = len(cap.calls)
    print(f"{model} {mode}: {len(cap.calls)} calls; per op: {sum(opcodes.values()) / n:.0f} Python opcodes, "
          f"{counts['Python calls'] / n:.1f} Python calls, {counts['C calls'] / n:.1f} C calls "
          f"(replaydiff from {os.path.dirname(replaydiff.__file__)})")
    print("opcodes per op by function: " + ", ".join(f"{fn} {v / n:.0f}" for (_, fn), v in opcodes.most_common(16)))
    print("C calls per op: " + ", ".join(f"{k} {v / n:.2f}" for k, v in c_calls.most_common(16)))


if __name__ == "__main__":
    main()
