"""Ctrl-C during ``replaydiff record -- python train.py``: the interrupt is the job's. Its traceback shows the job's
frames, none of the recorder's (which was on the stack: it read as replaydiff crashing), and record says in one line
that the command was interrupted and what the trace holds. A real SIGINT to the recorded child, as a terminal's
Ctrl-C delivers it (record itself does not pass on a SIGINT the terminal already gave the whole group)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import replaydiff

from process_helpers import child_env

CHILD = textwrap.dedent("""
    import os, sys
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = [torch.ones(1) for _ in range(3000)]
    for step in range(1, 4):
        loss = model(torch.randn(8, 4)).square().mean()
        if step == 2:
            print("pid", os.getpid(), flush=True)
            # One op with thousands of tensor arguments, over and over: nearly all its time is the recorder's
            # (it notes every argument), so the interrupt lands inside the recorder's dispatch mode.
            for _ in range(10 ** 6):
                torch.cat(parts)
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


@pytest.mark.slow
def test_ctrl_c_in_a_recorded_step_shows_the_jobs_frames_and_one_line_on_what_the_trace_holds(tmp_path):
    (tmp_path / "train.py").write_text(CHILD)
    proc = subprocess.Popen([sys.executable, "-m", "replaydiff", "record", "--tensors", "meta", "--step", "2", "-o",
                             "t", "--", sys.executable, "train.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())
    line = proc.stdout.readline()
    assert line.startswith("pid "), (line, proc.stderr.read() if proc.poll() is not None else "")
    time.sleep(0.7)  # some cat ops recorded
    os.kill(int(line.split()[1]), signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err

    tb = err[err.index("Traceback (most recent call last):"):err.index("\nKeyboardInterrupt")]
    files = re.findall(r'^  File "([^"]+)", line \d+', tb, flags=re.M)
    assert files and files[0].endswith("train.py"), tb
    package = os.path.dirname(os.path.abspath(replaydiff.__file__))
    assert not [f for f in files if os.path.abspath(f).startswith(package + os.sep)], tb
    assert "torch/_compile.py" not in tb and "simple_registry.py" not in tb, tb

    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    last = r.last_index if r.complete else r.truncated_after
    assert last is not None and last > 0 and r[last].name == "aten.cat.default"
    lines = err.splitlines()
    said = [x for x in lines if x.startswith("replaydiff: ")]
    assert said[0].startswith("replaydiff: the command was interrupted (Ctrl-C or SIGINT; exit code 130) before "
                              f"the recording finished. The trace t holds step 2 up to op #{last}, its last complete "
                              f"op: it reads up to there. Next"), err
    assert len(said) == 1, err  # the exit code was in that line: no second line about it
