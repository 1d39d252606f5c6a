"""Storage identity for the recorder: which bytes were already stored, and in which version.

The version counter is not an identity (it is bumped after a dispatch mode returns, ``.data`` aliases keep their
own, inference tensors have none), so a storage is identified by its StorageImpl address, plus a generation the
recorder bumps itself on every write it sees. Each (storage, generation) gets a *storage version* id; its bytes are
stored at most once.

An address is an identity only while the storage lives: the entry goes when the storage dies. torch keeps a
storage's Python object exactly as long as its StorageImpl (PyObject preservation), so a weak reference to that object
tells when the storage dies: its callback (``list.append``, C code: no Python frame for ``torch.compile``'s frame
hook to see inside a compiled region) queues it, and every lookup first drops the entries of dead storages, so a
new storage at a dead one's address is never taken for it. A ``StorageWeakRef`` would keep the address reserved
instead, but it keeps the dead StorageImpl allocated: ~200 bytes left on the C heap inside the hole each freed tensor
leaves, so the next tensor of that size no longer fits there and the heap grows by one tensor per op
(+1.1 GB of peak RSS for a step making 300 temporaries of 4 MB).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


class _StorageRef(weakref.ref):
    """A weak reference to a storage's Python object that knows the table key of its entry."""

    __slots__ = ("key",)
    key: int


@dataclass(slots=True)
class StorageEntry:
    weak: _StorageRef  # the storage's Python object; queued in the table's ``_dead`` when the storage dies
    nbytes: int
    version: int  # id of the current storage version
    chunk: int | None = None  # data file holding the current version's bytes; None until stored
    uninitialised: bool = False  # current version came out of an empty* op and was never written since
    crc: int | None = None  # CRC32 of the stored bytes, kept with verify_writes to notice writes torch never saw
    left_out: str | None = None  # why the current version's bytes were not stored (record --budget), counted once
    # A host storage an accelerator is still writing (mode.LateCopy): its bytes are copied before an op touches it
    late: Any = None


@dataclass
class StorageTable:
    _entries: dict[int, StorageEntry] = field(default_factory=dict)
    _next_version: int = 0
    # References whose storage died, appended by their callbacks (on whichever thread freed the storage).
    # If torch ever let the Python object die before the storage, its entry would go early: the storage would
    # then be taken for a new one (a new version, stored again), which costs bytes, never correctness.
    _dead: list[_StorageRef] = field(default_factory=list)

    def new_version_id(self) -> int:
        v = self._next_version
        self._next_version += 1
        return v

    def entry(self, storage: torch.UntypedStorage) -> StorageEntry:
        if self._dead:
            self._forget_dead()
        key = storage._cdata
        e = self._entries.get(key)
        nbytes = len(storage)  # an untyped storage's len() is its nbytes(), through the type's slot
        if e is None:  # a storage first seen (every new output of an op): new_version_id() inlined
            ref = _StorageRef(storage, self._dead.append)
            ref.key = key
            version = self._next_version
            self._next_version = version + 1
            e = StorageEntry(ref, nbytes, version)
            self._entries[key] = e
        elif e.nbytes != nbytes:  # resized in place (out= ops resize their outputs): a new version
            e.nbytes = nbytes
            self.bump(e)
        return e

    def bump(self, e: StorageEntry) -> None:
        e.version = self.new_version_id()
        e.chunk = None
        e.crc = None
        e.uninitialised = False
        e.left_out = None
        if e.late is not None:  # written again: the copy of the version before is taken now
            e.late.settle()
            e.late = None

    def forget_chunks_from(self, first: int) -> None:
        """Data files numbered ``first`` and up will never exist (the disk filled): their versions are not stored."""
        for e in self._entries.values():
            if e.chunk is not None and e.chunk >= first:
                e.chunk = None

    def clear(self) -> None:
        self._entries.clear()
        self._dead.clear()

    def _forget_dead(self) -> None:
        dead, entries = self._dead, self._entries
        while dead:
            ref = dead.pop()
            e = entries.get(ref.key)
            if e is not None and e.weak is ref:
                del entries[ref.key]
