"""Sweep over PyTorch's OpInfo database: record every CPU OpInfo's first samples, replay them, count what fails.

For every OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` that supports the pass's dtype on the
CPU, its first two sample inputs (and, where the OpInfo has one, its in-place variant on the same samples) are run
inside ``replaydiff.record``, one trace per group of OpInfos, and each trace is replayed at ``fp64`` and at ``same``
(by default by one fresh Python process at the end, as a user replays: elsewhere, without what recording imported).
Every replayed op is attributed to the sample that produced it through op counts (a counting dispatch mode entered
inside the recorder sees exactly the ops the recorder numbers). Passes:

- ``f32``:  float32 samples, forward only (plus in-place variants);
- ``grad``: float32 samples with ``requires_grad``, then backward of the sum of the floating outputs;
- ``bf16``: bfloat16 samples, forward only (plus in-place variants).

A sample that raises when run *without* the recorder is dropped (an OpInfo with no sample left is excluded); both
are listed with the exception. Besides the replay statuses the sweep checks the recorder's own promise: a sample
must not raise under recording when it does not without, and its results (outputs, mutated inputs, gradients) must
be bitwise those of the run without recording.

Only public entry points are used: ``replaydiff.record``, ``replaydiff.trace.open_trace(...).rank(0).lost`` and
``replaydiff.replay.replay_trace`` with ``ReplayOptions``.

    python tests/opdb_sweep.py [--passes f32,grad,bf16] [--limit N] [--only GLOB] [--json FILE] [--time-box S]
                               [--samples N] [--group N] [--threads N] [--replay-in-process]
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import fnmatch
import itertools
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import replaydiff
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.trace import open_trace

STATUSES = ("ok", "divergent", "error", "nondeterministic", "skipped")
PRECISIONS = ("fp64", "same")
UNINITIALISED_SKIP = "uninitialised output (empty*)"  # the one skip reason expected of op_db samples
SAMPLES = 2  # per OpInfo (and per variant)
GROUP_SIZE = 20
BASE_SEED = 1234


@dataclass(frozen=True)
class Pass:
    name: str
    dtype: torch.dtype
    grad: bool
    inplace: bool  # also run the OpInfo's in-place variant on fresh copies of the samples


PASSES = {
    "f32": Pass("f32", torch.float32, grad=False, inplace=True),
    "grad": Pass("grad", torch.float32, grad=True, inplace=False),
    "bf16": Pass("bf16", torch.bfloat16, grad=False, inplace=True),
}

# OpInfos whose outputs are uninitialised memory: their results cannot be compared with and without recording.
_UNINITIALISED_OPINFOS = ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                          "empty_permuted")


def load_op_db() -> list:
    """``op_db``. Importing it calls ``torch.backends.disable_global_flags()``, as a user's test suite built on
    torch's testing utilities does; replay works with the flags frozen (docs/design/opdb-triage.md class 9, fixed), so they stay so."""
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


# -- what one recorded run is ----------------------------------------------------------------------------------
@dataclass
class Unit:
    """One variant of one OpInfo on one sample: the thing recorded and attributed."""

    opinfo: str
    variant: str  # "op" | "inplace"
    sample: int
    seed: int
    first: int = -1  # op numbers [first, end) in its trace
    end: int = -1
    trace: int = -1
    raised: str | None = None  # raised under recording (it did not without)
    lost: str | None = None  # the recording stopped during this unit
    changed: str | None = None  # results differ from the run without recording


@dataclass
class OpRow:
    pass_name: str
    precision: str
    opinfo: str
    variant: str
    sample: int
    index: int
    op: str
    status: str
    reason: str | None


@dataclass
class PassResult:
    name: str
    seconds: float = 0.0  # recording (and, without a fresh replay process, replaying)
    opinfos: list[str] = field(default_factory=list)  # OpInfos recorded
    units: list[Unit] = field(default_factory=list)
    rows: list[OpRow] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)  # OpInfo -> why not run at all
    dropped: list[tuple[str, str, int, str]] = field(default_factory=list)  # (OpInfo, variant, sample, why)
    unattributed: list[str] = field(default_factory=list)  # op-count checks that failed
    replay_warnings: list[str] = field(default_factory=list)
    time_boxed: int = 0  # OpInfos not reached before the time box ran out
    replay_seconds: float = 0.0  # the fresh replay process, shared by the passes run together (0: replayed inline)


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach the dispatch modes; entered inside ``replaydiff.record`` it sits above the
    recorder and sees exactly the ops the recorder numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


# -- samples ---------------------------------------------------------------------------------------------------
def opinfo_seed(name: str) -> int:
    """A seed per OpInfo, independent of which other OpInfos are selected."""
    return BASE_SEED + zlib.crc32(name.encode()) % 100_000


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def make_samples(opinfo: Any, p: Pass, seed: int, n: int | None) -> list:
    """The OpInfo's first ``n`` samples (all for None) for this pass, generated afresh from the seed (so every run
    gets equal inputs)."""
    seed_everything(seed)
    return list(itertools.islice(opinfo.sample_inputs("cpu", p.dtype, requires_grad=p.grad), n))


def _flatten(v: Any) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _flatten(item)]
    if isinstance(v, dict):
        return [x for item in v.values() for x in _flatten(item)]
    return [v] if isinstance(v, (int, float, bool, complex)) else []


def variant_fn(opinfo: Any, variant: str) -> Callable:
    return opinfo.op if variant == "op" else opinfo.inplace_variant


def run_sample(opinfo: Any, variant: str, sample: Any, p: Pass, seed: int) -> list:
    """Run one sample; return everything it produced (outputs, the mutated input, gradients) to compare later."""
    torch.manual_seed(seed)
    out = variant_fn(opinfo, variant)(sample.input, *sample.args, **sample.kwargs)
    results = _flatten(out)
    if variant == "inplace":
        results += _flatten(sample.input)
    if p.grad:
        floats = [t for t in _flatten(sample.output_process_fn_grad(out)) if isinstance(t, torch.Tensor)
                  and t.is_floating_point() and t.requires_grad]
        if floats:
            loss = floats[0].sum()
            for t in floats[1:]:
                loss = loss + t.sum()
            loss.backward()
        leaves = [t for t in _flatten([sample.input, list(sample.args), sample.kwargs])
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        results += [t.grad for t in leaves if t.grad is not None]
    read_back(sample)
    return results


def read_back(sample: Any) -> None:
    """Read every tensor the sample gave the op once more (one clone each).

    A write the recorder did not see (an argument the op's schema does not mark written) leaves the recorder
    thinking the storage still holds the bytes it stored before the op; the clone is then recorded with those stale
    bytes as input and the new bytes as output, and replays divergent. Without this read, such a write would go
    unnoticed: nothing else in a sample reads the argument again."""
    with torch.no_grad():
        for t in _flatten([sample.input, list(sample.args), sample.kwargs]):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                torch.clone(t)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:240]


def _same(a: list, b: list) -> str | None:
    """None when two runs' results are bitwise equal (NaNs equal), else what differs."""
    if len(a) != len(b):
        return f"{len(a)} results vs {len(b)}"
    for k, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"result {k}: tensor vs {type(y).__name__}"
        if not isinstance(x, torch.Tensor):
            if x != y and not (isinstance(x, float) and math.isnan(x) and isinstance(y, float) and math.isnan(y)):
                return f"result {k}: {x!r} vs {y!r}"
            continue
        if x.layout != torch.strided or y.layout != torch.strided:
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"result {k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        x, y = x.detach().resolve_conj().resolve_neg(), y.detach().resolve_conj().resolve_neg()
        if x.is_complex():
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        if x.is_floating_point():
            same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        else:
            same = x == y
        if not bool(same.all()):
            return f"result {k}: {int((~same).sum())} of {x.numel()} elements differ"
    return None


# -- one pass --------------------------------------------------------------------------------------------------
def select(op_db: list, p: Pass, only: list[str] | None, limit: int | None) -> tuple[list, dict[str, str]]:
    """(OpInfos to run, {OpInfo: why excluded}) for this pass."""
    chosen, excluded = [], {}
    for o in op_db:
        name = o.full_name
        if only and not any(fnmatch.fnmatchcase(name, g) for g in only):
            continue
        if p.dtype not in o.supported_dtypes("cpu"):
            excluded[name] = f"does not support {str(p.dtype).removeprefix('torch.')} on cpu"
        elif p.grad and not o.supports_autograd:
            excluded[name] = "does not support autograd"
        elif p.grad and p.dtype not in o.supported_backward_dtypes("cpu"):
            excluded[name] = f"no backward at {str(p.dtype).removeprefix('torch.')} on cpu"
        else:
            chosen.append(o)
    if limit is not None and len(chosen) > limit:
        names = [o.full_name for o in op_db]
        stop = names.index(chosen[limit].full_name)  # exclusions past the last OpInfo run are not reported
        excluded = {k: v for k, v in excluded.items() if names.index(k) < stop}
        chosen = chosen[:limit]
    return chosen, excluded


def precheck(opinfo: Any, p: Pass, n: int | None, res: PassResult) -> list[tuple[str, int, list]]:
    """Run each (variant, sample) without recording; return those that ran with their results."""
    name, seed = opinfo.full_name, opinfo_seed(opinfo.full_name)
    variants = ["op"] + (["inplace"] if p.inplace and opinfo.inplace_variant is not None else [])
    ran = []
    for variant in variants:
        try:
            samples = make_samples(opinfo, p, seed, n)
        except Exception as exc:
            res.dropped.append((name, variant, -1, f"sample_inputs raised {_first_line(exc)}"))
            continue
        if not samples:
            res.dropped.append((name, variant, -1, "no sample inputs"))
        for k, sample in enumerate(samples):
            if variant == "inplace" and not isinstance(sample.input, torch.Tensor):
                res.dropped.append((name, variant, k, "sample input is not a tensor"))
                continue
            try:
                ran.append((variant, k, run_sample(opinfo, variant, sample, p, seed + k)))
            except Exception as exc:
                res.dropped.append((name, variant, k, f"raises without recording: {_first_line(exc)}"))
    if not ran:
        reasons = sorted({why for o, _, _, why in res.dropped if o == name})
        res.excluded[name] = "; ".join(reasons) or "no sample ran"
    return ran


def record_group(path: Path, jobs: list[tuple[Unit, Any, Any, list]], p: Pass) -> list[tuple[Unit, Any, Any, list]]:
    """Record units into one trace until one of them makes the recording stop; return the units not recorded."""
    done: list[tuple[Unit, list, list | None]] = []
    rest = list(jobs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(path), OpCounter() as counter:
            while rest:
                unit, opinfo, sample, before = rest.pop(0)
                seen = len(caught)
                unit.first = counter.n
                try:
                    after = run_sample(opinfo, unit.variant, sample, p, unit.seed)
                except Exception as exc:
                    unit.raised = _first_line(exc)
                    after = None
                unit.end = counter.n
                done.append((unit, before, after))
                stopped = [str(w.message) for w in caught[seen:] if issubclass(w.category, RuntimeWarning)
                           and str(w.message).startswith("replaydiff:")]
                if stopped:
                    unit.lost = stopped[0]
                    break
    for (unit, before, after), (_, opinfo, _, _) in zip(done, jobs):  # outside the recording: nothing recorded
        if after is not None and not any(fnmatch.fnmatchcase(unit.opinfo, g) for g in _UNINITIALISED_OPINFOS):
            unit.changed = _same(before, after)
            if unit.changed:
                unit.changed = f"{unit.changed} ({_why_changed(opinfo, unit, p, before)})"
    return rest


ANY_MODE = "a no-op dispatch mode changes it too"
RERUNS = 20  # plain reruns before a changed result is put down to recording (only changed samples are rerun)
NOT_DETERMINISTIC = "a second run without recording differs too"
EXPLAINED = (ANY_MODE, NOT_DETERMINISTIC)


class NoOpMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _why_changed(opinfo: Any, unit: Unit, p: Pass, before: list) -> str:
    """Is a result that changed under recording explained without replaydiff? Either the sample is not
    deterministic at all (a second plain run differs: linalg.lstsq's gelsy driver), or any dispatch mode changes it
    (torch's composite ops pick other algorithms whenever a dispatch mode is active: docs/design/opdb-triage.md)."""
    def rerun(mode: TorchDispatchMode | None, scribble: int = 0) -> list:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sample = make_samples(opinfo, p, unit.seed - unit.sample, unit.sample + 1)[unit.sample]
            # Vary what the allocator hands out (addresses, leftover bytes) from one rerun to the next: MKL's gelsy
            # gives other bits from call to call, more or less often depending on the memory it gets.
            keep = torch.empty(8 * scribble) if scribble % 2 else None
            if scribble % 3 == 2:
                del [torch.full((1 << (8 + k),), float(scribble + k)) for k in range(8)][:]
            with mode or contextlib.nullcontext():
                out = run_sample(opinfo, unit.variant, sample, p, unit.seed)
            del keep
            return out

    if any(_same(before, rerun(None, k)) is not None for k in range(RERUNS)):
        return NOT_DETERMINISTIC
    if _same(before, rerun(NoOpMode())) is not None:
        return ANY_MODE
    return "only under replaydiff.record"


def replay_traces(paths: list[str]) -> dict[str, dict[str, dict]]:
    """{trace: {precision: {"ops": [[index, op, status, reason], ...], "warnings": [...]}}}, replayed here."""
    out: dict[str, dict[str, dict]] = {}
    for path in paths:
        out[path] = {}
        for precision in PRECISIONS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = replay_trace(str(path), ReplayOptions(precision=precision))
            out[path][precision] = {"ops": [[r.index, str(r.op), status_name(r.status), r.reason] for r in report.ops],
                                    "warnings": [str(w) for w in report.warnings]}
    return out


def replay_in_fresh_process(paths: list[str]) -> dict[str, dict[str, dict]]:
    """replay_traces run by a new Python process, as ``replaydiff replay`` would be: it imports torch and replaydiff
    only, not what the recording process had imported (op_db, torch.testing, modules that register custom ops)."""
    with tempfile.TemporaryDirectory(prefix="opdb-replay-") as d:
        inp, outp = Path(d) / "in.json", Path(d) / "out.json"
        inp.write_text(json.dumps(paths))
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--replay-worker", str(inp), str(outp)],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(outp.read_text())


def attribute(path: Path, units: list[Unit], replayed: dict[str, dict], p: Pass, res: PassResult) -> None:
    """Give every replayed op of one trace to the unit whose op numbers hold it."""
    lost = open_trace(path).rank(0).lost
    if lost and not any(u.lost for u in units):
        units[-1].lost = "; ".join(lost)
    starts = [u.first for u in units]
    counted = {i for u in units for i in range(u.first, u.end)}
    for precision in PRECISIONS:
        rep = replayed[precision]
        res.replay_warnings += [f"{precision}: {w}" for w in rep["warnings"]]
        indices = {i for i, *_ in rep["ops"]}
        if not indices <= counted:
            res.unattributed.append(f"{precision}: ops {sorted(indices - counted)[:5]} of {path.name} "
                                    f"belong to no unit")
        for index, op, status, reason in rep["ops"]:
            u = units[bisect.bisect_right(starts, index) - 1]
            res.rows.append(OpRow(p.name, precision, u.opinfo, u.variant, u.sample, index, op, status, reason))


def status_name(status: Any) -> str:
    """The plain name of a status (a str or a str-Enum)."""
    for s in STATUSES:
        if status == s:
            return s
    return str(getattr(status, "value", status))


def record_pass(op_db: list, p: Pass, tmp: Path, only: list[str] | None, limit: int | None, group: int,
                time_box: float | None, log: Callable[[str], None] | None, samples_per_opinfo: int | None,
                replay_now: bool) -> tuple[PassResult, list[tuple[Path, list[Unit]]]]:
    """Record one pass into traces under ``tmp``; with ``replay_now`` replay (and delete) each trace in this process
    right after recording it, else return the traces to be replayed later."""
    t0 = time.perf_counter()
    res = PassResult(p.name)
    chosen, res.excluded = select(op_db, p, only, limit)
    tmp.mkdir(parents=True)
    traces: list[tuple[Path, list[Unit]]] = []
    for g in range(0, len(chosen), group):
        if time_box is not None and time.perf_counter() - t0 > time_box:
            res.time_boxed = len(chosen) - g
            break
        jobs = []
        for opinfo in chosen[g:g + group]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ran = precheck(opinfo, p, samples_per_opinfo, res)
                seed = opinfo_seed(opinfo.full_name)
                samples = {}
                for variant, k, before in ran:
                    if variant not in samples:
                        samples[variant] = make_samples(opinfo, p, seed, samples_per_opinfo)
                    unit = Unit(opinfo.full_name, variant, k, seed + k)
                    jobs.append((unit, opinfo, samples[variant][k], before))
            if ran:
                res.opinfos.append(opinfo.full_name)
        while jobs:
            path = tmp / f"t{len(traces)}"
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=UserWarning)
                warnings.filterwarnings("ignore", category=DeprecationWarning)
                rest = record_group(path, jobs, p)
            units = [u for u, *_ in jobs[:len(jobs) - len(rest)]]
            for u in units:
                u.trace = len(traces)
            res.units += units
            traces.append((path, units))
            if replay_now:
                attribute(path, units, replay_traces([str(path)])[str(path)], p, res)
                shutil.rmtree(path, ignore_errors=True)
            jobs = rest
        if log:
            log(f"[{p.name}] {min(g + group, len(chosen))}/{len(chosen)} OpInfos recorded, "
                f"{time.perf_counter() - t0:.0f} s")
    res.seconds = time.perf_counter() - t0
    return res, [] if replay_now else traces


def run_passes(op_db: list, passes: list[Pass], only: list[str] | None = None, limit: int | None = None,
               group: int = GROUP_SIZE, time_box: float | None = None, workdir: Path | None = None,
               log: Callable[[str], None] | None = None, samples_per_opinfo: int | None = SAMPLES,
               fresh_process: bool = True) -> list[PassResult]:
    """Record and replay passes. With ``fresh_process`` every trace of every pass is replayed at the end by one new
    Python process (as a user replays: elsewhere, later); without it, each trace right after it is recorded."""
    tmp = Path(tempfile.mkdtemp(prefix="opdb-", dir=workdir))
    try:
        recorded = [(p, *record_pass(op_db, p, tmp / p.name, only, limit, group, time_box, log,
                                     samples_per_opinfo, replay_now=not fresh_process)) for p in passes]
        paths = [str(path) for _, _, traces in recorded for path, _ in traces]
        if paths:
            t0 = time.perf_counter()
            replayed = replay_in_fresh_process(paths)
            for p, res, traces in recorded:
                for path, units in traces:
                    attribute(path, units, replayed[str(path)], p, res)
                res.replay_seconds = time.perf_counter() - t0
            if log:
                log(f"{len(paths)} traces replayed in a fresh process, {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [res for _, res, _ in recorded]


def run_pass(op_db: list, p: Pass, **kwargs: Any) -> PassResult:
    """One pass of ``run_passes``."""
    return run_passes(op_db, [p], **kwargs)[0]


# -- summaries -------------------------------------------------------------------------------------------------
def reason_key(reason: str | None) -> str:
    """A skip reason with op names and numbers taken out, so that equal causes count together."""
    if not reason:
        return "-"
    return re.sub(r"(?<![\w.])\d+(\.\d+)?(e[+-]?\d+)?", "N", reason)


def summary(res: PassResult, precision: str) -> dict:
    rows = [r for r in res.rows if r.precision == precision]
    c = Counter(r.status for r in rows)
    skipped = Counter(reason_key(r.reason) for r in rows if r.status == "skipped")
    return {
        "pass": res.name, "precision": precision, "opinfos": len(res.opinfos), "units": len(res.units),
        "ops": len(rows), **{s: c.get(s, 0) for s in STATUSES},
        "lost": sum(1 for u in res.units if u.lost),
        "raised_under_record": sum(1 for u in res.units if u.raised),
        "changed_by_record": sum(1 for u in res.units if u.changed and not explained(u.changed)),
        "changed_explained": sum(1 for u in res.units if u.changed and explained(u.changed)),
        "skipped_by_reason": dict(skipped.most_common()),
        "opinfos_failing": len({r.opinfo for r in rows if r.status in ("divergent", "error", "nondeterministic")}
                               | {u.opinfo for u in res.units
                                  if u.lost or u.raised or (u.changed and not explained(u.changed))}),
        "ok_uncompared": dict(Counter(r.op for r in rows if r.status == "ok" and r.reason
                                      and r.reason.startswith("nothing to compare")).most_common()),
    }


def returns_new_tensor(op: str) -> bool:
    """Does the op's schema return at least one tensor that is not an alias of an input?"""
    try:
        ns, name, overload = op.split(".")
        schema = getattr(getattr(getattr(torch.ops, ns), name), overload)._schema
    except (ValueError, AttributeError, RuntimeError):
        return True
    return any(r.alias_info is None and "Tensor" in str(r.type) for r in schema.returns)


def explained(changed: str) -> bool:
    """Is a "changed by recording" verdict explained without replaydiff (not deterministic, or any mode)?"""
    return any(e in changed for e in EXPLAINED)


def _table(rows: list[list[str]], out) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for n, r in enumerate(rows):
        print("| " + " | ".join(str(v).ljust(w) for v, w in zip(r, widths)) + " |", file=out)
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=out)


def _section(out, title: str, rows: list[list], note: str | None = None) -> None:
    """A heading and a table (the first row names the columns), or "none" when the table has no rows."""
    print(f"{title}\n", file=out)
    if note:
        print(f"{note}\n", file=out)
    if len(rows) > 1:
        _table(rows, out)
    else:
        print("none", file=out)
    print(file=out)


def render(results: list[PassResult], out=sys.stdout, header: str = "###") -> None:
    rows = [["pass", "precision", "OpInfos", "samples run", "ops", "ok", "divergent", "error", "nondet", "skipped",
             "lost recordings", "raised under record", "changed by record", "changed, not by replaydiff",
             "OpInfos failing"]]
    for res in results:
        for prec in PRECISIONS:
            s = summary(res, prec)
            rows.append([s["pass"], prec, s["opinfos"], s["units"], s["ops"], s["ok"], s["divergent"], s["error"],
                         s["nondeterministic"], s["skipped"], s["lost"], s["raised_under_record"],
                         s["changed_by_record"], s["changed_explained"], s["opinfos_failing"]])
    _section(out, f"{header} Summary", rows)
    for res in results:
        extra = f"; {res.time_boxed} OpInfos not reached (time box)" if res.time_boxed else ""
        print(f"- {res.name}: {len(res.opinfos)} OpInfos recorded in {res.seconds:.0f} s, {len(res.excluded)} "
              f"excluded, {len(res.dropped)} samples dropped{extra}", file=out)
    if results and results[0].replay_seconds:
        print(f"- replayed by one fresh process in {results[0].replay_seconds:.0f} s (all passes, both precisions)",
              file=out)
    print(file=out)

    rows = [["pass", "fp64", "same", "reason"]]
    for res in results:
        fp64, same = (summary(res, prec)["skipped_by_reason"] for prec in PRECISIONS)
        rows += [[res.name, fp64.get(k, 0), same.get(k, 0), k] for k in dict.fromkeys([*fp64, *same])]
    _section(out, f"{header} Skipped ops by reason (counts at fp64 / same)", rows)

    rows = [["pass", "OpInfo", "op", "fp64", "same", "reason"]]
    for res in results:
        c = Counter((r.opinfo, r.op, r.reason, r.precision) for r in res.rows
                    if r.status == "skipped" and r.reason != UNINITIALISED_SKIP)
        for o, op, why in dict.fromkeys(k[:3] for k in c):
            rows.append([res.name, o, op, c[(o, op, why, "fp64")], c[(o, op, why, "same")], why])
    _section(out, f"{header} Ops skipped for another reason than an uninitialised output (counts at fp64 / same)",
             rows)

    rows = [["pass", "count", "op"]]
    for res in results:
        rows += [[res.name, n, op] for op, n in summary(res, "fp64")["ok_uncompared"].items()
                 if returns_new_tensor(op)]
    _section(out, f"{header} Ops replayed ok with nothing compared although their schema returns a new tensor (fp64)",
             rows, "(views and aliases, which are checked by shape, stride and offset only, are left out; the JSON "
                   "file has them all)")

    rows = [["pass", "precision", "OpInfo", "variant/sample", "#", "op", "status", "reason"]]
    for res in results:
        rows += [[r.pass_name, r.precision, r.opinfo, f"{r.variant}/{r.sample}", r.index, r.op, r.status,
                  (r.reason or "").replace("|", "/")[:160]]
                 for r in res.rows if r.status in ("divergent", "error", "nondeterministic")]
    _section(out, f"{header} Divergent, error and nondeterministic ops", rows)

    rows = [["pass", "OpInfo", "variant/sample", "problem"]]
    for res in results:
        for u in res.units:
            for kind, what in (("lost", u.lost), ("raised", u.raised), ("changed", u.changed)):
                if what:
                    rows.append([res.name, u.opinfo, f"{u.variant}/{u.sample}", f"{kind}: {what}"[:200]])
        rows += [[res.name, "-", "-", f"attribution: {what}"] for what in res.unattributed]
    _section(out, f"{header} Recorder problems (lost recordings, raised or changed under recording)", rows)

    rows = [["pass", "OpInfo", "variant/sample", "reason"]]
    for res in results:
        rows += [[res.name, name, "all", why.replace("|", "/")[:200]] for name, why in sorted(res.excluded.items())]
        rows += [[res.name, name, f"{variant}/{k}", why.replace("|", "/")[:200]]
                 for name, variant, k, why in res.dropped if name not in res.excluded]
    _section(out, f"{header} Excluded OpInfos and dropped samples", rows)


def to_json(results: list[PassResult]) -> dict:
    return {
        "torch": torch.__version__,
        "summaries": [summary(res, prec) for res in results for prec in PRECISIONS],
        "passes": [{**{k: v for k, v in asdict(res).items() if k != "rows"},
                    "problem_ops": [asdict(r) for r in res.rows if r.status in ("divergent", "error",
                                                                                 "nondeterministic")],
                    "skipped_ops": [asdict(r) for r in res.rows if r.status == "skipped"]}
                   for res in results],
    }


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", default="f32,grad,bf16", help="comma-separated: f32, grad, bf16")
    ap.add_argument("--limit", type=int, help="first N eligible OpInfos of each pass (op_db order)")
    ap.add_argument("--only", action="append", help="OpInfo full-name glob (repeatable), e.g. 'linalg.*'")
    ap.add_argument("--samples", type=int, default=SAMPLES,
                    help="samples per OpInfo and variant (default %(default)s; 0 for all)")
    ap.add_argument("--group", type=int, default=GROUP_SIZE, help="OpInfos per trace (default %(default)s)")
    ap.add_argument("--time-box", type=float, help="seconds per pass; OpInfos not reached are counted")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default %(default)s)")
    ap.add_argument("--replay-in-process", action="store_true",
                    help="replay each trace in this process right after recording it (default: all traces in "
                         "one fresh process at the end, which has not imported what recording did)")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--replay-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.replay_worker:
        inp, outp = args.replay_worker
        Path(outp).write_text(json.dumps(replay_traces(json.loads(Path(inp).read_text()))))
        return 0
    names = [n.strip() for n in args.passes.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        ap.error(f"unknown pass {unknown}; choose from {sorted(PASSES)}")
    torch.set_num_threads(args.threads)
    op_db = load_op_db()
    log = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    results = run_passes(op_db, [PASSES[n] for n in names], args.only, args.limit, args.group, args.time_box,
                         log=log, samples_per_opinfo=args.samples or None, fresh_process=not args.replay_in_process)
    render(results)
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(results), indent=1, default=str))
    bad = any(summary(r, p)[k] for r in results for p in PRECISIONS
              for k in ("divergent", "error", "nondeterministic", "lost", "raised_under_record", "changed_by_record"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
