"""Ops a trace lost after it was written: an ops chunk deleted, never copied, or cut short.

A trace is usually copied from a cluster to a workstation; a copy cut short or made in part must never read as a
shorter, clean trace. The writer's final manifest lists every ops chunk it wrote (first and last op number, bytes);
the reader holds the ops directory against that list at open, which costs a ``stat`` per chunk and reads no chunk.
Each chunk that is not on disk as written becomes one ``MissingOps``: which ops, which file, what is wrong with it.
Traces whose manifest has no such list (a recording that never finished, an older format) still show a lost tail:
ops the manifest says were written past the last chunk on disk.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from replaydiff.errors import TraceError
from replaydiff.trace.format import ops_chunk_name
from replaydiff.trace.schema.manifest import OpsFileWritten


@dataclass(frozen=True)
class MissingOps:
    """A run of op numbers whose records cannot be read, and the ops file that held them."""

    rank: int
    first: int
    last: int
    path: Path  # the ops chunk; the ops directory when the trace does not say which files held them
    problem: str  # what is wrong with the file: "deleted or never copied", "cut short: 100 of 6023 bytes", ...
    file_known: bool = True

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    @property
    def span(self) -> str:
        return f"#{self.first}" if self.first == self.last else f"#{self.first}-#{self.last}"

    def describe(self, with_rank: bool = False) -> str:
        """e.g. '213 op(s) (#0-#212) missing: ops file TRACE/rank0/ops/000000000.rdt (deleted or never copied)'."""
        on = f" of rank {self.rank}" if with_rank else ""
        if not self.file_known:
            return f"{self.count} op(s) ({self.span}){on} missing: {self.problem}"
        return f"{self.count} op(s) ({self.span}){on} missing: ops file {self.path} ({self.problem})"

    def error(self) -> TraceError:
        """The TraceError a read of one of these ops raises: the file, and which ops it held."""
        if not self.file_known:
            return TraceError(self.path, f"{self.count} op(s) ({self.span}) of rank {self.rank} missing: "
                                         f"{self.problem}")
        return TraceError(self.path, f"{self.problem}; it held {self.count} op(s) ({self.span}) of rank {self.rank}, "
                                     f"so the trace is damaged")

    def clip(self, first: int | None, last: int | None) -> "MissingOps | None":
        """The part of this run within ``first..last`` (either may be None: unbounded), or None if none is."""
        lo = self.first if first is None else max(self.first, first)
        hi = self.last if last is None else min(self.last, last)
        if lo > hi:
            return None
        return MissingOps(self.rank, lo, hi, self.path, self.problem, self.file_known)

    def to_json(self) -> dict:
        return {"rank": self.rank, "first": self.first, "last": self.last, "count": self.count,
                "file": str(self.path) if self.file_known else None, "problem": self.problem}


@dataclass(frozen=True)
class CutShort:
    """A rank whose recording ended before what it was asked for: the recorder stopped (its own failure, or the
    script raised or was interrupted mid-step), or it never finished (the process was killed or crashed). Its trace
    reads up to its last complete op; what came after was never recorded, so the trace is partial, never clean."""

    rank: int
    last: int | None  # the last op that reads back; None: none does
    why: str

    def describe(self) -> str:
        """e.g. 'rank 0's recording stopped part-way after op #212: step 3 was cut short by the script's exception'."""
        where = f"after op #{self.last}" if self.last is not None else "before its first op"
        return f"rank {self.rank}'s recording stopped part-way {where}: {self.why}"

    def to_json(self) -> dict:
        return {"rank": self.rank, "last": self.last, "why": self.why}


def find_missing(rank: int, ops_dir: Path, written: list[OpsFileWritten] | None, complete: bool,
                 last_written: int | None, last_on_disk: int | None) -> tuple[MissingOps, ...]:
    """The runs of ops of one rank that are not on disk as written, in op order.

    ``written``: the chunks the manifest lists (None: it lists none); ``last_written``: the last op number the
    manifest says was written; ``last_on_disk``: the last op number the chunks on disk hold."""
    if written is not None:
        out = []
        for f in written:
            path = ops_dir / ops_chunk_name(f.first)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                out.append(MissingOps(rank, f.first, f.last, path, "deleted or never copied"))
                continue
            except OSError as exc:
                out.append(MissingOps(rank, f.first, f.last, path, f"unreadable: {exc.strerror or exc}"))
                continue
            if size < f.nbytes:
                out.append(MissingOps(rank, f.first, f.last, path, f"cut short: {size} of {f.nbytes} bytes"))
            elif size > f.nbytes:
                out.append(MissingOps(rank, f.first, f.last, path,
                                      f"not as written: {size} bytes, {f.nbytes} were written"))
        return tuple(out)
    if complete and last_written is not None and (last_on_disk is None or last_on_disk < last_written):
        first = 0 if last_on_disk is None else last_on_disk + 1
        return (MissingOps(rank, first, last_written, ops_dir,
                           f"their ops files are not in {ops_dir} (the recording wrote up to op #{last_written})",
                           file_known=False),)
    return ()


def describe_missing(missing: list[MissingOps] | tuple[MissingOps, ...], most: int = 4) -> list[str]:
    """One line per run (the rank named when runs of several ranks are listed), at most ``most`` and then a count."""
    with_rank = len({m.rank for m in missing}) > 1
    lines = [m.describe(with_rank) for m in missing[:most]]
    rest = missing[most:]
    if rest:
        lines.append(f"and {sum(m.count for m in rest)} more op(s) in {len(rest)} more ops file(s)")
    return lines
