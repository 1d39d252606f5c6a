"""What tests/integration/test_cli_replay.py and tests/e2e/test_cli_replay_e2e.py share: the one-line error check,
the planted-fault trace and the temporary cache the CLI keeps its journals in."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import replay_helpers as rh


def assert_one_line_error(proc: subprocess.CompletedProcess, *must_contain: str) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("replaydiff: error:")]
    assert len(errors) == 1, proc.stderr
    for text in must_contain:
        assert text in errors[0], proc.stderr


@pytest.fixture(scope="module")
def mlp_fault() -> tuple[Path, int]:
    name, occurrence, _ = rh.first_in_phase(rh.trace_ops(rh.step_trace("mlp")), rh.MATMULS, "forward")
    path = rh.step_trace("mlp", name, rel=1e-3, occurrence=occurrence)
    return path, rh.occurrence_index(rh.trace_ops(path), name, occurrence)


@pytest.fixture(autouse=True, scope="module")
def journals_in_a_temporary_cache(tmp_path_factory):
    """The CLI keeps a journal of judged ops in the user's cache folder: here in a temporary one."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before
