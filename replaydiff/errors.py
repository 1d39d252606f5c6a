"""The project's error types and the exit codes they map to.

Library code raises these; the CLI turns each into one line on stderr and its exit code, so a user never sees a
traceback for a problem that is theirs to fix (a bad argument, a damaged trace, a missing device).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_DIVERGENT = 1
EXIT_USAGE = 2
EXIT_TRACE = 3
EXIT_ENVIRONMENT = 4


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


class EnvironmentProblem(ReplaydiffError):
    """The machine lacks something the request needs (a CUDA device, a package)."""

    exit_code = EXIT_ENVIRONMENT
