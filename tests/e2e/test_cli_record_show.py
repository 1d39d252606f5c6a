"""``replaydiff record`` and ``replaydiff show``, run as a user would: the recorded jobs are processes of their own;
``replaydiff`` itself is a subprocess of ``python -m replaydiff`` in the tests about its process (the shared recording,
a closed pipe, one-line errors, signals) and ``main`` in this process (the ``cli`` fixture) in the others, which
spares a torch import per call."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff import open_trace
from replaydiff.cli.main import main
from replaydiff.trace import TensorRef, iter_refs
from replaydiff.trace.format import pack_frame, read_frame, write_atomic

from process_helpers import child_env

TRAIN = textwrap.dedent("""
    import json, sys
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    for step in range(3):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("LOSSES " + json.dumps(losses), flush=True)
    sys.exit(3)
""")

TRAIN_DDP = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()
""")


def replaydiff_cli(*args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replaydiff", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=child_env())


@pytest.fixture
def cli(cli_as_child):
    """cli_here under child_env's environment (conftest's cli_as_child)."""
    return cli_as_child


def tree(d: Path) -> dict[str, bytes | None]:
    """Every path under ``d`` with its bytes (None for a directory): what a refused command must leave as it was."""
    return {str(p.relative_to(d)): (None if p.is_dir() else p.read_bytes()) for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """``replaydiff record --step 2`` of the three-step script; shared by the record and show tests."""
    cwd = tmp_path_factory.mktemp("cli")
    (cwd / "train.py").write_text(TRAIN)
    proc = replaydiff_cli("record", "--step", "2", "-o", "trace", "--", sys.executable, "train.py", cwd=cwd)
    return cwd, proc


def test_record_of_step_2_of_a_script_holds_that_step_and_passes_its_exit_code_on(recorded):
    cwd, proc = recorded
    assert proc.returncode == 3, proc.stderr  # the script's own exit code passes through
    assert "Traceback" not in proc.stderr, proc.stderr
    losses = json.loads(re.search(r"LOSSES (.*)", proc.stdout).group(1))
    assert len(losses) == 3  # the recording did not stop the script
    assert "replaydiff show trace" in proc.stderr and "replaydiff replay trace" in proc.stderr
    r = open_trace(cwd / "trace").rank(0)
    assert r.complete and r.lost == []
    ops = list(r)
    phases = Counter(o.phase for o in ops)
    assert phases["forward"] and phases["backward"] and phases["optimizer"]
    assert any(o.name == "aten.addmm.default" and o.phase == "forward" for o in ops)
    assert any(o.name == "aten.addcdiv_.default" and o.phase == "optimizer" for o in ops)
    assert {o.module for o in ops if o.name == "aten.addmm.default"} == {"Sequential.0", "Sequential.2"}
    # Exactly step 2: one loss computed, and it is the second step's.
    (mse,) = [o for o in ops if o.name == "aten.mse_loss.default"]
    assert r.tensor(mse.outputs).item() == losses[1]
    # Step 2 is not the first: no optimizer state is created (AdamW's zeros_like happens in step 1 only).
    assert not any(o.name == "aten.zeros_like.default" for o in ops)


def test_record_of_step_1_starts_in_the_first_module_call_with_full_module_paths(tmp_path, cli):
    (tmp_path / "train.py").write_text(TRAIN)
    proc = cli("record", "--step", "1", "-o", "trace", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    ops = list(open_trace(tmp_path / "trace").rank(0))
    (mse,) = [o for o in ops if o.name == "aten.mse_loss.default"]
    assert ops[0].phase == "forward"
    # Recording starts inside the first module call: paths are still full ones.
    assert {o.module for o in ops if o.name == "aten.addmm.default"} == {"Sequential.0", "Sequential.2"}
    assert any(o.name == "aten.zeros_like.default" and o.phase == "optimizer" for o in ops)


def test_record_refuses_an_existing_directory(recorded, cli):
    cwd, _ = recorded
    before = sorted(p.name for p in (cwd / "trace").rglob("*"))
    proc = cli("record", "-o", "trace", "--", sys.executable, "train.py", cwd=cwd)
    assert proc.returncode == 2
    assert "--force" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in (cwd / "trace").rglob("*")) == before


def test_show_summary_counts_ops_phases_the_most_frequent_ops_bytes_and_environment(recorded, cli):
    cwd, _ = recorded
    proc = cli("show", "trace", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    r = open_trace(cwd / "trace").rank(0)
    ops = list(r)
    phases = Counter(o.phase for o in ops)
    assert f"1 rank(s), {len(ops)} ops" in out
    assert "rank 0:" in out
    assert "phases: " + ", ".join(f"{k} {v}" for k, v in sorted(phases.items())) in out
    top_name, top_count = Counter(o.name for o in ops).most_common(1)[0]
    assert re.search(rf"\b{top_count}\s+{re.escape(top_name)}\b", out)
    assert "most frequent of" in out
    assert re.search(r"\d+(\.\d)? (B|KiB|MiB) on disk", out)
    assert f"torch {torch.__version__}" in out and "threads" in out and "flags:" in out


def test_show_op_gives_its_arguments_shapes_producers_phase_and_module(recorded, cli):
    cwd, _ = recorded
    r = open_trace(cwd / "trace").rank(0)
    ops = list(r)
    # The second layer's addmm: its input was made by an earlier recorded op.
    producer = {}
    for o in ops:
        for ref in iter_refs([o.outputs, [after for _, after in o.writes]]):
            producer.setdefault(ref.version, o.index)
    target = [o for o in ops if o.name == "aten.addmm.default" and o.phase == "forward"][1]
    made = [producer[a.version] for a in target.args if isinstance(a, TensorRef) and a.version in producer
            and producer[a.version] < target.index]
    assert made
    proc = cli("show", "trace", "--op", target.index, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"op #{target.index} aten.addmm.default" in out
    assert "arguments:" in out and "outputs" in out
    for a in target.args:
        if isinstance(a, TensorRef):
            assert f"float32{list(a.shape)}" in out
    assert f"<- op #{made[0]}" in out
    assert "phase   forward" in out and "Sequential.2" in out


@pytest.mark.slow
def test_show_op_gives_the_recorded_source_text_and_says_when_the_file_changed(tmp_path, cli):
    (tmp_path / "train.py").write_text(TRAIN)
    proc = cli("record", "--step", "1", "-o", "trace", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    mse = next(o for o in open_trace(tmp_path / "trace").rank(0) if o.name == "aten.mse_loss.default")
    lineno = TRAIN.splitlines().index("    loss = F.mse_loss(model(x), y)") + 1
    assert mse.source == f"train.py:{lineno}"
    shown = cli("show", "trace", "--op", mse.index, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"  source  train.py:{lineno}  loss = F.mse_loss(model(x), y)\n" in shown.stdout
    assert "changed" not in shown.stdout
    # The user edits train.py: the recorded text is still shown, with a warning saying where that line is now.
    edited = "# tuned\n" + TRAIN.replace("F.mse_loss(model(x), y)", "F.l1_loss(model(x), y)")
    (tmp_path / "train.py").write_text(edited)
    shown = cli("show", "trace", "--op", mse.index, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"  source  train.py:{lineno}  loss = F.mse_loss(model(x), y)\n" in shown.stdout
    assert "train.py has changed since it was recorded; the recorded line is no longer in it\n" in shown.stdout
    assert "l1_loss" not in shown.stdout  # today's file is never shown: only the trace's own text


@pytest.mark.slow
def test_show_corrupt_trace_is_one_line_and_exit_3(recorded, tmp_path):
    cwd, _ = recorded
    shutil.copytree(cwd / "trace", tmp_path / "bad")
    chunk = sorted((tmp_path / "bad" / "rank0" / "ops").glob("*.rdt"))[0]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    chunk.write_bytes(bytes(raw))
    proc = replaydiff_cli("show", "bad", cwd=tmp_path)
    assert proc.returncode == 3
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and chunk.name in lines[0], proc.stderr
    # A manifest of a newer format: same treatment, and the message says why.
    path = tmp_path / "bad" / "rank0" / "manifest.rdt"
    write_atomic(path, pack_frame(dict(read_frame(path), version=999), None))
    proc = replaydiff_cli("show", "bad", "--op", 0, cwd=tmp_path)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "manifest.rdt" in lines[0] and "newer" in lines[0], proc.stderr


@pytest.mark.slow
def test_record_under_torchrun_writes_a_complete_trace_per_rank_with_its_collectives(tmp_path, cli):
    (tmp_path / "train_ddp.py").write_text(TRAIN_DDP)
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    proc = cli("record", "--step", "1", "-o", "trace", "--", *launcher, "--standalone",
               "--nproc-per-node", "2", "train_ddp.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stderr
    assert (tmp_path / "trace" / "rank0").is_dir() and (tmp_path / "trace" / "rank1").is_dir()
    tr = open_trace(tmp_path / "trace")
    assert sorted(tr.ranks) == [0, 1]
    for r in tr:
        assert r.complete and r.manifest["world_size"] == 2 and r.environment.rank == r.rank
        ops = list(r)
        assert {"forward", "backward", "optimizer"} <= {o.phase for o in ops}
        coll = [o for o in ops if o.collective is not None]
        assert coll and all(o.collective.size == 2 for o in coll)


def test_output_into_a_closed_pipe_exits_quietly(tmp_path):
    """`replaydiff replay trace --json - | head -1`: no BrokenPipeError traceback once the reader has gone."""
    from replaydiff import record

    with record(tmp_path / "t"):
        x = torch.randn(4, 4)
        for _ in range(3):
            x = x @ x.T / 4
    r, w = os.pipe()
    os.close(r)  # the reader is already gone: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "replaydiff", "replay", str(tmp_path / "t"), "--json", "-"],
                              stdout=w, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(w)
    err = proc.stderr.decode()
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err


# -- record --force replaces a trace and nothing else ------------------------------------------------------------
def test_force_in_the_working_directory_keeps_the_users_script(tmp_path):
    """`record --step 3 --force -o . -- python train.py` once deleted the directory, train.py included."""
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "data.txt").write_text("the user's")
    before = tree(tmp_path)
    proc = replaydiff_cli("record", "--step", "3", "--force", "-o", ".", "--", sys.executable, "train.py",
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "working directory" in lines[0], proc.stderr
    assert "LOSSES" not in proc.stdout  # refused before the script ran
    assert tree(tmp_path) == before


def test_force_refuses_whatever_is_not_wholly_a_trace(recorded, tmp_path, monkeypatch, capsys):
    """The working directory, its parents and the home directory are refused even when they hold a trace; so is a
    directory with anything in it a trace does not hold (a file, a symbolic link in place of a rank directory), and
    a file. Each is one line, exit 2, and nothing is touched."""
    cwd, _ = recorded
    work = tmp_path / "work"
    shutil.copytree(cwd / "trace", work / "inner")  # the working directory is itself a trace
    shutil.copytree(cwd / "trace", work / "mixed")
    (work / "mixed" / "notes.txt").write_text("mine")
    shutil.copytree(cwd / "trace", work / "linked")
    (work / "elsewhere").mkdir()
    (work / "elsewhere" / "keep.txt").write_text("mine")
    (work / "linked" / "rank1").symlink_to(work / "elsewhere")
    (work / "plain").mkdir()
    (work / "plain" / "a.txt").write_text("mine")
    (work / "train.py").write_text(TRAIN)
    shutil.copytree(cwd / "trace", tmp_path / "home")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(work / "inner")
    cases = [(".", "working directory"), ("..", "parent of the working directory"),
             (str(tmp_path), "parent of the working directory"), ("~", "home directory"),
             ("../mixed", "notes.txt"), ("../linked", "rank1"), ("../plain", "a.txt"),
             ("../train.py", "not a directory")]
    before = tree(tmp_path)
    for out, why in cases:
        code = main(["record", "--force", "-o", os.path.expanduser(out), "--", sys.executable, "-c", "pass"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and why in err[0], (out, err)
        assert tree(tmp_path) == before, out
    # Without --force, a file given as -o is the same one line (it was a NotADirectoryError traceback).
    assert main(["record", "-o", "../train.py", "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a directory" in err[0], err


@pytest.mark.slow
def test_force_replaces_a_trace_file_by_file(recorded, tmp_path, cli):
    """A real trace is replaced: its rank directories (a rank the new job no longer has included) and the
    temporary files a killed writer leaves go; the new recording is what the directory then holds."""
    cwd, _ = recorded
    shutil.copytree(cwd / "trace", tmp_path / "trace")
    shutil.copytree(cwd / "trace" / "rank0", tmp_path / "trace" / "rank1")  # an earlier two-rank job
    (tmp_path / "trace" / "rank0" / "manifest.rdt.tmp").write_bytes(b"RDT\x01")  # a writer killed mid-rename
    (tmp_path / "train.py").write_text(TRAIN)
    proc = cli("record", "--step", "1", "--force", "-o", "trace", "--", sys.executable, "train.py",
               cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr  # the script's own exit code
    assert "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "trace").iterdir()) == ["rank0"]
    assert not list((tmp_path / "trace").rglob("*.tmp"))
    r = open_trace(tmp_path / "trace").rank(0)
    assert r.complete
    # Step 1, not the old step 2: AdamW creates its state (zeros_like) in the first step only.
    assert any(o.name == "aten.zeros_like.default" for o in r)
    assert (tmp_path / "train.py").read_text() == TRAIN


# -- a file where a trace directory is expected --------------------------------------------------------------------
def test_a_file_given_as_a_trace_is_one_line_and_exit_3(recorded, tmp_path, capsys):
    cwd, _ = recorded
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    trace = str(cwd / "trace")
    for argv in (["show", script], ["replay", script], ["tui", script], ["trend", script],
                 ["repro", script, "0", "-o", tmp_path / "r"], ["diff", trace, script], ["diff", script, trace]):
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 3 and len(err) == 1 and "train.py" in err[0] and "not a" in err[0], (argv, err)
    assert script.read_text() == TRAIN and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_removed_data_file_is_one_line_and_nothing_after_it(recorded, tmp_path):
    """The reader reports it in one line, and no destructor prints `Exception ignored in: DataFile.__del__` after it."""
    cwd, _ = recorded
    shutil.copytree(cwd / "trace", tmp_path / "t")
    data = sorted((tmp_path / "t" / "rank0" / "data").glob("*.safetensors"))
    assert data
    for f in data:
        f.unlink()
    proc = replaydiff_cli("replay", "t", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0] and ".safetensors" in lines[0], proc.stderr


def test_show_says_a_trace_copied_in_part_is_damaged(recorded, tmp_path, capsys):
    """A data file cut short: show describes the trace as DAMAGED (never as whole, the manifest's word) and exits 3,
    in text and in JSON."""
    cwd, _ = recorded
    assert main(["show", str(cwd / "trace")]) == 0
    assert "DAMAGED" not in capsys.readouterr().out
    shutil.copytree(cwd / "trace", tmp_path / "t")
    data = sorted((tmp_path / "t" / "rank0" / "data").glob("*.safetensors"))
    size = data[0].stat().st_size
    with open(data[0], "r+b") as f:
        f.truncate(size - 10)
    assert main(["show", str(tmp_path / "t")]) == 3  # described, and never as whole
    out = capsys.readouterr().out
    assert "rank 0: " in out and "(DAMAGED: 10 B of its op and data files are missing" in out, out
    assert main(["show", str(tmp_path / "t"), "--json"]) == 3
    js = json.loads(capsys.readouterr().out)
    assert js["format"] == "replaydiff.show/1" and js["ranks"][0]["bytes_missing"] == 10
CNN = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 1, 6, 6), torch.tensor([0, 2])
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
""")


SMALL_PLANT = "aten.convolution_backward.default:1:1e-9"
ROUNDS_BACK = "changed nothing (all 18 elements of output 1 (output 0 is None) round back to their float32 values)"


@pytest.fixture(scope="module")
def conv_backward_plant(tmp_path_factory):
    """A plant on the first conv layer's backward so small that it changes nothing: its output 0, the input's
    gradient, is None (the batch needs no gradient), so it lands on output 1, the weight's gradient, where a REL of
    1e-9 rounds back to every float32 value."""
    cwd = tmp_path_factory.mktemp("plant")
    (cwd / "cnn.py").write_text(CNN)
    proc = replaydiff_cli("record", "--plant", SMALL_PLANT, "-o", "trace", "--", sys.executable, "cnn.py", cwd=cwd)
    return cwd, proc


@pytest.mark.slow
def test_record_says_a_plant_changed_nothing_and_where_it_landed(conv_backward_plant):
    cwd, proc = conv_backward_plant
    assert proc.returncode == 0, proc.stderr
    rt = open_trace(cwd / "trace").rank(0)
    p = rt.planted
    op = rt[p.index]
    assert (op.name, op.module, op.phase) == ("aten.convolution_backward.default", "Sequential.0", "backward")
    assert op.outputs[0] is None
    assert (p.landed, p.effect.tensors, p.effect.changed) == (True, 1, 0)
    assert (f"replaydiff: warning: the planted fault ({SMALL_PLANT}) landed on op #{op.index} "
            f"aten.convolution_backward.default in Sequential.0 (backward) but {ROUNDS_BACK}; replay will have "
            f"nothing to find: plant a larger REL (--plant OP:N:REL), or another call or op\n") in proc.stderr
    assert "replay should name that op" not in proc.stderr


def test_replay_of_a_plant_that_changed_nothing_says_so_and_exits_0(conv_backward_plant, cli):
    cwd, _ = conv_backward_plant
    rt = open_trace(cwd / "trace").rank(0)
    text = cli("replay", "trace", cwd=cwd)
    assert text.returncode == 0, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == (f"PLANTED FAULT (record --plant): aten.convolution_backward.default call 1 x(1+1e-09), "
                        f"op #{rt.planted.index} on rank 0: {ROUNDS_BACK}")
    assert (f"planted fault: op #{rt.planted.index} aten.convolution_backward.default {ROUNDS_BACK}: there was "
            f"nothing for replay to find") in lines
    assert not any(w in text.stdout for w in ("missed", "NOT", "not found"))
    js = cli("replay", "trace", "--json", "-", cwd=cwd)
    assert js.returncode == 0
    doc = json.loads(js.stdout)
    assert [(q["index"], q["outcome"], q["landed"]) for q in doc["plants"]] == [(rt.planted.index, "no_effect", True)]
    assert doc["plants"][0]["note"] in lines


@pytest.mark.slow
def test_record_warns_at_the_end_when_the_planted_op_never_ran(tmp_path, cli):
    (tmp_path / "cnn.py").write_text(CNN)
    proc = cli("record", "--plant", "aten.nosuch.default", "-o", "trace", "--", sys.executable, "cnn.py",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    warning = ("replaydiff: warning: --plant aten.nosuch.default planted nothing: the recording never ran "
               "aten.nosuch.default (`replaydiff show` lists the ops it ran)")
    assert warning in proc.stderr.splitlines()
    assert "replay should name that op" not in proc.stderr
    p = open_trace(tmp_path / "trace").rank(0).planted
    assert (p.op, p.landed, p.calls_seen, p.index) == ("aten.nosuch.default", False, 0, None)


@pytest.mark.slow
def test_record_of_statistics_points_to_diff_not_replay(tmp_path, cli):
    """A statistics trace cannot be replayed: the next command record prints fits the trace."""
    (tmp_path / "train.py").write_text(TRAIN)
    proc = cli("record", "--step", "2", "--tensors", "stats", "-o", "trace", "--", sys.executable,
               "train.py", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr  # the script's own exit code
    # 3 is also replaydiff's "unreadable trace": the summary and the last line say it is the command's
    assert "recorded step 2 into trace (1 rank(s)), but then the command exited with code 3. Next" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "replaydiff: the command exited with code 3; record exits with the " \
                                           "command's code", proc.stderr
    assert "replaydiff replay" not in proc.stderr, proc.stderr
    assert "replaydiff diff" in proc.stderr and "replaydiff show trace" in proc.stderr, proc.stderr
    assert "cannot be replayed" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_record_of_a_step_the_script_never_reaches(tmp_path, cli):
    """`--step 10` of a 3-step script recorded nothing, left an empty trace directory and exited 0."""
    (tmp_path / "train.py").write_text(TRAIN.replace("sys.exit(3)", ""))
    (tmp_path / "mine").mkdir()  # the user's (empty) directory: it was there before, it stays
    proc = cli("record", "--step", "10", "-o", "mine/runs/trace", "--", sys.executable, "train.py",
               cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr  # the usage code: nothing diverged, step 10 is not in this job
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "step 10 was never reached: the script ran 3 steps of its first optimizer" in proc.stderr, proc.stderr
    # neither the trace directory nor the parent made for it is left; the user's directory is
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())


def test_record_of_step_1_of_a_script_without_modules_says_why_nothing_was_recorded(tmp_path, cli):
    """Step 1's recording starts at the first module call: a script of functional calls on bare tensors has none, so
    `--step 1` records nothing, and says so with what to do instead (it said "no process said how many optimizer
    steps it ran"); `--step 2` of the same script records its step."""
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F

        torch.manual_seed(0)
        w = torch.randn(3, 4, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        x, y = torch.randn(8, 4), torch.randn(8, 3)
        for step in range(2):
            F.mse_loss(F.linear(x, w), y).backward()
            opt.step()
            opt.zero_grad()
    """))
    proc = cli("record", "--step", "1", "-o", "t1", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "step 1 called no torch.nn.Module before its optimizer step" in proc.stderr, proc.stderr
    assert "record step 2 (`--step 2`" in proc.stderr and proc.stderr.count("step 1 called no") == 1, proc.stderr
    assert not (tmp_path / "t1").exists()
    proc = cli("record", "--step", "2", "-o", "t2", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert any(op.name == "aten.mse_loss.default" for op in open_trace(tmp_path / "t2").rank(0))


@pytest.mark.slow
def test_record_of_the_step_after_the_last_is_never_reached_and_a_range_says_what_it_got(tmp_path, cli):
    """`--step 4` of a 3-step script is a step never reached, like `--step 10` (exit 2, no directory; never the
    script's tail after its last step as a trace); `--steps 2-4` names the steps it got and the one it never
    reached, exit 0."""
    (tmp_path / "train.py").write_text(TRAIN.replace("sys.exit(3)", ""))
    proc = cli("record", "--step", "4", "-o", "s4", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "nothing was recorded into s4: step 4 was never reached: the script ran 3 steps of its first optimizer" \
        in proc.stderr, proc.stderr
    assert "recorded step" not in proc.stderr and not (tmp_path / "s4").exists(), proc.stderr
    proc = cli("record", "--steps", "2-4", "-o", "s24", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "recorded steps 2-3 into s24 (1 rank(s)). Step 4 was never reached: the script ran 3 steps of its first optimizer." \
        in proc.stderr, proc.stderr
    assert "recorded steps 2-4" not in proc.stderr and proc.stdout.startswith("LOSSES"), proc.stderr


@pytest.mark.slow
def test_record_with_no_process_of_the_ranks_asked_says_the_rank_it_ran_as(tmp_path, cli):
    """`--rank 7` of a single-process job: no process had a rank in --rank 7, and the line says it ran as rank 0
    (the hook did run); exit 2, nothing written."""
    (tmp_path / "train.py").write_text(TRAIN.replace("sys.exit(3)", ""))
    proc = cli("record", "--step", "2", "--ranks", "7", "-o", "rk", "--", sys.executable, "train.py",
               cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        "replaydiff: nothing was recorded into rk: no process of the command had a rank in --rank 7: it ran as " \
        "rank 0", proc.stderr
    assert not (tmp_path / "rk").exists()


def test_force_is_offered_only_for_a_directory_it_would_replace(recorded, tmp_path, monkeypatch, capsys):
    """`record -o` on a folder holding a user's file says --force would not replace it, naming the file; on a
    trace it offers --force. Neither is touched."""
    cwd, _ = recorded
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    shutil.copytree(cwd / "trace", tmp_path / "old")
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    code, _, err = _cli_main(capsys, "record", "-o", "other", "--", sys.executable, "-c", "pass")
    assert code == 2 and err.strip() == (
        "replaydiff: error: other exists and is not empty, and --force would not replace it: notes.txt is not a "
        "rank<N>/ directory of a trace (remove it yourself or choose another directory); choose another -o"), err
    code, _, err = _cli_main(capsys, "record", "-o", "old", "--", sys.executable, "-c", "pass")
    assert code == 2, err
    assert err.strip() == "replaydiff: error: old exists and holds a trace; pass --force to replace it", err
    assert tree(tmp_path) == before


def _cli_main(capsys, *args) -> tuple[int, str, str]:
    from replaydiff.cli.main import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_rank_not_in_the_trace_is_a_usage_error_in_every_verb(recorded, tmp_path, capsys):
    """A rank the trace does not hold is exit 2 with one sentence in every verb (not exit 3, a damaged trace)."""
    cwd, _ = recorded
    t = cwd / "trace"
    for verb in (["replay", t, "--rank", 5], ["show", t, "--rank", 5], ["show", t, "--op", 0, "--rank", 5],
                 ["show", t, "--list", "--rank", 5], ["diff", t, t, "--rank", 5], ["trend", t, "--rank", 5],
                 ["repro", t, 0, "--rank", 5, "-o", tmp_path / "repro"], ["tui", t, "--rank", 5]):
        code, out, err = _cli_main(capsys, *verb)
        assert code == 2, (verb, err)
        assert out == "" and err.count("\n") == 1, (verb, err)
        assert "rank 5 is not in" in err and "(ranks: [0])" in err, (verb, err)
    assert not (tmp_path / "repro").exists()


def _list_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines()]


def test_show_list_one_line_per_op_from_the_index(recorded, capsys):
    cwd, _ = recorded
    r = open_trace(cwd / "trace").rank(0)
    ops = list(r)
    code, out, err = _cli_main(capsys, "show", cwd / "trace", "--list")
    assert code == 0, err
    rows = _list_rows(out)
    assert [int(row[0]) for row in rows] == [o.index for o in ops]
    for row, o in zip(rows, ops):
        assert row[1:4] == [o.name, o.module or "-", o.phase or "-"], row
        first = o.outputs_refs()[0] if o.outputs_refs() else None
        if first is not None:
            assert " ".join(row[4:]) == first.describe(), (row, first.describe())
    # filters: name and module globs, phase, a range; they combine
    code, out, _ = _cli_main(capsys, "show", cwd / "trace", "--list", "--op", "aten.addmm*")
    assert [int(row[0]) for row in _list_rows(out)] == [o.index for o in ops if o.name == "aten.addmm.default"]
    code, out, _ = _cli_main(capsys, "show", cwd / "trace", "--list", "--module", "Sequential.2", "--phase",
                             "backward")
    want = [o.index for o in ops if o.module == "Sequential.2" and o.phase == "backward"]
    assert want and [int(row[0]) for row in _list_rows(out)] == want
    code, out, _ = _cli_main(capsys, "show", cwd / "trace", "--list", "--from", 3, "--to", 7)
    assert [int(row[0]) for row in _list_rows(out)] == [3, 4, 5, 6, 7]
    # --json for machines: the same rows
    code, out, _ = _cli_main(capsys, "show", cwd / "trace", "--list", "--phase", "optimizer", "--json")
    doc = json.loads(out)
    assert doc["format"] == "replaydiff.oplist/1" and doc["rank"] == 0
    assert [(d["index"], d["op"], d["module"], d["phase"]) for d in doc["ops"]] == \
        [(o.index, o.name, o.module, o.phase) for o in ops if o.phase == "optimizer"]


def test_show_list_usage_errors(recorded, capsys):
    cwd, _ = recorded
    last = open_trace(cwd / "trace").rank(0).last_index
    for args, said in ((["--list", "--from", last + 1], f"past the last op (#{last})"),
                       (["--list", "--from", 5, "--to", 2], "--from 5 is after --to 2"),
                       (["--module", "Sequential.0"], "--list"),
                       (["--op", "aten.mm*"], "--list --op")):
        code, out, err = _cli_main(capsys, "show", cwd / "trace", *args)
        assert code == 2, (args, err)
        assert out == "" and err.count("\n") == 1 and said in err, (args, err)


def test_record_help_says_steps_are_counted_on_the_first_optimizer(capsys):
    """With two optimizers in one loop, --step N is the N-th step() of the first optimizer that steps: --help says
    so."""
    with pytest.raises(SystemExit) as exit_:
        main(["record", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "which optimizer step to record, from 1 (default 1; with several optimizers, the steps of the first one " \
           "to step)" in text


@pytest.mark.slow
def test_record_says_when_the_recording_stopped_part_way(tmp_path, cli):
    """A recorder that stops part-way (here: its module statistics fail): the summary line and show say it stopped,
    and why, never `recorded steps 1-3`. The job's exit code is passed through."""
    (tmp_path / "train.py").write_text(
        "from replaydiff.record.module_stats import ModuleStatsHooks\n"
        "def boom(*a, **k):\n    raise RuntimeError('injected')\n"
        "ModuleStatsHooks._record = boom\n" + TRAIN)
    proc = cli("record", "--tensors", "stats", "--granularity", "module", "--steps", "1-3", "-o", "t",
               "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "recorded steps 1-3" not in proc.stderr, proc.stderr
    assert "replaydiff: recording STOPPED part-way: parameter statistics failed (RuntimeError: injected). The trace " \
           "t (1 rank(s)) holds what was recorded before that, not all of steps 1-3." in proc.stderr, proc.stderr
    show = cli("show", "t", cwd=tmp_path)
    assert "STOPPED part-way: parameter statistics failed (RuntimeError: injected)" in show.stdout, show.stdout
    assert "complete" not in show.stdout, show.stdout


@pytest.mark.slow
def test_record_of_a_step_the_script_raises_in_says_it_was_cut_short(tmp_path, cli):
    """`--step 3` of a script that raises during step 3 ended in a traceback of replaydiff's own (IndexError in
    _steps_text) and show called the cut step `complete`."""
    (tmp_path / "train.py").write_text(TRAIN.replace("    loss = F.mse_loss(model(x), y)\n",
                                                     "    loss = F.mse_loss(model(x), y)\n"
                                                     "    if step == 2:\n        raise ValueError('shape bug')\n"))
    proc = cli("record", "--step", "3", "-o", "t", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr  # the script's own code
    assert "IndexError" not in proc.stderr and proc.stderr.count("Traceback") == 1, proc.stderr
    assert "replaydiff: recording STOPPED part-way: step 3 was cut short by the script's exception (ValueError: " \
           "shape bug). The trace t (1 rank(s)) holds what was recorded before that, not all of step 3." \
           in proc.stderr, proc.stderr
    show = cli("show", "t", cwd=tmp_path)
    assert "STOPPED part-way: step 3 was cut short by the script's exception (ValueError: shape bug)" in show.stdout
    assert "complete" not in show.stdout, show.stdout



@pytest.mark.slow
def test_record_of_a_step_killed_by_a_signal_says_it_was_cut_short(tmp_path):
    """A recording killed by SIGTERM inside step 3 says the command was stopped, that the trace holds part of the
    step, and (last) whose exit code record returns; never `recorded step 3 into ...`."""
    (tmp_path / "train.py").write_text(TRAIN.replace("    loss = F.mse_loss(model(x), y)\n",
                                                     "    loss = F.mse_loss(model(x), y)\n"
                                                     "    if step == 2:\n        import os, signal\n"
                                                     "        os.kill(os.getpid(), signal.SIGKILL)\n"))
    proc = replaydiff_cli("record", "--step", "3", "-o", "t", "--", sys.executable, "train.py", cwd=tmp_path)
    assert proc.returncode == 128 + 9, proc.stderr
    assert "recorded step 3" not in proc.stderr, proc.stderr
    assert "replaydiff: recording cut short: the command was stopped by SIGKILL (exit code 137) before the " \
           "recording finished. The trace t (1 rank(s)) holds the ops recorded before that, not all of step 3." \
           in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == \
        "replaydiff: the command was stopped by SIGKILL (exit code 137); record exits with the command's code"



def test_a_plant_in_a_compiled_region_warns_in_one_line_why_the_region_ran_eager(tmp_path, monkeypatch, capsys):
    """`record --plant gelu` of a torch.compile'd model printed a raw `.../recorder.py:126: RuntimeWarning:` saying
    the region 'ran as eager aten ops', not why (without --plant the same region is recorded as compiled units). In
    a child of `replaydiff record` (its variable set) recorder warnings are now one `replaydiff: warning:` line."""
    from replaydiff.record.child_arming import ENV_VAR

    fn = torch.compile(lambda a: (a * 2).cos(), backend="aot_eager")
    monkeypatch.setenv(ENV_VAR, "{}")
    with replaydiff.record(tmp_path / "t", plant="cos"):
        fn(torch.randn(3))
    lines = [line for line in capsys.readouterr().err.splitlines() if "torch.compile region" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("replaydiff: warning: 1 torch.compile region ran while recording: "), lines
    assert lines[0].endswith("ran as eager aten ops (in the trace; not the compiled code the job runs otherwise). "
                             "--plant is a dispatch mode below the recorder's, and under it torch runs compiled "
                             "regions as eager aten ops, so the fault is planted in (and the trace holds) those "
                             "eager ops; without --plant the compiled regions are recorded as compiled units."), lines
    assert open_trace(tmp_path / "t").rank(0).planted.landed


@pytest.mark.slow
def test_record_warns_of_ranks_the_job_does_not_have(tmp_path):
    """`--rank 0,3` of a 2-process job recorded rank 0 alone without a word; here a 1-process job (rank 0 of 1)."""
    (tmp_path / "train.py").write_text(TRAIN.replace("sys.exit(3)", ""))
    proc = replaydiff_cli("record", "--step", "2", "--rank", "0", "--rank", "3", "-o", "t", "--", sys.executable,
                          "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("replaydiff: warning:")]
    assert warnings == ["replaydiff: warning: --rank 0,3: rank 3 is not in this job of 1 process (rank 0); "
                        "recorded rank 0"], proc.stderr
    assert open_trace(tmp_path / "t").ranks == [0]

SCRIPT_WITHOUT_STEP = textwrap.dedent("""
    import torch
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4))
""")


@pytest.mark.slow
@pytest.mark.parametrize("script, why", [
    ("infer.py", "record --step/--steps count optimizer steps (torch.optim's step hooks) and the command ran none; to "
                 "record code without an optimizer step, put `with replaydiff.record(\"trace/\"):` around it "
                 "(README, \"record: one step\")"),
    ("nosuch.py", "the command exited with code 2 before its first optimizer step (its output above may say why)")],
    ids=["no-optimizer", "missing-script"])
def test_record_of_a_command_without_any_optimizer_step_says_why(tmp_path, script, why):
    """An inference loop is told there is no optimizer and pointed to replaydiff.record(); a missing script is told
    its file is missing. Neither reads `the script ran 0 steps of its first optimizer`."""
    (tmp_path / "infer.py").write_text(SCRIPT_WITHOUT_STEP)
    proc = replaydiff_cli("record", "--step", "3", "-o", "t", "--", sys.executable, script, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"replaydiff: nothing was recorded into t: {why}", proc.stderr
    assert not (tmp_path / "t").exists()

@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM", "SIGINT"])
def test_record_passes_signals_on_to_the_command_and_waits_for_it(tmp_path, sig):
    """`kill -USR1 <replaydiff record's pid>` (or TERM, INT) reaches the command, whose flight recorder is told;
    replaydiff waits for it and passes its exit code through, never ending first and leaving the job orphaned. A
    SIGINT is passed on to a command that left record's process group (one in it gets a SIGINT sent to the group
    itself: test_record_interrupt.py)."""
    import signal
    import time

    (tmp_path / "child.py").write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        def got(signum, frame):
            open("got", "w").write(signal.Signals(signum).name)
            sys.exit(7)
        signal.signal(signal.{sig}, got)
        if signal.{sig} == signal.SIGINT:
            os.setsid()
        open("pid", "w").write(str(os.getpid()))
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "replaydiff", "record", "-o", "t", "--", sys.executable,
                             "child.py"], cwd=tmp_path, stderr=subprocess.PIPE, text=True, env=child_env())
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the child's handler is installed before it writes its pid
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert (tmp_path / "got").read_text() == sig, err
    assert proc.returncode == 7, err  # the command's own code, after it ended
    child = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.mark.slow
def test_a_script_that_raised_mid_run_is_said_with_the_steps_trend_reads(tmp_path, cli):
    """--steps 1-6 and an exception in step 4: the summary says steps 1-3 whole and part of step 4, as trend counts
    them (4 steps), and that steps 5-6 were never reached."""
    (tmp_path / "crash.py").write_text(
        "import torch\ntorch.manual_seed(0)\nnet = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.01)\n"
        "for step in range(1, 7):\n"
        "    loss = net(torch.randn(8, 4)).pow(2).mean()\n"
        "    if step == 4:\n        raise RuntimeError('data loader died')\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n")
    proc = cli("record", "--tensors", "stats", "--steps", "1-6", "-o", "t", "--", sys.executable, "crash.py",
               cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "The trace t (1 rank(s)) holds steps 1-3 whole, then what was recorded of step 4 before that. Steps " \
           "5-6 were never reached" in proc.stderr, proc.stderr
    trend = cli("trend", "t", cwd=tmp_path)
    assert "4 steps (1..4)" in trend.stdout, trend.stdout
