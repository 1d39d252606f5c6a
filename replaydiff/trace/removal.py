"""Which files make up a trace directory, so that replacing a trace (``record --force``) removes a trace and nothing
else.

A trace is recognised by its manifests: either the directory is one rank's (``manifest.rdt`` in it) or it holds
``rank<N>/`` directories only, each with a replaydiff manifest. Its files are those ``format.py`` names (manifest,
index, entered marker, ``ops/<N>.rdt``, ``data/<N>.safetensors``), any other frame file a rank directory holds, and
the ``.tmp`` twins a writer killed mid-rename leaves. Anything else (a user's script, notes, a symbolic link) means
the directory is not wholly a trace: it is refused before a single file is removed. So are the working directory,
its parents and the home directory, whatever they hold: a slip of ``-o`` there costs too much.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from replaydiff.errors import TraceError, UsageError
from replaydiff.trace.format import (
    DATA_DIR,
    ENTERED,
    FRAME_SUFFIX,
    INDEX,
    MANIFEST,
    OPS_DIR,
    has_frame_magic,
    rank_of_dir_name,
    read_manifest_frame,
)
from replaydiff.trace.ownership import OWNER
from replaydiff.trace.hyperparameters import HYPERPARAMETERS
from replaydiff.trace.placements import PLACEMENTS
from replaydiff.trace.samplers import SAMPLERS

_TMP = ".tmp"  # write_atomic's temporary twin of a file
_OPS_FILE = re.compile(r"\d+" + re.escape(FRAME_SUFFIX))
_DATA_FILE = re.compile(r"\d+\.safetensors")


def trace_files(path: str | os.PathLike) -> list[Path]:
    """Every file and directory of the trace at ``path`` (``path`` itself excluded), deepest first: the order to
    remove them in. UsageError, naming the first entry that is not a trace's, if ``path`` is not wholly a trace."""
    root = Path(path)
    if not root.is_dir():
        raise _refused(root, "it is not a directory")
    if (root / MANIFEST).exists():
        return _rank_files(root, root)
    out: list[Path] = []
    for entry in _entries(root):
        if entry.name == OWNER and entry.is_file(follow_symlinks=False):
            continue  # the recording's claim (ownership.py): its owner removes it, a later claim takes it over
        if not entry.is_dir(follow_symlinks=False) or rank_of_dir_name(entry.name) is None:
            raise _refused(root, f"{entry.name} is not a rank<N>/ directory of a trace (remove it yourself or "
                                 f"choose another directory)")
        out += _rank_files(root, Path(entry.path)) + [Path(entry.path)]
    if not out:
        raise _refused(root, f"it holds no replaydiff trace (no rank<N>/{MANIFEST})")
    return out


def replaceable_files(path: str | os.PathLike) -> list[Path]:
    """What ``remove_trace(path)`` would remove, deepest first, removing nothing: UsageError (saying why) for the
    working directory, its parents, the home directory, and anything that is not wholly a trace. ``record`` asks it
    before it offers ``--force``."""
    root = Path(path).resolve()
    cwd = Path.cwd().resolve()
    if root == cwd:
        raise _refused(path, "it is the working directory (give the trace's own directory)")
    if root in cwd.parents:
        raise _refused(path, "it is a parent of the working directory")
    if root == Path.home().resolve():
        raise _refused(path, "it is the home directory")
    return trace_files(path)


def remove_trace(path: str | os.PathLike) -> None:
    """Remove the trace at ``path`` file by file, leaving ``path`` itself, empty. UsageError, with nothing removed,
    for the working directory, its parents, the home directory, and anything that is not wholly a trace."""
    for p in replaceable_files(path):
        try:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()  # only ever empty by now: a file that appeared since is kept, and says so below
            else:
                p.unlink()
        except OSError as exc:
            raise UsageError(f"could not remove {p} ({exc.strerror or exc}); the trace is partly removed") from None


def _entries(d: Path) -> list[os.DirEntry]:
    with os.scandir(d) as it:
        return sorted(it, key=lambda e: e.name)


class NotReplaceable(UsageError):
    """``path`` is not a trace that may be replaced; ``why`` says why in a clause ("it is the home directory")."""

    def __init__(self, path: str | os.PathLike, why: str) -> None:
        self.why = why
        super().__init__(f"refusing to replace {path}: {why}")


def _refused(path: str | os.PathLike, why: str) -> UsageError:
    return NotReplaceable(path, why)


def _foreign(root: Path, entry: str) -> UsageError:
    return _refused(root, f"{Path(entry).relative_to(root)} is not a trace's file (remove it yourself or choose "
                          f"another directory)")


def _rank_files(root: Path, rank_dir: Path) -> list[Path]:
    try:
        read_manifest_frame(rank_dir / MANIFEST)
    except TraceError as exc:
        raise _refused(root, f"{(rank_dir / MANIFEST).relative_to(root)} is {exc.problem}, so this is not a "
                             f"replaydiff trace") from None
    out: list[Path] = []
    for entry in _entries(rank_dir):
        p = Path(entry.path)
        if entry.is_dir(follow_symlinks=False) and entry.name in (OPS_DIR, DATA_DIR):
            pattern = _OPS_FILE if entry.name == OPS_DIR else _DATA_FILE
            for inner in _entries(p):
                if not (inner.is_file(follow_symlinks=False) and pattern.fullmatch(_untmp(inner.name))):
                    raise _foreign(root, inner.path)
                out.append(Path(inner.path))
            out.append(p)
        elif entry.is_file(follow_symlinks=False) and (
                _untmp(entry.name) in (MANIFEST, INDEX, ENTERED, PLACEMENTS, HYPERPARAMETERS, SAMPLERS)
                or (entry.name.endswith(FRAME_SUFFIX) and has_frame_magic(p))):  # a frame file a later version adds
            out.append(p)
        else:
            raise _foreign(root, entry.path)
    # The manifest last: a removal cut short leaves what is still recognisable as a trace, so --force can finish it.
    return sorted(out, key=lambda p: p.name == MANIFEST)


def _untmp(name: str) -> str:
    return name[: -len(_TMP)] if name.endswith(_TMP) else name
