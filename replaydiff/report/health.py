"""The health report of a replayed trace: checks, the culprit, the worst ops, errors per module, the environment,
and likely causes, each shown with the evidence in the trace that supports it.

``build_health(trace, report)`` gathers everything into plain dataclasses (and may re-run the culprit to test a
cause: its dependence on the CPU thread count); ``render_markdown`` and ``render_html`` write it to a TextIO. The
HTML is one self-contained file (inline CSS and an inline SVG plot of the error along the op sequence). A cause is
listed only when its evidence is there: no hint is a guess.
"""
from __future__ import annotations

import html
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

from replaydiff import aten
from replaydiff.causes import finds, finders
from replaydiff.compare.metrics import FloatError
from replaydiff.replay.result import OpResult, ReplayReport, Status
from replaydiff.report.plant import plant_notes
from replaydiff.report.text import argument_text, metrics_line, op_line, planted_line
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


@dataclass
class Health:
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

    @property
    def failed(self) -> list[Check]:
        """The checks that FAIL: a report with any is never healthy (the CLI exits 1)."""
        return [c for c in self.checks if c.passed is False]


def normalised_error(r: OpResult) -> float | None:
    """An op's error over its limit (1.0 = at the limit): its severity, the verdict's own measure (an ill-conditioned
    op's limit is its own error at its recorded dtype). None for an op without a verdict (skipped, error, a view)."""
    return None if r.verdict is None else r.severity


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


# -- gathering ------------------------------------------------------------------------------------------------------
def build_health(trace: Trace, report: ReplayReport, probe: bool = True) -> Health:
    h = Health(trace=report.trace or str(trace.path), planted=list(report.planted), options=dict(report.options),
               counts=report.counts(), warnings=list(report.warnings))
    plants = report.plants or [rt.planted for rt in trace if rt.planted is not None]
    if not h.planted:  # a report written before --plant existed, or by hand: the trace still knows
        h.planted = [p.describe() for p in plants]
    h.plant_notes = plant_notes(report, plants)
    errs = {(r.rank, r.index): normalised_error(r) for r in report.ops}
    h.points = [(r.rank, r.index, e, r.status.value) for r in report.ops
                if (e := errs[(r.rank, r.index)]) is not None]
    h.culprit = report.first_divergent or report.first_nondeterministic
    h.culprit_kind = "first divergent op" if report.first_divergent else (
        "first nondeterministic op" if h.culprit else "")
    ranked = sorted(((r, e) for r in report.ops if (e := errs[(r.rank, r.index)]) is not None),
                    key=lambda p: (-p[1], p[0].rank, p[0].index))
    h.top = ranked[:TOP]
    h.modules = _modules(report, errs)
    rank = h.culprit.rank if h.culprit else (trace.ranks[0] if trace.ranks else None)
    if rank is not None and rank in trace.ranks:
        h.environment, h.environment_rank = trace.rank(rank).environment, rank
    h.checks = _checks(trace, report, errs)
    h.causes = _causes(trace, report, h, probe)
    return h


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
        Check("largest error / limit", _fmt(worst) + (f" (#{at[1]}{f' rank {at[0]}' if len(ranks) > 1 else ''})"
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


def _causes(trace: Trace, report: ReplayReport, h: Health, probe: bool) -> list[Cause]:
    culprit = h.culprit
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
    if packet in aten.TF32_MATMUL_PACKETS:
        if flags.matmul_tf32:
            tf32_flags.append("torch.backends.cuda.matmul.allow_tf32 = True")
        if flags.float32_matmul_precision in ("high", "medium"):
            tf32_flags.append(f"torch.get_float32_matmul_precision() = {flags.float32_matmul_precision!r}")
    if packet in aten.TF32_CONV_PACKETS and flags.cudnn_tf32:
        tf32_flags.append("torch.backends.cudnn.allow_tf32 = True")
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
    op = rt[culprit.index]
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


# -- rendering ------------------------------------------------------------------------------------------------------
def _title(h: Health) -> list[str]:
    lines = []
    if h.planted:
        lines.append(planted_line(h.planted))
    lines.append(f"replaydiff health report: {h.trace}")
    return lines


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |\n"


def _passed(c: Check) -> str:
    return "n/a" if c.passed is None else ("pass" if c.passed else "FAIL")


def render_markdown(h: Health, out: TextIO) -> None:
    title = _title(h)
    if h.planted:
        out.write(f"**{title[0]}**\n\n" + "".join(f"{note}\n\n" for note in h.plant_notes))
    out.write(f"# {title[-1]}\n\n")
    o = h.options
    out.write(f"Replayed on {o.get('device')} at {o.get('precision')}"
              + (f", reference {o['reference']}" if o.get("reference") else "") + ": "
              + ", ".join(f"{n} {s}" for s, n in h.counts.items()) + "\n\n")
    for w in h.warnings:
        out.write(f"- warning: {w}\n")
    out.write("## Checks\n\n" + _row(["check", "measured", "limit", "result"]) + _row(["---"] * 4))
    for c in h.checks:
        out.write(_row([c.what, c.measured, c.limit, _passed(c)]))
    out.write("\n## Culprit\n\n")
    if h.culprit is None:
        out.write("No divergent or nondeterministic op.\n")
    else:
        r = h.culprit
        out.write(f"{h.culprit_kind}: **#{r.index} {r.op}**" + (f" (rank {r.rank})" if r.rank else "") + "\n\n")
        for k, v in _culprit_fields(r):
            out.write(f"- {k}: {v}\n")
    out.write(f"\n## The {TOP} ops with the largest error / limit\n\n")
    out.write(_row(["op", "name", "module", "phase", "status", "error / limit", "detail"]) + _row(["---"] * 7))
    for r, e in h.top:
        out.write(_row([f"#{r.index}" + (f" r{r.rank}" if r.rank else ""), r.op, r.module or "", r.phase or "",
                        r.status.value, _fmt(e), _detail(r)]))
    out.write("\n## Error per module\n\n")
    out.write(_row(["module", "ops", "divergent", "largest error / limit", "at"]) + _row(["---"] * 5))
    for m in h.modules:
        out.write(_row([m.module, str(m.ops), str(m.divergent), _fmt(m.worst),
                        f"#{m.worst_op.index} {m.worst_op.op}" if m.worst_op else ""]))
    out.write("\n## Likely causes\n\n")
    if not h.causes:
        out.write("None with evidence in this trace and replay.\n")
    for c in h.causes:
        out.write(f"### {c.title}\n\nEvidence:\n\n" + "".join(f"- {e}\n" for e in c.evidence)
                  + f"\nRemedy: {c.remedy}\n\n")
    out.write("\n## Environment" + (f" (rank {h.environment_rank})" if h.environment_rank is not None else "")
              + "\n\n")
    for k, v in _environment_rows(h.environment):
        out.write(f"- {k}: {v}\n")


def _detail(r: OpResult) -> str:
    """An op's figures, and for an op within its limits despite figures over the fixed ones, why."""
    why = r.verdict.explanation if r.verdict is not None else None
    return metrics_line(r) + (f"; {why}" if why else "")


def _culprit_fields(r: OpResult) -> list[tuple[str, str]]:
    rows = [("module", r.module or "-"), ("phase", r.phase or "-"), ("source line", r.source or "-")]
    if r.forward_index is not None:
        rows.append(("forward op", f"#{r.forward_index}" + (f" at {r.forward_source}" if r.forward_source else "")))
    rows.append(("figures", metrics_line(r)))
    if r.reason:
        rows.append(("reason", r.reason))
    return rows


def _environment_rows(env: Environment) -> list[tuple[str, str]]:
    rows = [(k, str(v)) for k, v in (("torch", env.torch), ("cuda", env.cuda), ("cudnn", env.cudnn),
                                     ("nccl", env.nccl), ("driver", env.driver), ("num_threads", env.num_threads),
                                     ("num_interop_threads", env.num_interop_threads), ("hostname", env.hostname),
                                     ("rank", env.rank), ("world_size", env.world_size), ("platform", env.platform))]
    rows.append(("devices", ", ".join(f"{d.name} (sm {'.'.join(map(str, d.capability))})"
                                      for d in env.devices) or "none (CPU)"))
    for k, v in env.flags.recorded:
        rows.append((k, str(v)))
    for k, v in env.variables.items():
        rows.append((f"${k}", str(v)))
    return rows


# -- HTML -----------------------------------------------------------------------------------------------------------
_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f3f3f3}.FAIL{color:#b00;font-weight:bold}.pass{color:#070}.planted{background:#fee;
border:2px solid #b00;padding:.5em;font-weight:bold}code{background:#f6f6f6}svg{border:1px solid #ddd}"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>")
    return "".join(out) + "</table>\n"


def error_plot_svg(points: list[tuple[int, int, float, str]], width: int = 1000, height: int = 260) -> str:
    """Error / limit (log scale) of every judged op along the op sequence; the limit is the dashed line at 1."""
    pad_l, pad_r, pad_t, pad_b = 60, 10, 10, 30
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40"><text x="10" y="25">' \
               f"no op was judged</text></svg>"
    ranks = sorted({p[0] for p in points})
    span = {r: max(p[1] for p in points if p[0] == r) + 1 for r in ranks}
    offset, acc = {}, 0
    for r in ranks:  # ranks side by side along x
        offset[r], acc = acc, acc + span[r]
    lo, hi = -4.0, 4.0  # log10 of error / limit shown; beyond is clipped to the edge

    def x(rank: int, i: int) -> float:
        return pad_l + (offset[rank] + i) / max(1, acc) * (width - pad_l - pad_r)

    def y(e: float) -> float:
        v = hi if math.isinf(e) else (lo if e <= 0 else min(hi, max(lo, math.log10(e))))
        return pad_t + (hi - v) / (hi - lo) * (height - pad_t - pad_b)

    colour = {"divergent": "#c00", "nondeterministic": "#e80", "ok": "#579"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img"><title>error / limit along the op sequence</title>']
    for v in range(int(lo), int(hi) + 1, 2):
        yy = y(10.0 ** v)
        parts.append(f'<line x1="{pad_l}" x2="{width - pad_r}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>'
                     f'<text x="{pad_l - 6}" y="{yy + 4:.1f}" font-size="11" text-anchor="end">1e{v}</text>')
    y1 = y(1.0)
    parts.append(f'<line x1="{pad_l}" x2="{width - pad_r}" y1="{y1:.1f}" y2="{y1:.1f}" stroke="#c00" '
                 f'stroke-dasharray="4 3"/><text x="{width - pad_r - 4}" y="{y1 - 4:.1f}" font-size="11" '
                 f'text-anchor="end" fill="#c00">limit</text>')
    for r, i, e, status in points:
        c = colour.get(status, "#999")
        rad = 3.5 if status != "ok" else 1.8
        parts.append(f'<circle cx="{x(r, i):.1f}" cy="{y(e):.1f}" r="{rad}" fill="{c}"><title>'
                     f'{_esc(f"rank {r} op #{i} {status} error/limit {_fmt(e)}")}</title></circle>')
    parts.append(f'<text x="{(width + pad_l) / 2:.0f}" y="{height - 8}" font-size="12" text-anchor="middle">'
                 f'op number' + (" (ranks side by side: " + ", ".join(map(str, ranks)) + ")" if len(ranks) > 1
                                 else "") + "</text>")
    parts.append(f'<text x="14" y="{height / 2:.0f}" font-size="12" transform="rotate(-90 14 {height / 2:.0f})" '
                 f'text-anchor="middle">error / limit</text></svg>')
    return "".join(parts)


def render_html(h: Health, out: TextIO) -> None:
    title = _title(h)
    if h.planted:  # the first line of every report says so
        out.write(f"<!-- {_esc(title[0])} -->\n")
    out.write(f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>"
              f"{_esc(title[-1])}</title><style>{_CSS}</style></head><body>\n")
    if h.planted:
        out.write(f'<p class="planted">{_esc(title[0])}</p>\n' + "".join(f"<p>{_esc(n)}</p>\n" for n in h.plant_notes))
    o = h.options
    out.write(f"<h1>{_esc(title[-1])}</h1><p>Replayed on {_esc(o.get('device'))} at {_esc(o.get('precision'))}: "
              + _esc(", ".join(f"{n} {s}" for s, n in h.counts.items())) + "</p>\n")
    for w in h.warnings:
        out.write(f"<p>warning: {_esc(w)}</p>\n")
    out.write("<h2>Checks</h2>" + _table(["check", "measured", "limit", "result"],
                                         [[c.what, c.measured, c.limit, _passed(c)] for c in h.checks],
                                         [_passed(c) for c in h.checks]))
    out.write("<h2>Error along the op sequence</h2>\n" + error_plot_svg(h.points) + "\n<h2>Culprit</h2>\n")
    if h.culprit is None:
        out.write("<p>No divergent or nondeterministic op.</p>\n")
    else:
        r = h.culprit
        out.write(f"<p>{_esc(h.culprit_kind)}: <b>#{r.index} {_esc(r.op)}</b>"
                  + (f" (rank {r.rank})" if r.rank else "") + "</p>"
                  + _table(["", ""], [[k, v] for k, v in _culprit_fields(r)]))
    out.write(f"<h2>The {TOP} ops with the largest error / limit</h2>" + _table(
        ["op", "name", "module", "phase", "status", "error / limit", "detail"],
        [[f"#{r.index}" + (f" r{r.rank}" if r.rank else ""), r.op, r.module or "", r.phase or "", r.status.value,
          _fmt(e), _detail(r)] for r, e in h.top]))
    out.write("<h2>Error per module</h2>" + _table(
        ["module", "ops", "divergent", "largest error / limit", "at"],
        [[m.module, str(m.ops), str(m.divergent), _fmt(m.worst),
          f"#{m.worst_op.index} {m.worst_op.op}" if m.worst_op else ""] for m in h.modules]))
    out.write("<h2>Likely causes</h2>\n")
    if not h.causes:
        out.write("<p>None with evidence in this trace and replay.</p>\n")
    for c in h.causes:
        out.write(f"<h3>{_esc(c.title)}</h3><p>Evidence:</p><ul>" + "".join(f"<li>{_esc(e)}</li>"
                                                                          for e in c.evidence)
                  + f"</ul><p>Remedy: {_esc(c.remedy)}</p>\n")
    out.write("<h2>Environment" + (f" (rank {h.environment_rank})" if h.environment_rank is not None else "")
              + "</h2>" + _table(["", ""], [[k, v] for k, v in _environment_rows(h.environment)]))
    out.write("</body></html>\n")
