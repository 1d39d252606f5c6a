"""A rich progress bar on a terminal, nothing when stderr is piped; the --json FILE|- output of every verb."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from replaydiff.errors import UsageError


@contextmanager
def progress_bar(description: str) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]] | tuple[None, None]]:
    """Yields (set_total, advance) callbacks, or (None, None) when stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield None, None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=None)
        yield (lambda n: prog.update(task, total=n)), (lambda k: prog.advance(task, k))


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
