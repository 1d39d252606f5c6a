"""The JSON replay report, schema ``replaydiff.replay/1`` (documented in docs/replay.md).

Top level: ``format``, ``planted`` (faults planted while recording, one line per rank; empty for a real trace),
``plants`` (the same faults as objects: ``rank``, ``op``, ``call``, ``rel``, ``landed``, ``index``, ``calls_seen``,
``effect`` (what the plant changed: ``tensors``, ``elements``, ``nonzero``, ``changed``, ``max_ulps``, ``nonfinite``,
``dtype``), ``summary``, ``outcome`` (found, not_run, no_effect, within_limit, not_checked, not_replayed) and
``note``),
``trace``, ``options``, ``warnings``, ``summary`` (count per status), ``first_divergent`` (null or an op object),
``first_nondeterministic``, ``nonfinite_origin`` (the first op that made NaN/Inf from finite inputs, or NaN from
inputs holding Inf but no NaN, that reach the loss, a gradient, a parameter or an output of the step), ``nonfinite_entry`` (null, or, when no op made such NaN/Inf
before it, the first op that read NaN/Inf that no replayed op computed and that reach one: its ``nonfinite_input``
says which input), ``nonfinite_discarded`` (the ops that made or let in NaN/Inf that every op reading them
selected away: information, never a fault) and ``ops`` (one object per replayed op:
``rank``, ``index``, ``op``, ``status``, ``module``, ``phase``, ``source``, ``forward_index``, ``metrics``,
``severity`` (how far over its limit, in units of the limit: at most 1 within, over 1 divergent; null when not
judged), ``data_left_out`` (only when the recording left the op's tensor data out: filtered, budget or disk full;
the op is skipped), ``unjudged`` (only when true: a compiled unit replay could not run, its computation unchecked;
never clean), ``nonfinite_input`` (only when an input already held NaN/Inf that came from outside the trace
or from an op whose data was left out: ``position``, ``nan``, ``inf``, ``producer`` (null: outside the trace),
``producer_op``, and with a producer the earliest op replay did not run whose recorded output holds them,
walked back through the statistics the recording kept: ``earliest`` (its number), ``earliest_op``,
``earliest_nan``, ``earliest_inf``, ``earliest_input`` (its input that held them, written outside the trace; else
null), ``earliest_made`` (true: it made them from inputs that hold none) and ``earliest_argument`` (a NaN/Inf
number it was passed, its inputs holding none: ``fill_(inf)``; else null); or, when they came in as a number argument such as ``masked_fill``'s -inf: ``argument``, its
value, ``position`` its index among the positional arguments and ``nan``/``inf`` what it put in the outputs),
``nonfinite_origin`` (true when it made NaN/Inf from finite inputs, or NaN from inputs holding
Inf but no NaN), ``nonfinite_from_inf`` (only when true: the latter), ``nonfinite_discarded_by``
(only when the NaN/Inf it made or let in are discarded: the ops that end them), ``reason`` (why it is divergent,
skipped or, within its limits despite a large error, ok)),
``first_divergent_per_rank`` (each rank's earliest divergent op) and ``undecided`` (ranks and op
numbers of candidates that no collective orders against ``first_divergent``), ``replicas`` (null, or where
data-parallel replicas first stop agreeing: ``rank``, ``index``, ``other_rank``, ``other_index``, ``op``, ``what``),
``missing_ops`` (runs of ops asked for whose records are gone from a damaged trace, never judged: ``rank``,
``first``, ``last``, ``count``, ``file`` (the ops file that held them, null if unknown), ``problem``),
``cut_short`` (ranks whose recording stopped part-way, so the trace is partial: ``rank``, ``last`` (the last op that
reads back), ``why``).
Floats that are not finite are written as the strings "inf", "-inf" and "nan" so the file stays JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from replaydiff.trace.location import location_from_json, location_json
from replaydiff.compare.verdict import Verdict
from replaydiff.errors import UsageError

from replaydiff.replay.result import NonfiniteInput, OpResult, ReplayReport, Status
from replaydiff.replay.plants import plant_reports
from replaydiff.trace.damage import CutShort, MissingOps
from replaydiff.trace.schema import PlantedFaultInfo

JSON_FORMAT = "replaydiff.replay/1"


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def op_json(r: OpResult | None) -> dict | None:
    if r is None:
        return None
    return _clean({"rank": r.rank, "index": r.index, "op": r.op, "status": r.status.value, "module": r.module,
                   "phase": r.phase, "source": r.source, "forward_index": r.forward_index,
                   "forward_source": r.location.source if r.location and r.location.of_forward else None,
                   "location": location_json(r.location), "metrics": r.metrics, "severity": r.severity,
                   "reason": r.reason, **({"repeats_disagree": True} if r.repeats_disagree else {}),
                   **({"data_left_out": r.data_left_out} if r.data_left_out else {}),
                   **({"nonfinite_origin": True} if r.nonfinite_origin else {}),
                   **({"nonfinite_from_inf": True} if r.nonfinite_from_inf else {}),
                   **({"unjudged": True} if r.unjudged else {}),
                   **({"nonfinite_input": _nonfinite_input_json(r.nonfinite_input)} if r.nonfinite_input else {}),
                   **({"nonfinite_discarded_by": list(r.nonfinite_discarded_by)}
                      if r.nonfinite_discarded_by is not None else {})})


def _nonfinite_input_json(held: NonfiniteInput) -> dict:
    """An op's ``nonfinite_input``: ``argument`` only for a number argument, the ``earliest*`` keys only with an
    earliest op (from a producer replay did not run)."""
    return {k: v for k, v in dataclasses.asdict(held).items()
            if not (k == "argument" and v is None) and not (k.startswith("earliest") and held.earliest is None)}


def report_to_json(report: ReplayReport) -> dict:
    return {
        "format": JSON_FORMAT,
        "planted": list(report.planted),
        "plants": _clean([pr.to_json() for pr in plant_reports(report)]),
        "trace": report.trace,
        "trace_fingerprint": report.fingerprint,
        "options": _clean(report.options),
        "warnings": list(report.warnings),
        "summary": report.counts(),
        "first_divergent": op_json(report.first_divergent),
        "first_divergent_per_rank": [op_json(r) for r in report.first_per_rank],
        "undecided": [{"rank": k, "index": i} for k, i in report.undecided],
        "replicas": None if report.replicas is None else report.replicas.to_json(),
        "recomputes_differ": [d.to_json() for d in report.recomputes_differ],
        "recomputes_state": [d.to_json() for d in report.recomputes_state],
        "first_nondeterministic": op_json(report.first_nondeterministic),
        "nonfinite_origin": op_json(report.nonfinite_origin),
        "nonfinite_entry": op_json(report.nonfinite_entry),
        "nonfinite_discarded": [op_json(r) for r in report.nonfinite_discarded],
        "missing_ops": [m.to_json() for m in report.missing],
        "cut_short": [c.to_json() for c in report.cut_short],
        "ops": [op_json(r) for r in report.ops],
    }


def load_replay_json(path: str | Path) -> ReplayReport:
    """Read a ``replaydiff.replay/1`` report back (``replaydiff replay --json FILE``)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a readable JSON replay report ({exc})") from None
    if not isinstance(d, dict) or d.get("format") != JSON_FORMAT:
        raise UsageError(f"{path}: not a {JSON_FORMAT} report")
    report = ReplayReport(trace=d.get("trace", ""), options=d.get("options") or {}, warnings=d.get("warnings") or [],
                          planted=[str(x) for x in d.get("planted") or []],
                          plants=[PlantedFaultInfo.from_json(x) for x in d.get("plants") or [] if isinstance(x, dict)],
                          missing=[MissingOps(m["rank"], m["first"], m["last"], Path(m.get("file") or ""), m["problem"],
                                              m.get("file") is not None)
                                   for m in d.get("missing_ops") or [] if isinstance(m, dict)],
                          cut_short=[CutShort(c["rank"], c.get("last"), str(c.get("why") or ""))
                                     for c in d.get("cut_short") or [] if isinstance(c, dict)],
                          fingerprint=str(d.get("trace_fingerprint") or ""))
    for o in d.get("ops") or []:
        status = Status(o["status"])
        m = o.get("metrics")
        verdict = None if m is None else Verdict.from_json(m, status is Status.DIVERGENT, o.get("reason"))
        report.ops.append(OpResult(rank=o["rank"], index=o["index"], op=o["op"], status=status,
                                   module=o.get("module"), phase=o.get("phase"), source=o.get("source"),
                                   forward_index=o.get("forward_index"), location=location_from_json(o.get("location")),
                                   verdict=verdict, reason=o.get("reason"),
                                   repeats_disagree=bool(o.get("repeats_disagree")),
                                   data_left_out=o.get("data_left_out"), unjudged=bool(o.get("unjudged")),
                                   nonfinite_origin=o.get("nonfinite_origin") is True,
                                   nonfinite_from_inf=o.get("nonfinite_from_inf") is True,
                                   nonfinite_input=NonfiniteInput(**o["nonfinite_input"])
                                   if isinstance(o.get("nonfinite_input"), dict) else None,
                                   nonfinite_discarded_by=[int(i) for i in o["nonfinite_discarded_by"]]
                                   if isinstance(o.get("nonfinite_discarded_by"), list) else None))
    first = d.get("first_divergent")
    if first:
        report.culprit = (first["rank"], first["index"])
    report.undecided = [(u["rank"], u["index"]) for u in d.get("undecided") or []]
    if d.get("replicas"):
        from replaydiff.replay.replicas import ReplicaBreak

        report.replicas = ReplicaBreak(**d["replicas"])
    if d.get("recomputes_differ"):
        from replaydiff.replay.recomputes import RecomputeDiffers

        report.recomputes_differ = [RecomputeDiffers(**x) for x in d["recomputes_differ"] if isinstance(x, dict)]
    if d.get("recomputes_state"):
        from replaydiff.replay.recomputes import RecomputeDiffers

        report.recomputes_state = [RecomputeDiffers(**x) for x in d["recomputes_state"] if isinstance(x, dict)]
    origin = d.get("nonfinite_origin")
    if origin:
        for r in report.ops:
            if (r.rank, r.index) == (origin["rank"], origin["index"]):
                r.nonfinite_origin = True
    return report
