"""What a trace stores of each tensor (``record --tensors``): the one place a storage mode is defined.

A mode's value is its spelling on disk (the manifest's options) and on the command line. What each mode keeps, and
the words that say so, are here too: a new mode is added here (and where it is rendered), not compared as a string
across the record, replay, diff and CLI code.
"""
from __future__ import annotations

from enum import Enum
from typing import Any


class TensorMode(str, Enum):
    FULL = "full"  # the tensors' data: replay can run every op again
    STATS = "stats"  # per-tensor statistics (numel, mean, absmax, l2, var, NaN/Inf counts)
    META = "meta"  # shapes and dtypes only

    def __str__(self) -> str:
        return self.value

    __format__ = lambda self, spec: format(self.value, spec)  # noqa: E731  (f"{mode}" -> "full" on every Python)

    @property
    def stores_data(self) -> bool:
        """The trace holds tensor data (what replay runs ops on)."""
        return self is TensorMode.FULL

    @property
    def stores_statistics(self) -> bool:
        """Every recorded tensor has its statistics (a trend's series; a diff by statistics)."""
        return self is not TensorMode.META

    @property
    def holds(self) -> str:
        """What a trace of this mode holds of a tensor, in a user's words."""
        return {TensorMode.FULL: "tensor data", TensorMode.STATS: "per-tensor statistics",
                TensorMode.META: "shapes and dtypes"}[self]

    @classmethod
    def read(cls, value: Any) -> "TensorMode | None":
        """The mode a manifest names; None when it names none (a trace from before the option: full) or one this
        version does not know."""
        try:
            return cls(value)
        except ValueError:
            return None


TENSOR_MODES = tuple(m.value for m in TensorMode)  # the CLI's choices
