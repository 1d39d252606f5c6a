"""Where an op is, said one way by every reader (replay, diff, report, show, the TUI).

An op's place is its module and the line of the user's code it computes for. For an op of the backward pass, that
line is not its own recorded one: a backward op's stack holds nothing of the user's but the ``backward()`` call, so
its own line is that call, and the forward op it differentiates says which code it is. An op of a checkpointed
region run again in the backward (activation checkpointing) runs forward code: its own line is that code, its module
the forward op's it repeats, and the ``backward()`` call that ran it is recorded apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from replaydiff.trace.schema import OpRecord


@dataclass(frozen=True)
class OpLocation:
    module: str | None
    phase: str | None
    source: str | None  # 'file.py:LINE' of the code the op computes for
    source_text: str | None  # that line's text when known
    of_forward: bool  # ``source`` is the line of the forward op it differentiates (a backward op)
    backward_call: str | None  # for a backward or recomputed op: where backward() was called
    forward_index: int | None  # for a backward op: the forward op it differentiates
    recompute: bool  # an op of a checkpointed region run again in the backward
    recompute_of: int | None  # for a recompute: the forward op it runs again (None: none matched)

    @property
    def phase_text(self) -> str:
        """'backward', or 'recompute of #N' for a recompute."""
        if self.recompute:
            return f"recompute of #{self.recompute_of}" if self.recompute_of is not None else "recompute"
        return self.phase or ""

    def where(self, no_module: str = "") -> str:
        """'MODULE  (PHASE)  file.py:LINE', the parts known."""
        phase = self.phase_text
        return "  ".join(x for x in (self.module or no_module, f"({phase})" if phase else "", self.source or "")
                         if x)

    def origin(self) -> str | None:
        """What ran the op, for one of the backward pass: 'backward of forward op #N; backward() called at ...'."""
        called = f"; backward() called at {self.backward_call}" if self.backward_call else ""
        if self.recompute:
            of = f" of forward op #{self.recompute_of}" if self.recompute_of is not None else \
                " (the checkpoint's own bookkeeping: no forward op of the user's code)"
            return f"recompute{of} (activation checkpointing){called}"
        if self.forward_index is not None:
            return f"backward of forward op #{self.forward_index}{called}"
        return None


def locate(op: OpRecord, forward_source: Callable[[int], tuple[str | None, str | None]] | None = None) -> OpLocation:
    """Where ``op`` is; ``forward_source(i)`` gives forward op ``i``'s (line, text) (None: the op's own line
    stands)."""
    fwd = op.forward_index
    recompute = op.recompute
    source, text, of_forward, called = op.source, op.source_text, False, None
    if recompute:
        called = op.backward_call
    elif op.phase == "backward" and fwd is not None and forward_source is not None:
        try:
            line, line_text = forward_source(fwd)
        except Exception:  # a damaged chunk elsewhere: the op's own line stands
            line, line_text = None, None
        if line:
            source, text, of_forward, called = line, line_text, True, op.source
    elif op.phase == "backward" and fwd is not None:
        called = op.source
    return OpLocation(module=op.module, phase=op.phase, source=source, source_text=text, of_forward=of_forward,
                      backward_call=called, forward_index=fwd if not recompute else None, recompute=recompute,
                      recompute_of=op.recompute_of)


def location_json(loc: OpLocation | None) -> dict | None:
    """The location as JSON (``replay --json``, ``diff --json``)."""
    if loc is None:
        return None
    return {"module": loc.module, "phase": loc.phase, "source": loc.source, "source_text": loc.source_text,
            "of_forward": loc.of_forward, "backward_call": loc.backward_call, "forward_index": loc.forward_index,
            "recompute": loc.recompute, "recompute_of": loc.recompute_of}


def location_from_json(d: object) -> OpLocation | None:
    """Read back ``location_json``'s object (None: absent or not one)."""
    if not isinstance(d, dict):
        return None

    def text(k: str) -> str | None:
        v = d.get(k)
        return v if isinstance(v, str) else None

    def number(k: str) -> int | None:
        v = d.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return OpLocation(module=text("module"), phase=text("phase"), source=text("source"),
                      source_text=text("source_text"), of_forward=d.get("of_forward") is True,
                      backward_call=text("backward_call"), forward_index=number("forward_index"),
                      recompute=d.get("recompute") is True, recompute_of=number("recompute_of"))
