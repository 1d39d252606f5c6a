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


def _result_tensors(func, args, kwargs, out) -> tuple[str | None, list[torch.Tensor]]:
    """What a plant perturbs, and its name: the written argument that is the op's result (in-place, out=, a
    collective's tensors: ``written argument 'self'``), else the op's first floating-point output (``output 1
    (output 0 is None)``; batch norm's running statistics are bookkeeping, not its result). (None, []) when the op
    returned no tensor."""
    written = written_args(facts(func), args, kwargs, result_only=True)
    if written:
        (kind, where), value = written[0]
        name = func._schema.arguments[where].name if kind == "arg" else where
        return f"written argument {name!r}", list(iter_tensors(value))
    outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    tensors = [(i, v) for i, v in enumerate(outputs) if isinstance(v, torch.Tensor)]
    # the first floating-point output; an op with none (argmax) is named by its first tensor, which holds no float
    i, t = next(((i, v) for i, v in tensors if v.is_floating_point()), tensors[0] if tensors else (None, None))
    if t is None:
        return None, []
    skipped = [str(j) for j, v in enumerate(outputs[:i]) if v is None]
    none = f" (output{'s' if len(skipped) > 1 else ''} {', '.join(skipped)} {'are' if len(skipped) > 1 else 'is'} " \
        f"None)" if skipped else ""
    return f"output {i}{none}", [t]


def _completed(out, results: list[torch.Tensor]):
    """``out`` with each Work replaced by one that is already complete."""
    from torch._C._distributed_c10d import _create_work_from_future

    def done():
        fut = torch.futures.Future()
        fut.set_result(results)
        return _create_work_from_future(fut).boxed()

    if isinstance(out, (tuple, list)):
        return type(out)(done() if hasattr(v, "wait") and not isinstance(v, torch.Tensor) else v for v in out)
    return done()


def _count(x: float) -> str:
    return f"{x:.0f}" if x < 1e6 else f"{x:.3g}"


@dataclass(frozen=True)
class PlantEffect:
    """What a plant did to the result it perturbed, counted in the result's own dtype as it landed.

    The recorder writes it into the manifest, where the trace schema reads it back: a plant that changed nothing (a
    None result, all zeros, values that round back) has nothing for replay to find, and one that changed a value by
    one ulp is no larger than a rounding."""

    tensors: int  # result tensors reached (0: the op's result there is None)
    elements: int  # their floating-point elements
    nonzero: int  # of those, the ones that were not zero
    changed: int  # elements whose value the plant changed (NaN staying NaN is no change)
    max_ulps: float | None  # largest change from a finite value to a finite value, in ulps of the result's dtype
    nonfinite: int  # elements the plant turned into NaN or Inf
    dtype: str | None  # the floating dtype(s) of the result, e.g. "bfloat16"
    target: str | None = None  # what was perturbed: "output 0", "written argument 'self'" (None: no tensor)

    @property
    def changed_nothing(self) -> bool:
        return self.changed == 0

    @property
    def within_one_rounding(self) -> bool:
        """Changed, but no value by more than one ulp: replay may not tell that from a correctly rounded result."""
        return self.changed > 0 and not self.nonfinite and self.max_ulps is not None and self.max_ulps <= 1

    @property
    def hint(self) -> str | None:
        """What the size of the change means for replay, when it matters."""
        return "one rounding: replay may not tell it from rounding error" if self.within_one_rounding else None

    def describe(self) -> str:
        """The facts, and the hint if there is one."""
        return self.facts() + (f" ({self.hint})" if self.hint else "")

    def facts(self) -> str:
        what = self.target or "its result"
        if self.changed_nothing:
            if self.tensors == 0:
                why = "its result is None: no tensor to perturb"
            elif self.elements == 0:
                why = f"{what} has no floating-point elements"
            elif self.nonzero == 0:
                why = f"{what} is all zeros"
            else:
                why = f"all {self.elements} elements of {what} round back to their {self.dtype} values"
            return f"changed nothing ({why})"
        text = f"changed {self.changed} of {self.elements} elements" + (f" of {self.target}" if self.target else "")
        if self.nonfinite:
            text += f" ({self.nonfinite} to NaN/Inf)"
        if self.max_ulps is not None:
            text += f" by at most {_count(self.max_ulps)} ulp{'' if self.max_ulps == 1 else 's'} of {self.dtype}"
        return text

    def to_json(self) -> dict:
        """For a JSON report."""
        return {"tensors": self.tensors, "elements": self.elements, "nonzero": self.nonzero, "changed": self.changed,
                "nonfinite": self.nonfinite, "max_ulps": self.max_ulps, "dtype": self.dtype, "target": self.target}


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (common) floating dtype lie between finite ``a`` and ``b``."""
    bits = a.element_size() * 8
    magnitude = (1 << (bits - 1)) - 1

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # sign and magnitude as an integer that counts representable values: -0.0 and 0.0 are both 0
        i = t.contiguous().view(_SAME_WIDTH_INT[t.element_size()]).to(torch.int64)
        return torch.where(i < 0, -(i & magnitude), i)

    ka, kb = ordered(a), ordered(b)
    same_sign = (ka < 0) == (kb < 0)  # then the integer difference cannot overflow, and is exact
    return torch.where(same_sign, (kb - ka).abs().double(), (kb.double() - ka.double()).abs())


def _perturb(results: list[torch.Tensor], rel: float, target: str | None = None) -> PlantEffect:
    """Multiply each floating result by 1 + ``rel`` in place and count what that changed."""
    elements = nonzero = changed = nonfinite = 0
    max_ulps: float | None = None
    dtypes: list[str] = []
    with torch.no_grad():
        for t in results:
            if not (t.is_floating_point() and t.numel()):
                continue
            new = (t.double() * (1.0 + rel)).to(t.dtype)
            moved = ~((new == t) | (new.isnan() & t.isnan()))
            finite = moved & new.isfinite() & t.isfinite()
            elements += t.numel()
            nonzero += int((t != 0).sum())
            changed += int(moved.sum())
            nonfinite += int((moved & ~new.isfinite()).sum())
            if finite.any():
                u = float(_ulps_apart(t[finite], new[finite]).max())
                max_ulps = u if max_ulps is None else max(max_ulps, u)
            name = str(t.dtype).removeprefix("torch.")
            if name not in dtypes:
                dtypes.append(name)
            t.copy_(new)
    return PlantEffect(len(results), elements, nonzero, changed, max_ulps, nonfinite, ", ".join(dtypes) or None,
                       target)


@dataclass
class PlantedFault(TorchDispatchMode):
    """Multiply the output of the ``call``-th call (from 1, as ``record --plant OP:N``) of ``op`` (e.g.
    ``aten.mm.default``) by ``1 + rel``. After the block: ``planted`` (the call came), ``seen`` (calls of ``op``
    made) and ``effect`` (what the plant changed, a PlantEffect)."""

    op: str
    rel: float = 1e-3
    call: int = 1
    rank: int | None = None  # plant only in the process of this rank (torch.distributed or $RANK)
    seen: int = field(default=0, init=False)
    planted: bool = field(default=False, init=False)
    effect: PlantEffect | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        TorchDispatchMode.__init__(self)
        if self.call < 1:
            raise ValueError(f"PlantedFault call={self.call}: calls count from 1")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if str(func) != self.op or not self._on_this_rank():
            return out
        self.seen += 1
        if self.seen != self.call:
            return out
        works = []
        if func.namespace == "c10d":  # a collective's result exists once its work completes: corrupt it after that
            for w in (out if isinstance(out, (tuple, list)) else (out,)):  # (tensors, Work) or a bare Work
                if hasattr(w, "wait") and not isinstance(w, torch.Tensor):
                    w.wait()
                    works.append(w)
        target, results = _result_tensors(func, args, kwargs, out)
        self.effect = _perturb(results, self.rel, target)
        if works:
            # gloo copies a result into place again on every wait(): the job's own wait would undo the fault, so
            # it gets a Work that is already complete
            out = _completed(out, results)
        self.planted = True
        return out

    def _on_this_rank(self) -> bool:
        return self.rank is None or current_rank()[0] == self.rank

    @classmethod
    def from_spec(cls, spec: "str | PlantSpec", rank: int | None = None) -> "PlantedFault":
        """The fault ``record --plant SPEC`` plants (SPEC as PlantSpec.parse takes it)."""
        p = spec if isinstance(spec, PlantSpec) else PlantSpec.parse(spec)
        return cls(p.op, rel=p.rel, call=p.call, rank=rank)


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
