"""The typed op record (``OpRecord``), read from its decoded dict on demand, and what it carries: written-argument
paths, a collective's group, a random op's generator state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from replaydiff import aten
from replaydiff.errors import TraceError
from replaydiff.trace.schema.index_rows import IndexRow, index_row
from replaydiff.trace.schema.keys import (_ARGS, _BACKWARD_CALL, _CHUNK, _COLL, _DEVICE, _FORWARD, _INDEX, _KWARGS,
                                          _LEFT_OUT, _MODULE, _NAME, _NBYTES, _NOT_RECORDED, _OUTPUTS, _PATH_ARG,
                                          _PHASE, _RECOMPUTE, _RNG, _SOURCE, _SOURCE_TEXT, _STEP, _UNINIT, _UNIT,
                                          _VERSION, _WRITES)
from replaydiff.trace.schema.units import UnitInfo
from replaydiff.trace.schema.values import TensorRef, decode_value, iter_refs, value_json

PHASES = ("forward", "backward", "optimizer")
# Record names of granularity="module" (record/module_stats.py): a module call's outputs, the gradient reaching them,
# and one of the module's own parameters as its first call in a step found it (the parameter's name is the one arg).
MODULE_OUTPUT, MODULE_GRAD, MODULE_PARAM = "module.output", "module.grad", "module.param"


class ArgPath(NamedTuple):
    """Where a written argument sits: ``("arg", 0)`` for ``self``, ``("kwarg", "out")``."""

    kind: str
    key: int | str


@dataclass(frozen=True)
class StoredBytes:
    """A storage version's bytes in the trace: what a generator state is (a uint8 storage of its own)."""

    version: int
    chunk: int
    nbytes: int


@dataclass(frozen=True)
class RngState:
    """The generator state a random op ran with, on ``device``."""

    device: str
    data: StoredBytes


@dataclass(frozen=True)
class CollectiveInfo:
    """A collective's process group (name, member ranks, size, this rank in it), reduce op and root."""

    ranks: tuple[int, ...] = ()
    size: int | None = None
    group_rank: int | None = None
    group_name: str | None = None
    reduce_op: str | None = None  # sum avg min max product ...; "unknown" when it could not be read
    root: int | None = None  # root_rank / src / root / group_src, as the op's schema names it
    extras: dict = field(default_factory=dict)  # other integer arguments (group_size ...)
    problems: tuple[str, ...] = ()

    @property
    def group_key(self) -> tuple:
        """Identity of the process group: its name and its ranks (two groups over the same ranks stay apart)."""
        return (self.group_name, self.ranks)


_ROOT_NAMES = ("root_rank", "src", "root", "group_src")


def _collective_from_wire(c: dict) -> CollectiveInfo:
    root = next((c[k] for k in _ROOT_NAMES if isinstance(c.get(k), int)), None)
    extras = {k: v for k, v in c.items() if k not in ("ranks", "size", "group_rank", "group_name", "reduce_op",
                                                      "problems", *_ROOT_NAMES)}
    return CollectiveInfo(ranks=tuple(c.get("ranks") or ()), size=c.get("size"), group_rank=c.get("group_rank"),
                          group_name=c.get("group_name"), reduce_op=c.get("reduce_op"), root=root, extras=extras,
                          problems=tuple(c.get("problems") or ()))


def wire_collective(info: CollectiveInfo) -> dict:
    d: dict[str, Any] = {"ranks": list(info.ranks), "size": info.size, "group_rank": info.group_rank}
    if info.group_name is not None:
        d["group_name"] = info.group_name
    if info.reduce_op is not None:
        d["reduce_op"] = info.reduce_op
    if info.root is not None:
        d["root"] = info.root
    d.update(info.extras)
    if info.problems:
        d["problems"] = list(info.problems)
    return d


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class OpRecord:
    """One recorded op. Fields are read from the decoded record on demand; argument trees are decoded once."""

    __slots__ = ("_w", "_args", "_kwargs", "_outputs", "_writes", "_inputs", "rank", "_path")

    def __init__(self, wire: dict, rank: int = 0, path: Any = None) -> None:
        self._w = wire
        self._args = self._kwargs = self._outputs = self._writes = self._inputs = None
        self.rank = rank
        self._path = path  # the ops chunk it came from, named in the error if a field does not decode

    def _decode(self, v: Any) -> Any:
        try:
            return decode_value(v)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise TraceError(self._path or "trace", f"malformed record of op #{self._w.get(_INDEX)} ({exc})") \
                from None

    @classmethod
    def absent(cls, index: int, rank: int = 0, why: str = "no record in the trace") -> "OpRecord":
        """A number the trace has no record for (a gap in an older trace)."""
        return cls({_INDEX: index, _NAME: "?", _NOT_RECORDED: why}, rank)

    index = property(lambda self: self._w[_INDEX])
    name = property(lambda self: self._w[_NAME], doc="e.g. 'aten.mm.default'")
    phase = property(lambda self: self._w.get(_PHASE), doc="forward, backward, optimizer, or None")
    module = property(lambda self: self._w.get(_MODULE), doc="dotted module path, e.g. 'GPT.blocks.0.ln1'")
    source = property(lambda self: self._w.get(_SOURCE), doc="'file.py:LINE' of the user's code, if recorded")
    source_text = property(lambda self: self._w.get(_SOURCE_TEXT),
                           doc="that line's text when recorded (stripped; None in traces from before it was kept)")
    forward_index = property(lambda self: self._w.get(_FORWARD), doc="for a backward op: the forward op it undoes")
    recompute = property(lambda self: _RECOMPUTE in self._w,
                         doc="an op of a checkpointed region run again in the backward pass (activation checkpointing)")
    recompute_of = property(lambda self: _int_or_none(self._w.get(_RECOMPUTE)),
                            doc="for a recompute: the forward op it runs again (None: none was matched)")
    backward_call = property(lambda self: self._w.get(_BACKWARD_CALL) if isinstance(self._w.get(_BACKWARD_CALL), str)
                             else None, doc="for a recompute: 'file.py:LINE' of the backward() call that ran it")
    uninitialised = property(lambda self: bool(self._w.get(_UNINIT)), doc="output of an empty* op")
    recorded = property(lambda self: _NOT_RECORDED not in self._w, doc="False: numbered, but not recorded")
    not_recorded_reason = property(lambda self: self._w.get(_NOT_RECORDED))
    step = property(lambda self: self._w.get(_STEP), doc="optimizer step it ran in, from 1 (multi-step traces)")
    data_left_out = property(
        lambda self: self._w.get(_LEFT_OUT),
        doc="None, or why some of the op's tensor data is not in the trace although the op is recorded (its tensors "
            "then have statistics): LEFT_OUT_FILTERED, LEFT_OUT_BUDGET or LEFT_OUT_DISK_FULL. Such an op is never "
            "judged by replay.")

    @property
    def schema(self) -> str | None:
        try:
            return str(aten.resolve(self.name)._schema)
        except aten.UnknownOp:
            return None

    @property
    def unit(self) -> "UnitInfo | None":
        """The graph of a compiled unit (``compiled.unit.*`` records), decoded; None for an op."""
        u = self._w.get(_UNIT)
        if not isinstance(u, dict):
            return None
        try:
            return UnitInfo.from_wire(u)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise TraceError(self._path or "trace", f"malformed graph of unit #{self._w.get(_INDEX)} ({exc})") \
                from None

    @property
    def collective(self) -> CollectiveInfo | None:
        c = self._w.get(_COLL)
        return _collective_from_wire(c) if isinstance(c, dict) else None

    @property
    def rng(self) -> RngState | None:
        r = self._w.get(_RNG)
        if not isinstance(r, dict):
            return None
        return RngState(str(r.get(_DEVICE)), StoredBytes(int(r[_VERSION]), int(r[_CHUNK]), int(r[_NBYTES])))

    @property
    def args(self) -> list:
        if self._args is None:
            self._args = self._decode(self._w.get(_ARGS) or [])
        return self._args

    @property
    def kwargs(self) -> dict:
        if self._kwargs is None:
            self._kwargs = {k: self._decode(v) for k, v in (self._w.get(_KWARGS) or {}).items()}
        return self._kwargs

    @property
    def outputs(self) -> Any:
        if self._outputs is None:
            self._outputs = self._decode(self._w.get(_OUTPUTS))
        return self._outputs

    @property
    def writes(self) -> list[tuple[ArgPath, Any]]:
        """Each argument the op wrote, as it was after the op (its ``args`` entry holds it as it was before)."""
        if self._writes is None:
            try:
                self._writes = [(ArgPath("arg" if p[0] == _PATH_ARG else "kwarg", p[1]), self._decode(v))
                                for p, v in self._w.get(_WRITES) or []]
            except (ValueError, TypeError, IndexError) as exc:
                raise TraceError(self._path or "trace", f"malformed writes of op #{self.index} ({exc})") from None
        return self._writes

    def inputs(self) -> list[TensorRef]:
        """The tensors it reads, arguments then keyword arguments, flattened in order (the input positions)."""
        if self._inputs is None:  # replay asks several times an op
            self._inputs = tuple(iter_refs([self.args, list(self.kwargs.values())]))
        return list(self._inputs)

    def outputs_refs(self) -> list[TensorRef]:
        """The tensors it produces: outputs, then written arguments not already among them (the output positions)."""
        out = list(iter_refs(self.outputs))
        seen = {r.geometry for r in out}
        for _, v in self.writes:
            for r in iter_refs(v):
                if r.geometry not in seen:
                    seen.add(r.geometry)
                    out.append(r)
        return out

    def index_row(self) -> "IndexRow":
        return index_row(self._w)

    def to_json(self) -> dict:
        """The typed record as JSON (``show --op N --json``; schema ``replaydiff.op/1``, see the README)."""
        c = self.collective
        rng = self.rng
        return {
            "rank": self.rank, "index": self.index, "name": self.name, "recorded": self.recorded,
            "not_recorded_reason": self.not_recorded_reason, "phase": self.phase, "module": self.module,
            "source": self.source, "source_text": self.source_text, "forward_index": self.forward_index,
            "recompute": self.recompute, "recompute_of": self.recompute_of, "backward_call": self.backward_call,
            "schema": self.schema, "step": self.step, "data_left_out": self.data_left_out,
            "uninitialised": self.uninitialised,
            "collective": None if c is None else {"group_name": c.group_name, "ranks": list(c.ranks), "size": c.size,
                                                  "group_rank": c.group_rank, "reduce_op": c.reduce_op,
                                                  "root": c.root},
            "random": None if rng is None else {"device": rng.device},
            "args": [value_json(v) for v in self.args],
            "kwargs": {k: value_json(v) for k, v in self.kwargs.items()},
            "writes": [{p.kind: p.key, "after": value_json(v)} for p, v in self.writes],
            "outputs": value_json(self.outputs),
            **({"unit": self.unit.to_json()} if _UNIT in self._w else {}),
        }

    def __repr__(self) -> str:
        return f"OpRecord(#{self.index} {self.name}, {self.phase}, {self.module})"
