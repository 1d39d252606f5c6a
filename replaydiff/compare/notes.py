"""Typed notes: what a judgement says about an op beside its status and verdict, as values until it is shown.

Replay (``replay/notes.py``) and the diff of two traces (``diff/notes.py``) judge an op into a status, a verdict and
a tuple of notes. Each note is a small frozen value of its own kind (a fixed sentence, or a sentence with fields),
and ``render`` turns the tuple into the one line of text a result's ``reason`` holds, the notes joined by "; ", so
no judging code grows a reason by concatenating strings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


class Note:
    """One thing a judgement says; ``text`` is its sentence as the reports show it."""

    __slots__ = ()

    def text(self) -> str:
        raise NotImplementedError


class Fact(Note):
    """A note that is one fixed sentence: mixed into an Enum whose members' values are the sentences."""

    __slots__ = ()

    def text(self) -> str:
        return self.value  # type: ignore[attr-defined]  (the Enum's)


@dataclass(frozen=True)
class VerdictReason(Note):
    """A verdict's own words (``Verdict.reason`` of a divergent output, ``Verdict.explanation`` of an ok one)."""

    said: str

    def text(self) -> str:
        return self.said


def verdict_reason(said: str | None) -> tuple[Note, ...]:
    """The note for a verdict's reason or explanation: none when the verdict says nothing."""
    return () if said is None else (VerdictReason(said),)


def render(notes: Iterable[Note]) -> str | None:
    """The reason line: every note's sentence in order, joined by "; "; None when there is no note."""
    texts = [n.text() for n in notes]
    return "; ".join(texts) if texts else None
