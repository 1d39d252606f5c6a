"""Provides the note of data samplers a rank's trace holds (``trace/schema/samplers.py`` spells it): one small JSON
file in the rank's directory, rewritten whole (atomically) when the recorder learns of another sampler, read by the
diff of a parallel run to name the line that gave each rank its shard. A note that cannot be read, or is not sound,
reads as unknown (None)."""
from __future__ import annotations

import json
from pathlib import Path

from replaydiff.trace.format import write_atomic
from replaydiff.trace.schema.samplers import SamplersNote, samplers_from_wire, wire_samplers

SAMPLERS = "samplers.json"
_MAX_BYTES = 64 << 10  # a note of MAX_SAMPLERS entries is a few KiB: a larger file is not one the recorder wrote


def write_samplers(rank_dir: Path, note: SamplersNote) -> None:
    write_atomic(Path(rank_dir) / SAMPLERS, json.dumps(wire_samplers(note), separators=(",", ":")).encode())


def read_samplers(rank_dir: Path) -> SamplersNote | None:
    """The rank's note, or None when it has none (recorded before the note existed, or nothing watched) or it is
    not sound."""
    try:
        with open(Path(rank_dir) / SAMPLERS, "rb") as fh:
            raw = fh.read(_MAX_BYTES + 1)
    except OSError:
        return None
    if len(raw) > _MAX_BYTES:
        return None
    try:
        return samplers_from_wire(json.loads(raw))
    except (ValueError, RecursionError):  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
