"""Provides TraceModel: the headless state behind the TUI (verdicts per op, visible rows, modules, heat, navigation).

Nothing here imports textual: the app draws what this model says, and tests can drive the model without a screen.
Everything per op is a plain list indexed by op number and filled from the trace's index (no chunk decoding), so a
100,000-op trace opens in a fraction of a second; op records are decoded only for the op on display.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Union

from replaydiff.diff.result import PairStatus, UnitPair
from replaydiff.diff.parallel import MappedOp
from replaydiff.replay.result import Status

PHASES = ("forward", "backward", "optimizer")
PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", None: "   "}

class Presence(str, Enum):
    """Diff mode's row status for an op of the target that no reference op aligns with: not a pair, so not one of
    PairStatus's values."""

    TARGET_ONLY = "target_only"

    def __str__(self) -> str:
        return self.value

    __format__ = lambda self, spec: format(self.value, spec)  # noqa: E731  (as Status and PairStatus do)


# A row's status is a replay's Status, or in diff mode a Status (a pair that is the same: ok; not compared: skipped;
# divergent), PairStatus.INHERITED (carried an earlier difference forward) or Presence.TARGET_ONLY.
RowStatus = Union[Status, PairStatus, Presence]
PROBLEMS = (Status.DIVERGENT, Status.NONDETERMINISTIC)
INHERITED_SEVERITY = 0.99  # an inherited difference is at most orange on the heat strip: red is for where it began
# a status given as its string (a report built by hand): the member it names; a replay's Status first
_BY_VALUE: dict[str, RowStatus] = {m.value: m for e in (Presence, PairStatus, Status) for m in e}


def row_status(status: Any) -> RowStatus | None:
    """The member a status names, whether it came as a member, its string, or nothing yet (None)."""
    if status is None or isinstance(status, (Status, PairStatus, Presence)):
        return status
    return _BY_VALUE[str(status)]


def verdict_figures(result: Any) -> tuple[float | None, str]:
    """(severity, error text) of a replay's OpResult or a diff's PairResult. The severity is the result's own (the
    verdict's measure of how far over its limit the op is, which the report and the repro read too); the text is
    the figure the op list shows: that severity (``error_text``)."""
    verdict = result.verdict
    if verdict is None:  # a report built by hand, or an op judged without figures
        m = result.metrics or {}
        return result.severity, error_text(result.severity, m.get("mismatches"), bool(m))
    return result.severity, error_text(result.severity, getattr(verdict.measure, "mismatches", None))


@dataclass(frozen=True)
class RowResult:
    """One op's verdict as every part of the TUI reads it, whether a replay or a diff gave it: the one row type.
    ``source`` is what it came from: the replay's OpResult, or the diff's PairResult (None for an op of the target
    only); ``ref_rank`` is set in diff mode only (the reference rank the row was aligned against)."""

    rank: int
    index: int
    status: RowStatus
    severity: float | None  # the verdict's own: how far over its limit the op is (see verdict_figures)
    error: str  # the figure the op list shows
    metrics: dict | None
    reason: str | None
    nonfinite_origin: bool = False
    source: Any = None
    ref_rank: int | None = None
    # why the recording left this op's tensor data out (a LEFT_OUT_* value: filtered, budget, disk full), else None
    left_out: str | None = None

    @property
    def in_diff(self) -> bool:
        """A row of diff mode (no replay behind it: nothing to replay the op against)."""
        return self.ref_rank is not None

    @property
    def pair(self) -> Any:
        """Diff mode: the PairResult (None for an op of the target only or of a compiled unit pair, and in a
        replay)."""
        return self.source if self.in_diff and not isinstance(self.source, (UnitPair, MappedOp)) else None

    @classmethod
    def of_replay(cls, r: Any) -> "RowResult":
        """The row of a replay's OpResult."""
        severity, error = verdict_figures(r)
        return cls(r.rank, r.index, row_status(r.status), severity, error, r.metrics, r.reason,  # type: ignore[arg-type]
                   # an origin of NaN/Inf the step keeps; made and discarded ones are information (details)
                   bool(r.nonfinite_origin) and getattr(r, "nonfinite_discarded_by", None) is None, r,
                   left_out=getattr(r, "data_left_out", None))

    @classmethod
    def of_pair(cls, rank: int, pair: Any, status: RowStatus, ref_rank: int) -> "RowResult":
        """Diff mode: the row of target op ``pair.target`` of target rank ``rank``, with ``status`` as its row's."""
        severity, error = verdict_figures(pair)
        if status is PairStatus.INHERITED and severity is not None:
            severity = min(severity, INHERITED_SEVERITY)
        return cls(rank, pair.target, status, severity, error, pair.metrics, pair.reason, False, pair, ref_rank)

    @property
    def unit(self) -> Any:
        """Diff mode: the UnitPair of a compiled unit and the eager ops of its region that this row belongs to (the
        unit's own row, or an eager op of its region in the target); None otherwise."""
        return self.source if self.in_diff and isinstance(self.source, UnitPair) else None

    @classmethod
    def of_unit(cls, rank: int, index: int, unit: Any, status: RowStatus, ref_rank: int, lead: bool = True
                ) -> "RowResult":
        """Diff mode: the row of target op ``index`` that a compiled unit pair covers, with ``status`` as its row's.
        The ``lead`` row carries the figures: where the unit and the eager ops part, that node's; else the unit's
        boundaries'. The region's other eager ops carry none (they were not compared one by one)."""
        verdict = None
        if lead:
            verdict = unit.part.verdict if unit.part is not None and status is Status.DIVERGENT else unit.verdict
        severity = None if verdict is None else verdict.severity
        _, error = verdict_figures(_Figures(verdict, severity))  # the text gives the pair's own figure
        if status is PairStatus.INHERITED and severity is not None:
            severity = min(severity, INHERITED_SEVERITY)
        return cls(rank, index, status, severity, error, None if verdict is None else verdict.to_json(), unit.reason,
                   False, unit, ref_rank)

    @classmethod
    def target_only(cls, rank: int, index: int, ref_rank: int) -> "RowResult":
        """Diff mode: the row of an op of the target that no reference op aligns with."""
        return cls(rank, index, Presence.TARGET_ONLY, None, "", None, None, False, None, ref_rank)


def invariance_rows(result: Any) -> "GivenRows":
    """The rows of a batch-invariance check (``replaydiff.invariance.InvarianceResult``): a batch-variant op as a
    divergent one (red), an invariant one ok, every other op skipped with what the check said of it."""
    from replaydiff.invariance import Finding

    rows = []
    for c in result.checks:
        if c.finding is Finding.VARIANT:
            w = c.worst
            why = "batch-variant" + ("" if w is None else f": {w.rows}, {w.output}: {w.mismatches} of {w.elements} "
                                     f"elements differ, up to {w.max_ulps} ulps, rel_l2 {w.rel_l2:.2g}")
            rows.append(RowResult(result.rank, c.index, Status.DIVERGENT, None,
                                  error_text(None, w.mismatches if w else None), None, why, source=c))
        elif c.finding is Finding.INVARIANT:
            rows.append(RowResult(result.rank, c.index, Status.OK, None, "exact", None, "batch-invariant", source=c))
        else:
            rows.append(RowResult(result.rank, c.index, Status.SKIPPED, None, "", None,
                                  c.finding.words + (f": {c.reason}" if c.reason else ""), source=c))
    return GivenRows(tuple(rows))


@dataclass(frozen=True)
class GivenRows:
    """Rows computed before the app opened (a batch-invariance check), applied as a given report's are."""

    ops: tuple


@dataclass(frozen=True)
class _Figures:
    """A verdict and severity in the shape ``verdict_figures`` reads (a unit pair's part has no result of its own)."""

    verdict: Any
    severity: float | None
    metrics: dict | None = None


def as_row(result: Any) -> RowResult:
    """A row as it is, a replay's OpResult as its row."""
    return result if isinstance(result, RowResult) else RowResult.of_replay(result)


def severity_text(severity: float | None, digits: int = 3) -> str:
    """A severity as the TUI writes it, in units of the op's divergence limit: ``0.31×``, ``1.05e3×`` (over 1 is
    divergent), ``✗`` for a divergence without a figure (NaN/Inf where the reference has none, a wrong shape)."""
    if severity is None:
        return ""
    if math.isinf(severity):
        return "✗"
    return f"{severity:.{digits}g}".replace("e+0", "e").replace("e+", "e") + "×"


def error_text(severity: float | None, mismatches: int | None = None, figures: bool = True) -> str:
    """The op list's error column (``err/lim``): the op's severity, its error over its limit (the figure the module
    tree, the heat strip, replay and the report give too), or the mismatch count of an exact comparison. Empty for
    an op judged without ``figures`` (a view) unless it is divergent all the same."""
    if mismatches is not None:
        return f"≠{mismatches}" if mismatches else "exact"
    if not figures and not (severity is not None and math.isinf(severity)):
        return ""
    return severity_text(severity)


def short_op(name: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``aten.add.Tensor`` -> ``add.Tensor``."""
    if name.startswith("aten."):
        name = name[5:]
    if name.endswith(".default"):
        name = name[:-8]
    return name


def shorten_left(text: str, width: int) -> str:
    """Fit a dotted path into ``width`` cells by dropping its start: ``…blocks.1.ln2``."""
    if width <= 0:
        return ""
    if len(text) <= width:
        return text
    if width == 1:
        return "…"
    tail = text[-(width - 1):]
    dot = tail.find(".")
    if 0 <= dot < len(tail) - 1 and len(tail) - dot - 1 >= width // 2:
        tail = tail[dot:]  # start at a component boundary when that keeps most of the room
    return "…" + tail


@dataclass
class ModuleGroup:
    """One node of the module tree: a module path within one phase (path "" is the phase itself)."""
    phase: str
    path: str
    name: str
    children: list["ModuleGroup"] = field(default_factory=list)
    count: int = 0  # ops in this module and below
    worst: float | None = None  # worst severity of its ops (None: nothing replayed yet)
    worst_op: int | None = None


class Columns:
    """The index columns the TUI reads per row, copied once into plain lists (a list item is several times
    cheaper to read than the index's packed columns, and drawing or filtering 100,000 rows reads them all)."""

    FIELDS = ("name", "phase", "module", "source", "forward", "output", "cheap")

    def __init__(self, index: Any) -> None:
        n = len(index)
        for f in self.FIELDS:
            setattr(self, f, list(getattr(index, f)[0:n]))
        self.n = n

    def __len__(self) -> int:
        return self.n


class TraceModel:
    """One rank of a trace as the TUI sees it: rows, verdicts, filters and the op graph's shortcuts."""

    def __init__(self, rank_trace: Any) -> None:
        self.trace = rank_trace
        self.index = Columns(rank_trace.index)
        self.n = len(self.index)
        self._haystack: list[str] | None = None  # "name module" in lower case, for the filter
        self._not_cheap: list[int] | None = None
        self.results: list[RowResult | None] = [None] * self.n
        self.status: list[RowStatus | None] = [None] * self.n
        self.severity: list[float | None] = [None] * self.n
        self.error: list[str] = [""] * self.n  # the normalised error as the list shows it
        self._counts: dict[RowStatus, int] = {}
        self.divergent: list[int] = []  # sorted op numbers with a problem verdict
        self.nonfinite: list[int] = []
        self.hide_cheap = False
        self.filter_text = ""
        self.scope: tuple[str, str] | None = None  # (phase, module path) chosen in the tree
        self._backward_of: dict[int, list[int]] | None = None
        self.visible: list[int] = list(range(self.n))
        self._groups: dict[tuple[str, str], ModuleGroup] | None = None

    # -- verdicts ---------------------------------------------------------------------------------------------
    def clear_results(self) -> None:
        self.results = [None] * self.n
        self.status = [None] * self.n
        self.severity = [None] * self.n
        self.error = [""] * self.n
        self.divergent, self.nonfinite = [], []
        self._counts = {}

    def add_results(self, results: Iterable[Any]) -> int:
        """Take RowResults or a replay's OpResults (of this rank; others are ignored); returns how many were taken."""
        rank = getattr(self.trace, "rank", None)
        taken = 0
        for r in map(as_row, results):
            if rank is not None and r.rank != rank:
                continue
            i = r.index
            if not 0 <= i < self.n:
                continue
            s = r.status
            old = self.status[i]
            if old is not None:
                self._counts[old] -= 1
            self._counts[s] = self._counts.get(s, 0) + 1
            self.results[i] = r
            self.status[i] = s
            self.severity[i], self.error[i] = r.severity, r.error
            if s in PROBLEMS:
                k = bisect.bisect_left(self.divergent, i)
                if k == len(self.divergent) or self.divergent[k] != i:
                    self.divergent.insert(k, i)
            if r.nonfinite_origin:
                bisect.insort(self.nonfinite, i)
            taken += 1
        return taken

    def counts(self) -> dict[str, int]:
        """Ops per status, by the status's string (every replay status is there, 0 when none)."""
        c = {s.value: 0 for s in Status}
        c.update((s.value, n) for s, n in self._counts.items())
        return c

    # -- rows -------------------------------------------------------------------------------------------------
    def set_view(self, *, hide_cheap: bool | None = None, filter_text: str | None = None,
                 scope: tuple[str, str] | None | bool = False) -> None:
        """Change what is listed (``scope=None`` clears the module scope; leaving it out keeps it)."""
        before = (self.hide_cheap, self.filter_text.strip().lower(), self.scope)
        if hide_cheap is not None:
            self.hide_cheap = hide_cheap
        if filter_text is not None:
            self.filter_text = filter_text
        if scope is not False:
            self.scope = scope  # type: ignore[assignment]
        f = self.filter_text.strip().lower()
        if (self.hide_cheap, self.scope) == before[::2] and before[1] and f.startswith(before[1]):
            # typing on in the filter box: only rows shown now can still match
            self.visible = self._compute_visible(self.visible, filter_only=True)
        else:
            self.visible = self._compute_visible()

    def _compute_visible(self, start: list[int] | None = None, filter_only: bool = False) -> list[int]:
        ix = self.index
        if not (self.hide_cheap or self.scope or self.filter_text.strip()):
            return list(range(self.n))
        rows: Iterable[int] = range(self.n) if start is None else start
        if filter_only:
            f = self.filter_text.strip().lower()
            hay = self._haystack
            assert hay is not None
            return [i for i in rows if f in hay[i]]
        if self.hide_cheap:
            if start is None:
                if self._not_cheap is None:
                    cheap = ix.cheap
                    self._not_cheap = [i for i in range(self.n) if not cheap[i]]
                rows = self._not_cheap
            else:
                cheap = ix.cheap
                rows = [i for i in rows if not cheap[i]]
        if self.scope is not None:
            phase, path = self.scope
            phases = ix.phase
            mods = ix.module
            pre = path + "."
            if path:
                rows = [i for i in rows if phases[i] == phase and mods[i] is not None
                        and (mods[i] == path or mods[i].startswith(pre))]
            else:
                rows = [i for i in rows if phases[i] == phase]
        f = self.filter_text.strip().lower()
        if f:
            if self._haystack is None:
                self._haystack = [f"{name}\0{mod or ''}".lower() for name, mod in zip(ix.name, ix.module)]
            hay = self._haystack
            rows = [i for i in rows if f in hay[i]]
        return list(rows)  # a copy: the cached list of non-cheap rows must not be shared

    def row_of(self, op: int) -> int | None:
        """The row showing op number ``op``, or None when it is hidden."""
        k = bisect.bisect_left(self.visible, op)
        if k < len(self.visible) and self.visible[k] == op:
            return k
        return None

    def nearest_row(self, op: int) -> int:
        """The row of ``op`` or, when it is hidden, of the next shown op (the last row past the end)."""
        k = bisect.bisect_left(self.visible, op)
        return min(k, max(0, len(self.visible) - 1))

    # -- navigation -------------------------------------------------------------------------------------------
    def first_divergent(self) -> int | None:
        return self.divergent[0] if self.divergent else None

    def next_divergent(self, op: int) -> int | None:
        k = bisect.bisect_right(self.divergent, op)
        return self.divergent[k] if k < len(self.divergent) else None

    def previous_divergent(self, op: int) -> int | None:
        k = bisect.bisect_left(self.divergent, op)
        return self.divergent[k - 1] if k > 0 else None

    def first_nonfinite(self) -> int | None:
        return self.nonfinite[0] if self.nonfinite else None

    def backward_ops(self, forward_op: int) -> list[int]:
        """The backward ops that belong to forward op ``forward_op`` (built once from the index)."""
        if self._backward_of is None:
            out: dict[int, list[int]] = {}
            for i, f in enumerate(self.index.forward):
                if f is not None:
                    out.setdefault(f, []).append(i)
            self._backward_of = out
        return self._backward_of.get(forward_op, [])

    def partner(self, op: int) -> int | None:
        """For a backward op its forward op; for a forward op its first backward op."""
        f = self.index.forward[op]
        if f is not None:
            return f
        back = self.backward_ops(op)
        return back[0] if back else None

    # -- heat strip -------------------------------------------------------------------------------------------
    def heat(self, cells: int) -> list[tuple[int, int, float | None, int | None]]:
        """The op sequence cut into ``cells`` equal spans: (first op, last op, worst severity, worst op)."""
        n = self.n
        out = []
        if n == 0 or cells <= 0:
            return out
        sev = self.severity
        for c in range(cells):  # with fewer ops than cells, an op spans several cells
            lo = c * n // cells
            hi = max(lo, (c + 1) * n // cells - 1)
            worst, at = None, None
            for i in range(lo, hi + 1):
                s = sev[i]
                if s is not None and (worst is None or s > worst):
                    worst, at = s, i
            out.append((lo, hi, worst, at))
        return out

    # -- module tree ------------------------------------------------------------------------------------------
    def module_groups(self) -> list[ModuleGroup]:
        """Phase nodes (forward, backward, optimizer, then any other), each holding its module tree with op
        counts and worst severities. The structure is built once; ``refresh_worst`` updates the severities."""
        if self._groups is None:
            self._build_groups()
        self.refresh_worst()
        roots = [g for (ph, path), g in self._groups.items() if path == ""]  # type: ignore[union-attr]
        order = {p: k for k, p in enumerate(PHASES)}
        return sorted(roots, key=lambda g: (order.get(g.phase, len(order)), g.phase))

    def _build_groups(self) -> None:
        groups: dict[tuple[str, str], ModuleGroup] = {}
        self._op_group: list[ModuleGroup] = []
        ix = self.index
        cache: dict[tuple[str, str], ModuleGroup] = {}
        for i in range(self.n):
            phase = ix.phase[i] or "other"
            mod = ix.module[i] or ""
            key = (phase, mod)
            g = cache.get(key)
            if g is None:
                g = self._group(groups, phase, mod)
                cache[key] = g
            g.count += 1
            self._op_group.append(g)
        # counts roll up to the parents
        for g in sorted(groups.values(), key=lambda g: -g.path.count(".") - (1 if g.path else 0)):
            for c in g.children:
                g.count += c.count
        self._groups = groups

    def _group(self, groups: dict, phase: str, path: str) -> ModuleGroup:
        key = (phase, path)
        g = groups.get(key)
        if g is not None:
            return g
        g = ModuleGroup(phase, path, path.rsplit(".", 1)[-1] if path else phase)
        groups[key] = g
        parent = self._group(groups, phase, path.rsplit(".", 1)[0] if "." in path else "") if path else None
        if parent is not None:
            parent.children.append(g)
        return g

    def refresh_worst(self) -> None:
        if self._groups is None:
            self._build_groups()
        groups = self._groups
        assert groups is not None
        for g in groups.values():
            g.worst, g.worst_op = None, None
        sev = self.severity
        own: dict[int, tuple[float, int]] = {}
        for i, s in enumerate(sev):
            if s is None:
                continue
            g = self._op_group[i]
            cur = own.get(id(g))
            if cur is None or s > cur[0]:
                own[id(g)] = (s, i)
                if g.worst is None or s > g.worst:
                    g.worst, g.worst_op = s, i
        for g in sorted(groups.values(), key=lambda g: -g.path.count(".") - (1 if g.path else 0)):
            for c in g.children:
                if c.worst is not None and (g.worst is None or c.worst > g.worst
                                            or (c.worst == g.worst and (c.worst_op or 0) < (g.worst_op or 0))):
                    g.worst, g.worst_op = c.worst, c.worst_op
