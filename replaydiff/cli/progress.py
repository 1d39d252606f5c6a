"""A rich progress bar on a terminal, nothing when stderr is piped; the --json FILE|- output of every verb."""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from replaydiff.errors import UsageError, say


@contextmanager
def progress_bar(description: str, plain_every: float | None = None
                 ) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]] | tuple[None, None]]:
    """Yields (set_total, advance) callbacks: a rich bar with the time left on a terminal. When stderr is not a
    terminal, nothing (None, None), or with ``plain_every`` one plain line of progress every that many seconds."""
    if not sys.stderr.isatty():
        if plain_every is None:
            yield None, None
        else:
            line = PlainProgress(description, plain_every)
            yield line.set_total, line.advance
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=None)
        yield (lambda n: prog.update(task, total=n)), (lambda k: prog.advance(task, k))


class PlainProgress:
    """Progress as a line on stderr at most every ``every`` seconds: done/total, the rate, the time left."""

    def __init__(self, description: str, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.description, self.every, self.clock = description, every, clock
        self.total: int | None = None
        self.done = 0
        self.start = self.last = clock()

    def set_total(self, n: int) -> None:
        self.total = n

    def advance(self, k: int) -> None:
        self.done += k
        now = self.clock()
        if now - self.last < self.every:
            return
        self.last = now
        say(self.line(now))
        sys.stderr.flush()

    def line(self, now: float) -> str:
        took = max(now - self.start, 1e-9)
        rate = self.done / took
        text = f"{self.description}: {self.done}" + (f"/{self.total}" if self.total else "") + f" ({rate:,.0f}/s"
        if self.total and rate > 0:
            left = max(self.total - self.done, 0) / rate
            text += f", about {_duration(left)} left"
        return text + ")"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def check_json_dest(dest: str) -> None:
    """UsageError unless ``--json FILE`` can be written: checked before the work (a replay of a large trace) rather
    than found after it as a traceback. '-' is stdout."""
    if dest == "-":
        return
    path = Path(dest)
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"--json {dest} is a directory: give a file name")
    if not folder.is_dir():
        raise UsageError(f"--json {dest}: the directory {folder} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise UsageError(f"--json {dest}: {'the file' if path.exists() else f'the directory {folder}'} is not "
                         f"writable")


def write_json(dest: str, obj: object, indent: int | None = 1) -> None:
    """``--json FILE|-``: the document to stdout ('-') or to FILE, one trailing newline."""
    import json

    text = json.dumps(obj, indent=indent) + "\n"
    if dest == "-":
        sys.stdout.write(text)
        return
    try:
        with open(dest, "w") as fh:
            fh.write(text)
    except OSError as exc:  # checked up front; what changed since (a full disk) is still one line
        raise UsageError(f"--json {dest}: could not write it ({exc.strerror or exc})") from None
