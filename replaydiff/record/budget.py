"""The byte budget of a recording (``record --budget SIZE``, per rank): which storages get their bytes stored.

One pass, no look-ahead, and statistics for every op always:

* The trace on disk is tensor data plus everything else (op records with their statistics, data file headers, the
  manifest, the index). Tensor data may use the budget less room for the rest: a reserve of a tenth of the budget
  (at least 256 KiB), and never less than the records written so far plus half that reserve, so a long recording's
  growing records squeeze the data out before they could pass the budget.
* A storage version is charged when first stored, at its raw size plus ``BLOB_OVERHEAD`` (zstd only makes it
  smaller, so the trace stays under the budget compressed or not). One that does not fit is not stored: its
  tensors get statistics, and every op that reads or writes it is marked ``data_left_out == "budget"``. A smaller
  storage later may still fit: data stops in step order, not at one op.
* Selected first: with ``--module``/``--op`` and a budget, the filter says what comes first instead of what is
  stored at all. Ops outside the filter may fill only the first half of the data allowance; ops inside it may use
  all of it. So the selected ops always have at least half of it, wherever they fall in the step. Without a filter
  every op is selected: data in step order until the budget.
"""
from __future__ import annotations

import re

BLOB_OVERHEAD = 128  # bytes one stored storage adds to its data file's header (key, dtype, shape, offsets, codec)
MIN_RESERVE = 256 << 10
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes of ``500M``, ``2G``, ``1.5GiB``, ``64K`` or ``1000000`` (K, M, G, T: powers of 1024); ValueError
    otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.fullmatch(str(text))
        if m is None:
            raise ValueError(f"a size is a number with an optional K, M, G or T (e.g. 500M, 2G), not {text!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"a size must be positive, not {text!r}")
    return n


def format_size(n: float) -> str:
    """``1.5G``, ``200M``, ``12K``: the form parse_size reads, at most 3 significant digits."""
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.3g}{unit}"
    return f"{int(n)}B"


def format_bytes(n: float) -> str:
    """``812 B``, ``1.5 KiB``, ``20.3 MiB``, ``2.0 GiB``: a size for people to read (one decimal, powers of 1024)."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def records_reserve(budget: int) -> int:
    """Bytes of the budget kept for what is not tensor data."""
    return max(MIN_RESERVE, budget // 10)


def budget_that_fits(nbytes: int) -> int:
    """The smallest ``--budget`` (rounded up to a size format_size writes exactly) whose room for tensor data and
    records, the budget less its reserve, holds ``nbytes``."""
    need = max(nbytes + MIN_RESERVE, -(-nbytes * 10 // 9))
    unit = next((_UNITS[u] for u in ("T", "G", "M", "K") if need >= 10 * _UNITS[u]), _UNITS["K"])
    return -(-need // unit) * unit


class DataBudget:
    """The data allowance of one rank's recording; ``admit`` charges a storage that fits."""

    def __init__(self, budget: int, prioritised: bool) -> None:
        self.budget = budget
        self.reserve = records_reserve(budget)
        self.prioritised = prioritised  # a filter names the ops that come first
        self.used = 0  # tensor data charged so far, with its header entries

    def admit(self, nbytes: int, selected: bool, records_bytes: int) -> bool:
        limit = self.budget - max(self.reserve, records_bytes + self.reserve // 2)
        if self.prioritised and not selected:
            limit //= 2
        cost = nbytes + BLOB_OVERHEAD
        if self.used + cost > limit:
            return False
        self.used += cost
        return True
