"""Provides RunOutbox and the messages a background run (a replay or a diff) posts to the app, each carrying its run's
generation so that the app drops what an older run still says after a newer one replaced it (R during a run).

A worker thread never writes the app's fields: its callbacks put progress and results into its run's RunOutbox, and
the outbox posts one RunUpdate to the app whenever it goes from empty to not empty (at most one in flight: a replay
of 100,000 ops does not queue 100,000 messages; the app takes whatever gathered when it gets to the message).
"""
from __future__ import annotations

import threading
from enum import Enum
from typing import Any

from textual.message import Message


class RunState(str, Enum):
    """Where the app's verdicts come from: nothing yet, a run under way, a finished or failed run, a given report."""

    NONE = "none"  # nothing replayed (R runs a replay)
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    REPORT = "report"  # colours from a report given at the start (--replay REPORT)

    def __str__(self) -> str:
        return self.value


class Cancelled(Exception):
    """Raised inside a run's callbacks once a newer run replaced it, to stop it early."""


class RunMessage(Message):
    """What a run posts; ``generation`` says which run (the app's current run has the highest)."""

    def __init__(self, outbox: "RunOutbox") -> None:
        super().__init__()
        self.outbox = outbox
        self.generation = outbox.generation
        self.kind = outbox.kind


class RunUpdate(RunMessage):
    """Progress or results are waiting in ``outbox`` (take them with ``outbox.take()``)."""


class RunFinished(RunMessage):
    """The run is done; ``report`` is its ReplayReport or DiffReport."""

    def __init__(self, outbox: "RunOutbox", report: Any) -> None:
        super().__init__(outbox)
        self.report = report


class RunFailed(RunMessage):
    """The run stopped with an error, said in ``text``."""

    def __init__(self, outbox: "RunOutbox", text: str) -> None:
        super().__init__(outbox)
        self.text = text


class RunOutbox:
    """The channel from one run's worker thread to the app (``target``): the callbacks a replay or a diff takes
    (``total``, ``advance``, ``result``) and its end (``finish``, ``fail``). Thread-safe."""

    def __init__(self, target: Any, generation: int, kind: str) -> None:
        self.target = target  # the app: anything with a thread-safe post_message
        self.generation = generation
        self.kind = kind  # "replay" or "diff"
        self.ended = False  # finish or fail was posted
        self._lock = threading.Lock()
        self._closed = False
        self._total: int | None = None
        self._advance = 0
        self._results: list = []
        self._posted = False  # a RunUpdate is on its way and will take what gathers until it is handled

    def close(self) -> None:
        """A newer run replaced this one: its callbacks raise Cancelled from now on and nothing more is posted."""
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the worker's side ----------------------------------------------------------------------------------------
    def total(self, n: int) -> None:
        with self._lock:
            self._check()
            self._total = n
            self._post_update()

    def advance(self, k: int) -> None:
        with self._lock:
            self._check()
            self._advance += k
            self._post_update()

    def result(self, r: Any) -> None:
        with self._lock:
            self._check()
            self._results.append(r)
            self._post_update()

    def finish(self, report: Any) -> None:
        self._end(RunFinished(self, report))

    def fail(self, text: str) -> None:
        self._end(RunFailed(self, text))

    def _end(self, message: RunMessage) -> None:
        with self._lock:
            if self._closed:
                return
            self.ended = True
            self.target.post_message(message)

    def _check(self) -> None:
        if self._closed:
            raise Cancelled()

    def _post_update(self) -> None:
        if not self._posted:
            self._posted = True
            self.target.post_message(RunUpdate(self))

    # -- the app's side -------------------------------------------------------------------------------------------
    def take(self) -> tuple[int | None, int, list]:
        """(total if it was set since the last take, ops done since, results since), emptying the outbox."""
        with self._lock:
            out = (self._total, self._advance, self._results)
            self._total, self._advance, self._results = None, 0, []
            self._posted = False
            return out
