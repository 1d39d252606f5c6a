"""Values inside op records (arguments, outputs): tensor references, opaque arguments, and their codec.

Values are trees of TensorRef, Python scalars, lists and torch objects (dtype, device, layout, memory format); what
cannot be rebuilt from the trace alone (a generator, a symbolic size, an arbitrary object) is an ``Opaque``. Decoding
only looks names up in torch's own namespaces: it never imports or evaluates anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from replaydiff.trace.schema.keys import (_CHUNK, _CONJ, _DEVICE, _DTYPE, _NBYTES, _NEG, _OFFSET, _REQ_GRAD, _SHAPE,
                                          _STATS, _STRIDE, _UNINIT, _UNSUPPORTED, _VERSION, _ZERO)



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
    def stored_data(self) -> bool:
        """Its values are the bytes of a stored storage: ``stored``, and neither a ZeroTensor nor on the meta device
        (one look at the record: replay asks this of every tensor it rebuilds)."""
        w = self._w
        return (not w.get(_ZERO) and w.get(_VERSION) is not None and (_CHUNK in w or w.get(_NBYTES) == 0)
                and not (w.get(_DEVICE) == "meta" and w.get(_STRIDE) is not None and _UNSUPPORTED not in w))

    @property
    def layout(self) -> tuple:
        """(shape, stride, offset, conj, neg): what the tensor is rebuilt over its storage with (``as_recorded``)."""
        w = self._w
        stride = w.get(_STRIDE)
        return (tuple(w[_SHAPE]), None if stride is None else tuple(stride), w.get(_OFFSET, 0), bool(w.get(_CONJ)),
                bool(w.get(_NEG)))

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


# Values nest this deep at most: an aten argument is a list of lists of tensors at the deepest, a compiled unit's
# constant a little deeper. A hand-made record nested deeper is refused before Python's own recursion limit is.
MAX_DEPTH = 32
# A tensor has at most this many dimensions (torch allows 64 on CPU; CUDA fewer).
_MAX_DIMS = 64
_DTYPE_NAMES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))
_NONE = type(None)
_SCALARS = frozenset((_NONE, bool, int, float, str))


def check_ref(w: dict) -> TensorRef:
    """The TensorRef of a tensor reference read back, after checking the type of every field it has (ValueError):
    a dtype torch names, a shape and stride of ints, an offset, a version, a size and a data file number, flags.
    Called once per reference, where the value holding it is decoded."""
    dt, sh, st = w.get(_DTYPE), w.get(_SHAPE), w.get(_STRIDE)
    if dt not in _DTYPE_NAMES:
        raise ValueError(f"a tensor of dtype {dt!r}" if isinstance(dt, str) else "a tensor without a dtype name")
    if type(sh) is not list or len(sh) > _MAX_DIMS or not all(type(x) is int and x >= 0 for x in sh):
        raise ValueError("a tensor whose shape is not a list of sizes")
    if st is not None and (type(st) is not list or len(st) != len(sh) or not all(type(x) is int for x in st)):
        raise ValueError("a tensor whose stride does not fit its shape")
    for key in (_OFFSET, _NBYTES, _CHUNK):
        v = w.get(key, 0)
        if type(v) is not int or v < 0:
            raise ValueError(f"a tensor whose {_FIELD_NAMES[key]} is not an int >= 0")
    v = w[_VERSION]
    if v is not None and type(v) is not int:
        raise ValueError("a tensor whose storage version is not an int")
    if len(w) > 7:  # the optional fields: a reference of a plain stored tensor has none of them
        for key, kinds in _REF_OPTIONAL:
            x = w.get(key)
            if x is not None and not isinstance(x, kinds):
                raise ValueError(f"a tensor whose {_FIELD_NAMES[key]} is {type(x).__name__}")
        s = w.get(_STATS)
        if s and (len(s) != len(TensorStats.FIELDS) or not all(type(x) in (int, float) for x in s)):
            raise ValueError("a tensor whose statistics are not numbers")
    return TensorRef(w)


_REF_OPTIONAL = ((_DEVICE, str), (_STATS, list), (_UNSUPPORTED, str), (_REQ_GRAD, bool), (_UNINIT, bool),
                 (_CONJ, bool), (_NEG, bool), (_ZERO, bool))
_FIELD_NAMES = {_OFFSET: "offset", _NBYTES: "storage size", _CHUNK: "data file number", _DEVICE: "device",
                _STATS: "statistics", _UNSUPPORTED: "reason", _REQ_GRAD: "requires_grad flag",
                _UNINIT: "uninitialised flag", _CONJ: "conj bit", _NEG: "neg bit", _ZERO: "zero flag"}


def decode_value(v: Any, depth: int = 0) -> Any:
    """Inverse of encode_value, with TensorRef for tensors and Opaque for what the trace cannot rebuild.
    Raises ValueError on junk (the reader turns it into a TraceError naming the file): a value nested deeper than
    ``MAX_DEPTH``, a tensor reference with a field of another type, a marker torch does not name."""
    if isinstance(v, list):
        if depth >= MAX_DEPTH:
            raise ValueError(f"a value nested more than {MAX_DEPTH} deep")
        return [decode_value(x, depth + 1) for x in v]
    if not isinstance(v, dict):
        if type(v) not in _SCALARS:  # bytes, msgpack's ext types: never written into a value
            raise ValueError(f"a value of type {type(v).__name__}")
        return v
    if _VERSION in v:
        return check_ref(v)
    if len(v) != 1:
        raise ValueError(f"unexpected structure {sorted(map(str, v))[:4]}")
    (key, val), = v.items()
    if key == "dtype":
        return _torch_attr(val, torch.dtype)
    if key == "device":
        try:
            return torch.device(val) if isinstance(val, str) else torch.device(str(val))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"device {str(val)[:40]!r}: {str(exc).splitlines()[0][:80]}") from None
    if key == "layout":
        return _torch_attr(val, torch.layout)
    if key == "memory_format":
        return _torch_attr(val, torch.memory_format)
    if key == "complex":
        if not (isinstance(val, list) and len(val) == 2 and all(type(x) in (int, float) for x in val)):
            raise ValueError("a complex number that is not [real, imaginary]")
        return complex(float(val[0]), float(val[1]))
    if key == "bigint":
        return int(str(val))
    if key in ("generator", "symbolic", "object"):
        if not isinstance(val, (str, _NONE)):
            raise ValueError(f"a {key} marker holding {type(val).__name__}")
        return Opaque(key, val)
    raise ValueError(f"unknown marker {str(key)[:40]!r}")
