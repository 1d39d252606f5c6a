"""What a recording left out (record --budget, a full disk, a --module/--op filter): per op, and per rank in the
manifest.
"""
from __future__ import annotations

from dataclasses import dataclass

from replaydiff.trace.op_runs import OpRuns, describe_runs
from replaydiff.trace.schema.keys import _INDEX, _LEFT_OUT, _mapping, _typed

# Why an op's tensor data was left out while the op itself was recorded (its tensors have statistics instead; with
# --tensors meta, shapes only): OpRecord.data_left_out.
LEFT_OUT_FILTERED = "filtered"  # outside record's --module/--op filter
LEFT_OUT_BUDGET = "budget"  # past record's --budget
LEFT_OUT_DISK_FULL = "disk full"  # the disk filled while recording
LEFT_OUT_DEVICE_PENDING = "device pending"  # a device had not finished the work before the copy by the deadline
# Data the recording meant to store and could not: the ops are never judged, so a replay is never clean
LEFT_OUT_UNWANTED = (LEFT_OUT_BUDGET, LEFT_OUT_DISK_FULL, LEFT_OUT_DEVICE_PENDING)
LEFT_OUT_WHY = {LEFT_OUT_FILTERED: "outside the record --module/--op filter", LEFT_OUT_BUDGET: "past the record --budget",
                LEFT_OUT_DISK_FULL: "the disk was full while recording",
                LEFT_OUT_DEVICE_PENDING: "the device had not finished its work in time (a hung kernel or collective?)"}


# The manifest's entry: the left-out ops of a rank by reason.
_M_LEFT_OUT = "left_out"  # {reason: {"ops": n, "first": i, "last": j, "bytes": b, "runs": [[a, b], ...], "nruns": r}}
_LO_OPS, _LO_FIRST, _LO_LAST, _LO_BYTES = "ops", "first", "last", "bytes"
_LO_RUNS, _LO_NRUNS = "runs", "nruns"  # the first runs of consecutive op numbers (op_runs.SHOWN), and how many in all
_LO_EVERY = "every_op"  # true when the reason covers every op written: a --module/--op filter that matched no op


@dataclass(frozen=True)
class LeftOut:
    """The ops of a rank whose tensor data a recording left out for one reason (a LEFT_OUT_* value): how many,
    the first and last of them, and the bytes of data not stored (each storage version counted once)."""

    reason: str
    ops: int
    first: int | None
    last: int | None
    nbytes: int
    every_op: bool = False  # every op the trace holds (for the filter: it matched no op)
    runs: tuple[tuple[int, int], ...] = ()  # the first runs of consecutive op numbers; () in a trace that has none
    nruns: int = 0  # runs in all

    @property
    def where(self) -> str:
        """Which ops, exactly: their runs (``#7-#18, #20-#25 and 4 more runs up to #719``). A trace written before
        the runs were kept has the first and last only, and ops between them may have kept their data."""
        if self.runs:
            return describe_runs(list(self.runs), self.nruns, self.last)
        return f"#{self.first}" if self.first == self.last else f"between #{self.first} and #{self.last}"

    def describe(self) -> str:
        where = self.where
        mb = f", {self.nbytes / 1e6:.3g} MB of tensor data not stored" if self.nbytes else ""
        none = " (the filter matched no op)" if self.every_op and self.reason == LEFT_OUT_FILTERED else ""
        return f"{self.ops} op(s) ({where}) kept with statistics only: {LEFT_OUT_WHY.get(self.reason, self.reason)}" \
               f"{none}{mb}"


class LeftOutTally:
    """Counts what is left out while a trace is written: ops (the writer thread, from the records it writes) and
    bytes (the recording thread); two dicts, each filled by one thread, read once both are done."""

    def __init__(self) -> None:
        self._ops: dict[str, list[int]] = {}  # reason -> [ops, first, last]
        self._runs: dict[str, OpRuns] = {}  # reason -> its ops as runs of consecutive numbers
        self._bytes: dict[str, int] = {}
        self._seen = 0  # ops written, left out or not

    def add_op(self, rec: dict) -> None:
        self._seen += 1
        why = rec.get(_LEFT_OUT)
        if why is not None:
            t = self._ops.get(why)
            if t is None:
                self._ops[why] = [1, rec[_INDEX], rec[_INDEX]]
                self._runs[why] = OpRuns()
            else:
                t[0] += 1
                t[2] = rec[_INDEX]
            self._runs[why].add(rec[_INDEX])

    def add_bytes(self, why: str, nbytes: int) -> None:
        self._bytes[why] = self._bytes.get(why, 0) + nbytes

    def wire(self) -> dict:
        """The manifest entry (an empty dict when nothing was left out)."""
        out = {why: {_LO_OPS: n, _LO_FIRST: first, _LO_LAST: last, _LO_BYTES: max(0, self._bytes.get(why, 0)),
                     _LO_RUNS: self._runs[why].runs, _LO_NRUNS: self._runs[why].count,
                     **({_LO_EVERY: True} if n == self._seen else {})}
               for why, (n, first, last) in self._ops.items()}
        return {_M_LEFT_OUT: out} if out else {}


def left_out_from_manifest(manifest: dict) -> list[LeftOut]:
    v = manifest.get(_M_LEFT_OUT)
    out = []
    for why, d in (v.items() if isinstance(v, dict) else ()):
        d = _mapping(d)
        runs = d.get(_LO_RUNS)
        runs = tuple((a, b) for a, b in runs if isinstance(a, int) and isinstance(b, int)) \
            if isinstance(runs, list) and all(isinstance(x, list) and len(x) == 2 for x in runs) else ()
        out.append(LeftOut(str(why), _typed(d.get(_LO_OPS), int) or 0, _typed(d.get(_LO_FIRST), int),
                           _typed(d.get(_LO_LAST), int), _typed(d.get(_LO_BYTES), int) or 0,
                           _typed(d.get(_LO_EVERY), bool) or False, runs,
                           (_typed(d.get(_LO_NRUNS), int) or len(runs)) if runs else 0))
    return sorted(out, key=lambda x: (x.first is None, x.first))
