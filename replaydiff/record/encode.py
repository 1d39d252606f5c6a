"""Turning op arguments into msgpack-safe structures, and back.

Non-tensor values are kept verbatim where msgpack can hold them; torch objects become one-key dicts (aten schemas never
take a dict, so a dict in a trace is always one of these markers). Tensors are handed to a callback that returns a
reference dict. Decoding only looks names up in torch's own namespaces: it never imports or evaluates anything.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

TENSOR_KEY = "T"


def encode_value(v: Any, tensor_ref: Callable[[torch.Tensor], dict]) -> Any:
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


def decode_value(v: Any, tensor: Callable[[dict], Any], marker: Callable[[str, Any], Any] | None = None) -> Any:
    """Inverse of encode_value; ``tensor`` builds a tensor from a reference dict, ``marker`` handles the markers
    that cannot be rebuilt from the trace alone (generators, objects). Raises ValueError on junk."""
    if isinstance(v, list):
        return [decode_value(x, tensor, marker) for x in v]
    if not isinstance(v, dict):
        return v
    if TENSOR_KEY in v:
        return tensor(v)
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
        if marker is not None:
            return marker(key, val)
        raise ValueError(f"an argument of kind {key!r} cannot be rebuilt for replay")
    raise ValueError(f"unknown marker {key!r}")


def dtype_from_name(name: str) -> torch.dtype:
    return _torch_attr(name, torch.dtype)


def iter_tensor_refs(v: Any):
    """Every tensor reference dict inside an encoded structure, in order."""
    if isinstance(v, list):
        for x in v:
            yield from iter_tensor_refs(x)
    elif isinstance(v, dict) and TENSOR_KEY in v:
        yield v
