"""Manifest metadata: the record options, the compiled regions, the flight recorder's dump, the command line and
what the writer says it wrote, typed once at open.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from replaydiff.trace.modes import TensorMode
from replaydiff.trace.schema.environment import Environment
from replaydiff.trace.schema.keys import _mapping, _typed

# Manifest keys (written by record/recorder.py through wire_manifest and wire_closing_facts).
_M_RANK, _M_WORLD, _M_ENV, _M_OPTIONS, _M_STARTED, _M_ROOT = (
    "rank", "world_size", "environment", "options", "started_at", "source_root")
_M_COMPILED, _M_UNSEEN, _M_OPS_SEEN, _M_SECONDS, _M_DISABLED, _M_CUSTOM, _M_SOURCES, _M_PLANTED = (
    "compiled_regions", "unseen_writes", "ops_seen", "record_seconds", "disabled", "custom_ops", "source_files",
    "planted")
_M_DATA_BYTES = "data_bytes"  # what the writer wrote into ops/ and data/ (trace/writer.py RankWriter.close)
_M_OPS_WRITTEN, _M_LAST_OP = "ops_written", "last_op"  # op records written, and the last one's number
# The job's command line, as given to `replaydiff record -- CMD` (absent from the Python API and from older traces):
# what `trend` puts in the record command of its zoom-in.
_M_COMMAND = "command"
# Compiled-region keys (record/compiled.py builds each through wire_compiled_region).
_C_REGION, _C_KIND, _C_CALLS, _C_HOW, _C_BY_HOW, _C_BACKEND, _C_FULLGRAPH, _C_IN_TRACE, _C_SUPPRESSED, _C_NOTE = (
    "region", "kind", "calls", "how", "calls_by_how", "backend", "fullgraph", "ops_in_trace",
    "fullgraph_errors_suppressed", "note")
_C_UNITS = "units"  # calls recorded as compiled units (record(compiled="capture")); absent before units existed


@dataclass(frozen=True)
class RecordedOptions:
    """The record options a trace was written with (replaydiff.record.RecordOptions.to_json()); None where the trace
    does not say. Only the ones readers act on are typed; ``wire`` holds all."""
    tensors: TensorMode | None = None  # None: not said (a trace from before the option: full)
    steps: str | None = None
    flight: int | None = None
    plant: str | None = None
    granularity: str | None = None
    budget: int | None = None  # bytes (record --budget)
    compiled: str | None = None  # capture / eager (None: recorded before units existed: eager)
    # The --module / --op globs (None: no such filter): ops outside them were kept without their tensor data
    modules: tuple[str, ...] | None = None
    ops: tuple[str, ...] | None = None
    wire: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, d: Any) -> "RecordedOptions":
        d = _mapping(d)
        return cls(tensors=TensorMode.read(d.get("tensors")), steps=_typed(d.get("steps"), str),
                   flight=_typed(d.get("flight"), int), plant=_typed(d.get("plant"), str),
                   granularity=_typed(d.get("granularity"), str), budget=_typed(d.get("budget"), int),
                   compiled=_typed(d.get("compiled"), str), modules=_globs(d.get("modules")),
                   ops=_globs(d.get("ops")), wire=d)

    def to_json(self) -> dict:
        return self.wire


def _globs(v: Any) -> tuple[str, ...] | None:
    """A stored list of globs (None where absent, empty or not a list of strings)."""
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        return None
    return tuple(v)


@dataclass(frozen=True)
class CompiledRegion:
    """A torch.compile region entered while recording (record/compiled.py), or a note that tracking failed."""
    region: str | None = None
    kind: str | None = None  # forward / backward
    calls: int | None = None
    how: str | None = None  # eager / compiled / mixed / unknown
    calls_by_how: dict[str, int] = field(default_factory=dict)
    backend: str | None = None
    fullgraph: bool = False
    ops_in_trace: bool | None = None
    fullgraph_errors_suppressed: int = 0
    note: str | None = None  # set only on the entry saying that tracking failed
    units: bool = False  # its compiled graphs' calls are in the trace as compiled units (record/unit_capture.py)

    @classmethod
    def from_wire(cls, d: Any) -> "CompiledRegion":
        d = _mapping(d)
        return cls(_typed(d.get(_C_REGION), str), _typed(d.get(_C_KIND), str), _typed(d.get(_C_CALLS), int),
                   _typed(d.get(_C_HOW), str), {str(k): v for k, v in _mapping(d.get(_C_BY_HOW)).items()},
                   _typed(d.get(_C_BACKEND), str), d.get(_C_FULLGRAPH) is True, _typed(d.get(_C_IN_TRACE), bool),
                   _typed(d.get(_C_SUPPRESSED), int) or 0, _typed(d.get(_C_NOTE), str), d.get(_C_UNITS) is True)

    def to_wire(self) -> dict:
        if self.note is not None:
            return {_C_REGION: None, _C_KIND: None, _C_CALLS: None, _C_HOW: self.how, _C_NOTE: self.note}
        d = {_C_REGION: self.region, _C_KIND: self.kind, _C_CALLS: self.calls, _C_HOW: self.how,
             _C_BY_HOW: dict(self.calls_by_how), _C_BACKEND: self.backend, _C_FULLGRAPH: self.fullgraph,
             _C_IN_TRACE: self.ops_in_trace}
        if self.fullgraph_errors_suppressed:
            d[_C_SUPPRESSED] = self.fullgraph_errors_suppressed
        if self.units:
            d[_C_UNITS] = True
        return d


def wire_options(options: dict[str, Any]) -> dict[str, Any]:
    """Record options as stored (``RecordOptions.to_json()``): KeyError if one that RecordedOptions reads back is
    missing, so the option names and their reader cannot drift apart."""
    missing = {f.name for f in dataclasses.fields(RecordedOptions)} - {"wire"} - set(options)
    if missing:
        raise KeyError(f"record options lack {sorted(missing)}")
    return options


def compiled_regions_from_wire(v: Any) -> list[CompiledRegion]:
    return [CompiledRegion.from_wire(x) for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def wire_manifest(rank: int, world_size: int, environment: dict, options: dict, started_at: float,
                  source_root: str | None, command: list[str] | None = None) -> dict:
    """The manifest a rank's recording starts with; ``command``: the job's command line where the recording was
    made by ``replaydiff record -- CMD`` (None: from Python, where there is no such line)."""
    return {_M_RANK: rank, _M_WORLD: world_size, _M_ENV: environment, _M_OPTIONS: options,
            _M_STARTED: started_at, _M_ROOT: source_root,
            **({_M_COMMAND: list(command)} if command is not None else {})}


# The flight recorder's entry (record/flight.py writes it through wire_flight when it dumps its ring).
_M_FLIGHT = "flight"
_F_REASON, _F_STEPS, _F_KEEP, _F_MIB, _F_HELD, _F_DROPPED = (
    "reason", "steps", "keep", "budget_mib", "held_bytes", "dropped_for_budget")


def wire_flight(reason: str, steps: list[int], keep: int, budget_mib: float, held_bytes: int,
                dropped_for_budget: int) -> dict:
    """The manifest entry of a flight recorder's dump: why it wrote, the steps it held, its K and memory."""
    return {_M_FLIGHT: {_F_REASON: reason, _F_STEPS: steps, _F_KEEP: keep, _F_MIB: budget_mib, _F_HELD: held_bytes,
                        _F_DROPPED: dropped_for_budget}}


@dataclass(frozen=True)
class FlightDump:
    """What a flight recorder's trace says of its dump (None where a field is absent or mistyped)."""
    reason: str | None
    steps: tuple[int, ...]
    keep: int | None  # --flight K
    budget_mib: float | None  # --flight-mib
    dropped_for_budget: int  # older steps dropped to stay within budget_mib


def manifest_flight(manifest: dict) -> FlightDump | None:
    """The flight recorder's entry of a manifest; None for a trace not written by the flight recorder."""
    d = manifest.get(_M_FLIGHT)
    if not isinstance(d, dict):
        return None
    steps = d.get(_F_STEPS)
    return FlightDump(_typed(d.get(_F_REASON), str),
                      tuple(x for x in steps if _typed(x, int) is not None) if isinstance(steps, list) else (),
                      _typed(d.get(_F_KEEP), int), _typed(d.get(_F_MIB), (int, float)),
                      _typed(d.get(_F_DROPPED), int) or 0)


def manifest_command(manifest: dict) -> tuple[str, ...] | None:
    """The command line the trace was recorded from (``replaydiff record -- CMD``); None when the trace does not hold
    one (recorded from Python, or by a replaydiff that did not store it)."""
    v = manifest.get(_M_COMMAND)
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        return None
    return tuple(v)


def wire_closing_facts(compiled_regions: list[dict], unseen_writes: int, ops_seen: int,
                       record_seconds: float, disabled: str | None, custom_ops: dict, source_files: dict,
                       planted: dict | None) -> dict:
    """What the final manifest adds about the recording (``planted`` only when a fault was planted)."""
    return {_M_COMPILED: compiled_regions, _M_UNSEEN: unseen_writes, _M_OPS_SEEN: ops_seen,
            _M_SECONDS: record_seconds, _M_DISABLED: disabled, _M_CUSTOM: custom_ops, _M_SOURCES: source_files,
            **({_M_PLANTED: planted} if planted is not None else {})}


def manifest_bytes_written(manifest: dict) -> int | None:
    """Bytes of op chunks and data files the writer wrote, as its final manifest counts them (None: not said)."""
    return _typed(manifest.get(_M_DATA_BYTES), int)


# Every ops chunk the writer wrote: [[first op, last op, bytes], ...], in the final manifest (and in one rewritten
# before a process dies). A reader holds the ops directory against it: a chunk deleted or cut short since is named.
_M_OPS_FILES = "ops_files"


@dataclass(frozen=True)
class OpsFileWritten:
    """One ops chunk as the writer wrote it: the op numbers it holds and its size in bytes."""

    first: int
    last: int
    nbytes: int


def wire_writer_totals(ops_written: int, last_op: int | None, ops_files: list[tuple[int, int, int]],
                       data_bytes: int | None = None) -> dict:
    """What the writer says of what it wrote: op records, the last one's number, each ops chunk (``(first, last,
    nbytes)``) and, in the final manifest, the bytes of ops and data files."""
    out = {_M_OPS_WRITTEN: ops_written, _M_LAST_OP: last_op, _M_OPS_FILES: [list(f) for f in ops_files]}
    if data_bytes is not None:
        out[_M_DATA_BYTES] = data_bytes
    return out


def manifest_ops_files(manifest: dict) -> list[OpsFileWritten] | None:
    """The ops chunks the writer says it wrote, in order; None when the manifest does not say (older traces, or a
    recording that never wrote its final manifest)."""
    v = manifest.get(_M_OPS_FILES)
    if not isinstance(v, list):
        return None
    out = []
    for x in v:
        if isinstance(x, list) and len(x) == 3 and all(isinstance(y, int) and not isinstance(y, bool) for y in x) \
                and 0 <= x[0] <= x[1] and x[2] >= 0:
            out.append(OpsFileWritten(x[0], x[1], x[2]))
        else:
            return None  # hand-edited or damaged: nothing to hold the directory against
    return out


def manifest_last_op(manifest: dict) -> int | None:
    """The number of the last op the writer wrote (None: not said)."""
    return _typed(manifest.get(_M_LAST_OP), int)


def manifest_stopped(manifest: dict) -> str | None:
    """Why the recording stopped before the end it was asked for (None: it did not)."""
    return _typed(manifest.get(_M_DISABLED), str)


def manifest_metadata(manifest: dict) -> tuple[Environment, RecordedOptions, tuple[CompiledRegion, ...]]:
    """The typed environment, record options and compiled regions of a manifest as read (any format version)."""
    return (Environment.from_wire(manifest.get(_M_ENV)), RecordedOptions.from_wire(manifest.get(_M_OPTIONS)),
            tuple(compiled_regions_from_wire(manifest.get(_M_COMPILED))))


# The manifest's entries the reader acts on, each with the types it may hold (absent is always allowed: older
# traces, a recording that never finished). A manifest with any other type in one of them is refused: its file is
# named, nothing of it is guessed. Entries only shown (environment, options' contents) read as unknown when mistyped.
_NAT = "natural"  # an int >= 0 (never a bool)
_MANIFEST_TYPES: dict[str, tuple] = {
    "version": (int,), _M_RANK: (_NAT,), _M_WORLD: (_NAT, type(None)), "complete": (bool,),
    "lost": (list, type(None)), _M_CUSTOM: (dict, type(None)), _M_SOURCES: (dict, type(None)),
    _M_ROOT: (str, type(None)), _M_DISABLED: (str, type(None)), _M_OPS_FILES: (list, type(None)),
    _M_LAST_OP: (_NAT, type(None)), _M_DATA_BYTES: (_NAT, type(None)), _M_OPS_WRITTEN: (_NAT, type(None)),
    _M_OPS_SEEN: (_NAT, type(None)), _M_UNSEEN: (_NAT, type(None)), _M_COMMAND: (list, type(None)),
    _M_ENV: (dict, type(None)), _M_OPTIONS: (dict, type(None)), _M_COMPILED: (list, type(None)),
    _M_PLANTED: (dict, type(None)), _M_FLIGHT: (dict, type(None)),
    _M_STARTED: (int, float, type(None)), _M_SECONDS: (int, float, type(None)), "written_at": (int, float, type(None)),
}
# A rank or world size beyond this is no job's (and a rank directory's number is read as one).
_MAX_RANK = 1 << 24


def _has_type(v: Any, kinds: tuple) -> bool:
    for k in kinds:
        if k == _NAT:
            if type(v) is int and 0 <= v:
                return True
        elif isinstance(v, k) and not (k in (int, float) and isinstance(v, bool)):
            return True
    return False


def _kind_names(kinds: tuple) -> str:
    return " or ".join("an int >= 0" if k == _NAT else "None" if k is type(None) else f"a {k.__name__}"
                       for k in kinds)


def check_manifest(m: dict) -> None:
    """ValueError (what is wrong, one line) unless every entry of the manifest that the reader acts on has its type:
    the rank an int, the lists and maps what they hold, every ops file three op numbers."""
    for key, kinds in _MANIFEST_TYPES.items():
        if key in m and not _has_type(m[key], kinds):
            raise ValueError(f"manifest entry {key!r} is {type(m[key]).__name__}, not {_kind_names(kinds)}")
    for key in (_M_RANK, _M_WORLD):
        if isinstance(m.get(key), int) and m[key] > _MAX_RANK:
            raise ValueError(f"manifest entry {key!r} is {m[key]}, more than any job has")
    if m.get(_M_WORLD) == 0:
        raise ValueError("manifest entry 'world_size' is 0")
    for key in ("lost", _M_COMMAND):
        if not all(isinstance(x, str) for x in m.get(key) or ()):
            raise ValueError(f"manifest entry {key!r} holds a value that is not a string")
    for key in (_M_CUSTOM, _M_SOURCES):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in (m.get(key) or {}).items()):
            raise ValueError(f"manifest entry {key!r} maps to a value that is not a string")
    if m.get(_M_OPS_FILES) is not None:
        files = manifest_ops_files(m)
        if files is None:
            raise ValueError(f"manifest entry {_M_OPS_FILES!r} holds an entry that is not [first op, last op, bytes]")
        if any(b.first <= a.last for a, b in zip(files, files[1:])):
            raise ValueError(f"manifest entry {_M_OPS_FILES!r} lists ops files out of order")
