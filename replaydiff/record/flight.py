"""The flight recorder's memory: the op records of the last K steps, written out only when something goes wrong.

It stands in for the trace writer (same calls as ``RankWriter``), so the recorder does not know the difference. A
step's records are msgpack-encoded when the step ends, so the memory held is measured, not guessed: the ring keeps
at most ``flight`` steps and at most ``flight_mib`` MiB of encoded records (oldest steps go first; the step being
recorded always stays). Nothing touches the disk until ``dump()``: on the first NaN/Inf in a gradient or in the
loss (the last forward op before backward starts), once that step ends; on SIGTERM/SIGUSR1 or an exception
(``steps.py`` installs those triggers); at exit only with ``flight_at_exit``. One dump per recording.
"""
from __future__ import annotations

import logging
from collections import deque
from pathlib import Path
from typing import Any, Callable

import msgpack

from replaydiff.trace import schema
from replaydiff.trace.schema import OpRecord
from replaydiff.trace.writer import RankWriter

log = logging.getLogger("replaydiff")


class FlightBuffer:
    data_refused: str | None = None  # RankWriter's: the flight recorder never stores tensor data
    def __init__(self, root: Path, manifest: dict, options: Any, closing_facts: Callable[[], dict]) -> None:
        self.root = root
        self.options = options
        self._manifest = manifest
        self._closing_facts = closing_facts
        self.budget = int(options.flight_mib * (1 << 20))
        self.keep = int(options.flight)
        self._ring: deque[tuple[int | None, int, bytes]] = deque()  # (step, ops, encoded records)
        self._held = 0  # encoded bytes in the ring
        self._step: int | None = None
        self._current: list[dict] = []
        self._last_forward: dict | None = None
        self._seen_backward = False
        self.dropped_for_budget = 0
        self.lost: list[str] = []
        self.failed = False
        self.trigger: str | None = None  # why a dump is due
        self.dumped_to: Path | None = None

    # -- what the recorder calls (RankWriter's interface) ------------------------------------------------------
    def add_op(self, record: dict) -> None:
        if self.dumped_to is not None:
            return
        view = OpRecord(record)
        phase = view.phase
        if phase == "backward":
            if not self._seen_backward:
                self._seen_backward = True
                last = self._last_forward  # the loss, or what the backward pass starts from
                if last is not None and schema.wire_nonfinite(last) and self.trigger is None:
                    self.trigger = f"the loss (op #{schema.wire_index(last)}) is NaN/Inf at step {self._step}"
            if self.trigger is None and schema.wire_nonfinite(record):
                self.trigger = (f"a gradient (op #{schema.wire_index(record)} {view.name}) is NaN/Inf "
                                f"at step {self._step}")
        elif phase == "forward":
            if self._seen_backward and self.trigger is not None and view.module is not None:
                # A module runs forward again without an optimizer step in between (a grad scaler skipped it): the
                # NaN step is over, write it out now. (Ops outside modules, e.g. the optimizer's profiler op, run
                # in the "forward" phase too.)
                self.dump(self.trigger)
                return
            self._last_forward = record
        self._current.append(record)

    def add_snapshot(self, snap: Any) -> int:
        raise ValueError("the flight recorder keeps statistics only; it stores no tensor data")

    def note_lost(self, what: str) -> None:
        if len(self.lost) < 100:
            self.lost.append(what)

    def flush(self) -> None:
        pass

    def sync(self, timeout: float) -> bool:
        """SIGTERM (through the recorder): write what the ring holds now."""
        self.dump(self.lost[-1] if self.lost else "the process is being terminated")
        return True

    def write_manifest_now(self) -> None:
        pass

    def close(self, extra: dict) -> None:
        if self.dumped_to is None and self.options.flight_at_exit:
            self.dump("the process ended (flight_at_exit)")

    # -- steps ---------------------------------------------------------------------------------------------------
    def begin_step(self, step: int | None) -> None:
        self._step = step
        self._current = []
        self._last_forward = None
        self._seen_backward = False

    def end_step(self) -> None:
        """Encode the finished step into the ring; drop the oldest steps past K or past the memory budget."""
        if self.dumped_to is not None:
            return
        if self._current:
            blob = msgpack.packb(self._current, use_bin_type=True)
            self._ring.append((self._step, len(self._current), blob))
            self._held += len(blob)
        self._current = []
        while len(self._ring) > self.keep or (self._held > self.budget and len(self._ring) > 1):
            step, _, blob = self._ring.popleft()
            self._held -= len(blob)
            if len(self._ring) < self.keep:
                self.dropped_for_budget += 1
        if self.trigger is not None:
            self.dump(self.trigger)

    @property
    def held_bytes(self) -> int:
        """Encoded bytes of the finished steps held (one step over the budget alone is kept)."""
        return self._held

    @property
    def steps_held(self) -> list[int | None]:
        return [s for s, _, _ in self._ring]

    # -- writing -------------------------------------------------------------------------------------------------
    def dump(self, reason: str) -> Path | None:
        """Write the ring (and the step in progress) as a trace; later calls do nothing."""
        if self.dumped_to is not None or self.failed:
            return self.dumped_to
        o = self.options
        try:
            # The last K steps, the one in progress included.
            while self._ring and len(self._ring) + (1 if self._current else 0) > self.keep:
                self._held -= len(self._ring.popleft()[2])
            steps = [s for s, _, _ in self._ring] + ([self._step] if self._current else [])
            manifest = dict(self._manifest, flight={
                "reason": reason, "steps": steps, "keep": self.keep, "budget_mib": o.flight_mib,
                "held_bytes": self._held, "dropped_for_budget": self.dropped_for_budget})
            writer = RankWriter(self.root, manifest, o.compress, o.shuffle, o.chunk_ops, o.chunk_bytes,
                                o.flush_seconds)
            for _, _, blob in self._ring:
                for record in msgpack.unpackb(blob, raw=False, strict_map_key=False):
                    writer.add_op(record)
            for record in self._current:
                writer.add_op(record)
            if self.dropped_for_budget:
                writer.note_lost(f"{self.dropped_for_budget} older step(s) were dropped to stay within "
                                 f"{o.flight_mib} MiB")
            for line in self.lost:
                writer.note_lost(line)
            writer.close(self._closing_facts())
            self.dumped_to = self.root
            self._ring.clear()
            self._current = []
            self._held = 0
        except Exception as exc:  # never into the job: one warning
            self.failed = True
            import warnings

            warnings.warn(f"replaydiff: the flight recorder could not write its steps: {exc}", RuntimeWarning,
                          stacklevel=2)
        return self.dumped_to
