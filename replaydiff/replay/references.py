"""What an op is replayed against, when not its own kernel: a reference the user registers, or a decomposition.

A custom op (``mylib::fused_ln``, a fused or hand-written kernel) replayed through its own kernel at float64 repeats
the kernel's bug; so does an aten op whose kernel is wrong on every device. ``register_reference(name, fn)`` gives
replay a plain implementation to run instead (loaded with ``replay --reference-module MODULE``), and
``--reference decomp`` runs aten ops that have one through their ``torch._decomp`` decomposition: the same maths,
built from other, simpler aten ops, so a wrong fused kernel disagrees with it even on the recording device.
"""
from __future__ import annotations

from typing import Any, Callable

REFERENCES = ("kernel", "decomp")  # --reference: the op's own kernel (default), or its decomposition where one exists

_REGISTRY: dict[str, Callable[..., Any]] = {}


def _key(op_name: str) -> str:
    """``mylib::fused_ln``, ``mylib.fused_ln`` and ``mylib::fused_ln.default`` alike -> ``mylib.fused_ln[.overload]``."""
    ns, sep, rest = op_name.strip().partition("::")
    name = f"{ns}.{rest}" if sep else op_name.strip()
    if name.startswith("torch.ops."):
        name = name[len("torch.ops."):]
    if name.count(".") not in (1, 2):
        raise ValueError(f"{op_name!r} is not an op name such as mylib::fused_ln or aten.mm.default")
    return name


def register_reference(op_name: str, fn: Callable[..., Any]) -> None:
    """Replay ``op_name`` (every overload, or one: ``mylib::fused_ln.default``) by calling ``fn`` instead of its
    kernel. ``fn`` takes the op's arguments (tensors at the replay precision, float64 by default) and returns what the
    op returns; for an in-place op it writes into the same arguments."""
    if not callable(fn):
        raise TypeError(f"the reference for {op_name} is not callable")
    _REGISTRY[_key(op_name)] = fn


def unregister_reference(op_name: str) -> None:
    _REGISTRY.pop(_key(op_name), None)


def registered_reference(name: str) -> Callable[..., Any] | None:
    """The reference registered for a recorded op name (``mylib.fused_ln.default``): its overload's, else its own."""
    return _REGISTRY.get(name) or _REGISTRY.get(name.rsplit(".", 1)[0])


def decomposition(func: Any) -> Callable[..., Any] | None:
    """The op's decomposition in ``torch._decomp`` (imported on first use: it costs a second or more)."""
    from torch._decomp import decomposition_table

    return decomposition_table.get(func)
