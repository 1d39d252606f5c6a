"""Two `replaydiff record` runs into one directory: the second is refused in one line, exit 2, before its job starts,
and the first's trace is left whole (the second's clean-up once deleted it when its step was never reached)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import replaydiff
from replaydiff.cli.main import main
from replaydiff.trace.ownership import holder

WAITING_STEP = """
import pathlib, sys, time, torch
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.05)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(3, 4)).sum().backward()
opt.step()
"""


def test_a_second_record_into_a_directory_being_recorded_is_refused_before_its_job(tmp_path, capsys):
    script, go, out = tmp_path / "train.py", tmp_path / "go", tmp_path / "trace"
    script.write_text(WAITING_STEP)
    first = subprocess.Popen([sys.executable, "-m", "replaydiff", "record", "-o", str(out), "--", sys.executable,
                              str(script), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while holder(out) is None:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        marker = tmp_path / "second-job-ran"
        # a step the second job never reaches: its clean-up would remove what is in the directory
        code = main(["record", "--step", "5", "-o", str(out), "--", sys.executable, "-c",
                     f"open({str(marker)!r}, 'w')"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert len(err) == 1 and "another recording" in err[0] and str(out) in err[0], err
        assert not marker.exists(), "the second job started"
    finally:
        go.write_text("go")
        _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert "recorded step 1" in stderr, stderr
    rt = replaydiff.open_trace(out).rank(0)
    assert rt.complete and len(rt) > 0
    assert sorted(p.name for p in Path(out).iterdir()) == ["rank0"]
