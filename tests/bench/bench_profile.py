"""Where the recorder's per-op time goes: a breakdown in microseconds per op, part by part.

Why: the recorder's speed goals (tests/bench/README.md) are missed by 2-3x and the causes must be measured before the
hot path is changed. Two measurements, each on warmed-up models, one step per sample:

1. CPU time of the recording thread (``time.thread_time``; the writer thread's work is not in it), the fastest of
   interleaved samples (no profiler running): plain step, a do-nothing dispatch mode, the variant, and ``meta`` with
   one part switched off by a patch (source lines off). Differences over the number of
   ops give microseconds per op that no profiler inflated. Thread CPU time and the fastest sample, not wall medians:
   on the shared 2-core machine wall medians of the same code moved by 2x from run to run, the fastest thread
   CPU times by ~10%.
2. cProfile of a few recorded steps (the recording thread only): the functions' own time, grouped into parts
   (dispatch into the mode, argument encoding, storage versions, source line, module path, statistics, copies,
   writer hand-over), scaled so that the parts add up to the measured overhead over the do-nothing mode: cProfile
   inflates small functions, the scaling keeps the shares and restores the total.

Usage: ``python tests/bench/bench_profile.py [--models tiny,mid] [--variants meta,stats,flight,full,full+zstd]
[--rounds 7] [--threads N] [--top]``.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replaydiff  # noqa: E402
from bench import MODELS, VARIANT_BY_KEY, NoopMode, build_step, md_table  # noqa: E402
from replaydiff.record import context as rd_context  # noqa: E402

# Function (file suffix, name) -> part. The first match wins; anything else in replaydiff's record/ or trace/
# code is "other bookkeeping"; torch's own functions called from the mode (tensor attribute reads, the op itself
# is not in the mode) count where their caller is unknown to cProfile's flat table, so they are listed apart.
PARTS: list[tuple[str, str, str]] = [
    ("record/mode.py", "__torch_dispatch__", "mode entry (RecordingMode.__torch_dispatch__ own time)"),
    ("torch/utils/_python_dispatch.py", "", "dispatch-mode machinery (torch, Python)"),
    ("record/context.py", "source", "source line"),
    ("record/context.py", "_resolve", "source line"),
    ("record/context.py", "module", "module path"),
    ("record/context.py", "phase", "phase / backward_of"),
    ("record/context.py", "backward_of", "phase / backward_of"),
    ("record/context.py", "note_forward", "phase / backward_of"),
    ("record/storage.py", "", "storage version table"),
    ("record/stats.py", "", "statistics"),
    ("record/module_stats.py", "", "statistics"),
    ("record/mode.py", "_snapshot", "copies"),
    ("record/mode.py", "_copy", "copies"),
    ("trace/staging.py", "", "copies"),
    ("record/mode.py", "ref", "tensor description (ref)"),
    ("trace/schema/values.py", "encode_value", "argument walk (encode_value)"),
    ("record/mode.py", "encode", "argument walk (encode_value)"),
    ("trace/schema/", "", "record dicts (schema.wire_*)"),
    ("aten.py", "", "op facts / written args (aten.py)"),
    ("trace/writer.py", "", "hand-over to the writer"),
    ("record/mode.py", "flush", "statistics"),
    ("record/mode.py", "flush_stats", "statistics"),
    ("record/mode.py", "add_op", "hand-over to the writer"),
    ("record/flight.py", "", "flight ring"),
    ("record/mode.py", "", "other bookkeeping (mode.py)"),
    ("record/recorder.py", "", "other bookkeeping (recorder.py)"),
]


def part_of(filename: str, func: str) -> str | None:
    fn = filename.replace("\\", "/")
    for suffix, name, part in PARTS:
        # a suffix ending in "/" names a package: any module in it
        inside = f"/{suffix}" in fn if suffix.endswith("/") else fn.endswith(suffix)
        if inside and (not name or func == name):
            return part
    if "/replaydiff/" in fn:
        return "other bookkeeping"
    if fn == "~":  # built-ins: attributed below by caller-less name
        return None
    return None


def builtin_part(func: str) -> str:
    """Built-in and C functions (cProfile names them '{...}'): torch tensor methods, dict/list operations."""
    if "memmove" in func or "ctypes" in func:
        return "copies"
    if "crc32" in func:
        return "copies"
    if "numpy" in func or "reduceat" in func or "ufunc" in func:
        return "statistics"
    if "torch" in func or "Tensor" in func or "_TensorBase" in func or "TensorBase" in func:
        return "torch attribute reads (shape, stride, storage, ...)"
    return "Python built-ins (dict, list, isinstance, ...)"


def record_ctx(key: str, out: str) -> contextlib.AbstractContextManager:
    v = VARIANT_BY_KEY[key]
    return replaydiff.record(out, tensors=v.tensors, compress=v.compress, **dict(v.options))


def one_step(key: str, step: Callable[[], Any], patch: str | None = None) -> float:
    """Seconds of one step inside the instrumentation (the whole with block), optionally with a part patched off."""
    out = tempfile.mkdtemp(prefix="rdprof-")
    gc.collect()
    try:
        with patched(patch):
            t0 = time.thread_time()
            if key == "plain":
                step()
            elif key == "noop":
                with NoopMode():
                    step()
            else:
                with record_ctx(key, out):
                    step()
            return time.thread_time() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)


@contextlib.contextmanager
def patched(what: str | None):
    """Switch one part of the per-op bookkeeping off (the trace is then different; only the time matters here)."""
    if what is None:
        yield
        return
    cls = rd_context.OpContext
    if what == "no-source":
        old = cls.source
        cls.source = lambda self: None  # type: ignore[method-assign]
        try:
            yield
        finally:
            cls.source = old  # type: ignore[method-assign]
    else:  # ("no-module" is gone: place() reads the module itself, OpContext.module() is not on the per-op path)
        raise ValueError(what)


def count_ops(step: Callable[[], Any]) -> int:
    class Count(NoopMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    step()  # the first step creates AdamW's state: not what later steps run
    with Count():
        step()
    return Count.n


def wall(model: str, keys: list[str], rounds: int) -> dict[str, float]:
    """Fastest thread-CPU seconds per step of each key ('variant' or 'variant/patch'), interleaved with a rotating
    start."""
    steps = {k: build_step(MODELS[model]) for k in keys}
    for k in keys:  # warm-up: optimizer state, first-call caches
        steps[k]()
        one_step(k.split("/")[0], steps[k], k.split("/")[1] if "/" in k else None)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in order:
            base, _, patch = k.partition("/")
            samples[k].append(one_step(base, steps[k], patch or None))
    return {k: min(v) for k, v in samples.items()}


def profile_parts(model: str, key: str, steps: int = 3) -> tuple[dict[str, float], float, list[tuple]]:
    """cProfile of ``steps`` recorded steps: own time per part (seconds, summed), profiled total, top functions."""
    step = build_step(MODELS[model])
    step()
    one_step(key, step)
    prof = cProfile.Profile()
    out = tempfile.mkdtemp(prefix="rdprof-")
    try:
        for _ in range(steps):
            with record_ctx(key, out + f"/{_}"):
                prof.enable()
                step()
                prof.disable()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    st = pstats.Stats(prof)
    parts: dict[str, float] = {}
    rows = []
    for (filename, _line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        part = part_of(filename, func)
        if part is None:
            if filename == "~":
                # a recorder-called built-in only counts when replaydiff code calls it; the job's own built-ins
                # (the model's Python) are in the plain step too
                own = sum(v[2] for c, v in _callers.items() if "/replaydiff/" in c[0].replace("\\", "/"))
                if own:
                    parts[builtin_part(func)] = parts.get(builtin_part(func), 0.0) + own
                    rows.append((own, nc, f"{func} (called by replaydiff)"))
            continue
        parts[part] = parts.get(part, 0.0) + tt
        rows.append((tt, nc, f"{Path(filename).parent.name}/{Path(filename).name}:{func}"))
    rows.sort(reverse=True)
    return {k: v / steps for k, v in parts.items()}, sum(parts.values()) / steps, rows[:15]


# -- sections: thread-CPU time of each part, measured by wrapping the functions that do it -----------------------
def _section_targets(run: str) -> list[tuple[Any, str, str]]:
    """(owner, attribute, part) of the functions timed in one run. Run "total" wraps the recorder's whole per-op
    work; run "parts" wraps leaves that never call one another; run "ref" wraps the tensor description, which
    contains the storage table, the copies and the statistics copies (run "parts" times those inside it)."""
    from replaydiff import aten
    from replaydiff.record import flight, mode, recorder, stats, storage
    from replaydiff.trace import writer

    if run == "total":
        return [(recorder.Recorder, "before", "total"), (recorder.Recorder, "after", "total")]
    if run == "ref":
        return [(mode.OpBuilder, "ref", "tensor description (ref, inclusive)"),
                (mode.OpBuilder, "add_op", "record hand-over (inclusive: batched statistics, writer)")]
    ctx = rd_context.OpContext
    ext = stats.extension()
    kernel = (ext, "measure") if ext is not None else (mode, "kernel_stats")
    # place() reads the phase, the module and the forward op (phase(), module() and note_forward() inlined)
    return [(ctx, "place", "phase, module, forward op"),
            (ctx, "source", "source line"), (aten, "facts", "op facts / written args"),
            (mode, "written_args", "op facts / written args"), (storage.StorageTable, "entry", "storage version table"),
            (mode.OpBuilder, "_snapshot", "copies (full)"), (mode, "cpu_values", "statistics: value copies"),
            (mode, "values_stats", "statistics: arithmetic"), (mode, "batch_stats", "statistics: arithmetic"),
            # the kernel as the recorder calls it: its extension module's measure where it loads (replacing
            # mode.kernel_stats would turn the extension off: OpBuilder takes it only where kernel_stats is its own)
            (*kernel, "statistics: compiled kernel (in place)"),
            (writer.RankWriter, "add_op", "hand-over to the writer"),
            (flight.FlightBuffer, "add_op", "hand-over to the flight ring")]


_ACC: dict[str, list[int]] = {}  # part -> [thread-CPU ns, calls] of the current step


@contextlib.contextmanager
def timed_sections(run: str):
    clock = time.thread_time_ns
    saved = []
    for owner, name, part in _section_targets(run):
        fn = owner.__dict__.get(name)
        if fn is None:  # an older tree (REPLAYDIFF_SRC) without this part
            continue
        acc = _ACC.setdefault(part, [0, 0])

        def wrapper(*a: Any, _fn: Callable = fn, _acc: list = acc, **k: Any) -> Any:
            t0 = clock()
            try:
                return _fn(*a, **k)
            finally:
                _acc[0] += clock() - t0
                _acc[1] += 1
        saved.append((owner, name, fn))
        setattr(owner, name, staticmethod(wrapper) if isinstance(fn, staticmethod) else wrapper)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def wrapper_overhead_ns() -> float:
    """What a wrapper adds to the time it measures (two clock reads and the call), per call, fastest of 5."""
    clock = time.thread_time_ns
    acc = [0, 0]

    def f() -> None:
        return None

    def wrapper(_fn: Callable = f, _acc: list = acc) -> Any:
        t0 = clock()
        try:
            return _fn()
        finally:
            _acc[0] += clock() - t0
            _acc[1] += 1
    best = float("inf")
    for _ in range(5):
        acc[:] = [0, 0]
        for _ in range(20_000):
            wrapper()
        best = min(best, acc[0] / acc[1])
    return best


def sections(model: str, key: str, n_ops: int, steps: int) -> dict[str, float]:
    """us per op of each part: per run, the fastest of ``steps`` recorded steps, minus the wrappers' overhead."""
    step = build_step(MODELS[model])
    step()
    one_step(key, step)
    over = wrapper_overhead_ns()
    out: dict[str, float] = {}
    for run in ("total", "parts", "ref"):
        best: dict[str, float] = {}
        for i in range(steps):
            _ACC.clear()
            tmp = tempfile.mkdtemp(prefix="rdprof-")
            try:
                with timed_sections(run), record_ctx(key, tmp):
                    step()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            for part, (ns, calls) in _ACC.items():
                us = max(ns - over * calls, 0.0) / n_ops / 1e3
                best[part] = min(best.get(part, us), us)
        out.update(best)
    return out


CONTEXT = ("phase, module, forward op", "source line", "op facts / written args")
INSIDE = ("storage version table", "copies (full)", "statistics: value copies", "statistics: arithmetic",
          "hand-over to the writer", "hand-over to the flight ring")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,mid")
    p.add_argument("--variants", default="meta,stats,flight,full,full+zstd")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--top", action="store_true", help="also print cProfile's 15 costliest functions per variant")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    for model in args.models.split(","):
        n_ops = count_ops(build_step(MODELS[model]))
        t = wall(model, ["plain", "noop"] + variants, args.rounds)
        print(f"\n### {model}: {n_ops} ops per step; recording thread's CPU time, fastest of {args.rounds} "
              f"interleaved rounds (whole steps) or steps (sections)\n")
        floor = (t["noop"] - t["plain"]) / n_ops * 1e6
        print(f"- plain step {t['plain'] * 1e3:.1f} ms of thread CPU; a do-nothing dispatch mode adds "
              f"{floor:.1f} us/op\n")
        cols = {v: sections(model, v, n_ops, args.rounds) for v in variants}
        rows = [["x plain (whole step, thread CPU)", *(f"{t[v] / t['plain']:.2f}x" for v in variants)],
                ["step over the no-op mode, us/op", *(f"{(t[v] - t['noop']) / n_ops * 1e6:.1f}" for v in variants)],
                ["dispatch mode floor (no-op mode - plain)", *(f"{floor:.1f}" for _ in variants)],
                ["recorder's per-op work (before + after)", *(f"{cols[v].get('total', 0):.1f}" for v in variants)]]
        for part in CONTEXT:
            rows.append([f"  {part}", *(f"{cols[v].get(part, 0):.1f}" for v in variants)])
        rows.append(["  tensor description (ref), inclusive", *(f"{cols[v].get('tensor description (ref, inclusive)', 0):.1f}"
                                                                 for v in variants)])
        for part in INSIDE[:3]:
            rows.append([f"    of which {part}", *(f"{cols[v].get(part, 0):.1f}" for v in variants)])
        hand = "record hand-over (inclusive: batched statistics, writer)"
        rows.append([f"  {hand}", *(f"{cols[v].get(hand, 0):.1f}" for v in variants)])
        for part in INSIDE[3:]:
            rows.append([f"    of which {part}", *(f"{cols[v].get(part, 0):.1f}" for v in variants)])
        rest = {v: cols[v].get("total", 0) - sum(cols[v].get(k, 0) for k in CONTEXT)
                - cols[v].get("tensor description (ref, inclusive)", 0) - cols[v].get(hand, 0) for v in variants}
        rows.append(["  the rest: argument walk, record dicts, glue", *(f"{rest[v]:.1f}" for v in variants)])
        rows.append(["mode entry, module hooks, set-up and exit (step - floor - per-op work)",
                     *(f"{(t[v] - t['noop']) / n_ops * 1e6 - cols[v].get('total', 0):.1f}" for v in variants)])
        print(md_table(["us per op", *variants], rows))
        if args.top:
            for v in variants:
                _, _, top = profile_parts(model, v)
                print(f"\ntop functions, {model} {v} (cProfile, own time per step, ms; calls per step):")
                for tt, nc, name in top:
                    print(f"  {tt * 1e3 / 3:8.2f}  {nc // 3:6d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
