"""The index of a rank's trace: one column per field for every op, and the producer/consumer edges between ops.

A terminal UI must draw any row of a 100,000-op trace, or follow any edge, without decoding the op chunks (msgpack
and zstd: ~20 us an op). So when recording ends the writer stores, per rank, ``index.rdt``: small string tables
(names, modules, sources, output descriptions) with one integer column each, a flags column, and for every tensor an
op reads the op (and output position) that produced it. A trace without one (older versions, a job killed
mid-step) gets it rebuilt from its chunks on first use.

An input's producer is the first op whose outputs hold that very tensor (same storage version, dtype and view: a
later detach or alias of it returns the same view but computed nothing); failing that, the first op that produced
the storage version at all (a view nobody returned); else it came from outside the trace (parameters, the batch).
Versions change on every write, so an edge never points past a write.
"""
from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from replaydiff import aten
from replaydiff.errors import UsageError
from replaydiff.trace.schema import PHASES, IndexRow, OpRecord, index_row

INDEX_VERSION = 1
_NONE = -1
# At most this many op numbers in a row without a record (a writer numbers every op it sees, with a stub for one it
# does not record; gaps come from older traces only, and are short).
_MAX_GAP = 1 << 20
_F_RECORDED, _F_CHEAP, _F_COLLECTIVE, _F_UNINIT, _F_RANDOM = 1, 2, 4, 8, 16
_PHASE_IDS = {None: 0, **{p: k + 1 for k, p in enumerate(PHASES)}}
_PHASE_NAMES = [None, *PHASES]


class _Strings:
    """A string table with the id of each string (0 is reserved for None)."""

    def __init__(self, table: list | None = None) -> None:
        self.table: list[str | None] = table if table is not None else [None]
        self._ids = {s: k for k, s in enumerate(self.table)}

    def id(self, s: str | None) -> int:
        k = self._ids.get(s)
        if k is None:
            k = self._ids[s] = len(self.table)
            self.table.append(s)
        return k


class IndexBuilder:
    """Builds the index one op at a time, in op order (the writer thread as chunks are written, or a reader)."""

    def __init__(self) -> None:
        self.count = 0
        self.names, self.modules, self.sources, self.outputs = _Strings(), _Strings(), _Strings(), _Strings()
        self.name, self.phase, self.module, self.source = array("i"), array("b"), array("i"), array("i")
        self.forward, self.output, self.flags = array("i"), array("i"), array("B")
        self.recompute = array("i")
        self.in_ptr, self.in_prod, self.in_slot = array("i", [0]), array("i"), array("i")
        # per op: (output position, reading op); () until the op's first reader, which most ops of a module
        # granularity trace never get: an empty list for each would live as long as the recording, through every
        # collection of the job's garbage collector.
        self._readers: list[list[tuple[int, int]] | tuple] = []
        self._exact: dict[tuple, tuple[int, int]] = {}  # tensor geometry -> (op, output position), latest
        self._first: dict[Any, tuple[int, int]] = {}  # storage version -> (op, output position), first

    def _pad_to(self, index: int) -> None:
        if index - self.count > _MAX_GAP:  # a hand-made number: rows for it would fill memory
            raise ValueError(f"op #{index} follows op #{self.count - 1}: more than {_MAX_GAP} numbers without a "
                             f"record")
        while self.count < index:  # numbers with no record (gaps in older traces)
            self._row(OpRecord.absent(self.count).index_row())

    def pad_to(self, count: int) -> None:
        """Number ops up to ``count`` without a record (the reader, for ops of a chunk that is missing)."""
        self._pad_to(count)

    def add(self, op: OpRecord | dict) -> None:
        """Add the next op (an OpRecord, or a wire record as the writer holds it)."""
        row = op.index_row() if isinstance(op, OpRecord) else index_row(op)
        if row.index < self.count:
            raise ValueError(f"op #{row.index} added after #{self.count - 1}")
        self._pad_to(row.index)
        self._row(row)

    def _row(self, row: IndexRow) -> None:
        i = self.count
        self.count += 1
        self._readers.append(())
        name = row.name
        self.name.append(self.names.id(name))
        self.phase.append(_PHASE_IDS.get(row.phase, 0))
        self.module.append(self.modules.id(row.module))
        self.source.append(self.sources.id(row.source))
        self.forward.append(_NONE if row.forward is None else row.forward)
        self.recompute.append(_NONE if row.recompute is None else row.recompute)
        flags = 0
        if row.recorded:
            flags |= _F_RECORDED
            for version, geometry in row.inputs:
                found = self._exact.get(geometry) or self._first.get(version)
                self.in_prod.append(found[0] if found else _NONE)
                self.in_slot.append(found[1] if found else _NONE)
                if found:
                    readers = self._readers[found[0]]
                    if readers:
                        readers.append((found[1], i))
                    else:
                        self._readers[found[0]] = [(found[1], i)]
            for slot, (version, geometry) in enumerate(row.outputs):
                if version is None:
                    continue
                # The first op to hand out this very view keeps it: a detach or alias of an output returns the
                # same view, and the op that computed the values is the one to walk back to.
                self._exact.setdefault(geometry, (i, slot))
                self._first.setdefault(version, (i, slot))
            if row.collective:
                flags |= _F_COLLECTIVE
            if row.uninitialised:
                flags |= _F_UNINIT
            if row.random:
                flags |= _F_RANDOM
        if name != "?" and aten.is_cheap(name):
            flags |= _F_CHEAP
        self.in_ptr.append(len(self.in_prod))
        self.output.append(self.outputs.id(row.first_output))
        self.flags.append(flags)

    def to_frame(self) -> dict:
        # The consumer lists, stored rather than inverted at read time: O(1) per lookup from the first one on.
        cons_ptr, cons_slot, cons_op = array("i", [0]), array("i"), array("i")
        for readers in self._readers:
            last = None
            for slot, op in sorted(readers):
                if (slot, op) != last:
                    cons_slot.append(slot)
                    cons_op.append(op)
                    last = (slot, op)
            cons_ptr.append(len(cons_op))
        self.cons_ptr, self.cons_slot, self.cons_op = cons_ptr, cons_slot, cons_op
        return {
            "format": "replaydiff.index", "version": INDEX_VERSION, "count": self.count,
            "byteorder": _BYTEORDER,
            "tables": {"names": self.names.table, "modules": self.modules.table, "sources": self.sources.table,
                       "outputs": self.outputs.table},
            "columns": {k: getattr(self, k).tobytes() for k in _COLUMNS},
        }

    def build(self) -> "TraceIndex":
        return TraceIndex.from_frame(self.to_frame())


_COLUMNS = {"name": "i", "phase": "b", "module": "i", "source": "i", "forward": "i", "output": "i", "flags": "B",
            "in_ptr": "i", "in_prod": "i", "in_slot": "i", "cons_ptr": "i", "cons_slot": "i", "cons_op": "i",
            "recompute": "i"}
# Columns an index written by an earlier replaydiff may lack: read as "none" for every op.
_LATER_COLUMNS = {"recompute"}
_BYTEORDER = "little" if array("i", [1]).tobytes()[0] == 1 else "big"


class _Lookup(Sequence):
    def __init__(self, ids: array, table: list) -> None:
        self._ids, self._table = ids, table

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._table[k] for k in self._ids[i]]
        return self._table[self._ids[i]]


class _Optional(Sequence):
    def __init__(self, values: array) -> None:
        self._v = values

    def __len__(self) -> int:
        return len(self._v)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [None if v == _NONE else v for v in self._v[i]]
        v = self._v[i]
        return None if v == _NONE else v


class _Flag(Sequence):
    def __init__(self, flags: array, bit: int) -> None:
        self._f, self._bit = flags, bit

    def __len__(self) -> int:
        return len(self._f)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [bool(f & self._bit) for f in self._f[i]]
        return bool(self._f[i] & self._bit)


@dataclass
class ModuleNode:
    """A module of the model: its ops per phase as ranges of op numbers, its sub-modules, and its op count."""

    path: str
    name: str
    children: list["ModuleNode"] = field(default_factory=list)
    ops: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # phase -> [(first, last)] inclusive
    count: int = 0

    def walk(self) -> Iterator["ModuleNode"]:
        yield self
        for c in self.children:
            yield from c.walk()

    def find(self, path: str) -> "ModuleNode | None":
        return next((n for n in self.walk() if n.path == path), None)

    def contains(self, index: int) -> bool:
        return any(a <= index <= b for ranges in self.ops.values() for a, b in ranges)


class TraceIndex:
    """Columns for every op of a rank (``len(index)`` ops, numbered from 0) and the edges between them.

    ``name[i]``, ``phase[i]``, ``module[i]``, ``source[i]``, ``forward[i]`` (int or None), ``recompute[i]`` (the
    forward op a checkpointed op run again in the backward repeats, or None), ``output[i]`` (first
    output, e.g. ``float32[8, 32, 64]``, or None), ``cheap[i]`` (view, alias, detach, marker), ``recorded[i]``,
    ``collective[i]``, ``random[i]``; ``status`` has one free slot per op for a replay's verdicts. Safe to read from
    several threads."""

    def __init__(self, count: int, tables: dict, cols: dict[str, array]) -> None:
        self.count = count
        self._cols = cols
        self.name = _Lookup(cols["name"], tables["names"])
        self.module = _Lookup(cols["module"], tables["modules"])
        self.source = _Lookup(cols["source"], tables["sources"])
        self.output = _Lookup(cols["output"], tables["outputs"])
        self.phase = _Lookup(cols["phase"], _PHASE_NAMES)
        self.forward = _Optional(cols["forward"])
        self.recompute = _Optional(cols["recompute"])
        self.recorded = _Flag(cols["flags"], _F_RECORDED)
        self.cheap = _Flag(cols["flags"], _F_CHEAP)
        self.collective = _Flag(cols["flags"], _F_COLLECTIVE)
        self.uninitialised = _Flag(cols["flags"], _F_UNINIT)
        self.random = _Flag(cols["flags"], _F_RANDOM)
        self.status: list[Any] = [None] * count
        self._modules: ModuleNode | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_frame(cls, frame: Any) -> "TraceIndex":
        """Raises ValueError when the frame is not a sound index: every table a list of strings, every column of
        its length, every id within its table, every edge within the ops."""
        if not isinstance(frame, dict) or frame.get("format") != "replaydiff.index":
            raise ValueError("not an index")
        if frame.get("version") != INDEX_VERSION:
            raise ValueError(f"index version {frame.get('version')} (this replaydiff reads {INDEX_VERSION})")
        count, tables, columns = frame.get("count"), frame.get("tables"), frame.get("columns")
        if type(count) is not int or count < 0 or not isinstance(tables, dict) or not isinstance(columns, dict):
            raise ValueError("not an index")
        for t in ("names", "modules", "sources", "outputs"):
            table = tables.get(t)
            if not isinstance(table, list) or not table or table[0] is not None or \
                    not all(type(x) is str for x in table[1:]):
                raise ValueError(f"table {t} is not a list of strings")
        cols: dict[str, array] = {}
        for k, code in _COLUMNS.items():
            raw = columns.get(k)
            if raw is None and k in _LATER_COLUMNS:
                cols[k] = array(code, [_NONE]) * count
                continue
            if not isinstance(raw, bytes):
                raise ValueError(f"column {k} is not bytes")
            a = array(code)
            a.frombytes(raw)
            if frame.get("byteorder") != _BYTEORDER:
                a.byteswap()
            cols[k] = a
        for k in ("name", "phase", "module", "source", "forward", "output", "flags", "recompute"):
            if len(cols[k]) != count:
                raise ValueError(f"column {k} has {len(cols[k])} rows for {count} ops")
        if len(cols["in_ptr"]) != count + 1 or cols["in_ptr"][-1] != len(cols["in_prod"]) \
                or len(cols["in_slot"]) != len(cols["in_prod"]) or len(cols["cons_ptr"]) != count + 1 \
                or cols["cons_ptr"][-1] != len(cols["cons_op"]) or len(cols["cons_slot"]) != len(cols["cons_op"]):
            raise ValueError("edge columns do not fit")
        bounds = {"name": len(tables["names"]), "module": len(tables["modules"]), "source": len(tables["sources"]),
                  "output": len(tables["outputs"]), "phase": len(_PHASE_NAMES), "forward": count, "recompute": count,
                  "in_prod": count, "cons_op": count, "in_ptr": len(cols["in_prod"]) + 1,
                  "cons_ptr": len(cols["cons_op"]) + 1, "in_slot": 1 << 30, "cons_slot": 1 << 30}
        optional = {"forward", "recompute", "in_prod", "in_slot"}  # -1: none
        for k, bound in bounds.items():
            c = cols[k]
            if c and not ((_NONE if k in optional else 0) <= min(c) and max(c) < bound):
                raise ValueError(f"column {k} points outside its range")
        for k in ("in_ptr", "cons_ptr"):  # offsets into the edge columns: from 0, never decreasing
            c = cols[k]
            if c[0] != 0 or any(a > b for a, b in zip(c, c[1:])):
                raise ValueError(f"column {k} is not a run of offsets")
        return cls(count, tables, cols)

    def __len__(self) -> int:
        return self.count

    def _check(self, i: int) -> int:
        if not -self.count <= i < self.count:
            raise IndexError(f"op #{i} is not in the trace (0..{self.count - 1})")
        return i % self.count

    def producers(self, i: int) -> dict[int, int | None]:
        """{input position: number of the op that produced that input, or None (from outside the trace)}."""
        i = self._check(i)
        c = self._cols
        a, b = c["in_ptr"][i], c["in_ptr"][i + 1]
        return {k: (None if p == _NONE else p) for k, p in enumerate(c["in_prod"][a:b])}

    def consumers(self, i: int) -> dict[int, list[int]]:
        """{output position: numbers of the later ops that read that output}."""
        i = self._check(i)
        c = self._cols
        a, b = c["cons_ptr"][i], c["cons_ptr"][i + 1]
        out: dict[int, list[int]] = {}
        for slot, op in zip(c["cons_slot"][a:b], c["cons_op"][a:b]):
            out.setdefault(slot, []).append(op)
        return out

    def modules(self) -> ModuleNode:
        """The module tree, each node with its ops per phase (a module's ranges include its sub-modules' ops)."""
        if self._modules is None:
            with self._lock:
                if self._modules is None:
                    self._modules = self._module_tree()
        return self._modules

    def _module_tree(self) -> ModuleNode:
        root = ModuleNode("", "(all)")
        nodes: dict[str, ModuleNode] = {"": root}

        def node(path: str) -> ModuleNode:
            n = nodes.get(path)
            if n is None:
                parent_path = path.rsplit(".", 1)[0] if "." in path else ""
                n = nodes[path] = ModuleNode(path, path.rsplit(".", 1)[-1])
                node(parent_path).children.append(n)
            return n

        mod, ph = self._cols["module"], self._cols["phase"]
        table = self.module._table
        i, n = 0, self.count
        while i < n:  # runs of consecutive ops in one module and phase
            j = i
            while j + 1 < n and mod[j + 1] == mod[i] and ph[j + 1] == ph[i]:
                j += 1
            path = table[mod[i]]
            phase = _PHASE_NAMES[ph[i]] or "other"
            chain = [root]
            if path:
                parts = path.split(".")
                chain += [node(".".join(parts[:k])) for k in range(1, len(parts) + 1)]
            for nd in chain:
                ranges = nd.ops.setdefault(phase, [])
                if ranges and ranges[-1][1] == i - 1:
                    ranges[-1] = (ranges[-1][0], j)
                else:
                    ranges.append((i, j))
                nd.count += j - i + 1
            i = j + 1
        return root


def check_op_range(first: int | None, last: int | None, count: int) -> None:
    """UsageError unless ``--from first --to last`` selects at least one of op numbers 0..count-1 (``last`` may
    run past the end: it only bounds)."""
    if (first is not None and first < 0) or (last is not None and last < 0):
        raise UsageError("op numbers count from 0: --from and --to take 0 or more")
    if first is not None and last is not None and first > last:
        raise UsageError(f"--from {first} is after --to {last}: no op is in that range")
    if first is not None and first >= count:
        raise UsageError(f"--from {first} is past the last op (#{count - 1})" if count else
                         f"--from {first}: the trace holds no op")
