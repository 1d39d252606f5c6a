"""Planted faults: a dispatch mode *below* the recorder that makes one op return a slightly wrong answer.

This is how the demo and the tests stand in for a buggy kernel: the recorder sees (and stores) the perturbed output,
exactly as it would store the output of a real faulty kernel, and replay must name that op and no other.
Enter it *before* the recorder so that it sits below it on the mode stack.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replaydiff.aten import current_rank, facts, iter_tensors, written_args


def _result_tensors(func, args, kwargs, out) -> list[torch.Tensor]:
    """The op's result: its first written argument (self, out=, a collective's tensors), else its first output."""
    written = written_args(facts(func), args, kwargs)
    first = written[0][1] if written else (out[0] if isinstance(out, (tuple, list)) and out else out)
    return list(iter_tensors(first))


@dataclass
class PlantedFault(TorchDispatchMode):
    """Multiply the output of the ``occurrence``-th call of ``op`` (e.g. ``aten.mm.default``) by ``1 + rel``."""

    op: str
    rel: float = 1e-3
    occurrence: int = 0
    rank: int | None = None  # plant only in the process of this rank (torch.distributed or $RANK)
    seen: int = field(default=0, init=False)
    planted: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        TorchDispatchMode.__init__(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if str(func) != self.op or not self._on_this_rank():
            return out
        self.seen += 1
        if self.seen - 1 != self.occurrence:
            return out
        if func.namespace == "c10d" and isinstance(out, (tuple, list)):
            for w in out:  # a collective's result exists once its work completes: corrupt it after that
                if hasattr(w, "wait") and not isinstance(w, torch.Tensor):
                    w.wait()
        for t in _result_tensors(func, args, kwargs, out):
            if t.is_floating_point() and t.numel():
                with torch.no_grad():
                    t.copy_((t.double() * (1.0 + self.rel)).to(t.dtype))
        self.planted = True
        return out

    def _on_this_rank(self) -> bool:
        return self.rank is None or current_rank()[0] == self.rank

    @classmethod
    def from_spec(cls, spec: str) -> "PlantedFault":
        p = PlantSpec.parse(spec)
        return cls(p.op, rel=p.rel, occurrence=p.call - 1)


@dataclass(frozen=True)
class PlantSpec:
    """``OP[:N[:REL]]`` as ``replaydiff record --plant`` takes it: the N-th call (from 1) of OP times 1 + REL.

    OP is a full overload name (``aten.mm.default``), or short: ``mm`` and ``aten.mm`` mean ``aten.mm.default``,
    ``mylib::fused_ln`` means ``mylib.fused_ln.default``."""

    op: str
    call: int = 1
    rel: float = 1e-3

    @classmethod
    def parse(cls, spec: str) -> "PlantSpec":
        text = spec.strip()
        ns, sep, rest = text.partition("::")
        if sep:  # mylib::fused_ln[.overload][:N[:REL]]
            text = f"{ns}.{rest}"
        name, _, tail = text.partition(":")
        parts = tail.split(":") if tail else []
        if not name or len(parts) > 2:
            raise ValueError(f"--plant {spec!r} is not OP[:N[:REL]] (e.g. aten.mm.default:2:1e-3)")
        dots = name.count(".")
        op = f"aten.{name}.default" if dots == 0 else (f"{name}.default" if dots == 1 else name)
        try:
            call = int(parts[0]) if parts and parts[0] else 1
            rel = float(parts[1]) if len(parts) > 1 else 1e-3
        except ValueError:
            raise ValueError(f"--plant {spec!r}: N must be an integer and REL a number") from None
        if call < 1:
            raise ValueError(f"--plant {spec!r}: N counts calls from 1")
        if rel == 0 or rel != rel:
            raise ValueError(f"--plant {spec!r}: REL must be a non-zero number")
        return cls(op, call, rel)

    def describe(self) -> str:
        return f"{self.op} call {self.call} x(1{self.rel:+g})"
