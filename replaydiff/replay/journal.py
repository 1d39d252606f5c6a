"""The replay journal: every op's result written as it is judged, so an interrupted replay resumes (``--resume``).

A journal belongs to one trace replayed with one set of options: its file name is a hash of the trace's resolved
path and the options, and its header repeats them with each rank manifest's size and modification time, so a trace
recorded again at the same path (or other options) never resumes from results judged on something else. The file
is msgpack: a header, then one OpResult per record, appended and flushed about once a second; a record cut short
by a kill is dropped on reading. Results are encoded field by field, through a fixed list of result types (no
pickle: decoding a journal runs no code). A replay that finishes removes its journal.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from enum import Enum
from pathlib import Path
from typing import Any

import msgpack

from replaydiff.compare import metrics
from replaydiff.compare.verdict import Calibration, Verdict
from replaydiff.replay.policy import Precision, ReplayOptions
from replaydiff.replay.result import NonfiniteInput, OpResult, Status
from replaydiff.trace.format import MANIFEST
from replaydiff.trace.location import OpLocation
from replaydiff.trace.reader import Trace

_VERSION = 1
_TYPES: dict[str, type] = {c.__name__: c for c in (
    OpResult, NonfiniteInput, OpLocation, Verdict, Calibration, metrics.FloatError, metrics.NonfiniteMismatch,
    metrics.ExactMismatch, metrics.ShapeMismatch, metrics.ViewMismatch, metrics.ScalarMismatch)}
_ENUMS: dict[str, type[Enum]] = {c.__name__: c for c in (Status, Precision)}
_FLUSH_SECONDS = 1.0


def default_dir() -> Path:
    """Where journals go unless ``--journal DIR`` names a folder: the user's cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "replaydiff" / "journals"


def _encode(v: Any) -> Any:
    if isinstance(v, Enum):
        return {"~": type(v).__name__, "v": v.value}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        name = type(v).__name__
        if _TYPES.get(name) is not type(v):
            raise TypeError(f"a result field of type {name} cannot be journaled")
        return {"~": name, **{f.name: _encode(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"a result value of type {type(v).__name__} cannot be journaled")


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        name = v.get("~")
        if name in _ENUMS:
            return _ENUMS[name](v["v"])
        if name is not None:
            cls = _TYPES[name]  # KeyError for anything else: the record is not ours
            return cls(**{k: _decode(x) for k, x in v.items() if k != "~"})
        return {k: _decode(x) for k, x in v.items()}
    return v


def _header(trace: Trace, opts: ReplayOptions) -> dict:
    stamps = []
    for rt in trace:
        st = (rt.root / MANIFEST).stat()
        stamps.append([rt.rank, st.st_size, st.st_mtime_ns])
    return {"journal": _VERSION, "trace": str(trace.path.resolve()), "manifests": stamps,
            "options": json.loads(json.dumps(opts.to_json(), default=str))}


class Journal:
    """One replay's journal file: ``judged()`` reads what an earlier run left, ``add`` appends, ``finish`` removes."""

    def __init__(self, trace: Trace, opts: ReplayOptions, folder: str | os.PathLike | None = None) -> None:
        self.header = _header(trace, opts)
        key = hashlib.sha256(json.dumps([self.header["trace"], self.header["options"]],
                                        sort_keys=True).encode()).hexdigest()[:20]
        self.path = Path(folder) if folder is not None else default_dir()
        self.path = self.path / f"replay-{key}.rdj"
        self._fh: Any = None
        self._last_flush = 0.0
        self.count = 0
        self._kept = False

    def judged(self) -> list[OpResult]:
        """The results an earlier, interrupted run of the same replay wrote (none if its trace or options differ,
        or there is no journal)."""
        try:
            data = self.path.read_bytes()
        except OSError:
            return []
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(data)
        out: list[OpResult] = []
        try:
            if next(unpacker) != self.header:
                return []
            for rec in unpacker:
                r = _decode(rec)
                if isinstance(r, OpResult):
                    out.append(r)
        except StopIteration:
            return []
        except Exception:  # a damaged tail (a write cut short, or a stray file): keep what decoded before it
            pass
        return out

    def start(self, kept: list[OpResult]) -> None:
        """Begin the journal anew with ``kept`` (what a resumed run keeps) and open it for appending."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(msgpack.packb(self.header, use_bin_type=True))
            for r in kept:
                fh.write(msgpack.packb(_encode(r), use_bin_type=True))
        os.replace(tmp, self.path)
        self._fh = open(self.path, "ab")
        self._last_flush = time.monotonic()
        self._kept = bool(kept)

    def add(self, r: OpResult) -> None:
        if self._fh is None:
            return
        try:
            record = msgpack.packb(_encode(r), use_bin_type=True)
        except (TypeError, ValueError):  # a value no result type names: a resumed run replays this op again
            return
        self._fh.write(record)
        self.count += 1
        now = time.monotonic()
        if now - self._last_flush > _FLUSH_SECONDS:
            self._fh.flush()
            self._last_flush = now

    def close(self, finished: bool) -> None:
        """Flush and close. The journal is removed (only ours: the file we wrote) when the replay finished, or when
        it holds no result to resume from."""
        if self._fh is None:
            return
        self._fh.close()
        self._fh = None
        if finished or (self.count == 0 and not self._kept):
            self.path.unlink(missing_ok=True)
