"""Provides the DTensor placements a rank's trace holds: for each op the recording mode saw on DTensor arguments
(before DTensor unwraps it into the local ops that are recorded), each argument's placements, mesh shape and global
shape, one JSON line per op in a side file of the rank's directory. Only this module knows the file and its keys.

The recorder appends a line per DTensor op (``append_note``); ``declared_inputs`` links each line to the local op
of the same name that DTensor runs next, so that a reader knows, for an input position of a recorded op, how
DTensor said the value was laid out over the mesh. A line cut short (a job killed mid-write) is skipped.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable, Sequence

from replaydiff.trace.format import MAX_FRAME_BYTES, read_regular

PLACEMENTS = "dtensor.jsonl"
_AT, _OP, _ARGS = "at", "op", "args"  # the op number the next recorded op gets, the DTensor op, its tensor args
_PL, _MESH, _SHAPE = "pl", "mesh", "shape"


class Placement(str, Enum):
    SHARD = "shard"
    REPLICATE = "replicate"
    PARTIAL = "partial"
    NORM = "norm"  # DTensor's _NormP(p): each rank holds the p-norm of its shard
    OTHER = "other"  # a placement this reader does not know (_StridedShard, a custom one)

    def __str__(self) -> str:
        return self.value


_SHARD = re.compile(r"^(?:S|Shard)\((?:dim=)?(-?\d+)\)$")


@dataclass(frozen=True)
class DTensorArg:
    """One DTensor argument: its placements as DTensor writes them ('S(0)', 'R', 'P(sum)'), one per mesh
    dimension, the mesh's shape and the global (unsharded) shape."""

    placements: tuple[str, ...]
    mesh: tuple[int, ...]
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{', '.join(self.placements)} on a mesh of {'x'.join(map(str, self.mesh))}"

    def placement(self) -> tuple[Placement, int | None]:
        """The placement on a one-dimensional mesh, with the dimension sharded (OTHER on a mesh of more)."""
        if len(self.placements) != 1:
            return Placement.OTHER, None
        p = self.placements[0]
        m = _SHARD.match(p)
        if m:
            d = int(m.group(1))
            return Placement.SHARD, d % len(self.shape) if self.shape else d
        if p in ("R", "Replicate()"):
            return Placement.REPLICATE, None
        if p.startswith("_NormP(") or p.startswith("NormP("):
            return Placement.NORM, None
        if p.startswith("P(") or p.startswith("Partial("):
            return Placement.PARTIAL, None
        return Placement.OTHER, None


@dataclass(frozen=True)
class DTensorNote:
    at: int
    op: str
    args: tuple[DTensorArg | None, ...]  # per tensor argument in input order; None: a plain tensor


def append_note(rank_dir: Path, at: int, op: str, args: Sequence[DTensorArg | None]) -> None:
    """Append one DTensor op's facts (one line, written whole with one call)."""
    line = json.dumps({_AT: at, _OP: op, _ARGS: [None if a is None else
                                                 {_PL: list(a.placements), _MESH: list(a.mesh), _SHAPE: list(a.shape)}
                                                 for a in args]}, separators=(",", ":")) + "\n"
    fd = os.open(rank_dir / PLACEMENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_notes(rank_dir: Path) -> list[DTensorNote]:
    """The DTensor ops of a rank, in order; [] when the trace has none (no DTensor, or recorded before)."""
    path = Path(rank_dir) / PLACEMENTS
    if not os.path.lexists(path):
        return []
    text = read_regular(path, MAX_FRAME_BYTES).decode("utf-8", "replace")  # a link or a FIFO: TraceError
    out = []
    for line in text.splitlines():
        try:
            d = json.loads(line)
            args = tuple(None if a is None else DTensorArg(tuple(str(p) for p in a[_PL]), tuple(int(x) for x in a[_MESH]),
                                                           tuple(int(x) for x in a[_SHAPE])) for a in d[_ARGS])
            out.append(DTensorNote(int(d[_AT]), str(d[_OP]), args))
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # a line cut short: what it said is unknown, not guessed
    return out


def declared_inputs(notes: Sequence[DTensorNote], ops: Iterable) -> dict[tuple[int, int], DTensorArg]:
    """{(op number, input position): DTensorArg} for the recorded local op each DTensor op ran as: the first op of
    the same name recorded from the note's op number on, before the next note's. ``ops``: the rank's op records
    (``index``, ``name``), in order."""
    out: dict[tuple[int, int], DTensorArg] = {}
    if not notes:
        return out
    by_at = sorted(notes, key=lambda n: n.at)
    k = 0
    pending: DTensorNote | None = None
    for op in ops:
        while k < len(by_at) and by_at[k].at <= op.index:
            pending = by_at[k]  # a later note replaces one whose local op never came (a redistribution only)
            k += 1
        if pending is not None and op.name == pending.op:
            for pos, a in enumerate(pending.args):
                if a is not None:
                    out[(op.index, pos)] = a
            pending = None
    return out
