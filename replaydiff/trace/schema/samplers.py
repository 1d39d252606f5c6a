"""The data samplers a recorded process built: one entry per ``torch.utils.data.DistributedSampler`` (or subclass)
constructed while the recorder watched, with where it was built and the rank and replica count it was given and took.
A sampler is built before the step that uses it, so a recorded step cannot show it; this note lets the diff of a
parallel run name the line that gave every rank the same shard. The keys are spelled here only.

Read as untrusted data: each field is checked for its type and bounded in size; a note with any field that is not
sound reads as no note (unknown), never as "no sampler was built"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_VERSION, _WHOLE, _SAMPLERS = "v", "whole_process", "samplers"
_KIND, _AT, _RANK_GIVEN, _REPLICAS_GIVEN, _RANK, _REPLICAS, _SHUFFLE, _SEED = (
    "kind", "at", "rank_given", "replicas_given", "rank", "replicas", "shuffle", "seed")
VERSION = 1
MAX_SAMPLERS = 32  # a process that builds more (a sampler per epoch) keeps its first ones: they are what the steps read
MAX_TEXT = 300  # characters of a class name or a 'file.py:LINE'


@dataclass(frozen=True)
class SamplerBuilt:
    """One sampler's construction: its class name, where it was built ('file.py:LINE' of the code that called it;
    None: not found), the ``rank`` and ``num_replicas`` it was given (None: left to the process group) and those it
    took, and its shuffle flag and seed."""

    kind: str
    at: str | None
    rank_given: int | None
    replicas_given: int | None
    rank: int | None
    replicas: int | None
    shuffle: bool | None = None
    seed: int | None = None


@dataclass(frozen=True)
class SamplersNote:
    """What a process noted of its samplers. ``whole_process``: the recorder watched from the interpreter's start
    (``replaydiff record -- CMD``), so a sampler missing here was never built; otherwise only those built while
    recording are known."""

    whole_process: bool
    samplers: tuple[SamplerBuilt, ...]


def wire_samplers(note: SamplersNote) -> dict:
    return {_VERSION: VERSION, _WHOLE: note.whole_process,
            _SAMPLERS: [{_KIND: s.kind, _AT: s.at, _RANK_GIVEN: s.rank_given, _REPLICAS_GIVEN: s.replicas_given,
                         _RANK: s.rank, _REPLICAS: s.replicas, _SHUFFLE: s.shuffle, _SEED: s.seed}
                        for s in note.samplers[:MAX_SAMPLERS]]}


def _int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 1 << 62:
        raise ValueError(f"not an integer: {v!r:.40}")
    return v


def _text(v: Any, optional: bool) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_TEXT:
        raise ValueError("not a short string")
    return v


def _flag(v: Any) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    raise ValueError(f"not a flag: {v!r:.40}")


def _sampler(d: Any) -> SamplerBuilt:
    if not isinstance(d, dict):
        raise ValueError("an entry that is not an object")
    return SamplerBuilt(_text(d.get(_KIND), False), _text(d.get(_AT), True), _int(d.get(_RANK_GIVEN)),
                        _int(d.get(_REPLICAS_GIVEN)), _int(d.get(_RANK)), _int(d.get(_REPLICAS)),
                        _flag(d.get(_SHUFFLE)), _int(d.get(_SEED)))


def samplers_from_wire(d: Any) -> SamplersNote:
    """The note read back; ValueError when it is not one this version writes (another version, a damaged file)."""
    if not isinstance(d, dict) or d.get(_VERSION) != VERSION or not isinstance(d.get(_WHOLE), bool) or \
            not isinstance(d.get(_SAMPLERS), list) or len(d[_SAMPLERS]) > MAX_SAMPLERS:
        raise ValueError("not a samplers note")
    return SamplersNote(d[_WHOLE], tuple(_sampler(s) for s in d[_SAMPLERS]))
