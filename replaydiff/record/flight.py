"""The flight recorder's memory: the op records of the last K steps, written out only when something goes wrong.

It stands in for the trace writer (same calls as ``RankWriter``), so the recorder does not know the difference. A
step's records are msgpack-encoded when the step ends, so the memory held is measured, not guessed: the ring keeps
at most ``flight`` steps and at most ``flight_mib`` MiB of encoded records (oldest steps go first; the step being
recorded always stays). Nothing touches the disk until ``dump()``: on the first NaN/Inf in the loss (the value
``backward()`` starts from: what the gradient seed reads), in an output of a top-level module call
(``output_watch.py``), in a value the script reads with ``.item()``, in a gradient, or in a parameter or optimizer
state after the update, once that step ends (or when the recording ends, for a step that never does); on
SIGTERM/SIGUSR1 or an exception (``multi_step.py`` installs those triggers); at exit only with ``flight_at_exit``
(the last K whole steps; ops after the last step are left out). One dump per recording.

With ``tensors="full"`` and a ``modules``/``ops`` filter (the suspect), the ops the filter matches keep their tensors'
bytes and the others statistics (kept with the reason "filtered", as every filtered op is), so one run of the job catches the step where the suspect goes
wrong, ready to replay. The copies are held in memory of the flight recorder's own (anonymous mappings, outside the
job's heap) and count against the same ``flight_mib`` as the records: older steps go first; a copy that does not
fit beside what the step in progress already holds is left out (the manifest's lost list says how many), and its
ops read as not stored. Every step is
self-contained (the recorder forgets its storages between steps), so dropping a whole step loses nothing later
steps need.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

from replaydiff import device as seam
from replaydiff.errors import warn_job
from replaydiff.trace import schema
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.writer import RankWriter, Snapshot

log = logging.getLogger("replaydiff")


class _Copy:
    """Memory for one tensor copy (what ``trace.staging.Slot`` is to the writer): an anonymous mapping of its own,
    or, for a copy left out to keep within the budget, a scratch mapping dropped right after the copy."""

    __slots__ = ("view", "address", "nbytes", "dropped", "_mm", "_anchor")

    def __init__(self, nbytes: int, dropped: bool, pinned: bool = False) -> None:
        self.nbytes = nbytes
        self.dropped = dropped
        self._mm = self._anchor = None
        self.view: memoryview | None = None if pinned else memoryview(bytearray())
        self.address = 0
        if nbytes and not pinned:  # pinned: a reservation (a GPU copy goes to torch's pinned memory)
            self._mm = mmap.mmap(-1, nbytes)
            self._anchor = ctypes.c_char.from_buffer(self._mm)
            self.address = ctypes.addressof(self._anchor)
            self.view = memoryview(self._mm)


@dataclass
class _Step:
    step: int | None
    ops: int
    blob: bytes  # the step's op records, msgpack
    snapshots: list = field(default_factory=list)  # Snapshot of each copy kept
    data: int = 0  # bytes of those copies
    left_out: int = 0  # copies left out (over the budget)

    @property
    def held(self) -> int:
        return len(self.blob) + self.data


_GRADIENT_SEED = "aten.ones_like.default"
_READ_BACK = "aten._local_scalar_dense.default"  # .item(), float(t), print(t): a value the script reads


def _loss_nonfinite(last: dict) -> bool:
    """Whether the value a backward pass starts from is NaN/Inf, given the last forward op before it: the seed
    ``backward()`` makes (ones like the loss; the loss is what it reads), or the loss itself when the caller passed
    the gradient."""
    if OpRecord(last).name == _GRADIENT_SEED:
        return schema.wire_nonfinite_inputs(last)
    return schema.wire_nonfinite(last)


def _nonfinite(record: dict, name: str, phase: str | None, loss: dict | None, step: int | None) -> str | None:
    """Why a record triggers a dump, None when it does not: for the first backward op, ``loss`` (the last forward op
    before it: what the backward pass starts from) is NaN/Inf; a backward op's gradient is; an optimizer op's
    parameter or state is, after the update."""
    if phase == "backward":
        if loss is not None and _loss_nonfinite(loss):
            return f"the loss (what backward() starts from, op #{schema.wire_index(loss)}) is NaN/Inf at step {step}"
        if schema.wire_nonfinite(record):
            return f"a gradient (op #{schema.wire_index(record)} {name}) is NaN/Inf at step {step}"
    elif phase == "optimizer" and schema.wire_nonfinite(record):
        return f"a parameter or optimizer state (op #{schema.wire_index(record)} {name}) is NaN/Inf after step {step}"
    elif phase == "forward" and name == _READ_BACK and schema.wire_nonfinite_inputs(record):
        source = OpRecord(record).source
        return f"a value the script read (op #{schema.wire_index(record)} .item(){' at ' + source if source else ''})" \
               f" is NaN/Inf at step {step}"
    return None


def _nonfinite_kind(nan: int, inf: int) -> str:
    return "NaN and Inf" if nan and inf else "NaN" if nan else "Inf"


class FlightBuffer:
    data_refused: str | None = None  # RankWriter's: the flight recorder never stores tensor data
    def __init__(self, root: Path, manifest: dict, options: Any, closing_facts: Callable[[], dict]) -> None:
        self.root = root
        self.options = options
        self._manifest = manifest
        self._closing_facts = closing_facts
        self.budget = int(options.flight_mib * (1 << 20))
        self.keep = int(options.flight)
        self._ring: deque[_Step] = deque()
        self._held = 0  # bytes of the finished steps in the ring (records and copies)
        self._step: int | None = None
        self._current: list[dict] = []
        self._snapshots: list[Snapshot] = []  # copies of the step in progress
        self._data = 0  # their bytes
        self._left_out = 0  # copies of the step in progress left out
        self._last_forward: dict | None = None
        self._seen_backward = False
        # Outputs of the step's root module calls not judged yet: (where in the output, its (NaN, Inf) counts or
        # None while not measured, the call, where it was called, step); see output_watch.py
        self._watched: list[tuple[str, Callable[[], tuple[int, int] | None], str, str | None, int | None]] = []
        self.dropped_for_budget = 0
        self.lost: list[str] = []
        self.failed = False
        self.trigger: str | None = None  # why a dump is due
        self.dumped_to: Path | None = None
        # RankWriter's accounts that the recorder's data budget reads: ops kept with statistics only (the filter's
        # others), and bytes of records (no --budget with the flight recorder, so never compared with one).
        self.left_out = schema.LeftOutTally()
        self.records_bytes = 0
        self._fills: list[Callable[[float], bool]] = []  # deferred statistics of the step in progress

    # -- what the recorder calls (RankWriter's interface) ------------------------------------------------------
    def add_op(self, record: dict) -> None:
        if self.dumped_to is not None:
            return
        view = OpRecord(record)
        phase = view.phase
        if phase == "backward":
            first = not self._seen_backward
            self._seen_backward = True
            if self.trigger is None:
                self.trigger = _nonfinite(record, view.name, phase, self._last_forward if first else None, self._step)
        elif phase == "optimizer":
            if self.trigger is None:
                self.trigger = _nonfinite(record, view.name, phase, None, self._step)
        elif phase == "forward":
            if self._seen_backward and self.trigger is not None and view.module is not None:
                # A module runs forward again without an optimizer step in between (a grad scaler skipped it): the
                # NaN step is over, write it out now. (Ops outside modules, e.g. the optimizer's profiler op, run
                # in the "forward" phase too.)
                self.dump(self.trigger)
                return
            self._last_forward = record
            if self.trigger is None and view.name == _READ_BACK:
                self.trigger = _nonfinite(record, view.name, phase, None, self._step)
        self._current.append(record)

    def watch_output(self, counts: list[tuple[str, Callable[[], tuple[int, int] | None]]], call: str,
                     called_at: str | None, step: int | None) -> None:
        """A root module call (``call``: "GPT2LMHeadModel.forward", called at ``called_at``) returned these
        floating values: where each is in the output, and how to read its NaN and Inf counts (None while they are
        not measured yet). Judged now where measured; the rest when the step ends, after its deferred statistics."""
        if self.trigger is not None or self.dumped_to is not None:
            return
        self._watched.extend((where, count, call, called_at, step) for where, count in counts)
        self._judge_outputs(final=False)

    def _judge_outputs(self, final: bool) -> None:
        """Set the trigger from the first watched output that holds NaN/Inf; ``final``: the step's statistics are
        all in (what is still unmeasured never will be)."""
        waiting = []
        for item in self._watched:
            where, count, call, called_at, step = item
            try:
                got = count() if self.trigger is None else None
            except Exception as exc:  # a count that cannot be read judges nothing
                log.debug("an output's NaN/Inf count could not be read: %s", exc)
                got = None
            if got is None:
                if not final and self.trigger is None:
                    waiting.append(item)
                continue
            nan, inf = got
            if nan or inf:
                at = f" at {called_at}" if called_at else ""
                when = f" at step {step}" if step is not None else ""
                self.trigger = f"{where} of {call}{at} holds {_nonfinite_kind(nan, inf)}{when}"
                waiting = []
        self._watched = waiting

    # -- copies (full tensors of the filter's ops): the recorder's OpBuilder calls staging.take/reserve, then
    # add_snapshot; this buffer is its own staging memory.
    @property
    def staging(self) -> "FlightBuffer":
        return self

    def take(self, n: int) -> _Copy:
        return _Copy(n, dropped=not self._room(n))

    def reserve(self, n: int) -> _Copy:
        return _Copy(n, dropped=not self._room(n), pinned=True)

    def release(self, slot: Any) -> None:
        """A copy the recorder gave up on (its op failed): counted no more."""
        if isinstance(slot, _Copy) and not slot.dropped:
            self._data -= slot.nbytes
            slot.dropped = True

    def _room(self, n: int) -> bool:
        """Count ``n`` more bytes of the step in progress, dropping the oldest finished steps to fit; False when
        they cannot fit even so (the copy is then left out)."""
        while self._ring and self._held + self._data + n > self.budget:
            self._drop_oldest(for_budget=True)
        if self._held + self._data + n > self.budget:
            return False
        self._data += n
        return True

    def add_snapshot(self, snap: Snapshot) -> int:
        """Keep a copy with the step in progress. The number returned stands for a data file until ``dump`` writes
        them (then every record is pointed at the file that holds its bytes: schema.wire_rechunk)."""
        slot = snap.slot
        if isinstance(slot, _Copy) and slot.dropped:
            self._left_out += 1
            return -1
        self._snapshots.append(snap)
        return 0

    def note_lost(self, what: str) -> None:
        if len(self.lost) < 100:
            self.lost.append(what)

    def enter_collective(self, stub: dict) -> None:
        """Nothing is on disk until a dump: no marker of a collective entered either."""

    def leave_collective(self, event: Any = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def sync(self, timeout: float) -> bool:
        """SIGTERM (through the recorder): write what the ring holds now."""
        self.dump(self.lost[-1] if self.lost else "the process is being terminated")
        return True

    def write_manifest_now(self) -> None:
        pass

    def close(self, extra: dict) -> None:
        if self.dumped_to is None and self._watched:
            self._run_fills()
            self._judge_outputs(final=True)
        if self.dumped_to is None and self.trigger is not None:  # the step it came in never ended (no optimizer)
            self.dump(self.trigger)
        if self.dumped_to is None and self.options.flight_at_exit:
            if not self._seen_backward:  # ops after the last step (a loss.item()), no step of their own: left out
                self._free(self._snapshots)
                self._current, self._snapshots, self._data, self._left_out = [], [], 0, 0
            self.dump("the process ended (flight_at_exit)")

    def defer(self, fill: Callable[[float], bool]) -> None:
        """As ``RankWriter.defer``: statistics of device tensors on their way to the host, filled when the step
        ends (waiting for the device there, never synchronising it), before the step is encoded."""
        self._fills.append(fill)

    def _run_fills(self) -> None:
        """Fill the step's deferred statistics, then look at them for a NaN/Inf the records said nothing of yet."""
        fills, self._fills = self._fills, []
        if not fills:
            return
        timeout = seam.EVENT_DEADLINE
        for fill in fills:
            if not fill(timeout):
                timeout = 0.0  # a device that has not finished by the deadline: only look at the rest
        if self._watched:
            self._judge_outputs(final=False)
        if self.trigger is None:
            last_forward, first = None, True
            for record in self._current:
                view = OpRecord(record)
                if view.phase in ("backward", "optimizer") or view.name == _READ_BACK:
                    self.trigger = _nonfinite(record, view.name, view.phase, last_forward if first else None,
                                              self._step)
                    first = first and view.phase != "backward"
                    if self.trigger is not None:
                        break
                if view.phase == "forward":
                    last_forward = record

    # -- steps ---------------------------------------------------------------------------------------------------
    def begin_step(self, step: int | None) -> None:
        self._step = step
        self._current = []
        self._last_forward = None
        self._seen_backward = False
        self._watched = []

    def end_step(self) -> None:
        """Encode the finished step into the ring; drop the oldest steps past K or past the memory budget."""
        if self.dumped_to is not None:
            return
        self._run_fills()
        if self._watched:
            self._judge_outputs(final=True)
        if self._current:
            blob = msgpack.packb(self._current, use_bin_type=True)
            done = _Step(self._step, len(self._current), blob, self._snapshots, self._data, self._left_out)
            self._ring.append(done)
            self._held += done.held
        else:
            self._free(self._snapshots)
        self._current, self._snapshots, self._data, self._left_out = [], [], 0, 0
        while len(self._ring) > self.keep or (self._held > self.budget and len(self._ring) > 1):
            self._drop_oldest(for_budget=len(self._ring) <= self.keep)
        if self.trigger is not None:
            self.dump(self.trigger)

    def _drop_oldest(self, for_budget: bool) -> None:
        old = self._ring.popleft()
        self._held -= old.held
        self._free(old.snapshots)
        if for_budget:
            self.dropped_for_budget += 1

    @staticmethod
    def _free(snapshots: list[Snapshot]) -> None:
        for snap in snapshots:
            snap.data = None  # the mapping goes with its last view  # type: ignore[assignment]

    @property
    def held_bytes(self) -> int:
        """Bytes of the finished steps held: encoded records and tensor copies (one step over the budget alone is
        kept)."""
        return self._held

    @property
    def steps_held(self) -> list[int | None]:
        return [s.step for s in self._ring]

    # -- writing -------------------------------------------------------------------------------------------------
    def dump(self, reason: str) -> Path | None:
        """Write the ring (and the step in progress) as a trace; later calls do nothing."""
        if self.dumped_to is not None or self.failed:
            return self.dumped_to
        o = self.options
        try:
            self._run_fills()  # the step in progress's deferred statistics
            # The last K steps, the one in progress included.
            while self._ring and len(self._ring) + (1 if self._current else 0) > self.keep:
                self._drop_oldest(for_budget=False)
            steps = list(self._ring)
            if self._current:
                steps.append(_Step(self._step, len(self._current), b"", self._snapshots, self._data, self._left_out))
            manifest = dict(self._manifest, **schema.wire_flight(reason, [s.step for s in steps], self.keep,
                                                                 o.flight_mib, self._held, self.dropped_for_budget))
            writer = RankWriter(self.root, manifest, o.compress, o.shuffle, o.chunk_ops, o.chunk_bytes,
                                o.flush_seconds)
            left_out = 0
            for st in steps:
                # Each copy goes to the writer's data files (not its staging memory: the bytes are ours, freed
                # after the writer closes); each record is pointed at the file that holds its copies.
                chunks = {snap.version: writer.add_snapshot(Snapshot(snap.version, snap.data, snap.itemsize,
                                                                     snap.event))
                          for snap in st.snapshots}
                records = msgpack.unpackb(st.blob, raw=False, strict_map_key=False) if st.blob else self._current
                for record in records:
                    if chunks or st.left_out:
                        schema.wire_rechunk(record, chunks)
                    writer.add_op(record)
                left_out += st.left_out
            if self.dropped_for_budget:
                writer.note_lost(f"{self.dropped_for_budget} older step(s) were dropped to stay within "
                                 f"{o.flight_mib} MiB")
            if left_out:
                writer.note_lost(f"{left_out} tensor copies were left out to stay within {o.flight_mib} MiB: "
                                 f"their ops keep no data")
            for line in self.lost:
                writer.note_lost(line)
            writer.close(self._closing_facts())
            self.dumped_to = self.root
            for st in steps:
                self._free(st.snapshots)
            self._ring.clear()
            self._current, self._snapshots, self._data = [], [], 0
            self._held = 0
        except Exception as exc:  # never into the job: one warning
            self.failed = True
            warn_job(f"the flight recorder could not write its steps: {exc}")
        return self.dumped_to
