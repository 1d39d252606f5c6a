"""The project's exit codes, its error types and the one way its lines on stderr are said.

Library code raises these errors; the CLI turns each into one line on stderr and its exit code, so a user never sees
a traceback for a problem that is theirs to fix (a bad argument, a damaged trace, a missing device). Every line the
project writes for people on stderr goes through ``say``, ``warn`` or ``fail`` (or ``line`` where it is built before
it is written), so each starts ``replaydiff: `` and a warning or error says so the same way.
"""
from __future__ import annotations

import sys
from enum import IntEnum
from typing import TextIO


class ExitCode(IntEnum):
    """Every exit code of every verb (each verb's --help lists them all, with what each means for that verb)."""

    OK = 0
    DIVERGENT = 1
    USAGE = 2
    TRACE = 3
    ENVIRONMENT = 4
    INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended
    BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout left (`replaydiff show trace | head`)

    @property
    def meaning(self) -> str:
        """What the code means for any verb; a verb's --help may say more of it."""
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "clean: nothing wrong found",
    ExitCode.DIVERGENT: "a problem found in the trace (what counts is the verb's)",
    ExitCode.USAGE: "usage: an argument or request that cannot be done as asked",
    ExitCode.TRACE: "the trace is unreadable, damaged (files missing or cut short) or partial",
    ExitCode.ENVIRONMENT: "the machine lacks what the request needs (a device, a package)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
    ExitCode.BROKEN_PIPE: "the reader of standard output left (a pipe into head)",
}

EXIT_OK = ExitCode.OK
EXIT_DIVERGENT = ExitCode.DIVERGENT
EXIT_USAGE = ExitCode.USAGE
EXIT_TRACE = ExitCode.TRACE
EXIT_ENVIRONMENT = ExitCode.ENVIRONMENT


def prefixed(message: str) -> str:
    """``replaydiff: MESSAGE``: the one place the prefix is added to what the user's job or terminal shows (stderr
    lines, warnings, log records), so that every such line says where it comes from the same way."""
    return f"replaydiff: {message}"


def warn_job(message: str) -> None:
    """A RuntimeWarning into the job (the recorder's Python API: filterable, catchable), prefixed as every line is.
    It is located at the user's code: the first frame of the call stack outside the replaydiff package (the ``with
    replaydiff.record(...)`` line, the training loop's ``opt.step()``), not the recorder's line that noticed the
    problem (where every frame is replaydiff's own: at the caller)."""
    import warnings

    warnings.warn(prefixed(message), RuntimeWarning, stacklevel=_users_level() + 1)


def _users_level() -> int:
    """The ``stacklevel`` (as ``warnings.warn`` counts it from warn_job's caller) of the first frame outside this
    package; 1 (the caller) when there is none."""
    import os

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(2)  # warn_job's caller
    level = 1
    while frame is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(package):
            return level
        frame = frame.f_back
        level += 1
    return 1


def line(message: str, kind: str | None = None) -> str:
    """One line for stderr: ``replaydiff: MESSAGE`` (``kind``: 'warning', 'error'), with its newline. The message
    may hold strings from a trace (an op's name, a module): its control characters and newlines are shown as
    escapes, so it stays one line and a terminal obeys nothing in it."""
    from replaydiff.rebuild_and_judge import shown

    return prefixed(f"{kind + ': ' if kind else ''}{shown(message)}\n")


def say(message: str, file: TextIO | None = None) -> None:
    """Write a line for people (what was written, what happens next) on stderr, or ``file``."""
    (file or sys.stderr).write(line(message))


def warn(message: str, file: TextIO | None = None) -> None:
    """Write a warning: the command goes on, and its result may not be what the user expects."""
    (file or sys.stderr).write(line(message, "warning"))


def fail(message: str, code: ExitCode = ExitCode.USAGE, file: TextIO | None = None) -> ExitCode:
    """Write an error line and return the exit code to end with."""
    (file or sys.stderr).write(line(message, "error"))
    return code


class ReplaydiffError(Exception):
    """Base class: an error with a one-line message and the exit code the CLI should return."""

    exit_code = EXIT_USAGE


class UsageError(ReplaydiffError):
    """The user asked for something that cannot be done as asked."""

    exit_code = EXIT_USAGE


class TraceError(ReplaydiffError):
    """A trace file is missing, damaged, truncated, hand-edited or of a newer format."""

    exit_code = EXIT_TRACE

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):  # crosses process boundaries from --workers replay processes
        return type(self), (self.path, self.problem)


class NotRegularFile(TraceError):
    """A trace's file that is a symbolic link, a FIFO, a device or a directory: refused, never read through."""


class EnvironmentProblem(ReplaydiffError):
    """The machine lacks something the request needs (a CUDA device, a package)."""

    exit_code = EXIT_ENVIRONMENT
