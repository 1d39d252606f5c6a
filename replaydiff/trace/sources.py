"""Source lines of a trace: the text an op's line had when it was recorded, and whether the file has changed since.

An op's ``source`` is ``file.py:LINE``. The recorder also keeps that line's text with the op and one SHA-256 per
file in the manifest, so that a trace read elsewhere, or after the user edited ``train.py``, still shows the code
that ran, and a reader can say when the file on disk is no longer the one recorded (instead of pointing at whatever
line now has that number). Both sides read files through ``read_source`` and cut lines with ``line_text``, so a
recorded line and today's line compare equal exactly when they are the same code. What is shown of a line is the
trace's own text only: a file here that the trace names is read (a regular file, bounded, and only one inside the
working directory of the process reading the trace: the user's own project, never an arbitrary path a received
trace names) to say whether it has changed, never shown.
"""
from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

MAX_LINE = 200  # characters of a line kept (a generated or minified line can be any length)


def line_text(raw: str) -> str:
    """A source line as the trace keeps it: without indentation or trailing blanks, at most MAX_LINE characters."""
    text = raw.strip()
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."


MAX_SOURCE_BYTES = 8 << 20  # a source file larger than this is not read (a trace may name any path)


def read_source(path: str | os.PathLike) -> tuple[str, list[str]] | None:
    """(SHA-256 of the file's bytes, its lines), or None when it cannot be read or is no regular file of at most
    MAX_SOURCE_BYTES (a FIFO or device a trace names is never opened for reading)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
                return None
            data = fh.read(MAX_SOURCE_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_SOURCE_BYTES:
        return None
    return hashlib.sha256(data).hexdigest(), data.decode("utf-8", errors="replace").splitlines()


def split_location(source: str | None) -> tuple[str, int] | None:
    """``("train.py", 12)`` from ``"train.py:12"``; None for no location or a malformed one."""
    if not source or ":" not in source:
        return None
    file, _, line = source.rpartition(":")
    try:
        return file, int(line)
    except ValueError:
        return None


@dataclass(frozen=True)
class SourceLine:
    """An op's source line, as recorded and as the file on disk has it now."""

    file: str  # as recorded: relative to the job's working directory when it was under it
    line: int
    recorded: str | None  # the line's text when recorded (None: a trace from before texts were kept)
    path: Path | None  # the file found here now, if any
    lines: tuple[str, ...]  # that file's lines now (empty if none was found)
    changed: bool | None  # the file differs from the recorded one; None: cannot tell (no hash recorded, no file)
    moved_to: int | None  # line number of the recorded text in today's changed file (nearest occurrence), if any

    @property
    def current(self) -> str | None:
        """The text at the recorded line number in today's file."""
        return line_text(self.lines[self.line - 1]) if 0 < self.line <= len(self.lines) else None

    def warning(self) -> str | None:
        """One line saying the file on disk is not the recorded one, and where the recorded line is now."""
        if not self.changed:
            return None
        if self.moved_to is not None:
            where = (f"line {self.line} is unchanged" if self.moved_to == self.line else
                     f"the recorded line is now line {self.moved_to}")
        else:  # today's text is not shown: a trace may name any file here, and only its own text is shown
            where = "the recorded line is no longer in it"
        return f"{self.file} has changed since it was recorded; {where}"


_READ: dict[tuple[str, int, int], tuple[str, list[str]] | None] = {}  # (path, mtime, size) -> read_source()


def _read_now(path: Path) -> tuple[str, list[str]] | None:
    """read_source(), once per version of a file (a UI asks again at every selection)."""
    try:
        st = path.stat()
    except OSError:
        return None
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _READ:
        if len(_READ) > 64:
            _READ.clear()
        _READ[key] = read_source(path)
    return _READ[key]


def _ours(path: Path) -> bool:
    """Whether ``path`` (links followed) lies inside this process's working directory: the only files a trace may
    make us read."""
    try:
        return path.resolve().is_relative_to(Path.cwd().resolve())
    except (OSError, RuntimeError, ValueError):
        return False


def locate(source: str | None, recorded: str | None, digest: str | None, cwd: str | None) -> SourceLine | None:
    """What is known of the line ``source`` (``file.py:LINE``) now: ``recorded`` is its recorded text, ``digest``
    the file's recorded SHA-256, ``cwd`` the job's working directory (relative paths are resolved against it, then
    against ours)."""
    loc = split_location(source)
    if loc is None:
        return None
    file, line = loc
    candidates = [Path(file)]
    if cwd and not os.path.isabs(file):
        candidates.insert(0, Path(cwd) / file)
    found = next(((p, r) for p in candidates if _ours(p) and p.is_file() and (r := _read_now(p)) is not None), None)
    if found is None:
        return SourceLine(file, line, recorded, None, (), None, None)
    path, (now_digest, lines) = found
    at_line = line_text(lines[line - 1]) if 0 < line <= len(lines) else None
    if digest is not None:
        changed: bool | None = now_digest != digest
    elif recorded is not None and at_line != recorded:  # no hash recorded: a different line is evidence enough
        changed = True
    else:
        changed = None
    moved = None
    if changed and recorded:
        same = [k for k, raw in enumerate(lines, 1) if line_text(raw) == recorded]
        moved = min(same, key=lambda k: (abs(k - line), k)) if same else None
    return SourceLine(file, line, recorded, path, tuple(lines), changed, moved)
