"""What became of a fault planted while recording (``record --plant``) in one replay.

A plant that changed nothing (its op's result is None or all zeros, or every value rounds back), one that never
landed, and one no larger than the rounding error replay allows all leave replay nothing to find: the reports say
which, with the figures, so that "no divergent op" never reads as a fault replay failed to find. One PlantReport per
plant, for the text and JSON replay reports and the health report.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from replaydiff.compare.tolerance import DEFAULT_LIMITS
from replaydiff.compare.verdict import within_fixed_limits
from replaydiff.replay.result import OpResult, ReplayReport, Status
from replaydiff.trace.damage import MissingOps
from replaydiff.trace.schema import PlantedFaultInfo


class PlantOutcome(str, Enum):
    FOUND = "found"  # replay judged the planted op divergent
    NOT_RUN = "not_run"  # the recording never made the planted call: nothing was planted
    NO_EFFECT = "no_effect"  # the plant landed and changed no value
    WITHIN_LIMIT = "within_limit"  # it changed the result, and replay judged the op ok
    NOT_CHECKED = "not_checked"  # the planted op was skipped, failed to replay, or is not in the trace
    NOT_REPLAYED = "not_replayed"  # outside the ops this replay was asked for

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PlantReport:
    plant: PlantedFaultInfo
    outcome: PlantOutcome
    note: str | None  # one line for people; None when replay named the op as planted

    def to_json(self) -> dict:
        return {**self.plant.to_json(), "outcome": self.outcome.value, "note": self.note}


def plant_reports(report: ReplayReport, plants: list[PlantedFaultInfo] | None = None) -> list[PlantReport]:
    """What became of each plant (``report.plants`` unless given) in ``report``."""
    results = {(r.rank, r.index): r for r in report.ops}
    limits = (report.options or {}).get("tolerances") or {}  # dtype -> [MAX, REL], as ReplayOptions.to_json says
    # dtypes whose limit the user's --tolerance moved from the default: a plant within such a limit is theirs to see
    moved = {d for d, lim in limits.items() if d in DEFAULT_LIMITS and tuple(lim) != DEFAULT_LIMITS[d]}
    return [_judge(p, results.get((p.rank, p.index)), moved, report.missing)
            for p in (report.plants if plants is None else plants)]


def plant_notes(report: ReplayReport, plants: list[PlantedFaultInfo] | None = None) -> list[str]:
    return [pr.note for pr in plant_reports(report, plants) if pr.note]


def _judge(p: PlantedFaultInfo, r: OpResult | None, moved: set[str], missing: list[MissingOps]) -> PlantReport:
    head = "planted fault:"
    effect = p.effect
    if not p.landed and p.call is None:  # only the options name the plant: the manifest was never finished
        return PlantReport(p, PlantOutcome.NOT_CHECKED,
                           f"{head} the recording did not finish, so where {p.op} landed is unknown")
    if not p.landed:
        if p.calls_seen == 0:
            made = f"the recording never ran {p.op}"
        elif p.calls_seen is not None:
            made = f"the recording made {p.calls_seen} call{'' if p.calls_seen == 1 else 's'} of {p.op}, not {p.call}"
        else:
            made = f"the recording never made call {p.call} of {p.op}"
        return PlantReport(p, PlantOutcome.NOT_RUN,
                           f"{head} {made}: nothing was planted, so there was nothing for replay to find")
    where = f"op #{p.index} {p.op}" if p.index is not None else f"{p.op} call {p.call}"
    nothing = effect is not None and effect.changed_nothing
    if r is not None and r.status is Status.DIVERGENT:
        return PlantReport(p, PlantOutcome.FOUND, None if not nothing else
                           f"{head} {where} is divergent although the plant {effect.facts()}: the kernel's own result "
                           f"differs from the reference")
    if nothing:
        return PlantReport(p, PlantOutcome.NO_EFFECT,
                           f"{head} {where} {effect.facts()}: there was nothing for replay to find")
    if p.index is None:
        return PlantReport(p, PlantOutcome.NOT_CHECKED,
                           f"{head} {where} landed on an op the trace does not hold (record --op/--module left it "
                           f"out): replay could not check it")
    gone = next((m for m in missing if m.rank == p.rank and m.first <= p.index <= m.last), None)
    if r is None and gone is not None:
        return PlantReport(p, PlantOutcome.NOT_CHECKED,
                           f"{head} {where} is among the ops missing from the trace, not judged: {gone.describe()}")
    if r is None:
        return PlantReport(p, PlantOutcome.NOT_REPLAYED,
                           f"{head} {where} was not replayed (outside the ops this replay was asked for)")
    if r.status is Status.OK:
        return PlantReport(p, PlantOutcome.WITHIN_LIMIT, f"{head} {where} replayed ok{_why_ok(p, r, moved)}")
    return PlantReport(p, PlantOutcome.NOT_CHECKED,
                       f"{head} {where} was {r.status.value}" + (f": {r.reason}" if r.reason else ""))


def _why_ok(p: PlantedFaultInfo, r: OpResult, moved: set[str]) -> str:
    """Why a planted op replayed ok, in replay's own figures: its change is within the limit (one the user's
    --tolerance set, when it did), or replay says why."""
    plant = f"the plant {p.effect.facts()}" if p.effect is not None else ""
    m = r.metrics or {}
    within = None if r.verdict is None else within_fixed_limits(r.verdict)
    if within is not None:
        measure = f"max_abs/(eps*absmax) {m['norm_max']:.3g}"
        if within:
            dtype = p.effect.dtype if p.effect is not None else None
            if dtype in moved:
                return (f": {plant + ', and ' if plant else ''}replay's error measure for it, {measure}, is within "
                        f"its limit {m['limit_max']:.3g}, which --tolerance set for {dtype} (by default "
                        f"{DEFAULT_LIMITS[dtype][0]:.3g})")
            return (f": {plant + ', and ' if plant else ''}replay's error measure for it, {measure}, is within its "
                    f"limit {m['limit_max']:.3g}: a change this small is not told apart from rounding error")
        return (f": {plant + '; ' if plant else ''}{measure} is over its limit {m['limit_max']:.3g}"
                + (f", and replay judged it ok: {r.reason}" if r.reason else ", and replay judged it ok"))
    return f": {plant}" if plant else ""
