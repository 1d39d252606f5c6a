"""Which recording owns a trace directory while it is written: one marker file, ``.replaydiff-recording``, at the top
of the directory (beside ``rank<N>/``).

A recording claims the directory before it writes anything: the marker is created with ``O_CREAT | O_EXCL``, so of
two recordings started into one directory exactly one gets it, and the other is refused before its job runs (the
CLI) or records nothing (the Python API). The marker holds a token naming the recording: every process of one
recording (the ranks of a torchrun job, the children of ``replaydiff record``) carries the same token and joins the
claim instead of being refused, so the lock is per recording, not per rank. Clean-up after a recording checks the
marker's token, not file names: a recording removes only what it wrote. The claimant removes the marker when the
recording ends; one whose process was killed leaves it, and a later claim on the same host takes it over once that
process is gone (another host's is said, for the user to remove).
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

OWNER = ".replaydiff-recording"  # the marker's name, at the top of a trace directory
_SETTLE_S = 1.0  # how long a marker just created may be seen empty (its owner is still writing its token)


@dataclass(frozen=True)
class Holder:
    """The recording that holds a directory: its token, and the process and host that claimed it, and when."""

    token: str
    pid: int
    host: str
    since: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)) if self.since else "an unknown time"
        return f"pid {self.pid} on {self.host or 'an unknown host'}, since {when}"

    @property
    def gone(self) -> bool:
        """The claiming process no longer runs (known only on its own host)."""
        if self.host != socket.gethostname() or self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # another user's process: it runs
            return False
        return False


class DirectoryHeld(Exception):
    """Another recording holds the directory."""

    def __init__(self, directory: Path, holder: Holder | None) -> None:
        self.directory, self.holder = directory, holder
        who = holder.describe() if holder is not None else "a recording whose marker cannot be read"
        super().__init__(f"{directory} is being recorded into by another recording ({who}); wait for it to end or "
                         f"choose another directory (a recording killed on another host leaves {directory / OWNER}: "
                         f"remove it if no recording runs)")


class NotWritable(Exception):
    """The trace directory cannot be made or written: says which directory and why, in one clause."""

    def __init__(self, directory: Path, why: str) -> None:
        self.directory, self.why = directory, why
        super().__init__(f"cannot write the trace into {directory}: {why}")


def claim(directory: str | os.PathLike, token: str) -> bool:
    """Make ``directory`` (and its parents) and take it for the recording ``token``: True when this call created
    the marker (the caller ``release``s it when the recording ends), False when the recording ``token`` already
    holds it (another process of the same recording). DirectoryHeld when another recording holds it; NotWritable
    when it cannot be made or written (a read-only file system, a file in the way)."""
    root = Path(directory)
    _make(root)
    marker = root / OWNER
    body = json.dumps({"token": token, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    for _ in range(3):
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            held = _read_settled(marker)
            if held is not None and held.token == token:
                return False
            if held is None and not marker.exists():
                # released between our create and our read (another rank of this recording ended its block at
                # once: seen under load as a 2-rank trace holding one rank): the directory is free, take it
                continue
            if held is not None and held.gone:  # a recording killed here: its marker is stale
                _remove_if(marker, held.token)
                continue
            raise DirectoryHeld(root, held) from None
        except OSError as exc:
            raise NotWritable(root, _why(exc)) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(body)
        except OSError as exc:
            marker.unlink(missing_ok=True)
            raise NotWritable(root, _why(exc)) from None
        return True
    raise DirectoryHeld(root, holder(root))


def release(directory: str | os.PathLike, token: str) -> None:
    """End the claim of the recording ``token`` on ``directory``: the marker is removed only if it is that one's."""
    try:
        _remove_if(Path(directory) / OWNER, token)
    except OSError:
        pass


def holder(directory: str | os.PathLike) -> Holder | None:
    """The recording holding ``directory`` now, or None (no marker, or one that cannot be read)."""
    return _read(Path(directory) / OWNER)


def owns(directory: str | os.PathLike, token: str) -> bool:
    """Whether the recording ``token`` holds ``directory``: what clean-up asks before it removes anything there."""
    held = holder(directory)
    return held is not None and held.token == token


def _make(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where the directory (or one of its parents) should be
        raise NotWritable(root, f"{_file_in_the_way(root)} is a file, not a directory") from None
    except NotADirectoryError:
        raise NotWritable(root, f"{_file_in_the_way(root)} is a file, not a directory") from None
    except OSError as exc:
        raise NotWritable(root, _why(exc)) from None


def _file_in_the_way(root: Path) -> Path:
    for p in (root, *root.parents):
        if p.exists() and not p.is_dir():
            return p
    return root


def _why(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    if exc.errno == errno.ENOTDIR:
        return "a part of the path is a file, not a directory"
    return exc.strerror or type(exc).__name__


def _read(marker: Path) -> Holder | None:
    try:
        with open(marker, encoding="utf-8") as fh:
            raw = json.loads(fh.read(4096))
        return Holder(str(raw["token"]), int(raw["pid"]), str(raw["host"]), float(raw["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_settled(marker: Path) -> Holder | None:
    """The marker's holder, waiting a moment for one created an instant ago to be written."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        held = _read(marker)
        if held is not None or time.monotonic() > deadline or not marker.exists():
            return held
        time.sleep(0.02)


def _remove_if(marker: Path, token: str) -> None:
    held = _read(marker)
    if held is not None and held.token == token:
        marker.unlink(missing_ok=True)
