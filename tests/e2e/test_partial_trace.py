"""A trace whose recording stopped part-way (the script raised or was interrupted mid-step) is partial: replay says
which rank, where it stops and why, and never calls it clean (exit 3); the health report's "recording complete" row
FAILs; diff says the side stopped and never exits 0 on it; and a report with any FAIL row exits non-zero."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

import replaydiff

from process_helpers import child_env  # the environment record's child runs in

# Three optimizer steps; at step 2, after the first layer's forward, the script ends: by an exception (a crash) or by
# a real SIGINT it sends itself (Ctrl-C, as a terminal delivers it).
SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        h = model[0](torch.randn(8, 4))
        if step == 2 and sys.argv[1] == "crash":
            raise RuntimeError("boom mid-step")
        if step == 2 and sys.argv[1] == "ctrl-c":
            # A shell's background job starts with SIGINT ignored; a terminal's Ctrl-C meets Python's own handler.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.kill(os.getpid(), signal.SIGINT)
        loss = model[2](model[1](h)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


def _record(cli, tmp_path: Path, how: str, *flags: str) -> Path:
    (tmp_path / "train.py").write_text(SCRIPT)
    out = tmp_path / f"t-{how}"
    proc = cli("record", *flags, "-o", out, "--", sys.executable, "train.py", how, cwd=tmp_path)
    assert proc.returncode != 0 or how == "whole", proc.stderr
    return out


@pytest.fixture
def cli(cli_as_child):
    """cli_here under child_env's environment (conftest's cli_as_child)."""
    return cli_as_child


@pytest.mark.parametrize("how, why", [("crash", "step 2 was cut short by the script's exception (RuntimeError: "
                                                "boom mid-step)"),
                                      ("ctrl-c", "step 2 was cut short: the script was interrupted "
                                                 "(KeyboardInterrupt)")])
def test_replay_of_a_recording_stopped_mid_step_is_partial_not_clean(cli, tmp_path, how, why):
    trace = _record(cli, tmp_path, how, "--steps", "1-3")
    rt = replaydiff.open_trace(trace).rank(0)
    assert rt.stopped == why
    last = rt.last_index
    assert rt[last].step == 2  # the trace holds step 1 whole and step 2 up to where the script ended

    proc = cli("replay", trace, "--json", tmp_path / "r.json")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no divergent op: every replayed op matches" not in proc.stdout
    assert f"  rank 0's recording stopped part-way after op #{last}: {why}\n" in proc.stdout
    assert f"not clean: the trace is partial: the recording stopped part-way (rank 0's after op #{last}; why " \
           f"above)" in proc.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["cut_short"] == [{"rank": 0, "last": last, "why": why}]

    proc = cli("report", trace, "--replay", tmp_path / "r.json", "--no-probe")
    assert proc.returncode == 3, proc.stderr
    row = next(x for x in proc.stdout.splitlines() if x.startswith("| recording complete |"))
    assert row == f"| recording complete | rank 0's recording stopped part-way after op #{last}: {why} | complete " \
                  f"| FAIL |"


def test_a_whole_recording_is_not_partial(cli, tmp_path):
    trace = _record(cli, tmp_path, "whole", "--steps", "1-3")
    assert replaydiff.open_trace(trace).rank(0).cut_short is None
    proc = cli("replay", trace)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "partial" not in proc.stdout


def test_a_block_of_the_python_api_that_raises_leaves_a_partial_trace(tmp_path):
    import torch

    lin = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError):
        with replaydiff.record(tmp_path / "t"):
            y = lin(torch.randn(3, 4))
            raise ValueError("the script's own error")
    cut = replaydiff.open_trace(tmp_path / "t").rank(0).cut_short
    assert cut is not None and cut.why == "the recorded block raised ValueError: the script's own error"
    assert y.shape == (3, 2)


def test_diff_against_a_trace_stopped_mid_step_says_so_and_is_not_clean(cli, tmp_path):
    whole = _record(cli, tmp_path, "whole", "--step", "2")
    crash = _record(cli, tmp_path, "crash", "--step", "2")
    last = replaydiff.open_trace(crash).rank(0).last_index
    proc = cli("diff", whole, crash, "--json", tmp_path / "d.json")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no difference: every compared op pair agrees" not in proc.stdout
    assert "  no difference among the ops both traces hold; not clean: a trace is partial (below)\n" in proc.stdout
    assert f"not clean: the target trace is partial: rank 0's recording stopped part-way after op #{last}: step 2 " \
           f"was cut short by the script's exception (RuntimeError: boom mid-step); what came after was never " \
           f"recorded, so not compared\n" in proc.stdout
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["cut_short"] == [{"side": "target", "rank": 0, "last": last, "why": "step 2 was cut short by the "
                                 "script's exception (RuntimeError: boom mid-step)"}]
    assert cli("diff", whole, whole).returncode == 0  # a whole trace against itself agrees


# A replicated forward on every rank (no collective needed to map it onto one process); with "stop" the recorded
# block then raises, on every rank, as a crash mid-step would: the ops both hold are the same.
PARALLEL = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    import replaydiff
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    x = torch.randn(8, 6)
    try:
        with replaydiff.record(sys.argv[1]):
            loss = model(x).square().mean()
            if sys.argv[2] == "stop":
                raise RuntimeError("crashed mid-step")
    except RuntimeError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
""")


@pytest.mark.slow
def test_parallel_diff_against_a_trace_stopped_mid_step_says_so_and_is_not_clean(cli, tmp_path):
    import subprocess

    (tmp_path / "p.py").write_text(PARALLEL)
    subprocess.run([sys.executable, "p.py", "single", "whole"], cwd=tmp_path, check=True, env=child_env(),
                   timeout=120)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "p.py",
                    "multi", "stop"], cwd=tmp_path, check=True, env=child_env(), capture_output=True, timeout=180)
    multi = replaydiff.open_trace(tmp_path / "multi")
    assert [c.rank for c in multi.cut_short] == [0, 1]
    proc = cli("diff", tmp_path / "single", tmp_path / "multi", "--json", tmp_path / "d.json")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ranks against one process" in proc.stdout  # the parallel diff, not rank by rank
    assert "agree: every compared op maps" not in proc.stdout
    for c in multi.cut_short:
        assert f"not clean: the target trace is partial: {c.describe()}" in proc.stdout
    assert [d["rank"] for d in json.loads((tmp_path / "d.json").read_text())["cut_short"]] == [0, 1]


NAN = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        loss = torch.log(torch.relu(model(torch.randn(8, 4)))).mean()  # log(0) = -inf reaches the loss
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


def _fail_rows(markdown: str) -> list[str]:
    return [x for x in markdown.splitlines() if x.startswith("| ") and x.endswith(" | FAIL |")]


def test_report_exits_1_when_a_check_fails_though_the_replay_found_no_divergent_op(cli, tmp_path):
    # steps 2-5 of a 3-step script: steps 2 and 3 whole, the recording ended before step 5 (a lost line, no stop)
    trace = _record(cli, tmp_path, "whole", "--steps", "2-5")
    assert replaydiff.open_trace(trace).rank(0).cut_short is None
    assert cli("replay", trace, "--json", tmp_path / "r.json").returncode == 0
    proc = cli("report", trace, "--replay", tmp_path / "r.json", "--no-probe")
    assert _fail_rows(proc.stdout) == ["| data lost while recording | 1 | 0 | FAIL |"]
    assert proc.returncode == 1, proc.stdout

    (tmp_path / "nan.py").write_text(NAN)
    assert cli("record", "-o", tmp_path / "n", "--", sys.executable, "nan.py", cwd=tmp_path).returncode == 0
    assert cli("replay", tmp_path / "n", "--json", tmp_path / "n.json").returncode == 0
    proc = cli("report", tmp_path / "n", "--replay", tmp_path / "n.json", "--no-probe")
    origin = next(op.index for op in replaydiff.open_trace(tmp_path / "n").rank(0) if op.name == "aten.log.default")
    fails = _fail_rows(proc.stdout)
    assert len(fails) == 1 and fails[0].startswith(f"| NaN/Inf origin | #{origin} aten.log.default"), fails
    assert proc.returncode == 1, proc.stdout
