"""The short msgpack keys of an op record and of a tensor reference (``i op ph mod ...``, ``T dt sh st ...``),
and the two checks every reader of a manifest entry types a field with: the one place these keys are spelled.
"""
from __future__ import annotations

from typing import Any

# -- op record keys ---------------------------------------------------------------------------------------------
_INDEX, _NAME, _PHASE, _MODULE, _FORWARD, _SOURCE = "i", "op", "ph", "mod", "fwd", "src"
_ARGS, _KWARGS, _WRITES, _OUTPUTS, _UNINIT = "a", "k", "w", "o", "u"
_COLL, _RNG, _NOT_RECORDED = "coll", "rng", "x"
_STEP = "stp"  # optimizer step the op ran in (multi-step and flight recordings)
_ISSUED = "issued"  # an entered-collective marker of a collective a device had not completed (its op is recorded)
_SOURCE_TEXT = "srt"  # the text of the source line when recorded (absent in older traces)
_LEFT_OUT = "lo"  # why the op's tensor data is not in the trace although it is recorded (statistics kept instead)
_RECOMPUTE = "rc"  # a checkpointed region's op run again in the backward: the forward op it repeats (None: none matched)
_BACKWARD_CALL = "bwc"  # where backward() was called, for an op whose own source line is another (a recompute)
_UNIT = "cu"  # a compiled unit's graph and where it came from (record/unit_capture.py); only on unit records
# -- tensor reference keys --------------------------------------------------------------------------------------
_VERSION, _DTYPE, _SHAPE, _STRIDE, _OFFSET, _DEVICE = "T", "dt", "sh", "st", "of", "dev"
_NBYTES, _CHUNK, _STATS, _REQ_GRAD, _UNSUPPORTED = "sb", "f", "s", "rg", "unsupported"
_CONJ, _NEG, _ZERO = "cj", "ng", "z"
_PATH_ARG, _PATH_KWARG = "a", "k"


def _typed(v: Any, kind: type | tuple[type, ...]) -> Any:
    """``v`` if it has the type a field expects, else None: an old or damaged manifest reads as 'unknown'."""
    return v if isinstance(v, kind) and not (kind is int and isinstance(v, bool)) else None


def _mapping(v: Any) -> dict:
    return v if isinstance(v, dict) else {}
