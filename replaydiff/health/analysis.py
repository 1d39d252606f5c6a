"""The health report of a replayed trace: checks, the culprit, the worst ops, errors per module, the environment,
and likely causes, each with the evidence in the trace that supports it.

``build_health(trace, report)`` gathers everything into a frozen ``HealthReport`` (and may re-run the culprit to test
a cause: its dependence on the CPU thread count); ``replaydiff.report.health`` renders it as Markdown or HTML. A
cause is listed only when its evidence is there: no hint is a guess.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from replaydiff import aten
from replaydiff.causes import finds, finders
from replaydiff.errors import ExitCode
from replaydiff.compare.metrics import FloatError
from replaydiff.replay.describe import argument_text, figure_text, metrics_line, op_line
from replaydiff.replay.plants import plant_notes
from replaydiff.replay.result import OpResult, ReplayReport, Status
from replaydiff.trace.damage import describe_missing
from replaydiff.trace.reader import Trace
from replaydiff.trace.schema import Environment

TOP = 10
# An error over its limit by at most this factor is still of the size of the dtype's rounding (the limits were set at
# 2.7x the largest error of healthy ops), not of a wrong kernel (a planted 1e-3 fault in fp32 is ~500x).
ROUNDING_FACTOR = 4.0


@dataclass(frozen=True)
class Check:
    what: str
    measured: str
    limit: str
    passed: bool | None  # None: not checked by this replay (say how to check it)


@dataclass(frozen=True)
class Cause:
    title: str
    evidence: list[str]
    remedy: str


@dataclass(frozen=True)
class ModuleRow:
    module: str
    ops: int
    divergent: int
    worst: float | None  # largest error / limit
    worst_op: OpResult | None


@dataclass(frozen=True)
class HealthReport:
    trace: str
    planted: list[str]
    options: dict
    counts: dict[str, int]
    checks: list[Check] = field(default_factory=list)
    culprit: OpResult | None = None
    culprit_kind: str = ""
    top: list[tuple[OpResult, float]] = field(default_factory=list)
    modules: list[ModuleRow] = field(default_factory=list)
    environment: Environment = field(default_factory=Environment)
    environment_rank: int | None = None
    causes: list[Cause] = field(default_factory=list)
    points: list[tuple[int, int, float, str]] = field(default_factory=list)  # (rank, index, error/limit, status)
    warnings: list[str] = field(default_factory=list)
    plant_notes: list[str] = field(default_factory=list)  # a planted fault that left replay nothing to find
    # ops missing from the trace (a file deleted or cut short since it was written) or a recording stopped part-way,
    # with no divergent op named: never reported healthy, and not a divergence either
    incomplete: bool = False
    found_problem: bool = False  # the replay was not clean (ReplayReport.found_problem)

    @property
    def failed(self) -> list[Check]:
        """The checks that FAIL: a report with any is never healthy (the CLI exits 1)."""
        return [c for c in self.checks if c.passed is False]

    @property
    def exit_code(self) -> ExitCode:
        if self.incomplete:
            return ExitCode.TRACE  # a damaged or partial trace is never reported healthy (its check says where)
        return ExitCode.DIVERGENT if self.found_problem or self.failed else ExitCode.OK


def normalised_error(r: OpResult) -> float | None:
    """An op's error over its limit (1.0 = at the limit): its severity, the verdict's own measure (an ill-conditioned
    op's limit is its own error at its recorded dtype). None for an op without a verdict (skipped, error, a view)."""
    return None if r.verdict is None else r.severity


# -- gathering ------------------------------------------------------------------------------------------------------
def build_health(trace: Trace, report: ReplayReport, probe: bool = True) -> HealthReport:
    planted = list(report.planted)
    plants = report.plants or [rt.planted for rt in trace if rt.planted is not None]
    if not planted:  # a report written before --plant existed, or by hand: the trace still knows
        planted = [p.describe() for p in plants]
    errs = {(r.rank, r.index): normalised_error(r) for r in report.ops}
    culprit = report.first_divergent or report.first_nondeterministic
    ranked = sorted(((r, e) for r in report.ops if (e := errs[(r.rank, r.index)]) is not None),
                    key=lambda p: (-p[1], p[0].rank, p[0].index))
    rank = culprit.rank if culprit else (trace.ranks[0] if trace.ranks else None)
    environment, environment_rank = Environment(), None
    if rank is not None and rank in trace.ranks:
        environment, environment_rank = trace.rank(rank).environment, rank
    return HealthReport(
        trace=report.trace or str(trace.path), planted=planted, options=dict(report.options), counts=report.counts(),
        warnings=list(report.warnings), plant_notes=plant_notes(report, plants),
        points=[(r.rank, r.index, e, r.status.value) for r in report.ops if (e := errs[(r.rank, r.index)]) is not None],
        culprit=culprit, culprit_kind="first divergent op" if report.first_divergent else (
            "first nondeterministic op" if culprit else ""),
        top=ranked[:TOP], modules=_modules(report, errs), environment=environment, environment_rank=environment_rank,
        checks=_checks(trace, report, errs), causes=_causes(trace, report, culprit, probe),
        incomplete=bool(trace.missing_ops or trace.cut_short or report.cut_short) and not report.first_divergent,
        found_problem=report.found_problem)


def _modules(report: ReplayReport, errs: dict) -> list[ModuleRow]:
    groups: dict[str, list[OpResult]] = defaultdict(list)
    for r in report.ops:
        if r.status is not Status.SKIPPED:
            groups[r.module or "(outside any module)"].append(r)
    rows = []
    for mod, ops in groups.items():
        scored = [(errs[(r.rank, r.index)], r) for r in ops if errs[(r.rank, r.index)] is not None]
        worst = max(scored, key=lambda p: p[0], default=(None, None))
        rows.append(ModuleRow(mod, len(ops), sum(r.status is Status.DIVERGENT for r in ops), worst[0], worst[1]))
    return sorted(rows, key=lambda m: (-(m.worst if m.worst is not None else -1), m.module))


def _nonfinite_check(report: ReplayReport) -> Check:
    """The op that made NaN/Inf from finite inputs that reach the loss, a gradient, a parameter or an output of the
    step; where none did, the op such NaN/Inf entered the step through (the batch, a parameter: replay's
    nonfinite_entry). NaN/Inf the step makes or lets in and then selects away (T5's log(0) under a where, an additive
    -inf mask through softmax) pass, and are named as made and discarded."""
    origin, entry = report.nonfinite_origin, report.nonfinite_entry
    aside = ""
    for how, ops in (("made", [r for r in report.nonfinite_discarded if r.nonfinite_origin]),
                     ("let in", [r for r in report.nonfinite_discarded if not r.nonfinite_origin])):
        if ops:
            aside += f"; {how} and discarded: " + ", ".join(f"#{r.index} {r.op}" for r in ops[:3]) + \
                (f" and {len(ops) - 3} more" if len(ops) > 3 else "")
    if origin is not None:
        return Check("NaN/Inf origin", f"#{origin.index} {origin.op}{aside}", "none", False)
    held = entry.nonfinite_input if entry is not None else None
    if held is None:
        return Check("NaN/Inf origin", f"none{aside}", "none", True)
    if held.argument is not None:
        return Check("NaN/Inf origin", f"none made; {held.counts()} enter as {argument_text(held)} of "
                                       f"#{entry.index} {entry.op}{aside}", "none", False)
    whence = "outside the trace" if held.producer is None else f"op #{held.producer}, not replayed"
    if held.producer is not None and held.earliest is not None and held.earliest != held.producer:
        # the first op whose recorded outputs hold them, not the one that handed them over (replay/nonfinite_source.py)
        whence = f"op #{held.earliest} {held.earliest_op}, not replayed, the first whose recorded outputs hold them"
    return Check("NaN/Inf origin", f"none made; {held.counts()} enter through input {held.position} of "
                                   f"#{entry.index} {entry.op} (from {whence}){aside}", "none", False)


def _checks(trace: Trace, report: ReplayReport, errs: dict) -> list[Check]:
    c = report.counts()
    repeat = int(report.options.get("repeat") or 1)
    # the op with the largest severity (the culprit's own when it is the worst), named beside its figure
    scored = [(e, k) for k, e in errs.items() if e is not None]
    worst, at = max(scored, key=lambda p: (p[0], -p[1][0], -p[1][1]), default=(None, None))
    collectives = [r for r in report.ops if aten.is_collective(r.op) and r.status is not Status.SKIPPED]
    bad_coll = [r for r in collectives if r.status is Status.DIVERGENT]
    ranks = [trace.rank(r) for r in sorted({r.rank for r in report.ops} or set(trace.ranks)) if r in trace.ranks]
    # a recording that stopped part-way (the recorder stopped, the script raised or was interrupted mid-step, the
    # process died), as the trace and the replay each saw it
    cut = {c.rank: c for c in report.cut_short}
    cut.update({rt.rank: rt.cut_short for rt in ranks if rt.cut_short is not None})
    incomplete = [cut[k].describe() for k in sorted(cut)]
    # ops gone from the trace since it was written (an ops file deleted or cut short), as the trace and the replay
    # each saw them: a report of a replay made before the damage still says the trace is damaged
    seen = {(m.rank, m.first) for m in report.missing}
    gone = list(report.missing) + [m for rt in ranks for m in rt.missing_ops if (m.rank, m.first) not in seen]
    incomplete += [f"DAMAGED: {line}" for line in describe_missing(gone, most=2)]
    lost = sum(len(rt.lost) for rt in ranks)
    checks = [
        Check("ops divergent from the reference", str(c["divergent"]), "0", c["divergent"] == 0),
        Check("largest error / limit", figure_text(worst) + (f" (#{at[1]}{f' rank {at[0]}' if len(ranks) > 1 else ''})"
                                                      if at is not None and worst else ""),
              "1", None if worst is None else worst <= 1.0),
        Check("ops whose repeated runs disagree", str(c["nondeterministic"]) if repeat > 1 else
              "not checked (replay --repeat N)", "0", (c["nondeterministic"] == 0) if repeat > 1 else None),
        Check("ops that could not be replayed", str(c["error"]), "0", c["error"] == 0),
        _nonfinite_check(report),
        Check("collectives consistent across ranks", f"{len(bad_coll)} of {len(collectives)} disagree"
              if collectives else "none checked", "0", (not bad_coll) if collectives else None),
        Check("recording complete", "; ".join(incomplete) or "complete", "complete", not incomplete),
        Check("data lost while recording", str(lost), "0", lost == 0),
        # ops the recording left the data of out for its --budget or a full disk were never judged
        Check("ops not judged: data left out (--budget, full disk)",
              "; ".join(report.left_out_summary()) if report.not_judged else "0", "0", not report.not_judged),
        # ops skipped though they computed part of the step (a compiled unit without a replayable graph)
        Check("ops not judged: computed, but not replayable", "; ".join(report.unjudged_summary()) or "0", "0",
              not report.unjudged),
        # a replay that skipped every op (a --module filter that matched nothing) checked nothing: not a pass
        Check("ops judged", f"{len(report.ops) - c['skipped']} of {len(report.ops)}", "at least 1",
              not report.nothing_judged),
        Check("ops skipped", str(c["skipped"]), "-", None),
    ]
    return checks


# -- causes ---------------------------------------------------------------------------------------------------------
# Each cause of replaydiff/causes.py that a replayed trace can hold evidence of registers its finder here, per kind;
# the table gives its title and remedy. A finder returns None (no evidence) or the evidence lines and the fields its
# remedy names.
@dataclass(frozen=True)
class _Facts:
    """What the finders read: the trace, the report, the culprit and (if it could be read) its op record."""
    trace: Trace
    report: ReplayReport
    culprit: OpResult | None
    op: Any  # the culprit's OpRecord, None if there is no culprit or its chunk is damaged
    env: Environment  # of the culprit's rank (empty without an op)
    probe: bool

    @property
    def devices(self) -> set[str]:
        return {r.device for r in self.op.outputs_refs() if isinstance(r.device, str)}


_Found = Optional[tuple[list[str], dict[str, Any]]]


def _causes(trace: Trace, report: ReplayReport, culprit: OpResult | None, probe: bool) -> list[Cause]:
    op = None
    if culprit is not None and culprit.rank in trace.ranks:
        try:
            op = trace.rank(culprit.rank)[culprit.index]
        except Exception:  # a damaged chunk: the causes that need the op record are left out
            op = None
    facts = _Facts(trace, report, culprit, op, trace.rank(culprit.rank).environment if op is not None
                   else Environment(), probe)
    causes = []
    for known, finder in finders():
        found = finder(facts)
        if found is not None:
            evidence, fields = found
            causes.append(Cause(known.title, evidence, known.remedy.format(**fields) if fields else known.remedy))
    return causes


@finds("tf32")
def _tf32(f: _Facts) -> _Found:
    if f.culprit is None or f.op is None:
        return None
    culprit, flags = f.culprit, f.env.flags
    packet = aten.packet(culprit.op)
    tf32_flags = []
    # Named as the job set it: torch's per-backend fp32_precision API where the trace says TF32 through it (the
    # legacy flags were then read through it), else the legacy flags.
    if packet in aten.TF32_MATMUL_PACKETS:
        if flags.fp32_precision == "tf32":
            tf32_flags.append("torch.backends.fp32_precision = 'tf32'")
        elif flags.matmul_fp32_precision == "tf32" and flags.matmul_tf32 is None:
            tf32_flags.append("torch.backends.cuda.matmul.fp32_precision = 'tf32'")
        elif flags.matmul_tf32:
            tf32_flags.append("torch.backends.cuda.matmul.allow_tf32 = True")
        elif flags.float32_matmul_precision in ("high", "medium"):
            tf32_flags.append(f"torch.get_float32_matmul_precision() = {flags.float32_matmul_precision!r}")
    if packet in aten.TF32_CONV_PACKETS and flags.cudnn_tf32:
        tf32_flags.append("torch.backends.cudnn.conv.fp32_precision = 'tf32'" if flags.cudnn_conv_fp32_precision
                          == "tf32" and flags.fp32_precision == "tf32" else "torch.backends.cudnn.allow_tf32 = True")
    devices = f.devices
    if not (tf32_flags and any(d.startswith("cuda") for d in devices) and "float32" in {r.dtype for r in f.op.inputs()}):
        return None
    ev = [f"recorded with {', '.join(tf32_flags)} (environment of rank {culprit.rank})",
          f"the culprit {op_line(culprit)} is a {'convolution' if packet in aten.TF32_CONV_PACKETS else 'matmul'}"
          f" on {', '.join(sorted(devices))} with float32 inputs", metrics_line(culprit)]
    m = culprit.verdict.measure if culprit.verdict else None
    if isinstance(m, FloatError) and 1e-4 <= m.rel_l2 <= 1e-2:
        ev.append(f"its rel_l2 {m.rel_l2:.2g} is the size of TF32's 10-bit mantissa (~1e-3), not float32's (~1e-7)")
    return ev, {}


@finds("nondeterministic_kernel")
def _nondeterministic(f: _Facts) -> _Found:
    if f.culprit is None or f.op is None:
        return None
    culprit, report = f.culprit, f.report
    nd = [r for r in report.ops if r.repeats_disagree and r.op == culprit.op]
    if aten.packet(culprit.op) not in aten.CUDA_NONDETERMINISTIC_PACKETS or not nd:
        return None
    return [f"the culprit {culprit.op} is among the ops PyTorch documents as non-deterministic on CUDA "
            f"(torch.use_deterministic_algorithms)",
            f"replay --repeat {report.options.get('repeat')} on {report.options.get('device')} at "
            f"{report.options.get('precision')}: {len(nd)} call(s) of it gave different results run to run"
            + (" (the culprit itself)" if culprit in nd else f", first #{nd[0].index}")], {}


@finds("threads")
def _thread_probe(f: _Facts) -> _Found:
    """Re-run a CPU culprit at its recorded dtypes with the recorded thread count and with another: bitwise equal
    to the recording with the first and different with the second means the result depends on the thread count."""
    if f.culprit is None or f.op is None or not f.probe:
        return None
    devices = f.devices
    if not devices or not all(d.startswith("cpu") for d in devices):
        return None
    import torch

    from replaydiff.replay.policy import Precision, ReplayOptions, reference_settings
    from replaydiff.replay.runner import OpReplayer

    culprit, recorded = f.culprit, f.env.num_threads
    if recorded is None or recorded < 1:
        return None
    other = 1 if recorded > 1 else 2
    rt = f.trace.rank(culprit.rank)
    op = f.op if f.op is not None else rt[culprit.index]  # read once by _causes
    results = {}
    for n in (recorded, other):
        with reference_settings(n), torch.inference_mode():
            results[n] = OpReplayer(rt, ReplayOptions(precision=Precision.SAME)).replay(op)
    same, diff = results[recorded], results[other]
    if same.status is Status.OK and diff.status is Status.DIVERGENT:
        return [f"re-ran {op_line(culprit)} at its recorded dtypes: with the recorded {recorded} thread(s) it is bit "
                f"for bit the recorded output; with {other} thread(s) {diff.reason}",
                "so the kernel reduces in an order set by its parallel split: two runs (or ranks) with different "
                "thread counts disagree here without any bug"], {"threads": recorded}
    return None


@finds("rounding")
def _rounding(f: _Facts) -> _Found:
    culprit = f.culprit
    if culprit is None or culprit.status is not Status.DIVERGENT or culprit.verdict is None:
        return None
    v = culprit.verdict
    m = v.measure
    # held to the fixed limits (an ill-conditioned op's limits are its own error, not the dtype's rounding)
    fixed = v.calibration is None or v.calibration.limits is None
    if isinstance(m, FloatError) and v.limit_max and v.limit_rel and fixed and v.severity <= ROUNDING_FACTOR:
        return [f"the culprit's error{' in ' + v.output.label() if v.output and v.output.outputs > 1 else ''} is max_abs/(eps*absmax) {m.norm_max:.3g} and rel_l2/eps {m.norm_rel:.3g}: "
                f"within {ROUNDING_FACTOR:g}x of the limits ({v.limit_max:.3g}, {v.limit_rel:.3g}) set at 2.7x "
                f"the largest error of healthy ops, far below a wrong kernel's (a 1e-3 fault is ~8,000 in fp32)"], {}
    return None


@finds("collective")
def _collective(f: _Facts) -> _Found:
    trace = f.trace
    bad = [r for r in f.report.ops if aten.is_collective(r.op) and r.status is Status.DIVERGENT]
    if not bad:
        return None
    r = bad[0]
    cenv = trace.rank(r.rank).environment if r.rank in trace.ranks else Environment()
    nccl = {k: v for k, v in cenv.variables.items() if k.startswith("NCCL_")}
    return [f"rank {r.rank} {op_line(r)}: its output is not what all ranks' recorded inputs imply "
            f"({r.reason or metrics_line(r)})",
            f"{len(bad)} collective(s) disagree, on rank(s) {sorted({x.rank for x in bad})}; the other ranks' "
            f"copies of the same collectives agree" if len({x.rank for x in bad}) < len(trace.ranks)
            else f"{len(bad)} collective(s) disagree on every rank",
            f"NCCL {cenv.nccl}, variables {nccl or 'none set'} on rank {r.rank}"], {}
