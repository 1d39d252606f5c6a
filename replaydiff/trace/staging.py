"""Host memory for the tensor copies waiting to be written: the recorder's own, and bounded in bytes.

Why not ``bytearray`` (malloc): glibc serves blocks of a few MB from its heap once a block of that size has been
freed (its mmap threshold follows the largest freed block), so a job's temporaries keep reusing the holes their
predecessors leave. A copy made on the job's thread lands in such a hole and stays there until the writer is done
with it, the job's next tensor goes to the top of the heap instead, and the heap grows by about one tensor per op
(measured by ``tests/bench/bench_memory.py``). Here copies are carved from anonymous mappings of the recorder's own,
never from malloc's heap, and mappings are reused from one chunk to the next.

The bytes held at once (mappings, in use or spare, plus reservations for pinned memory) never pass ``limit``: a copy
that would pass it first hands the writer what it may write (``make_room``), then waits until the writer has
released enough, so a slow disk slows the job instead of filling host memory. A single copy larger than ``limit``
is let through alone (nothing else held). Copies from a GPU need pinned memory (torch's pinned allocator) for an
asynchronous copy; they only reserve their bytes here (``reserve``).
"""
from __future__ import annotations

import ctypes
import mmap
import threading
from dataclasses import dataclass
from typing import Callable

BLOCK = 4 << 20  # bytes per mapping that small copies are carved from (at most a quarter of the limit)
_ALIGN = 64  # copies start on a cache line
_PAGE = mmap.PAGESIZE
# Private and anonymous; populated at once, which costs less than faulting the pages in one at a time as the copies
# fill them (every mapping here is filled: blocks are carved from the start and reused).
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class _Block:
    """One mapping, carved from its start; reusable once every slot carved from it is released."""

    __slots__ = ("size", "view", "address", "used", "live", "_mm", "_anchor")

    def __init__(self, size: int) -> None:
        self._mm = mmap.mmap(-1, size, flags=_MAP_FLAGS)
        # A ctypes view exports the buffer, so the mapping lives as long as this block or any slot's view does;
        # dropping the last reference unmaps it (no explicit close, which would fail while a view is out).
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mm)
        self.size = size
        self.used = 0
        self.live = 0


@dataclass(slots=True)
class Slot:
    """Memory handed out by ``Staging``: ``view`` (writable; None for a reservation) at ``address``."""

    view: memoryview | None
    address: int
    nbytes: int
    block: _Block | None  # None: a reservation for memory allocated elsewhere (pinned)


class Staging:
    def __init__(self, limit: int, make_room: Callable[[], None]) -> None:
        self.limit = max(int(limit), 1)
        self.block = max(_PAGE, min(BLOCK, self.limit // 4 // _PAGE * _PAGE))
        self.own = self.block // 4  # a copy this large gets a mapping of its own (most of a shared block unused)
        self._make_room = make_room
        self._cond = threading.Condition(threading.Lock())
        self._mapped = 0  # bytes of live mappings (carved, or spare)
        self._reserved = 0  # bytes reserved for pinned copies
        self._current: _Block | None = None  # the block small copies are carved from
        self._spare: list[_Block] = []
        self._unbounded = False  # set when nothing will be released any more (the writer failed): never wait
        self.peak = 0  # most bytes held at once (for tests and benchmarks)
        self.waits = 0  # copies that had to wait for the writer
        self.waiting = False  # a copy is waiting for room now: the writer is behind the job

    @property
    def held(self) -> int:
        return self._mapped + self._reserved

    def take(self, n: int) -> Slot:
        """``n`` bytes of writable memory of the recorder's own (waits while ``limit`` would be passed)."""
        if n == 0:
            return Slot(memoryview(bytearray()), 0, 0, None)
        size = self.block if n < self.own else -(-n // _PAGE) * _PAGE
        return self._wait(lambda: self._carve(n, size))

    def reserve(self, n: int) -> Slot:
        """Count a pinned buffer of ``n`` bytes against the limit, until ``release``. torch's pinned allocator rounds
        each request up to a power of two, so that is what is counted."""
        n = 1 << (n - 1).bit_length() if n > 1 else n
        return self._wait(lambda: self._reserve(n))

    def release(self, slot: Slot) -> None:
        """The writer is done with ``slot``: its memory may be handed out again."""
        with self._cond:
            block = slot.block
            if block is None:
                self._reserved -= slot.nbytes
            else:
                block.live -= 1
                if block.live == 0:
                    if block is self._current:
                        block.used = 0
                    else:
                        self._spare.append(block)
            self._cond.notify_all()

    def trim(self) -> None:
        """Unmap the spare mappings (the writer is idle: between recorded steps, at the end)."""
        with self._cond:
            while self._spare:
                self._unmap(self._spare.pop())
            if self._current is not None and self._current.live == 0:
                self._unmap(self._current)
                self._current = None

    def unbound(self) -> None:
        """Nothing will be released any more (the writer failed and drops what it is handed): never wait."""
        with self._cond:
            self._unbounded = True
            self._cond.notify_all()

    def _wait(self, attempt: Callable[[], Slot | None]) -> Slot:
        """``attempt()`` under the lock until it hands out a slot; the first time it cannot, ask for room."""
        asked = False
        while True:
            with self._cond:
                slot = attempt()
                if slot is not None:
                    self.peak = max(self.peak, self.held)
                    self.waiting = False
                    return slot
                if asked:
                    self._cond.wait(0.5)
                    continue
                self.waits += 1
                self.waiting = True
            # Outside the lock: the writer thread needs it to release what it writes.
            self._make_room()
            asked = True

    # -- with the condition's lock held -------------------------------------------------------------------------
    def _room(self, size: int) -> bool:
        """Whether ``size`` more bytes may be held, unmapping spare mappings to make it so."""
        while self._spare and self.held + size > self.limit:
            self._unmap(self._spare.pop(0))
        return self.held + size <= self.limit or self.held == 0 or self._unbounded

    def _reserve(self, n: int) -> Slot | None:
        if not self._room(n):
            return None
        self._reserved += n
        return Slot(None, 0, n, None)

    def _carve(self, n: int, size: int) -> Slot | None:
        block = self._current if n < self.own else None
        if block is None or block.size - block.used < n:
            block = self._fresh(size)
            if block is None:
                return None
            if n < self.own:  # a new block to carve small copies from; the old one goes spare once released
                old, self._current = self._current, block
                if old is not None and old.live == 0:
                    self._spare.append(old)
        start = block.used
        block.used = min(block.size, -(-(start + n) // _ALIGN) * _ALIGN)
        block.live += 1
        return Slot(block.view[start:start + n], block.address + start, n, block)

    def _fresh(self, size: int) -> _Block | None:
        """A block of at least ``size`` bytes, nothing carved from it: a spare one, or a new mapping if there is room."""
        for i, block in enumerate(self._spare):
            if size <= block.size <= 2 * size:
                del self._spare[i]
                block.used = 0
                return block
        if not self._room(size):
            return None
        block = _Block(size)
        self._mapped += size
        return block

    def _unmap(self, block: _Block) -> None:
        self._mapped -= block.size
        # The mapping goes when its last view does; the writer holds none once a slot is released.
