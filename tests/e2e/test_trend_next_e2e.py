"""The record command trend prints for the next step is the recorded job and runs as printed (the rest:
tests/integration/test_trend_next.py). The printed command is run as a process (``python -m replaydiff``, as a
shell runs it); the other verbs by the CLI's ``main`` in this process (conftest's cli_here): each spares a torch
import."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from replaydiff.trace import open_trace
from replaydiff.trend import compute_trend

from process_helpers import child_env
from steps_helpers import one_thread  # noqa: F401 (autouse, as in tests/integration/test_trend_next.py)


SPIKE = textwrap.dedent("""
    import sys
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    spike = int(sys.argv[2])  # argv[1] is a label with a space in it: the command must come back quoted
    for step in range(1, 31):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        if step == spike:
            with torch.no_grad():
                model[2].weight.mul_(100)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
""")


@pytest.fixture
def cli(cli_as_child):
    """cli_here under child_env's environment (conftest's cli_as_child)."""
    return cli_as_child


def test_the_next_record_command_is_the_recorded_job_and_runs_as_printed(tmp_path, cli):
    """Recorded by ``replaydiff record -- CMD``: trend's record line ends in CMD, quoted for the shell; pasted into a
    shell it records the zoom-in of the same job, which holds the op trend named as the cause, and whose replay
    names that op as where the change comes from."""
    (tmp_path / "my train.py").write_text(SPIKE)
    command = [sys.executable, "my train.py", "run one", "25"]
    rec = cli("record", "--tensors", "stats", "--steps", "1-30", "-o", "t", "--", *command, cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    assert open_trace(tmp_path / "t").rank(0).command == tuple(command)

    trend = cli("trend", "t", cwd=tmp_path)
    assert trend.returncode == 1, trend.stderr
    # the cause, the mul_, runs in the loop outside any module: the zoom-in holds it and the first change by name
    first = compute_trend(open_trace(tmp_path / "t").rank(0)).first_change
    assert first is not None and first.module == "Sequential.2"
    record = f"replaydiff record --tensors full --steps 24-25 --op aten.mul_.Tensor --op {first.op} -o t-step25 -- " \
        + shlex.join(command)
    lines = trend.stdout.splitlines()
    assert f"  {record}" in lines and "  replaydiff replay t-step25" in lines
    assert "COMMAND" not in trend.stdout and "holds none" not in trend.stdout

    # As a user would paste it (replaydiff: this interpreter's)
    argv = shlex.split(record)
    assert argv[0] == "replaydiff"
    zoom = subprocess.run([sys.executable, "-m", "replaydiff", *argv[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=child_env())
    assert zoom.returncode == 0, zoom.stderr
    z = open_trace(tmp_path / "t-step25").rank(0)
    assert z.command == tuple(command) and sorted({op.step for op in z}) == [24, 25]
    mul = next(op for op in z if op.step == 25 and op.name == "aten.mul_.Tensor")
    out = cli("replay", "t-step25", cwd=tmp_path)
    assert mul.data_left_out is None  # held by the zoom-in: replayed, and named with its line
    assert f"from op #{mul.index} aten.mul_.Tensor at {mul.source}, which ran in no earlier step of this trace and " \
           f"replays right: the change is its doing" in out.stdout, out.stdout
