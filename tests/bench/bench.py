"""Benchmark of replaydiff: what recording costs a training step, how big traces are, and how fast replay runs.

Why: the issue sets goals (``full`` <= 3x a plain step on the tiny transformer and <= 1.5x on the mid one, ``stats``
<= 1.5x, trace bytes <= 0.12x the naive bytes, replay >= 10,000 ops/s per core on tiny), and this script measures
them the same way on every machine so that regressions and improvements show up as numbers.

What it prints (plain-text / markdown tables):

1. Record overhead per training step of TinyTransformer (``TransformerConfig()``) and the mid one
   (``TransformerConfig.mid()``): plain step, a do-nothing TorchDispatchMode, torch's DebugMode, and replaydiff
   ``meta``, ``stats`` (op by op, and ``granularity="module"``), the flight recorder (``flight=8``, op by op and by
   module: nothing is written, the ring is filled and encoded), ``full`` (raw) and ``full`` + zstd. Variants are
   timed round-robin in one process after warm-up, one step per sample, the median is reported. Each variant owns
   a model built from the same seed and keeps stepping it. Recording samples include the whole ``with`` block
   (set-up, the step, and the exit that flushes the writer), each into a fresh temporary directory; the steady
   cost per step of one long multi-step recording is ``bench_steps.py``'s.
2. Trace bytes on disk per recording variant against the naive bytes (the sum of nelement * element_size over
   every tensor input and output of every op, counted by a do-nothing dispatch mode).
3. Peak RSS (ru_maxrss) per variant, each in a fresh subprocess of this script (hidden ``--_rss-child`` flag).
4. Replay throughput of a ``full`` + zstd trace of each model: ``replay_trace`` timed end to end for precision fp64
   and same with 1 and 2 workers; for more than one worker also on a pool whose processes were started (and had
   imported replaydiff) before the clock started, which separates process start-up from replay work.
5. With ``--profile``: cProfile tables (replaydiff's top functions by cumulative and own time) of a full + zstd
   recording of the tiny step (recording thread and writer thread) and of an fp64 replay of its trace.

Usage: ``python tests/bench/bench.py [--quick] [--repeats N] [--models tiny,mid] [--threads N] [--profile]
[--record-only]``.
The machine may be shared: every section says how much CPU other processes took while it ran, because on an
oversubscribed machine every intra-op parallel region (two threads by default) can cost milliseconds.
"""
from __future__ import annotations

import os
import sys

if os.environ.get("REPLAYDIFF_SRC"):  # an A/B: the replaydiff of another tree (``git archive``) in this process
    sys.path.insert(0, os.environ["REPLAYDIFF_SRC"])

import argparse
import concurrent.futures as cf
import contextlib
import cProfile
import gc
import json
import multiprocessing as mp
import platform
import pstats
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import replaydiff
from replaydiff.models import TinyTransformer, TransformerConfig, make_step
from replaydiff.replay import ReplayOptions, Shard, plan, replay_trace, run_shard
from replaydiff.replay.engine import replay_threads
from replaydiff.trace import open_trace

MODELS: dict[str, TransformerConfig] = {"tiny": TransformerConfig(), "mid": TransformerConfig.mid()}
SEED = 0
LR = 1e-3

FULL_REPLAYS = (("fp64", 1), ("fp64", 2), ("same", 1), ("same", 2))
QUICK_REPLAYS = (("fp64", 1), ("fp64", 2), ("same", 1))
GOALS = (
    ("`full` <= 3x plain on tiny", "record", "tiny", 3.0),
    ("`full` <= 1.5x plain on mid", "record", "mid", 1.5),
    ("`stats` <= 1.5x plain on mid", "key:stats", "mid", 1.5),
    ("`stats` <= 3x plain on tiny", "key:stats", "tiny", 3.0),
    ("`--granularity module` <= 1.1x plain on mid", "key:stats-module", "mid", 1.1),
    ("flight recorder <= 1.2x plain on mid", "key:flight-module", "mid", 1.2),
    ("flight recorder <= 1.2x plain on mid", "key:flight", "mid", 1.2),
    ("trace bytes <= 0.12x naive", "bytes", None, 0.12),
    ("replay >= 10,000 ops/s per core on tiny", "replay", "tiny", 10_000.0),
)


# -- variants -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    tensors: str | None = None  # replaydiff tensors= mode; None for the non-recording variants
    compress: bool = False
    options: tuple = ()  # further record options as (name, value) pairs

    @property
    def writes_nothing(self) -> bool:
        """The flight recorder writes only when something goes wrong: a clean step leaves no trace to inspect."""
        return any(k == "flight" for k, _ in self.options)

    @property
    def records(self) -> bool:
        return self.tensors is not None


VARIANTS: tuple[Variant, ...] = (
    Variant("plain", "plain step"),
    Variant("noop", "no-op TorchDispatchMode"),
    Variant("debugmode", "torch DebugMode()"),
    Variant("meta", "replaydiff meta", "meta"),
    Variant("stats", "replaydiff stats", "stats"),
    Variant("stats-module", "replaydiff stats, granularity module", "stats", options=(("granularity", "module"),)),
    Variant("flight", "replaydiff flight K=8 (op stats)", "stats", options=(("flight", 8),)),
    Variant("flight-module", "replaydiff flight K=8, module", "stats",
            options=(("flight", 8), ("granularity", "module"))),
    Variant("full", "replaydiff full (raw)", "full", False),
    Variant("full+zstd", "replaydiff full + zstd", "full", True),
)
VARIANT_BY_KEY = {v.key: v for v in VARIANTS}


class NoopMode(TorchDispatchMode):
    """The cheapest possible dispatch mode: the floor for any Python-level op recorder."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _tensors_in(v: Any) -> Iterator[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors_in(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors_in(x)


class NaiveBytesMode(TorchDispatchMode):
    """Counts ops and the bytes of every tensor argument and output: what a recorder without dedup would store."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        self.nbytes += sum(t.nelement() * t.element_size() for t in _tensors_in((args, kwargs, out)))
        return out


def instrument(variant: Variant, trace_dir: str | None) -> ContextManager:
    """The context a variant's step runs in (entered and left inside the timed region)."""
    if variant.key == "plain":
        return contextlib.nullcontext()
    if variant.key == "noop":
        return NoopMode()
    if variant.key == "debugmode":
        from torch.utils._debug_mode import DebugMode  # imported lazily: spawned replay workers never need it

        return DebugMode()
    assert trace_dir is not None
    return replaydiff.record(trace_dir, tensors=variant.tensors, compress=variant.compress, **dict(variant.options))


def build_step(cfg: TransformerConfig) -> Callable[[], torch.Tensor]:
    """A fresh model and AdamW optimizer from a fixed seed, and the closure that runs one training step."""
    torch.manual_seed(SEED)
    model = TinyTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return make_step(model, model.example_batch(seed=SEED), opt)


# -- measuring one step ---------------------------------------------------------------------------------------------
@dataclass
class Sample:
    seconds: float  # the whole instrumented block
    exit_seconds: float  # of which: leaving the block (for replaydiff, the writer flush)
    total_bytes: int = 0
    data_bytes: int = 0
    ops_written: int | None = None
    problem: str | None = None


def dir_bytes(path: str) -> tuple[int, int]:
    """(all bytes, bytes under data/ directories) of a trace directory."""
    total = data = 0
    for root, _, files in os.walk(path):
        n = sum(os.path.getsize(os.path.join(root, f)) for f in files)
        total += n
        if Path(root).name == "data":
            data += n
    return total, data


def trace_problem(path: str) -> tuple[int | None, str | None]:
    """ops_written and a reason if the recorder did not finish cleanly."""
    try:
        m = open_trace(path).rank(0).manifest
    except Exception as exc:
        return None, f"unreadable trace: {exc}"
    problem = None
    if not m.get("complete"):
        problem = "trace not complete"
    elif m.get("disabled") or m.get("lost"):
        problem = f"recording degraded: {m.get('disabled') or m.get('lost')}"
    return m.get("ops_written"), problem


def timed_step(variant: Variant, step: Callable[[], torch.Tensor], inspect: bool = True) -> Sample:
    """One training step inside the variant's instrumentation; replaydiff variants record into a fresh directory."""
    trace_dir = tempfile.mkdtemp(prefix="rdbench-") if variant.records else None
    gc.collect()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            with instrument(variant, trace_dir):
                step()
                t1 = time.perf_counter()
            t2 = time.perf_counter()
        sample = Sample(t2 - t0, t2 - t1)
        rd_warnings = [str(w.message) for w in caught if "replaydiff" in str(w.message)]
        if trace_dir is not None and inspect and not variant.writes_nothing:
            sample.total_bytes, sample.data_bytes = dir_bytes(trace_dir)
            sample.ops_written, sample.problem = trace_problem(trace_dir)
        if rd_warnings:
            sample.problem = "; ".join([sample.problem or ""] + rd_warnings).strip("; ")
        return sample
    finally:
        if trace_dir is not None:
            shutil.rmtree(trace_dir, ignore_errors=True)


# -- section 1 + 2: overhead and bytes --------------------------------------------------------------------------------
@dataclass
class VariantResult:
    variant: Variant
    samples: list[Sample] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(s.seconds for s in self.samples)

    @property
    def spread_s(self) -> tuple[float, float]:
        xs = [s.seconds for s in self.samples]
        return min(xs), max(xs)

    @property
    def median_exit_s(self) -> float:
        return statistics.median(s.exit_seconds for s in self.samples)

    @property
    def last(self) -> Sample:
        return self.samples[-1]


_WARMED: set[str] = set()  # variants whose one-time costs (imports, first-call caches) this process has paid


def bench_record(cfg: TransformerConfig, repeats: int, warmup: int) -> dict[str, VariantResult]:
    """Round-robin timing of every variant, each on its own model; the start variant rotates every round.

    Warm-up steps create the optimizer state; they run instrumented the first time a variant is used in this
    process (paying its one-time costs) and plain afterwards (a second model needs no second warm-up recording).
    """
    steps = {v.key: build_step(cfg) for v in VARIANTS}
    for _ in range(warmup):
        for v in VARIANTS:
            timed_step(v if v.key not in _WARMED else VARIANTS[0], steps[v.key], inspect=False)
            _WARMED.add(v.key)
    results = {v.key: VariantResult(v) for v in VARIANTS}
    for r in range(repeats):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            results[v.key].samples.append(timed_step(v, steps[v.key]))
    return results


def naive_bytes(cfg: TransformerConfig) -> tuple[int, int]:
    """(ops, naive bytes) of one training step after a warm-up step (so AdamW state exists, as when recording)."""
    step = build_step(cfg)
    step()
    mode = NaiveBytesMode()
    with mode:
        step()
    return mode.ops, mode.nbytes


# -- section 3: peak RSS ----------------------------------------------------------------------------------------------
def vm_hwm_kib() -> int | None:
    """Peak RSS of this process's address space (Linux), which exec resets, unlike ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except Exception:
        return None


def rss_child(model: str, key: str) -> None:
    """Runs in a fresh process: one plain warm-up step, then one step of the variant; prints JSON with ru_maxrss."""
    step = build_step(MODELS[model])
    step()
    after_warm_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    timed_step(VARIANT_BY_KEY[key], step, inspect=False)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"warm_kib": after_warm_kib, "peak_kib": peak_kib, "hwm_kib": vm_hwm_kib()}))


def measure_rss(model: str, key: str, threads: int | None) -> dict[str, Any]:
    """ru_maxrss of a fresh process running one step of the variant.

    ru_maxrss survives exec and starts at the RSS of the process that forked, so a child forked from this (large)
    process would report at least this process's RSS. /bin/sh forks the child instead: its ru_maxrss starts small.
    """
    cmd = ["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, os.path.abspath(__file__), "--_rss-child", model,
           key]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"child failed (rc {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def measure_all_rss(model: str, threads: int | None) -> dict[str, dict[str, Any]]:
    """Every variant's child, as many at a time as there are CPUs (peak RSS does not depend on contention)."""
    with cf.ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool:
        futures = {v.key: pool.submit(measure_rss, model, v.key, threads) for v in VARIANTS}
        return {k: f.result() for k, f in futures.items()}


# -- section 4: replay ------------------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    precision: str
    workers: int
    threads: str
    total_ops: int
    replayed: int
    statuses: str
    seconds: float
    startup_s: float | None = None  # pool start-up measured separately (workers > 1)
    warm_seconds: float | None = None  # replay on an already started pool
    note: str | None = None


def record_replay_trace(cfg: TransformerConfig, path: str) -> Sample:
    """Records one step (after a warm-up step) with full + zstd, the trace the replay section reads."""
    step = build_step(cfg)
    step()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        with replaydiff.record(path, tensors="full", compress=True):
            step()
        sample = Sample(time.perf_counter() - t0, 0.0)
    sample.total_bytes, sample.data_bytes = dir_bytes(path)
    sample.ops_written, sample.problem = trace_problem(path)
    return sample


def thread_label(path: str, opts: ReplayOptions, workers: int) -> str:
    """Intra-op threads per worker as the engine will set them."""
    try:
        n = replay_threads(open_trace(path).rank(0), opts)
    except Exception:
        return "?"
    return f"{n}" if n else f"default ({torch.get_num_threads()})"


def summarise(ops: list) -> tuple[int, int, str]:
    """(total ops, ops replayed (status != skipped), status counts as text)."""
    counts: dict[str, int] = {}
    for r in ops:
        counts[r.status.value] = counts.get(r.status.value, 0) + 1
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return len(ops), len(ops) - counts.get("skipped", 0), statuses


def warm_replay_imports() -> None:
    """One-time costs of the first replay in a process: imports, and the lazy imports of the reference settings
    (torch.use_deterministic_algorithms imports torch._inductor on its first call)."""
    from replaydiff.replay.policy import reference_settings

    with reference_settings(1):
        pass


def _pool_ready(barrier: Any) -> None:
    """Pool initializer: pay a worker's one-time costs, then wait until every worker (and the parent) is up."""
    warm_replay_imports()
    barrier.wait(timeout=120)


COLD_START_CODE = """
import json, time
t0 = time.perf_counter()
from replaydiff.replay.engine import replay_trace
t1 = time.perf_counter()
from replaydiff.replay.policy import reference_settings
with reference_settings(1):
    pass
print(json.dumps({"imports": t1 - t0, "settings": time.perf_counter() - t1}))
"""


def cold_start() -> dict[str, float]:
    """What a fresh replay process (the CLI, or a pool worker) pays before replaying its first op."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", COLD_START_CODE], capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception:
        return {"wall": wall}
    return dict(out, wall=wall)


class WarmPool:
    """A spawn pool whose workers paid their one-time costs before the clock starts; replays split like replay_trace.

    Splits the work with the engine's own plan and shards (what replay_trace does); what it times excludes process
    spawn and imports but includes each worker opening the trace and decoding what it reads.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.startup_s = 0.0
        self._stack = contextlib.ExitStack()
        self._pool: cf.ProcessPoolExecutor | None = None

    def __enter__(self) -> "WarmPool":
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(self.workers + 1)
        t0 = time.perf_counter()
        self._pool = self._stack.enter_context(cf.ProcessPoolExecutor(
            max_workers=self.workers, mp_context=ctx, initializer=_pool_ready, initargs=(barrier,)))
        pings = [self._pool.submit(os.getpid) for _ in range(self.workers)]  # the executor spawns every worker
        barrier.wait(timeout=120)
        for p in pings:
            p.result()
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def replay(self, path: str, opts: ReplayOptions) -> tuple[float, int]:
        """(seconds, ops replayed)."""
        assert self._pool is not None
        shards = plan(open_trace(path), opts).split(self.workers)
        t0 = time.perf_counter()
        futures = [self._pool.submit(_run_shard, path, opts, shard) for shard in shards]
        done = [r for f in futures for r in f.result()]
        seconds = time.perf_counter() - t0
        return seconds, sum(1 for r in done if r.status != "skipped")


def _run_shard(path: str, opts: ReplayOptions, shard: Shard) -> list:
    return run_shard(open_trace(path).rank(shard.rank), opts, shard)


def replay_once(path: str, precision: str, workers: int) -> ReplayResult:
    """replay_trace timed end to end."""
    opts = ReplayOptions(precision=precision)
    gc.collect()
    t0 = time.perf_counter()
    report = replay_trace(path, opts, workers=workers)
    seconds = time.perf_counter() - t0
    total, replayed, statuses = summarise(report.ops)
    return ReplayResult(precision, workers, thread_label(path, opts, workers), total, replayed, statuses, seconds)


def add_warm_figures(path: str, results: list[ReplayResult]) -> None:
    """Replays every multi-worker configuration again on a warm pool (one per worker count)."""
    for workers in sorted({r.workers for r in results if r.workers > 1}):
        rows = [r for r in results if r.workers == workers]
        try:
            with WarmPool(workers) as pool:
                for r in rows:
                    r.startup_s = pool.startup_s
                    r.warm_seconds, warm_n = pool.replay(path, ReplayOptions(precision=r.precision))
                    if warm_n != r.replayed:
                        r.note = f"warm pool replayed {warm_n} ops"
        except Exception as exc:  # engine internals changed under us: report the end-to-end figures only
            for r in rows:
                r.note = f"warm-pool split unavailable ({type(exc).__name__}: {exc})"


def bench_replay(path: str, configs: Iterable[tuple[str, int]]) -> list[ReplayResult]:
    warm_replay_imports()  # in-process (1 worker) figures then measure replay, not this process's first imports
    results = [replay_once(path, precision, workers) for precision, workers in configs]
    add_warm_figures(path, results)
    return results


# -- profiling (--profile) --------------------------------------------------------------------------------------------
def _top(stats: pstats.Stats, key: str, n: int, only: str | None) -> list[list[str]]:
    rows = []
    idx = {"cumulative": 3, "tottime": 2}[key]
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][idx])  # type: ignore[attr-defined]
    for (file, line, func), (cc, nc, tt, ct, _) in entries:
        if only and (only not in file or "/replaydiff/models/" in file):  # the models are the workload
            continue
        where = f"{file.split(only, 1)[1] if only else Path(file).name}:{line}({func})" if file != "~" else func
        rows.append([f"{nc}", f"{tt:.3f}", f"{ct:.3f}", f"{1e6 * ct / max(nc, 1):.0f}", where])
        if len(rows) >= n:
            break
    return rows


def print_profile(title: str, prof: cProfile.Profile, n: int = 15) -> None:
    stats = pstats.Stats(prof)
    print(f"\n{title}: {stats.total_tt:.3f} s profiled in total.")  # type: ignore[attr-defined]
    head = ["calls", "tottime s", "cumtime s", "us/call (cum)", "function"]
    print(f"\n#### {title}: top {n} replaydiff functions by cumulative time\n")
    print(md_table(head, _top(stats, "cumulative", n, "/replaydiff/")))
    print(f"\n#### {title}: top {n} replaydiff functions by own time (tottime)\n")
    print(md_table(head, _top(stats, "tottime", n, "/replaydiff/")))
    print(f"\n#### {title}: top 10 functions overall by own time\n")
    print(md_table(head, _top(stats, "tottime", 10, None)))


def profile_record(cfg: TransformerConfig) -> None:
    """cProfile of one full + zstd recording: the recording thread, and (separately) the writer thread."""
    from replaydiff.trace.writer import RankWriter

    step = build_step(cfg)
    step()
    timed_step(VARIANT_BY_KEY["full+zstd"], step, inspect=False)  # warm-up recording
    writer_prof = cProfile.Profile()
    original_run = RankWriter._run

    def profiled_run(self: RankWriter) -> None:
        writer_prof.enable()
        try:
            original_run(self)
        finally:
            writer_prof.disable()

    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory(prefix="rdbench-") as d:
        RankWriter._run = profiled_run  # type: ignore[method-assign]
        try:
            prof.enable()
            with replaydiff.record(d, tensors="full", compress=True):
                step()
            prof.disable()
        finally:
            RankWriter._run = original_run  # type: ignore[method-assign]
    print_profile("record full + zstd, tiny, recording (main) thread", prof)
    print_profile("record full + zstd, tiny, writer thread", writer_prof, 10)


def profile_replay(path: str) -> None:
    replay_trace(path, ReplayOptions(precision="fp64"))  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    replay_trace(path, ReplayOptions(precision="fp64"))
    prof.disable()
    print_profile("replay fp64, tiny trace, 1 worker", prof)


# -- machine state ----------------------------------------------------------------------------------------------------
class CpuMonitor:
    """Share of the machine's CPU used by *other* processes since start() (Linux /proc/stat; None elsewhere)."""

    def __init__(self) -> None:
        self._start: tuple[float, float, float] | None = None

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        total = sum(fields[:8]) / tick
        idle = (fields[3] + fields[4]) / tick
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        mine = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
        return total, idle, mine

    def start(self) -> None:
        try:
            self._start = self._sample()
        except Exception:
            self._start = None

    def others_share(self) -> float | None:
        if self._start is None:
            return None
        try:
            total, idle, mine = self._sample()
        except Exception:
            return None
        t0, i0, m0 = self._start
        elapsed = total - t0
        busy = elapsed - (idle - i0)
        return max(0.0, busy - (mine - m0)) / elapsed if elapsed > 0 else None


def git_state() -> str:
    root = Path(replaydiff.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.splitlines()
    except Exception:
        return "unknown"
    return f"{head}" + (f" + {len(dirty)} modified tracked files" if dirty else " (clean)")


def print_header(args: argparse.Namespace, models: list[str]) -> None:
    la = os.getloadavg()
    print("# replaydiff benchmark\n")
    print(f"- torch {torch.__version__}, Python {platform.python_version()}, replaydiff {replaydiff.__version__} "
          f"at {git_state()}")
    print(f"- CPUs: os.cpu_count()={os.cpu_count()}, usable={len(os.sched_getaffinity(0))}; "
          f"torch threads: intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}"
          f"{', OMP_NUM_THREADS=' + os.environ['OMP_NUM_THREADS'] if 'OMP_NUM_THREADS' in os.environ else ''}")
    print(f"- mode: {'quick' if args.quick else 'full'}; models: {', '.join(models)}; warm-up steps per variant: "
          f"{args.warmup}; timed rounds: " + ", ".join(f"{m} {rounds(args, m)}" for m in models))
    print(f"- load average at start: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    print("- goals (from the issues): `full` <= 3x plain on tiny, <= 1.5x on mid; `stats` <= 3x on tiny, <= 1.5x on "
          "mid; `--granularity module` <= 1.1x on mid; flight recorder <= 1.2x on mid; "
          "trace bytes <= 0.12x naive; replay >= 10,000 ops/s per core on tiny")


# -- tables -----------------------------------------------------------------------------------------------------------
def md_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def record_table(res: dict[str, VariantResult]) -> str:
    plain = res["plain"].median_s
    plain_min = res["plain"].spread_s[0]
    rows = []
    for v in VARIANTS:
        r = res[v.key]
        lo, hi = r.spread_s
        ops = r.last.ops_written
        rows.append([v.label, f"{1e3 * r.median_s:.1f}", f"{1e3 * lo:.1f}-{1e3 * hi:.1f}",
                     f"{r.median_s / plain:.2f}x", f"{lo / plain_min:.2f}x",
                     f"{1e3 * r.median_exit_s:.1f}" if v.records else "-", str(ops) if ops is not None else "-"])
    return md_table(["variant", "ms/step (median)", "min-max ms", "vs plain", "vs plain (min/min)",
                     "of which exit/flush ms", "ops in trace"], rows)


def bytes_table(res: dict[str, VariantResult], naive_ops: int, naive: int) -> str:
    rows = [["naive (every input + output of every op)", fmt_bytes(naive), "-", "-", "1.000x"]]
    for v in VARIANTS:
        if not v.records:
            continue
        s = res[v.key].last
        rows.append([v.label, fmt_bytes(s.total_bytes), fmt_bytes(s.data_bytes),
                     fmt_bytes(s.total_bytes - s.data_bytes), f"{s.total_bytes / naive:.3f}x"])
    return (f"ops per step seen by a dispatch mode: {naive_ops}\n\n"
            + md_table(["variant", "trace bytes", "of which data/", "ops + manifest", "vs naive"], rows))


def rss_table(rss: dict[str, dict[str, Any]]) -> str:
    plain = rss.get("plain", {}).get("peak_kib")
    rows = []
    for v in VARIANTS:
        r = rss[v.key]
        if "error" in r:
            rows.append([v.label, "-", "-", "-", "-", r["error"]])
            continue
        delta = f"{(r['peak_kib'] - plain) / 1024:+.1f}" if plain else "-"
        hwm = f"{r['hwm_kib'] / 1024:.1f}" if r.get("hwm_kib") else "-"
        rows.append([v.label, f"{r['peak_kib'] / 1024:.1f}", delta, f"{r['warm_kib'] / 1024:.1f}", hwm, ""])
    return md_table(["variant", "peak RSS MiB", "vs plain MiB", "after plain warm-up step MiB",
                     "VmHWM MiB (check)", "note"], rows)


def replay_table(results: list[ReplayResult]) -> str:
    rows = []
    for r in results:
        e2e = r.replayed / r.seconds
        warm = f"{r.replayed / r.warm_seconds:,.0f}" if r.warm_seconds else "-"
        warm_pc = f"{r.replayed / r.warm_seconds / r.workers:,.0f}" if r.warm_seconds else "-"
        rows.append([r.precision, str(r.workers), r.threads, f"{r.replayed}/{r.total_ops}", r.statuses,
                     f"{r.seconds:.2f}", f"{e2e:,.0f}", f"{r.total_ops / r.seconds:,.0f}", f"{e2e / r.workers:,.0f}",
                     f"{r.startup_s:.2f}" if r.startup_s is not None else "-",
                     f"{r.warm_seconds:.2f}" if r.warm_seconds else "-", warm, warm_pc])
        if r.note:
            rows[-1][4] += f" ({r.note})"
    return md_table(["precision", "workers", "threads/worker", "replayed/total", "statuses", "e2e s",
                     "replayed ops/s", "all ops/s", "replayed ops/s/worker", "pool start s", "warm-pool s",
                     "warm ops/s", "warm ops/s/worker"], rows)


def goals_table(record: dict[str, dict[str, VariantResult]], byte_ratio: dict[str, dict[str, float]],
                replay: dict[str, list[ReplayResult]]) -> str:
    rows = []

    def ratio(model: str, key: str) -> float:
        return record[model][key].median_s / record[model]["plain"].median_s

    def add(goal: str, measured: str, value: float, limit: float, higher_is_better: bool = False) -> None:
        ok = value >= limit if higher_is_better else value <= limit
        rows.append([goal, measured, "met" if ok else "MISSED"])

    for goal, kind, model, limit in GOALS:
        models = [m for m in ([model] if model else list(record)) if m in record]
        for m in models:
            if kind != "replay" and not record[m]:  # --replay-only: nothing recorded to judge by
                continue
            if kind == "record":
                for key in ("full", "full+zstd"):
                    add(goal, f"{key} on {m}: {ratio(m, key):.2f}x", ratio(m, key), limit)
            elif kind.startswith("key:"):
                key = kind[4:]
                add(goal, f"{key} on {m}: {ratio(m, key):.2f}x", ratio(m, key), limit)
            elif kind == "bytes":
                for key, value in byte_ratio[m].items():
                    add(goal, f"{key} on {m}: {value:.3f}x", value, limit)
            elif kind == "replay" and replay.get(m):
                best = max(replay[m], key=per_core_rate)
                add(goal, f"best on {m}: {per_core_rate(best):,.0f} ops/s/worker ({best.precision}, "
                          f"{best.workers} worker{'s' if best.workers > 1 else ''}"
                          f"{', warm pool' if best.warm_seconds else ''})", per_core_rate(best), limit, True)
    return md_table(["goal", "measured", "verdict"], rows)


def per_core_rate(r: ReplayResult) -> float:
    seconds = r.warm_seconds or r.seconds
    return r.replayed / seconds / r.workers


# -- main -------------------------------------------------------------------------------------------------------------
def rounds(args: argparse.Namespace, model: str) -> int:
    if args.repeats:
        return args.repeats
    if args.quick:
        return 2
    return 3 if model == "mid" else 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model only (unless --models), 2 rounds: < ~2 min")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds per variant (default 5 for tiny and 3 for mid; 2 with --quick)")
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up steps per model and variant before timing; instrumented the first time a variant "
                        "runs in this process, plain afterwards (default 1)")
    p.add_argument("--models", default=None, help="comma-separated: tiny,mid (default both; tiny with --quick)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--record-only", action="store_true",
                   help="sections 1 and 2 only (no peak RSS, no replay): the overhead table in a few minutes")
    p.add_argument("--replay-only", action="store_true",
                   help="section 4 only (record the trace, then the replay throughput table); "
                        "tests/bench/bench_replay.py gives medians of many rounds and us/op by part")
    p.add_argument("--profile", action="store_true",
                   help="also print cProfile tables for full+zstd recording and fp64 replay of the tiny model")
    p.add_argument("--_rss-child", nargs=2, metavar=("MODEL", "VARIANT"), dest="rss_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.models is None:
        args.models = "tiny" if args.quick else "tiny,mid"
    return args


class Section:
    """Wall time of a section and the share of the machine that other processes used meanwhile."""

    def __enter__(self) -> "Section":
        self.monitor = CpuMonitor()
        self.monitor.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.others = self.monitor.others_share()

    def __str__(self) -> str:
        busy = f"; other processes used {100 * self.others:.0f}% of the CPUs" if self.others is not None else ""
        return f"{self.seconds:.0f} s{busy}"


def section_record(name: str, args: argparse.Namespace) -> dict[str, VariantResult]:
    with Section() as sec:
        rec = bench_record(MODELS[name], rounds(args, name), args.warmup)
    print(f"### 1. Record overhead per training step ({rounds(args, name)} rounds round-robin, median; {sec})\n")
    print(record_table(rec))
    problems = {v.label: s.problem for v in VARIANTS for s in rec[v.key].samples if s.problem}
    for label, why in problems.items():
        print(f"\n  warning: {label}: {why}")
    return rec


def section_bytes(name: str, rec: dict[str, VariantResult]) -> dict[str, float]:
    naive_ops, naive = naive_bytes(MODELS[name])
    print("\n### 2. Trace bytes on disk vs naive bytes\n")
    print(bytes_table(rec, naive_ops, naive), flush=True)
    return {v.key: rec[v.key].last.total_bytes / naive for v in VARIANTS if v.key.startswith("full")}


def section_rss(name: str, args: argparse.Namespace) -> None:
    with Section() as sec:
        rss = measure_all_rss(name, args.threads)
    print(f"\n### 3. Peak RSS (ru_maxrss), one fresh process per variant: one plain warm-up step, then one "
          f"step of the variant ({sec})\n")
    print(rss_table(rss), flush=True)


def section_replay(name: str, args: argparse.Namespace, path: str) -> list[ReplayResult]:
    trace = record_replay_trace(MODELS[name], path)
    with Section() as sec:
        replay = bench_replay(path, QUICK_REPLAYS if args.quick else FULL_REPLAYS)
    print(f"\n### 4. Replay throughput of a full + zstd trace ({trace.ops_written} ops, "
          f"{fmt_bytes(trace.total_bytes)}; {sec})\n")
    print(replay_table(replay), flush=True)
    cold = cold_start()
    print(f"\nCold start of a fresh replay process (not in the 1-worker rows; in the e2e rows of workers > 1, once "
          f"per worker): {cold['wall']:.2f} s wall, of which importing replaydiff.replay.engine (torch included) "
          f"{cold.get('imports', float('nan')):.2f} s and the first reference_settings() "
          f"{cold.get('settings', float('nan')):.2f} s (use_deterministic_algorithms imports torch._inductor).")
    return replay


def run_model(name: str, args: argparse.Namespace, tmp: str) -> tuple[dict[str, VariantResult], dict[str, float],
                                                                       list[ReplayResult]]:
    cfg = MODELS[name]
    print(f"\n## {name}: TransformerConfig({cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, "
          f"seq {cfg.seq}, batch {cfg.batch}, dropout {cfg.dropout}), AdamW\n", flush=True)
    if args.replay_only:
        return {}, {}, section_replay(name, args, os.path.join(tmp, f"{name}-trace"))
    rec = section_record(name, args)
    ratios = section_bytes(name, rec)
    if args.record_only:
        return rec, ratios, []
    section_rss(name, args)
    path = os.path.join(tmp, f"{name}-trace")
    replay = section_replay(name, args, path)
    if args.profile and name == "tiny":
        print("\n### Profiles (--profile)")
        profile_record(cfg)
        profile_replay(path)
    return rec, ratios, replay


def run_all(args: argparse.Namespace, models: list[str]) -> None:
    record: dict[str, dict[str, VariantResult]] = {}
    byte_ratio: dict[str, dict[str, float]] = {}
    replay: dict[str, list[ReplayResult]] = {}
    with tempfile.TemporaryDirectory(prefix="rdbench-") as tmp:
        for name in models:
            record[name], byte_ratio[name], replay[name] = run_model(name, args, tmp)
    print("\n## Goals (from the issue) vs measured\n")
    print(goals_table(record, byte_ratio, replay))
    print(NOTES)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(*args.rss_child)
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}", file=sys.stderr)
        return 2
    with Section() as total:
        print_header(args, models)
        run_all(args, models)
    la = os.getloadavg()
    print(f"\n- wall time {total}; load average at end: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    return 0


NOTES = """
Notes on method:
- ms/step: one training step inside the variant's `with` block, timed from entering to leaving it; for replaydiff this
  includes creating the recorder, the environment snapshot and the exit (writer flush, final manifest). Each variant
  steps its own model (same seed); variants are interleaved round-robin with a rotating start, after warm-up.
- vs plain: median / median of the plain step; min/min is the same with the fastest samples, which suffer least
  from other processes. On a busy machine the spread (min-max) is wide: read it too.
- naive bytes: sum of nelement * element_size over every tensor argument and output of every op of one step.
- peak RSS: ru_maxrss of a fresh process (imports, model, one plain warm-up step, one step of the variant), started
  through /bin/sh so that it does not inherit this process's high-water mark; VmHWM is the kernel's cross-check.
- replay: replay_trace timed end to end (open, read, decode, replay, compare; for workers > 1 also spawning the pool
  and each worker's cold start). The 1-worker rows run in this process after its one-time imports. replayed = ops
  with status != skipped. warm-pool: the same split of work (the engine's plan and shards) on a spawn pool
  whose workers had imported replaydiff and entered the reference settings once before the clock started; 'pool
  start s' is that start-up. ops/s/worker = ops/s / workers. threads/worker is what the engine sets
  (torch.set_num_threads); above 1, every intra-op parallel region must wake a second thread, which is slow when the
  cores are busy."""


if __name__ == "__main__":
    sys.exit(main())
