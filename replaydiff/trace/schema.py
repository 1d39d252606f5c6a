"""The wire format of op records, and the typed records every other module reads instead of it.

This is the one module that knows the short msgpack keys of a trace (``i op ph mod ...`` for an op, ``T dt sh st
...`` for a tensor reference). The recorder builds records through the ``wire_*`` functions below; readers get
``OpRecord`` and ``TensorRef``: slotted views over the decoded dict, so reading a field costs a dict lookup and
nothing is converted that is not asked for. Values inside records (arguments, outputs) are trees of TensorRef,
Python scalars, lists and torch objects (dtype, device, layout, memory format); what cannot be rebuilt from the
trace alone (a generator, a symbolic size, an arbitrary object) is an ``Opaque``. Decoding only looks names up in
torch's own namespaces: it never imports or evaluates anything.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch

from replaydiff import aten
from replaydiff.errors import TraceError
from replaydiff.faults import PlantEffect  # what a plant changed: measured while recording, read back here
from replaydiff.trace.modes import TensorMode
from replaydiff.trace.op_runs import OpRuns, describe_runs

# -- op record keys ---------------------------------------------------------------------------------------------
_INDEX, _NAME, _PHASE, _MODULE, _FORWARD, _SOURCE = "i", "op", "ph", "mod", "fwd", "src"
_ARGS, _KWARGS, _WRITES, _OUTPUTS, _UNINIT = "a", "k", "w", "o", "u"
_COLL, _RNG, _NOT_RECORDED = "coll", "rng", "x"
_STEP = "stp"  # optimizer step the op ran in (multi-step and flight recordings)
_SOURCE_TEXT = "srt"  # the text of the source line when recorded (absent in older traces)
_LEFT_OUT = "lo"  # why the op's tensor data is not in the trace although it is recorded (statistics kept instead)
_UNIT = "cu"  # a compiled unit's graph and where it came from (record/units.py); only on unit records
# -- tensor reference keys --------------------------------------------------------------------------------------
_VERSION, _DTYPE, _SHAPE, _STRIDE, _OFFSET, _DEVICE = "T", "dt", "sh", "st", "of", "dev"
_NBYTES, _CHUNK, _STATS, _REQ_GRAD, _UNSUPPORTED = "sb", "f", "s", "rg", "unsupported"
_CONJ, _NEG, _ZERO = "cj", "ng", "z"
_PATH_ARG, _PATH_KWARG = "a", "k"

PHASES = ("forward", "backward", "optimizer")
# Why an op's tensor data was left out while the op itself was recorded (its tensors have statistics instead; with
# --tensors meta, shapes only): OpRecord.data_left_out.
LEFT_OUT_FILTERED = "filtered"  # outside record's --module/--op filter
LEFT_OUT_BUDGET = "budget"  # past record's --budget
LEFT_OUT_DISK_FULL = "disk full"  # the disk filled while recording
LEFT_OUT_WHY = {LEFT_OUT_FILTERED: "outside the record --module/--op filter", LEFT_OUT_BUDGET: "past the record --budget",
                LEFT_OUT_DISK_FULL: "the disk was full while recording"}
# Record names of granularity="module" (record/module_stats.py): a module call's outputs, the gradient reaching them,
# and one of the module's own parameters as its first call in a step found it (the parameter's name is the one arg).
MODULE_OUTPUT, MODULE_GRAD, MODULE_PARAM = "module.output", "module.grad", "module.param"


# =============================================================================================================
# Typed records
# =============================================================================================================
class ArgPath(NamedTuple):
    """Where a written argument sits: ``("arg", 0)`` for ``self``, ``("kwarg", "out")``."""

    kind: str
    key: int | str


@dataclass(frozen=True)
class Opaque:
    """An argument that cannot be rebuilt from the trace alone: ``kind`` is generator, symbolic or object."""

    kind: str
    value: Any


@dataclass(frozen=True)
class TensorStats:
    """Statistics over the finite values of a tensor (``stats`` traces, and storages over ``max_tensor_bytes``)."""

    numel: int
    mean: float
    absmax: float
    l2: float
    var: float
    nan: int
    inf: int

    FIELDS = ("numel", "mean", "absmax", "l2", "var", "nan", "inf")


class TensorRef:
    """One tensor as recorded: its geometry, its storage version and where its bytes are (if stored)."""

    __slots__ = ("_w",)

    def __init__(self, wire: dict) -> None:
        self._w = wire

    dtype = property(lambda self: self._w[_DTYPE], doc="recorded dtype name, e.g. 'float32'")
    shape = property(lambda self: tuple(self._w[_SHAPE]))
    stride = property(lambda self: None if self._w.get(_STRIDE) is None else tuple(self._w[_STRIDE]))
    offset = property(lambda self: self._w.get(_OFFSET, 0))
    device = property(lambda self: self._w.get(_DEVICE))
    version = property(lambda self: self._w.get(_VERSION), doc="storage version id; None if not described")
    nbytes = property(lambda self: self._w.get(_NBYTES, 0), doc="bytes of the whole storage")
    chunk = property(lambda self: self._w.get(_CHUNK), doc="data file holding the storage bytes, if stored")
    requires_grad = property(lambda self: bool(self._w.get(_REQ_GRAD)))
    uninitialised = property(lambda self: bool(self._w.get(_UNINIT)))
    conj = property(lambda self: bool(self._w.get(_CONJ)), doc="the conjugate bit (a lazy x.conj())")
    neg = property(lambda self: bool(self._w.get(_NEG)), doc="the negative bit (torch._neg_view)")
    unsupported = property(lambda self: self._w.get(_UNSUPPORTED), doc="why it was not described, if so")
    zero = property(lambda self: bool(self._w.get(_ZERO)), doc="a ZeroTensor: all zeros, no storage")

    @property
    def stored(self) -> bool:
        """Its values are in the trace (a zero-byte storage needs no bytes, a ZeroTensor none at all)."""
        w = self._w
        return bool(w.get(_ZERO)) or self.meta or (w.get(_VERSION) is not None and (_CHUNK in w
                                                                                    or w.get(_NBYTES) == 0))

    @property
    def meta(self) -> bool:
        """A tensor on the meta device: shape and strides, no values (ZeroTensor kernels make some)."""
        w = self._w
        return w.get(_DEVICE) == "meta" and w.get(_STRIDE) is not None and _UNSUPPORTED not in w

    @property
    def stats(self) -> TensorStats | None:
        s = self._w.get(_STATS)
        return TensorStats(*s) if s else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self._w[_DTYPE])

    @property
    def geometry(self) -> tuple:
        """(version, dtype, shape, stride, offset): equal for two references to the very same tensor view."""
        w = self._w
        return (w.get(_VERSION), w[_DTYPE], tuple(w[_SHAPE]), tuple(w.get(_STRIDE) or ()), w.get(_OFFSET, 0))

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"

    def empty_meta(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.torch_dtype, device="meta")

    def to_json(self) -> dict:
        s = self.stats
        return {"dtype": self.dtype, "shape": list(self.shape), "stride": None if self.stride is None else
                list(self.stride), "offset": self.offset, "device": self.device, "version": self.version,
                "stored": self.stored, "uninitialised": self.uninitialised, "requires_grad": self.requires_grad,
                "conj": self.conj, "neg": self.neg, "zero": self.zero, "meta": self.meta, "unsupported": self.unsupported,
                "stats": None if s is None else {k: getattr(s, k) for k in TensorStats.FIELDS}}

    def __repr__(self) -> str:
        return f"TensorRef({self.describe()}, version={self.version}, stored={self.stored})"


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


class OpRecord:
    """One recorded op. Fields are read from the decoded record on demand; argument trees are decoded once."""

    __slots__ = ("_w", "_args", "_kwargs", "_outputs", "_writes", "rank", "_path")

    def __init__(self, wire: dict, rank: int = 0, path: Any = None) -> None:
        self._w = wire
        self._args = self._kwargs = self._outputs = self._writes = None
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
        return list(iter_refs([self.args, list(self.kwargs.values())]))

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


def iter_refs(v: Any) -> Iterator[TensorRef]:
    """Every TensorRef inside a value tree, in order."""
    out: list[TensorRef] = []
    _collect_refs(v, out)
    return iter(out)


def _collect_refs(v: Any, out: list[TensorRef]) -> None:
    # A list filled by plain calls, not nested generators: replay asks this of every op several times, and a
    # generator per level of nesting cost ~15 us an op.
    if isinstance(v, TensorRef):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            if isinstance(x, TensorRef):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                _collect_refs(x, out)


def value_json(v: Any) -> Any:
    if isinstance(v, TensorRef):
        return {"tensor": v.to_json()}
    if isinstance(v, (list, tuple)):
        return [value_json(x) for x in v]
    if isinstance(v, Opaque):
        return {v.kind: v.value}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, (torch.device, torch.layout, torch.memory_format)):
        return {type(v).__name__: str(v).removeprefix("torch.")}
    if isinstance(v, complex):
        return {"complex": [v.real, v.imag]}
    return v


# =============================================================================================================
# Values: encoding (recorder) and decoding (reader)
# =============================================================================================================
def encode_value(v: Any, tensor_ref: Callable[[torch.Tensor], dict]) -> Any:
    """A msgpack-safe form of an op argument or output; tensors go through ``tensor_ref``.

    Non-tensor values are kept verbatim where msgpack can hold them; torch objects become one-key dicts (aten
    schemas never take a dict, so a dict in a trace is always a tensor reference or one of these markers)."""
    if isinstance(v, torch.Tensor):
        return tensor_ref(v)
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v if -(1 << 63) <= v < (1 << 64) else {"bigint": str(v)}
    if isinstance(v, float):
        return v
    if isinstance(v, (list, tuple)):
        return [encode_value(x, tensor_ref) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    if isinstance(v, complex):
        return {"complex": [v.real, v.imag]}
    if isinstance(v, torch.Generator):
        return {"generator": str(v.device)}
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"symbolic": str(v)}
    return {"object": type(v).__name__}


def _torch_attr(name: Any, kind: type) -> Any:
    obj = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(obj, kind):
        raise ValueError(f"{name!r} is not a torch {kind.__name__}")
    return obj


def dtype_from_name(name: str) -> torch.dtype:
    return _torch_attr(name, torch.dtype)


def decode_value(v: Any) -> Any:
    """Inverse of encode_value, with TensorRef for tensors and Opaque for what the trace cannot rebuild.
    Raises ValueError on junk (the reader turns it into a TraceError naming the file)."""
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if not isinstance(v, dict):
        return v
    if _VERSION in v:
        return TensorRef(v)
    if len(v) != 1:
        raise ValueError(f"unexpected structure {sorted(v)[:4]}")
    (key, val), = v.items()
    if key == "dtype":
        return _torch_attr(val, torch.dtype)
    if key == "device":
        return torch.device(str(val))
    if key == "layout":
        return _torch_attr(val, torch.layout)
    if key == "memory_format":
        return _torch_attr(val, torch.memory_format)
    if key == "complex":
        return complex(float(val[0]), float(val[1]))
    if key == "bigint":
        return int(str(val))
    if key in ("generator", "symbolic", "object"):
        return Opaque(key, val)
    raise ValueError(f"unknown marker {key!r}")


# =============================================================================================================
# Building records (the recorder's side)
# =============================================================================================================
def wire_op(index: int, name: str, phase: str | None, module: str | None, forward: int | None, source: str | None,
            source_text: str | None = None) -> dict:
    rec: dict[str, Any] = {_INDEX: index, _NAME: name, _PHASE: phase}
    if module:
        rec[_MODULE] = module
    if forward is not None:
        rec[_FORWARD] = forward
    if source:
        rec[_SOURCE] = source
        if source_text is not None:
            rec[_SOURCE_TEXT] = source_text
    return rec


def wire_set_step(rec: dict, step: int) -> None:
    rec[_STEP] = step


def wire_nonfinite(rec: dict) -> bool:
    """Whether any output or written argument of an op record has statistics counting NaN or Inf values."""
    todo = [rec.get(_OUTPUTS), [v for _, v in rec.get(_WRITES) or []]]
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            s = v.get(_STATS)
            if s and (s[5] or s[6]):
                return True
    return False


def wire_not_recorded(rec: dict, why: str) -> dict:
    """Mark an op record as numbered but not recorded (filtered out, or not describable), with the reason."""
    rec[_NOT_RECORDED] = why
    return rec


ENTERED_REASON = "entered, not completed while recording (the rank was waiting in it)"


def wire_entered(index: int, name: str, phase: str | None, module: str | None, source: str | None,
                 info: CollectiveInfo) -> dict:
    """The stub a rank leaves when it enters a collective: numbered, its group known, no tensors (those come with
    the full record once it completes). Read back as an OpRecord with ``recorded`` False."""
    rec = wire_op(index, name, phase, module, None, source)
    rec[_COLL] = wire_collective(info)
    rec[_NOT_RECORDED] = ENTERED_REASON
    return rec


def check_entered(frame: Any) -> dict:
    """An entered-collective stub, after checking its structure; ValueError if it is not sound."""
    if not isinstance(frame, dict) or not isinstance(frame.get(_INDEX), int) or not isinstance(frame.get(_NAME), str) \
            or not isinstance(frame.get(_COLL), dict):
        raise ValueError("not an entered-collective record")
    return frame


def wire_set_left_out(rec: dict, why: str) -> None:
    """Mark a recorded op whose tensor data is (partly) left out, with the reason (a LEFT_OUT_* value)."""
    rec[_LEFT_OUT] = why


def wire_left_out(rec: dict) -> str | None:
    return rec.get(_LEFT_OUT)


def wire_strip_chunks(rec: dict, first_lost: int, why: str) -> bool:
    """Drop every reference of ``rec`` to data files numbered ``first_lost`` and up (never written: the disk filled),
    marking the op's data left out for ``why``; whether any was dropped."""
    todo: list = [rec.get(_ARGS), list((rec.get(_KWARGS) or {}).values()), rec.get(_OUTPUTS), rec.get(_WRITES)]
    dropped = False
    rng = rec.get(_RNG)
    if isinstance(rng, dict) and isinstance(rng.get(_CHUNK), int) and rng[_CHUNK] >= first_lost:
        del rec[_RNG]
        dropped = True
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            c = v.get(_CHUNK) if _VERSION in v else None  # other dicts are markers ({"dtype": ...}): no data
            if isinstance(c, int) and c >= first_lost:
                del v[_CHUNK]
                dropped = True
    if dropped and _LEFT_OUT not in rec:
        rec[_LEFT_OUT] = why
    return dropped


def wire_set_collective(rec: dict, info: CollectiveInfo) -> None:
    rec[_COLL] = wire_collective(info)


def wire_set_rng(rec: dict, device: str, version: int, chunk: int, nbytes: int) -> None:
    rec[_RNG] = {_DEVICE: device, _VERSION: version, _CHUNK: chunk, _NBYTES: nbytes}


def wire_set_inputs(rec: dict, args: list, kwargs: dict) -> None:
    rec[_ARGS] = args
    rec[_KWARGS] = kwargs


def wire_set_outputs(rec: dict, outputs: Any, writes: list[tuple[tuple[str, int | str], Any]] | None,
                     uninitialised: bool) -> None:
    if uninitialised:
        rec[_UNINIT] = True
    if writes:
        rec[_WRITES] = [[[_PATH_ARG if kind == "arg" else _PATH_KWARG, key], v] for (kind, key), v in writes]
    rec[_OUTPUTS] = outputs


def wire_is_collective(rec: dict) -> bool:
    return _COLL in rec


def wire_index(rec: dict) -> int:
    return rec[_INDEX]


def wire_tensor(dtype: str, shape: list, stride: list | None, offset: int, device: str) -> dict:
    return {_DTYPE: dtype, _SHAPE: shape, _STRIDE: stride, _OFFSET: offset, _DEVICE: device, _VERSION: None}


def wire_stored_tensor(dtype: str, shape: list, stride: list, offset: int, device: str, version: int, nbytes: int,
                       requires_grad: bool, uninitialised: bool, conj: bool, neg: bool) -> dict:
    """A stored tensor's reference in one call (the recorder's hot path: one per tensor of every op): ``wire_tensor``'s
    keys, then the storage's version and size, then the flags that are set."""
    ref = {_DTYPE: dtype, _SHAPE: shape, _STRIDE: stride, _OFFSET: offset, _DEVICE: device, _VERSION: version,
           _NBYTES: nbytes}
    if requires_grad:
        ref[_REQ_GRAD] = True
    if uninitialised:
        ref[_UNINIT] = True
    if conj:
        ref[_CONJ] = True
    if neg:
        ref[_NEG] = True
    return ref


def wire_unsupported(ref: dict, why: str) -> dict:
    ref[_VERSION] = None
    ref[_UNSUPPORTED] = why
    return ref


def wire_zero(ref: dict) -> dict:
    """A ZeroTensor (autograd's efficient zeros): values known without bytes, and no storage to identify."""
    ref[_VERSION] = None
    ref[_ZERO] = True
    return ref


def wire_set_chunk(ref: dict, chunk: int) -> None:
    ref[_CHUNK] = chunk


def wire_rechunk(rec: dict, chunks: dict[int, int]) -> int:
    """Point every stored tensor of an op record (and its generator state) at the data file ``chunks`` names for its
    storage version; a version ``chunks`` lacks has no bytes any more (the flight recorder left it out to stay
    within its memory) and is marked not stored (a generator state: dropped). Returns how many were left out."""
    left_out = 0
    rng = rec.get(_RNG)
    if isinstance(rng, dict) and _CHUNK in rng:
        chunk = chunks.get(rng.get(_VERSION))
        if chunk is None:
            del rec[_RNG]
            left_out += 1
        else:
            rng[_CHUNK] = chunk
    todo: list = [rec.get(_ARGS), rec.get(_KWARGS), rec.get(_OUTPUTS), [v for _, v in rec.get(_WRITES) or []]]
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            if _VERSION in v and _DTYPE in v:  # a tensor reference
                if _CHUNK in v:
                    chunk = chunks.get(v[_VERSION])
                    if chunk is None:
                        del v[_CHUNK]
                        left_out += 1
                    else:
                        v[_CHUNK] = chunk
            else:  # kwargs, or a marker of a torch object (holds no tensors, cheap to look through)
                todo.extend(v.values())
    return left_out


def wire_set_stats(ref: dict, stats: list | None) -> None:
    ref[_STATS] = stats


def wire_stats_key(ref: dict) -> tuple:
    return (ref[_VERSION], ref[_DTYPE], tuple(ref[_SHAPE]), tuple(ref[_STRIDE]), ref[_OFFSET])


# =============================================================================================================
# Compiled units (record/units.py): one call of a compiled graph, its graph stored as data
# =============================================================================================================
# Node kinds; a graph is a list of nodes in execution order, each argument a value tree whose {"node": i} markers
# refer to earlier nodes. Targets are names (``aten.mul.Tensor``, ``operator.getitem``): never code.
NODE_INPUT, NODE_CONST, NODE_CALL, NODE_OUTPUT = "input", "const", "call", "output"
_U_REGION, _U_BACKEND, _U_GRAPH, _U_KIND, _U_NODES, _U_CONSTS, _U_KERNELS, _U_NOTE = (
    "region", "backend", "graph", "kind", "nodes", "consts", "kernels", "note")
_NODE_REF = "node"


class NodeRef(NamedTuple):
    """An argument of a graph node that is the value of an earlier node (by position in the graph)."""

    index: int


@dataclass(frozen=True)
class UnitNode:
    kind: str  # input / const / call / output
    name: str  # the node's name in the graph (``erf``, ``mul_1``)
    target: str | None  # op name of a call (``aten.erf.default``); const: its position in the unit's consts
    args: list
    kwargs: dict
    module: str | None = None  # the module it was traced in, under the region's root: ``Sequential.1 (GELU)``

    def describe(self) -> str:
        return f"{self.name} ({self.target})" if self.kind == NODE_CALL else self.name


@dataclass(frozen=True)
class UnitInfo:
    """What a compiled unit record holds beside its inputs and outputs."""

    region: str | None  # ``Net.forward (model.py:12)``
    backend: str | None  # inductor / aot_eager ...
    graph_id: str | None  # one compiled graph (every call of it shares the id)
    kind: str | None  # forward / backward / inference
    nodes: tuple[UnitNode, ...]
    consts: list  # TensorRefs (and scalars) the graph reads as attributes
    kernels: tuple[str, ...] = ()  # the backend's kernel names, when it gives them
    note: str | None = None  # why the graph is not stored, when it is not

    @classmethod
    def from_wire(cls, d: dict) -> "UnitInfo":
        nodes = tuple(UnitNode(str(n[0]), str(n[1]), n[2], _decode_graph_value(n[3]),
                               {str(k): _decode_graph_value(v) for k, v in (n[4] or {}).items()},
                               n[5] if len(n) > 5 else None) for n in d.get(_U_NODES) or [])
        return cls(_typed(d.get(_U_REGION), str), _typed(d.get(_U_BACKEND), str), _typed(d.get(_U_GRAPH), str),
                   _typed(d.get(_U_KIND), str), nodes, decode_value(d.get(_U_CONSTS) or []),
                   tuple(str(k) for k in d.get(_U_KERNELS) or []), _typed(d.get(_U_NOTE), str))

    def calls(self) -> list[UnitNode]:
        return [n for n in self.nodes if n.kind == NODE_CALL]

    def to_json(self) -> dict:
        return {"region": self.region, "backend": self.backend, "graph": self.graph_id, "kind": self.kind,
                "nodes": [{"kind": n.kind, "name": n.name, "target": n.target, "module": n.module}
                          for n in self.nodes], "kernels": list(self.kernels), "note": self.note}


def _decode_graph_value(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode_graph_value(x) for x in v]
    if isinstance(v, dict) and len(v) == 1 and _NODE_REF in v:
        return NodeRef(int(v[_NODE_REF]))
    return decode_value(v)


def encode_graph_value(v: Any, node_index: Callable[[Any], int | None], tensor_ref: Callable[[torch.Tensor], dict]
                       ) -> Any:
    """A graph node's argument tree: nodes (``node_index`` gives their position, None for a non-node) become
    {"node": i}; everything else as ``encode_value``."""
    if isinstance(v, (list, tuple)):
        return [encode_graph_value(x, node_index, tensor_ref) for x in v]
    i = node_index(v)
    if i is not None:
        return {_NODE_REF: i}
    return encode_value(v, tensor_ref)


def wire_node(kind: str, name: str, target: Any, args: Any, kwargs: dict, module: str | None) -> list:
    return [kind, name, target, args, kwargs, module]


def wire_set_unit(rec: dict, region: str | None, backend: str | None, graph_id: str | None, kind: str | None,
                  nodes: list | None, consts: list, kernels: list[str], note: str | None = None) -> None:
    rec[_UNIT] = {_U_REGION: region, _U_BACKEND: backend, _U_GRAPH: graph_id, _U_KIND: kind,
                  _U_NODES: nodes or [], _U_CONSTS: consts, _U_KERNELS: kernels, _U_NOTE: note}


# =============================================================================================================
# Checking records read back (the reader's side)
# =============================================================================================================
class IndexRow(NamedTuple):
    """What the index needs of one op record, read straight from the wire dict (no TensorRef, no torch objects:
    the writer thread builds the index while the job runs, so this must be cheap)."""

    index: int
    name: str
    phase: str | None
    module: str | None
    source: str | None
    forward: int | None
    recorded: bool
    collective: bool
    uninitialised: bool
    random: bool
    inputs: list  # (version, geometry) per input tensor, in OpRecord.inputs() order
    outputs: list  # (version, geometry) per output tensor, in OpRecord.outputs_refs() order
    first_output: str | None  # e.g. "float32[8, 32, 64]"


def _list_refs(vs: list, out: list) -> None:
    """The tensor references (maps holding a storage version key) in a list and the lists nested in it, in order."""
    for v in vs:
        if isinstance(v, dict):
            if _VERSION in v:
                out.append(v)
        elif isinstance(v, list):
            _list_refs(v, out)


def _geom(w: dict) -> tuple:
    return (w.get(_VERSION), w[_DTYPE], tuple(w[_SHAPE]), tuple(w.get(_STRIDE) or ()), w.get(_OFFSET, 0))


def _geoms(vs: Any) -> list:
    """[(version, _geom(r))] for the tensor references in ``vs`` (a reference, or a list as ``_list_refs`` walks it;
    anything else holds none), in one loop for the common shapes: the writer thread runs this for every op."""
    out: list = []
    if isinstance(vs, dict):
        vs = [vs]
    elif not isinstance(vs, list):
        return out
    for r in vs:
        if isinstance(r, dict):
            if _VERSION in r:
                v = r[_VERSION]
                out.append((v, (v, r[_DTYPE], tuple(r[_SHAPE]), tuple(r.get(_STRIDE) or ()), r.get(_OFFSET, 0))))
        elif isinstance(r, list):
            raw: list = []
            _list_refs(r, raw)
            out.extend((w.get(_VERSION), _geom(w)) for w in raw)
    return out


def index_row(w: dict) -> IndexRow:
    """Raises KeyError/TypeError/ValueError on a malformed record."""
    recorded = _NOT_RECORDED not in w
    ins: list = []
    outs: list = []
    first = None
    if recorded:
        ins = _geoms(w.get(_ARGS))
        kwargs = w.get(_KWARGS)
        if kwargs:
            for v in kwargs.values():
                ins.extend(_geoms(v))
        outs = _geoms(w.get(_OUTPUTS))
        if outs:
            g = outs[0][1]
            first = f"{g[1]}{list(g[2])}"
        writes = w.get(_WRITES)
        if writes:
            seen = {g for _, g in outs}
            for _, v in writes:
                for version, g in _geoms(v):
                    if g not in seen:
                        seen.add(g)
                        outs.append((version, g))
    return IndexRow(w[_INDEX], w[_NAME], w.get(_PHASE), w.get(_MODULE), w.get(_SOURCE), w.get(_FORWARD), recorded,
                    _COLL in w, bool(w.get(_UNINIT)), isinstance(w.get(_RNG), dict), ins, outs, first)


def check_chunk(frame: Any, first: int) -> list[dict]:
    """The op records of an ops chunk, after checking its structure; ValueError if it is not sound."""
    if not isinstance(frame, dict):
        raise ValueError("chunk is not a map")
    ops = frame.get("ops")
    if frame.get("first") != first or not isinstance(ops, list) or not ops:
        raise ValueError("chunk does not match its name")
    prev = first - 1
    for op in ops:
        if not isinstance(op, dict) or not isinstance(op.get(_INDEX), int) or op[_INDEX] <= prev:
            raise ValueError("op numbers out of order")
        if not isinstance(op.get(_NAME), str):
            raise ValueError("op without a name")
        prev = op[_INDEX]
    return ops


def chunk_frame(ops: list[dict], number: int) -> dict:
    return {"chunk": number, "first": ops[0][_INDEX], "ops": ops}


# =============================================================================================================
# The planted fault (record --plant): one entry of a rank's manifest
# =============================================================================================================
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
                            call=call if isinstance(call, int) else None, rel=entry.get(_PLANT_REL), landed=landed,
                            index=None, rank=rank, calls_seen=seen if isinstance(seen, int) else None,
                            effect=_effect_from_json(entry.get(_PLANT_EFFECT)) if landed else None)


# =============================================================================================================
# Manifest metadata: the environment snapshot, the record options and the compiled regions, typed once at open
# =============================================================================================================
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
# Environment keys (record/environment.py builds the snapshot through wire_environment and wire_device).
_E_FLAGS, _E_VARIABLES, _E_DEVICES = "flags", "variables", "devices"
_E_SCALARS = ("torch", "python", "platform", "hostname", "rank", "world_size", "cuda", "cudnn", "nccl",
              "num_threads", "num_interop_threads", "driver")
_D_INDEX, _D_NAME, _D_CAPABILITY, _D_MEMORY = "index", "name", "capability", "memory"
# The numerics flags: attribute of EnvFlags -> its key under "flags" (the torch setting it reads).
_FLAG_KEYS = {
    "matmul_tf32": "cuda.matmul.allow_tf32",
    "matmul_bf16_reduced": "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "matmul_fp16_reduced": "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cudnn_tf32": "cudnn.allow_tf32",
    "cudnn_benchmark": "cudnn.benchmark",
    "cudnn_deterministic": "cudnn.deterministic",
    "deterministic_algorithms": "deterministic_algorithms",
    "deterministic_warn_only": "deterministic_warn_only",
    "float32_matmul_precision": "float32_matmul_precision",
}
# Compiled-region keys (record/compiled.py builds each through wire_compiled_region).
_C_REGION, _C_KIND, _C_CALLS, _C_HOW, _C_BY_HOW, _C_BACKEND, _C_FULLGRAPH, _C_IN_TRACE, _C_SUPPRESSED, _C_NOTE = (
    "region", "kind", "calls", "how", "calls_by_how", "backend", "fullgraph", "ops_in_trace",
    "fullgraph_errors_suppressed", "note")
_C_UNITS = "units"  # calls recorded as compiled units (record(compiled="capture")); absent before units existed


def _typed(v: Any, kind: type | tuple[type, ...]) -> Any:
    """``v`` if it has the type a field expects, else None: an old or damaged manifest reads as 'unknown'."""
    return v if isinstance(v, kind) and not (kind is int and isinstance(v, bool)) else None


def _mapping(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def flatten_keys(v: Any, prefix: str = "") -> dict[str, Any]:
    """A nested manifest entry as dotted keys ("flags.cudnn.allow_tf32", "devices.0.name"): what a diff compares."""
    out: dict[str, Any] = {}

    def walk(x: Any, p: str) -> None:
        if isinstance(x, dict):
            for k, y in x.items():
                walk(y, f"{p}{k}.")
        elif isinstance(x, list) and x and all(isinstance(y, dict) for y in x):
            for n, y in enumerate(x):
                walk(y, f"{p}{n}.")
        else:
            out[p[:-1]] = x

    walk(v, prefix)
    return out


def env_key(name: str) -> str:
    """The dotted key of an environment entry as ``Environment.flat()`` names it: an EnvFlags attribute
    ("matmul_tf32" -> "flags.cuda.matmul.allow_tf32"), a variable ("$NCCL_ALGO" -> "variables.NCCL_ALGO"), the
    devices ("devices" -> "devices", a prefix) or a top-level entry ("num_threads")."""
    if name in _FLAG_KEYS:
        return f"{_E_FLAGS}.{_FLAG_KEYS[name]}"
    if name.startswith("$"):
        return f"{_E_VARIABLES}.{name[1:]}"
    if name in _E_SCALARS or name == _E_DEVICES:
        return name
    raise KeyError(f"no environment entry {name!r}")


@dataclass(frozen=True)
class EnvFlags:
    """The numerics flags the job ran with; None where the trace does not say (an older recorder)."""
    matmul_tf32: bool | None = None
    matmul_bf16_reduced: bool | None = None
    matmul_fp16_reduced: bool | None = None
    cudnn_tf32: bool | None = None
    cudnn_benchmark: bool | None = None
    cudnn_deterministic: bool | None = None
    deterministic_algorithms: bool | None = None
    deterministic_warn_only: bool | None = None
    float32_matmul_precision: str | None = None
    recorded: tuple[tuple[str, Any], ...] = ()  # every flag as recorded (torch's name, value), for display

    @classmethod
    def from_wire(cls, d: Any) -> "EnvFlags":
        d = _mapping(d)
        typed = {a: _typed(d.get(k), str if a == "float32_matmul_precision" else bool) for a, k in _FLAG_KEYS.items()}
        return cls(**typed, recorded=tuple((str(k), v) for k, v in d.items()))


@dataclass(frozen=True)
class Device:
    index: int | None
    name: str | None
    capability: tuple[int, ...]  # () when unknown
    memory: int | None

    @classmethod
    def from_wire(cls, d: Any) -> "Device":
        d = _mapping(d)
        cap = d.get(_D_CAPABILITY)
        return cls(_typed(d.get(_D_INDEX), int), _typed(d.get(_D_NAME), str),
                   tuple(c for c in cap if isinstance(c, int)) if isinstance(cap, list) else (),
                   _typed(d.get(_D_MEMORY), int))


@dataclass(frozen=True)
class Environment:
    """The environment snapshot of one rank (record/environment.py); every entry None when the trace lacks it."""
    torch: str | None = None
    python: str | None = None
    platform: str | None = None
    hostname: str | None = None
    rank: int | None = None
    world_size: int | None = None
    cuda: str | None = None
    cudnn: int | None = None
    nccl: str | None = None
    num_threads: int | None = None
    num_interop_threads: int | None = None
    driver: int | None = None
    devices: tuple[Device, ...] = ()
    flags: EnvFlags = field(default_factory=EnvFlags)
    variables: dict[str, str] = field(default_factory=dict)  # NCCL_*, TORCH_*, OMP_* ... as recorded
    wire: dict = field(default_factory=dict, repr=False, compare=False)  # the snapshot as stored

    @classmethod
    def from_wire(cls, d: Any) -> "Environment":
        d = _mapping(d)
        kinds = {"rank": int, "world_size": int, "cudnn": int, "num_threads": int, "num_interop_threads": int,
                 "driver": int}
        scalars = {k: _typed(d.get(k), kinds.get(k, str)) for k in _E_SCALARS}
        devices = d.get(_E_DEVICES)
        return cls(**scalars, devices=tuple(Device.from_wire(x) for x in devices) if isinstance(devices, list) else (),
                   flags=EnvFlags.from_wire(d.get(_E_FLAGS)),
                   variables={str(k): str(v) for k, v in _mapping(d.get(_E_VARIABLES)).items()}, wire=d)

    def flat(self) -> dict[str, Any]:
        """The snapshot as dotted keys (see ``env_key``), as stored: what ``diff`` compares."""
        return flatten_keys(self.wire)

    def to_json(self) -> dict:
        return self.wire


def wire_device(index: int, name: Any, capability: list, memory: Any) -> dict:
    return {_D_INDEX: index, _D_NAME: name, _D_CAPABILITY: capability, _D_MEMORY: memory}


def wire_environment(scalars: dict[str, Any], flags: dict[str, Any], variables: dict[str, str],
                     devices: list[dict]) -> dict:
    """The snapshot as stored: ``scalars`` keyed by Environment attribute (torch, num_threads ...), ``flags`` by EnvFlags attribute."""
    unknown = set(scalars) - set(_E_SCALARS) or set(flags) - set(_FLAG_KEYS)
    if unknown:
        raise KeyError(f"not environment entries: {sorted(unknown)}")
    out = {k: scalars.get(k) for k in _E_SCALARS if k != "driver"}
    out[_E_DEVICES] = devices
    out["driver"] = scalars.get("driver")
    out[_E_FLAGS] = {_FLAG_KEYS[a]: v for a, v in flags.items()}
    out[_E_VARIABLES] = variables
    return out


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
    wire: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, d: Any) -> "RecordedOptions":
        d = _mapping(d)
        return cls(tensors=TensorMode.read(d.get("tensors")), steps=_typed(d.get("steps"), str),
                   flight=_typed(d.get("flight"), int), plant=_typed(d.get("plant"), str),
                   granularity=_typed(d.get("granularity"), str), budget=_typed(d.get("budget"), int),
                   compiled=_typed(d.get("compiled"), str), wire=d)

    def to_json(self) -> dict:
        return self.wire


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
    units: bool = False  # its compiled graphs' calls are in the trace as compiled units (record/units.py)

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


# -- what a recording left out (record --budget, a full disk, a --module/--op filter) ---------------------------
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


def manifest_metadata(manifest: dict) -> tuple[Environment, RecordedOptions, tuple[CompiledRegion, ...]]:
    """The typed environment, record options and compiled regions of a manifest as read (any format version)."""
    return (Environment.from_wire(manifest.get(_M_ENV)), RecordedOptions.from_wire(manifest.get(_M_OPTIONS)),
            tuple(compiled_regions_from_wire(manifest.get(_M_COMPILED))))
