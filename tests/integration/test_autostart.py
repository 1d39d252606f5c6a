"""The child's ``sitecustomize`` (replaydiff/record/autostart): what it does when arming the recorder fails."""
from __future__ import annotations

import importlib
import signal
import subprocess
import sys
from pathlib import Path

# (replaydiff.record is also the name of a function: the module by its full name)
env_module = importlib.import_module("replaydiff.record.autostart._replaydiff_record_env")

AUTOSTART = Path(env_module.__file__).parent


def _child(tmp_path: Path, arming: str) -> subprocess.CompletedProcess:
    """A Python started as ``replaydiff record`` starts the job, whose ``replaydiff.record.child_arming`` (a stand-in
    ahead on the path) runs ``arming`` at import."""
    fake = tmp_path / "fake" / "replaydiff" / "record"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "child_arming.py").write_text(f"{arming}\ndef install():\n    pass\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{AUTOSTART}:{tmp_path / 'fake'}", env_module.ENV_VAR: "{}"}
    return subprocess.run([sys.executable, "-c", "print('the job ran')"], env=env, capture_output=True, text=True,
                          timeout=60)


def test_ctrl_c_while_the_recorder_loads_ends_the_job_as_python_does(tmp_path):
    """Found by a new-user trial: Ctrl-C while the child imported torch gave 'Fatal Python error: init_import_site'
    and a traceback through sitecustomize.py, exit 1. Now: killed by SIGINT, one line, the job never started."""
    done = _child(tmp_path, "raise KeyboardInterrupt")
    assert done.returncode in (-signal.SIGINT, 130), (done.returncode, done.stderr)
    assert done.stderr == "KeyboardInterrupt\n", done.stderr
    assert "the job ran" not in done.stdout


def test_an_error_while_arming_warns_once_and_the_job_runs(tmp_path):
    done = _child(tmp_path, "raise RuntimeError('no recorder here')")
    assert done.returncode == 0 and done.stdout == "the job ran\n", done
    assert done.stderr == "replaydiff: step recording not armed: no recorder here\n", done.stderr
