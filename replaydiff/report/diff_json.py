"""The JSON diff report, schema ``replaydiff.diff/1`` (documented in docs/diff.md, beside the replay schema).

Top level: ``format``, ``planted`` (faults planted while recording, one line per trace and rank: "in the target
trace, ..."; empty for real traces), ``ref``, ``target``, ``baseline``, ``step_inputs`` (null, or for the first
rank pair whose step began from inputs that already differed: ``compared``, ``differ``, ``first`` and
``differing``), ``options``,
``steps`` (null, or the line saying which steps are compared when the traces hold different steps),
``warnings``, ``cut_short`` (sides whose recording stopped part-way, so the trace is partial: ``side``
("reference" or "target"), ``rank``, ``last`` (the last op that reads back), ``why``), ``environment`` (one object per
difference: ``key``, ``ref``, ``target``, ``hint``), ``found_difference`` (the runs part: what exit code 1 says),
``summary`` (pair counts per status, ops on one side only; rank by rank), ``first_divergent`` (null or a pair: the
earliest over ranks; for a parallel run mapped onto a single process, its departure in that shape, with
``"parallel": true``; ``parallel`` holds the whole of it), ``ranks`` (per rank pair: ``ref_rank``,
``target_rank``, ``evidence``, ``step_inputs``, ``summary``, ``first_divergent``, ``first_difference``, ``units``:
compiled units of one side diffed against the eager ops of their region in the other; ``precision``: pairs that
compute at different dtypes, per dtype pair, and the limits they were judged at; ``explained``: how many pairs
differ beyond the fixed limits while each side's op, replayed from its own inputs, is right),
``structural`` (runs of ops on
one side only) and ``pairs`` (one object per aligned pair). Non-finite floats are written as "inf", "-inf", "nan".
"""
from __future__ import annotations

from typing import Any

from replaydiff.trace.location import location_json
from replaydiff.diff.result import DiffReport, PairResult, RankDiff, Unaligned
from replaydiff.report.json_report import _clean

DIFF_FORMAT = "replaydiff.diff/1"


def pair_json(rd: RankDiff, p: PairResult | None) -> dict | None:
    if p is None:
        return None
    return _clean({
        "index": {"ref": p.ref, "target": p.target},
        "rank": {"ref": rd.ref_rank, "target": rd.target_rank},
        "op": p.op, "target_op": p.target_op, "module": p.module, "phase": p.phase, "source": p.source,
        "forward_index": p.forward_index,
        "forward_source": p.location.source if p.location and p.location.of_forward else None,
        "location": location_json(p.location),
        "status": p.status.value, "evidence": None if p.evidence is None else p.evidence.value,
        "inputs_agree": p.inputs_agree, "metrics": p.metrics, "reason": p.reason,
        "inherited_from": None if p.inherited_from is None else p.inherited_from.to_json(),
        "dtypes": None if p.dtypes is None else {"ref": p.dtypes[0], "target": p.dtypes[1]},
        "explained": p.explained,
    })


def _unaligned_json(rd: RankDiff, u: Unaligned) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for n in u.names:
        counts[n] = counts.get(n, 0) + 1
    return {"side": u.side, "rank": rd.target_rank if u.side == "target" else rd.ref_rank, "first": u.first,
            "last": u.last, "count": len(u.ops), "ops": counts, "module": u.module, "phase": u.phase}


def _parallel_first(report: DiffReport) -> dict | None:
    """A parallel diff's departure (``parallel.departure`` holds all of it) in the shape of a first divergent pair,
    so that a check of ``first_divergent`` finds it as it finds a rank-by-rank one: the op on the reference, and on
    the first rank that runs it."""
    d = report.parallel.departure if report.parallel is not None else None
    if d is None:
        return None
    return _clean({"index": {"ref": d.op.ref, "target": d.op.targets[0] if d.op.targets else None},
                   "rank": {"ref": d.op.ref_rank or 0, "target": d.op.ranks[0] if d.op.ranks else 0},
                   "op": d.op.name, "target_op": d.op.name, "module": d.op.module, "phase": d.op.phase,
                   "source": d.op.source, "status": "divergent", "reason": d.why, "parallel": True})


def diff_to_json(report: DiffReport) -> dict:
    first = report.first_divergent
    parted = report.step_inputs_differ
    return {
        "format": DIFF_FORMAT,
        "planted": list(report.planted),
        "ref": report.ref, "target": report.target, "baseline": report.baseline,
        "step_inputs": _clean(parted[0].step_inputs.to_json()) if parted else None,
        "options": _clean(report.options),
        "steps": report.steps,
        "warnings": list(report.warnings),
        "cut_short": [{"side": side, **c.to_json()} for side, c in report.cut_short],
        "environment": [_clean(d.to_json()) for d in report.environment],
        "found_difference": report.found_difference,
        "summary": report.counts(),
        "first_divergent": pair_json(*first) if first is not None else _parallel_first(report),
        "parallel": None if report.parallel is None else report.parallel.to_json(),
        "ranks": [{"ref_rank": rd.ref_rank, "target_rank": rd.target_rank, "ref_ops": rd.ref_ops,
                   "target_ops": rd.target_ops, "evidence": [e.value for e in rd.evidence],
                   "step_inputs": _clean(rd.step_inputs.to_json()),
                   "summary": rd.counts(), "first_divergent": pair_json(rd, rd.first_divergent),
                   "first_difference": pair_json(rd, rd.first_difference),
                   "units": [_clean(u.to_json()) for u in rd.units],
                   "precision": [_clean(x.to_json()) for x in rd.precision],
                   "explained": len(rd.explained)} for rd in report.ranks],
        "structural": [_unaligned_json(rd, u) for rd in report.ranks
                       for u in sorted(rd.ref_only + rd.target_only, key=lambda u: (u.side, u.first))],
        "pairs": [pair_json(rd, p) for rd in report.ranks for p in rd.pairs],
    }
