"""Ctrl-C during ``replaydiff record -- python train.py``: the interrupt is the job's. Its traceback shows the job's
frames, none of the recorder's (which was on the stack: it read as replaydiff crashing), and record says in one line
that the command was interrupted and what the trace holds. A real SIGINT to the recorded child, as a terminal's
Ctrl-C delivers it, or to the whole process group without a terminal, as `timeout -s INT` or a CI runner sends it
(record itself does not pass on a SIGINT the group got)."""
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


HANDLED = textwrap.dedent("""
    import os, sys, time
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = [torch.ones(1) for _ in range(3000)]
    try:
        for step in range(1, 4):
            loss = model(torch.randn(8, 4)).square().mean()
            if step == 2:
                for _ in range(20):
                    torch.cat(parts)
                print("pid", os.getpid(), flush=True)
                while True:  # the job's own Python code: an interrupt here is raised at once
                    pass
            loss.backward()
            opt.step()
            opt.zero_grad()
    except KeyboardInterrupt:
        time.sleep(1)  # the job's own cleanup: a second SIGINT would cut it short
        with open("interrupts", "a") as f:
            f.write("caught\\n")
        raise
""")


@pytest.mark.slow
def test_sigint_to_the_process_group_without_a_terminal_reaches_the_job_once(tmp_path):
    """`timeout -s INT`, a CI runner or a scheduler sends SIGINT to the whole process group, with no terminal: the
    job gets it from the group, and record does not pass on a second one (which landed in the recorder's exit
    handlers, a traceback of replaydiff's own). The trace reads up to the cut, partial: never clean."""
    (tmp_path / "train.py").write_text(HANDLED)
    proc = subprocess.Popen([sys.executable, "-m", "replaydiff", "record", "--tensors", "meta", "--step", "2", "-o",
                             "t", "--", sys.executable, "train.py"], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pid "), (line, proc.stderr.read() if proc.poll() is not None else "")
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # never leave the spinning job behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    caught = tmp_path / "interrupts"  # the job's handler ran once, whole: no second SIGINT cut its cleanup
    assert caught.exists() and caught.read_text() == "caught\n", err
    assert "Exception ignored" not in err, err
    assert err.count("Traceback (most recent call last):") == 1, err  # the job's own KeyboardInterrupt
    tb = err[err.index("Traceback (most recent call last):"):err.index("\nKeyboardInterrupt")]
    package = os.path.dirname(os.path.abspath(replaydiff.__file__))
    assert package not in tb, tb
    assert [x for x in err.splitlines() if x.startswith("replaydiff: ")][0].startswith(
        "replaydiff: the command was interrupted (Ctrl-C or SIGINT; exit code 130) before the recording finished"), err

    show = subprocess.run([sys.executable, "-m", "replaydiff", "show", "t"], cwd=tmp_path, capture_output=True,
                          text=True, env=child_env(), timeout=120)
    assert show.returncode == 3 and "step 2 was cut short: the script was interrupted" in show.stderr, \
        (show.stdout, show.stderr)
