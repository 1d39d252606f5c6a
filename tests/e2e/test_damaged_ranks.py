"""A multi-rank trace with an ops file of one rank gone: replay judges what is readable on every rank, lists the
missing ops and leaves unchecked (saying why) the collectives whose records are missing on some rank of their group;
with --rank it does the same for the ranks asked for. Never clean, never a bare error."""
from __future__ import annotations

import json
import shutil

import pytest

import replaydiff


@pytest.fixture
def damaged(ddp_step_with_rank1_allreduce_fault, tmp_path):
    trace = tmp_path / "trace"
    shutil.copytree(ddp_step_with_rank1_allreduce_fault, trace)
    n1 = len(replaydiff.open_trace(trace).rank(1))
    chunk = trace / "rank1" / "ops" / "000000000.rdt"
    chunk.unlink()
    return trace, chunk, n1


@pytest.mark.parametrize("ranks", [(), ("--rank", "0")])
def test_replay_of_a_trace_with_a_rank_file_gone_judges_the_rest(cli_here, damaged, tmp_path, ranks):
    trace, chunk, n1 = damaged
    t = replaydiff.open_trace(trace)
    n0 = len(t.rank(0))
    collectives = [op.index for op in t.rank(0) if op.collective is not None and not replaydiff.aten.is_wait_only(
        op.name)]
    assert collectives
    proc = cli_here("replay", trace, *ranks, "--json", tmp_path / "r.json")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "error" not in proc.stderr.split("warning")[0], proc.stderr
    said = f"{n1} op(s) (#0-#{n1 - 1}) missing: ops file {chunk} (deleted or never copied)"
    assert f"  {said}\n" in proc.stdout
    assert "not clean: " in proc.stdout and "no divergent op: every replayed op" not in proc.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [(m["rank"], m["first"], m["last"]) for m in doc["missing_ops"]] == [(1, 0, n1 - 1)]
    ops = {(o["rank"], o["index"]): o for o in doc["ops"]}
    assert sum(o["rank"] == 0 for o in ops.values()) == n0  # every op of rank 0 judged or said why not
    assert sum(o["status"] == "ok" for o in ops.values()) > n0 // 2
    for i in collectives:  # rank 0's calls cannot be matched with rank 1's: not checked, and why
        o = ops[(0, i)]
        assert o["status"] == "skipped", o
        assert o["reason"] == f"collective: not checked: records of collectives of its group are missing ({n1} " \
                              f"op(s) (#0-#{n1 - 1}) of rank 1 missing: ops file {chunk} (deleted or never " \
                              f"copied)), so which call on each rank is this one is unknown"


@pytest.mark.slow
def test_collectives_before_the_gap_are_still_checked(cli_here, tmp_path):
    import subprocess
    import sys

    from replay_helpers import DDP_STEP

    script = tmp_path / "ddp_step.py"
    script.write_text(DDP_STEP.replace("record(sys.argv[1])", "record(sys.argv[1], chunk_ops=30)"))
    trace = tmp_path / "trace"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(script), str(trace), "5"], check=True, capture_output=True, timeout=180)  # rank 5: no plant
    t = replaydiff.open_trace(trace)
    calls = [op.index for op in t.rank(1) if op.collective is not None and not replaydiff.aten.is_wait_only(op.name)]
    assert len(calls) >= 3
    # the last chunk of rank 1 that holds a collective, not its first one: calls before it stay matched
    chunk_first = calls[-1] // 30 * 30
    assert chunk_first > calls[0]
    (trace / "rank1" / "ops" / f"{chunk_first:09d}.rdt").unlink()
    proc = cli_here("replay", trace, "--json", tmp_path / "r.json")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    ops = {(o["rank"], o["index"]): o for o in doc["ops"]}
    known = [i for i in calls if i < chunk_first]
    for i in known:  # before the gap: matched call by call and checked across ranks
        assert ops[(1, i)]["status"] == "ok", ops[(1, i)]
    mine = [op.index for op in t.rank(0) if op.collective is not None and not replaydiff.aten.is_wait_only(op.name)]
    for k, i in enumerate(mine):
        o = ops[(0, i)]
        if k < len(known):
            assert o["status"] == "ok", o
        else:
            assert o["status"] == "skipped" and "records of collectives of its group are missing" in o["reason"], o
    assert (1, chunk_first) in {(m["rank"], m["first"]) for m in doc["missing_ops"]}
