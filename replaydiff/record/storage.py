"""Storage identity for the recorder: which bytes were already stored, and in which version.

The version counter is not an identity (it is bumped after a dispatch mode returns, ``.data`` aliases keep their
own, inference tensors have none), so a storage is identified by its StorageImpl address, kept alive by a weak
reference so the address cannot be reused while the recording lasts, plus a generation the recorder bumps itself on
every write it sees. Each (storage, generation) gets a *storage version* id; its bytes are stored at most once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef


@dataclass
class StorageEntry:
    weak: StorageWeakRef
    nbytes: int
    version: int  # id of the current storage version
    chunk: int | None = None  # data file holding the current version's bytes; None until stored
    uninitialised: bool = False  # current version came out of an empty* op and was never written since
    crc: int | None = None  # CRC32 of the stored bytes, kept with verify_writes to notice writes torch never saw


@dataclass
class StorageTable:
    _entries: dict[int, StorageEntry] = field(default_factory=dict)
    _next_version: int = 0

    def new_version_id(self) -> int:
        v = self._next_version
        self._next_version += 1
        return v

    def entry(self, storage: torch.UntypedStorage) -> StorageEntry:
        key = storage._cdata
        e = self._entries.get(key)
        nbytes = storage.nbytes()
        if e is None:
            e = StorageEntry(StorageWeakRef(storage), nbytes, self.new_version_id())
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

    def clear(self) -> None:
        self._entries.clear()
