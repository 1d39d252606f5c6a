"""Shared fixtures: a seeded tiny-transformer training step, recording one step into tmp_path, and the CLI run in
this process; and the tier rule (every test under tests/e2e/ is ``slow``)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff.models.tiny import TinyTransformer, make_step
from replaydiff.trace import open_trace


E2E = Path(__file__).resolve().parent / "e2e"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """The tiers are folders: every test under tests/e2e/ is ``slow``, so the quick tier (``-m "not slow"``) is
    tests/unit/ and tests/integration/. Tests marked ``gpu`` are deselected on a machine without CUDA (the marker's
    documented meaning)."""
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


# Files whose tests share no module-scoped fixture and are long enough to be worth spreading over both workers:
# their tests are scheduled one by one. test_parallel_jobs.py is spread by job script (its module fixture records
# each script once, for every test and step that reads it).
_SPREAD = ("tests/e2e/test_compiled_units.py", "tests/e2e/test_cli_replay_e2e.py")
_BY_JOB = "tests/e2e/test_parallel_jobs.py"


def work_unit(nodeid: str) -> str:
    """The unit of tests one xdist worker runs together: a test file, a test of a file in ``_SPREAD``, or a job
    script's tests of test_parallel_jobs.py (its id ``script-stepN``)."""
    file = nodeid.split("::", 1)[0]
    if file in _SPREAD:
        return nodeid
    if file == _BY_JOB and nodeid.endswith("]"):
        return f"{file}::{re.sub(r'-step[0-9]+$', '', nodeid.rsplit('[', 1)[1][:-1])}"
    return file


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: called only under -n
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n`` (the README's test command), a file's tests run on one worker (xdist's ``--dist loadfile``): a
    file's module-scoped recordings (a torchrun launch, a compile) are then made once, not once per worker its tests
    were spread over; the longest files are spread where that holds anyway (``work_unit``). A file of 10 minutes on
    one worker would otherwise be the suite's wall time."""
    from xdist.scheduler import LoadScopeScheduling

    class _Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return _Units(config, log)


@pytest.fixture
def tiny_step():
    """One training step (forward, backward, AdamW) of TinyTransformer built under torch.manual_seed(0).

    The closure returns the loss; ``.model``, ``.optimizer`` and ``.batch`` are attached to it."""
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = model.example_batch()
    step = make_step(model, batch, optimizer)
    step.model, step.optimizer, step.batch = model, optimizer, batch
    return step


@pytest.fixture
def record_one(tmp_path):
    """record_one(fn, name="trace", **options) -> (fn's result, RankTrace of rank 0): ``fn()`` run while recorded
    into ``tmp_path/name``."""

    def run(fn, name: str = "trace", **options):
        path = tmp_path / name
        with replaydiff.record(path, **options):
            result = fn()
        return result, open_trace(path).rank(0)

    return run


@pytest.fixture(scope="session")
def ddp_step_with_rank1_allreduce_fault(tmp_path_factory) -> Path:
    """A 2-rank gloo DDP step recorded with rank 1's all-reduce corrupted (replay_helpers.record_ddp_step), recorded
    once and read by the collective tests of test_collectives_replay and test_health_report: read it, never write
    into its directory."""
    from filelock import FileLock  # torch's own dependency
    from replay_helpers import record_ddp_step

    # Under pytest-xdist each worker is a session of its own: the workers' temporary folders share a parent, where
    # the first worker to ask records the step and the others wait for it and read it (a torchrun launch saved).
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    where, done = root / "ddp_step", root / "ddp_step.done"
    with FileLock(str(root / "ddp_step.lock")):
        if not done.exists():
            shutil.rmtree(where, ignore_errors=True)  # a worker that failed part-way
            where.mkdir()
            done.write_text(str(record_ddp_step(where, fault_rank=1)))
    return Path(done.read_text())


@pytest.fixture
def cli_here(capfd, monkeypatch):
    """cli_here(*args, cwd=None) -> CompletedProcess: ``replaydiff *args`` run by ``replaydiff.cli.main.main`` in this
    process, from ``cwd``; its output and that of the processes it starts (``record``'s job) captured as a
    subprocess's would be, warnings printed to stderr as a plain interpreter prints them. For tests that are not about
    the CLI's own process (its imports, exit, signals, a pipe): ``python -m replaydiff`` spends ~3 s importing torch
    before it starts."""

    def run(*args: str | Path, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        from replaydiff.cli.main import main

        if cwd is not None:
            monkeypatch.chdir(cwd)
        capfd.readouterr()
        with warnings.catch_warnings():
            _warn_as_a_process_would()
            code = main([str(a) for a in args])
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["replaydiff", *map(str, args)], code, out, err)

    return run


@pytest.fixture
def cli_as_child(cli_here, monkeypatch):
    """cli_here under process_helpers.child_env's environment, as the processes it stands for ran."""
    from process_helpers import child_env

    env = child_env()
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", env["PATH"])
    return cli_here


def _warn_as_a_process_would() -> None:
    """Inside catch_warnings: warnings printed to stderr under the filters of a plain ``python`` (pytest would
    otherwise collect them where a test of the CLI's stderr cannot see them)."""
    warnings.resetwarnings()
    warnings.showwarning = _print_warning  # in place of the recorder pytest installed
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
