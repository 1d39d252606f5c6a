"""A rich progress bar on a terminal, nothing when stderr is piped."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator


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


def write_json(dest: str, obj: object) -> None:
    """``--json FILE|-``: the document to stdout ('-') or to FILE, indented, one trailing newline."""
    import json

    text = json.dumps(obj, indent=1) + "\n"
    if dest == "-":
        sys.stdout.write(text)
    else:
        with open(dest, "w") as fh:
            fh.write(text)
