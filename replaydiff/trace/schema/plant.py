"""The planted fault (record --plant): one entry of a rank's manifest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replaydiff.faults import PlantEffect  # what a plant changed: measured while recording, read back here

_PLANT_OP, _PLANT_CALL, _PLANT_REL, _PLANT_LANDED, _PLANT_SPEC = "op", "call", "rel", "landed", "spec"
_PLANT_SEEN, _PLANT_EFFECT = "calls_seen", "effect"  # absent in traces written before a plant's effect was counted
_EFFECT_COUNTS = ("tensors", "elements", "nonzero", "changed", "nonfinite")
_EFFECT_ULPS, _EFFECT_DTYPE = "max_ulps", "dtype"
_EFFECT_TARGET = "target"  # absent in traces written before a plant named what it perturbed


def _effect_from_json(d: Any) -> "PlantEffect | None":
    """A plant's effect from its manifest entry (or a JSON report); None when it is absent or not sound."""
    if not isinstance(d, dict):
        return None
    counts = [d.get(k) for k in _EFFECT_COUNTS]
    ulps, dtype, target = d.get(_EFFECT_ULPS), d.get(_EFFECT_DTYPE), d.get(_EFFECT_TARGET)
    sound = all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) \
        and (ulps is None or isinstance(ulps, (int, float))) and (dtype is None or isinstance(dtype, str))
    if not sound:
        return None
    return PlantEffect(*counts[:4], None if ulps is None else float(ulps), counts[4], dtype,
                       target if isinstance(target, str) else None)


def wire_plant(op: str, call: int, rel: float, landed: bool, calls_seen: int | None, effect: Any = None) -> dict:
    """The manifest entry of a planted fault; ``effect`` is anything with PlantEffect's fields (the faults module's
    measurement), None when the plant never landed."""
    entry: dict = {_PLANT_OP: op, _PLANT_CALL: call, _PLANT_REL: rel, _PLANT_LANDED: bool(landed)}
    if calls_seen is not None:
        entry[_PLANT_SEEN] = int(calls_seen)
    if effect is not None:
        entry[_PLANT_EFFECT] = {k: getattr(effect, k, None)
                                for k in (*_EFFECT_COUNTS, _EFFECT_ULPS, _EFFECT_DTYPE, _EFFECT_TARGET)}
    return entry


@dataclass(frozen=True)
class PlantedFaultInfo:
    """A fault planted below the recorder: the ``call``-th call (from 1) of ``op`` times 1 + ``rel``; ``index`` is
    that op's number in the trace (None if the step never made that call); ``calls_seen`` how many calls of ``op``
    the recording made and ``effect`` what the plant changed (both None in traces written before they were kept)."""

    op: str
    call: int | None
    rel: float | None
    landed: bool
    index: int | None
    rank: int
    calls_seen: int | None = None
    effect: PlantEffect | None = None

    @property
    def nothing_to_find(self) -> bool:
        """The plant changed no value of the trace: it never landed, or where it landed it changed nothing."""
        return not self.landed or (self.effect is not None and self.effect.changed_nothing)

    def describe(self) -> str:
        what = self.op + (f" call {self.call}" if self.call else "") + \
            (f" x(1{self.rel:+g})" if isinstance(self.rel, (int, float)) else "")
        if self.index is not None:
            where = f"op #{self.index} on rank {self.rank}"
        elif self.landed:
            where = f"on rank {self.rank}, an op the trace does not hold"
        else:
            where = f"never reached on rank {self.rank}"
            if self.calls_seen == 0:
                where += " (the recording never ran it)"
            elif self.calls_seen is not None:
                where += f" (the recording made {self.calls_seen} call{'' if self.calls_seen == 1 else 's'})"
        e = self.effect
        if self.landed and e is not None and (e.changed_nothing or e.within_one_rounding):
            where += f": {e.describe()}"  # a plant that changed its result is named as it always was
        return f"{what}, {where}"

    def to_json(self) -> dict:
        return {"rank": self.rank, "op": self.op, "call": self.call, "rel": self.rel, "landed": self.landed,
                "index": self.index, "calls_seen": self.calls_seen,
                "effect": None if self.effect is None else self.effect.to_json(), "summary": self.describe()}

    @classmethod
    def from_json(cls, d: dict) -> "PlantedFaultInfo":
        rel = d.get("rel")
        if isinstance(rel, str):  # a JSON report writes a NaN or infinite REL as a string
            rel = float(rel) if rel in ("nan", "inf", "-inf") else None
        return cls(op=str(d.get("op")), call=d.get("call"), rel=rel, landed=bool(d.get("landed")),
                   index=d.get("index"), rank=int(d.get("rank") or 0), calls_seen=d.get("calls_seen"),
                   effect=_effect_from_json(d.get("effect")))


def plant_from_wire(entry: Any, spec: str | None, rank: int) -> PlantedFaultInfo | None:
    """The planted fault of a manifest (``index`` left None: the reader finds the op), or None if there was none.
    Without an entry, ``spec`` (the record options' plant) says a fault was asked for: still recording, or killed."""
    if not isinstance(entry, dict):
        if not spec:
            return None
        entry = {_PLANT_SPEC: spec}
    op, call, seen = entry.get(_PLANT_OP), entry.get(_PLANT_CALL), entry.get(_PLANT_SEEN)
    landed = bool(entry.get(_PLANT_LANDED))
    return PlantedFaultInfo(op=op if isinstance(op, str) else str(entry.get(_PLANT_SPEC)),
                            call=call if type(call) is int and call >= 1 else None, rel=entry.get(_PLANT_REL), landed=landed,
                            index=None, rank=rank, calls_seen=seen if isinstance(seen, int) else None,
                            effect=_effect_from_json(entry.get(_PLANT_EFFECT)) if landed else None)
