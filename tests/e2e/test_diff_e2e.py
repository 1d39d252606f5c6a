"""diff of a 2-rank torchrun run against one process (the rest: tests/integration/test_diff.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import replay_helpers as rh
from replaydiff.cli.main import main
from replaydiff import aten
from replaydiff.diff import diff_traces
from replaydiff.trace import open_trace

from diff_helpers import _index


DDP_STEP = textwrap.dedent('''
    import contextlib, sys, torch, torch.distributed as dist
    from replaydiff import record
    from replaydiff.faults import PlantedFault
    out, mode, fault_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if mode == "ddp":
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)  # the same batch on every rank and in the single process
    x = torch.randn(4, 8)
    fault = PlantedFault("aten.addmm.default", rel=1e-3, rank=fault_rank) if fault_rank >= 0 \\
        else contextlib.nullcontext()
    with fault, record(out):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    if mode == "ddp":
        dist.barrier()  # gloo aborts a rank that destroys its group while the other still talks to it
        dist.destroy_process_group()
''')


def test_two_rank_run_against_one_process_is_mapped_and_parts_where_rank_1_was_planted(tmp_path: Path, capsys) -> None:
    script = tmp_path / "step.py"
    script.write_text(DDP_STEP)
    one, two = tmp_path / "one", tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    procs = [subprocess.Popen([sys.executable, str(script), str(one), "single", "-1"], stderr=subprocess.PIPE),
             subprocess.Popen(torchrun + [str(script), str(two), "ddp", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    assert open_trace(two).ranks == [0, 1] and open_trace(one).ranks == [0]

    report = diff_traces(one, two)
    # every rank at once, mapped onto the single process (each rank holds the whole batch here: replicated)
    pd = report.parallel
    assert pd is not None and pd.world == 2 and not report.ranks
    # module paths match through the DDP wrapper, so the whole single-process step is aligned on both ranks
    assert pd.aligned == pd.ref_ops == len([op for op in rh.trace_ops(one) if not aten.is_marker(op.name)])
    assert not pd.not_aligned
    assert pd.layout_ops["c10d.allreduce_.default"] >= 2  # DDP's bucket all-reduce: a layout op, not a difference
    # the fault planted on rank 1 is where the runs part, and rank 0 is said to hold the reference's value there
    d = pd.departure
    assert (d.op.ref, d.op.targets) == (_index(one, "aten.addmm.default"),
                                        (_index(two, "aten.addmm.default", rank=0),
                                         _index(two, "aten.addmm.default", rank=1)))
    assert "rank 0 holds the reference's value, rank 1 does not" in d.why
    world = [d for d in report.environment if d.key == "world_size"]
    assert world and (world[0].ref, world[0].target) == (1, 2) and world[0].hint

    assert main(["diff", str(one), str(two), "--rank", "0", "--json", "-"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [r["target_rank"] for r in doc["ranks"]] == [0] and doc["first_divergent"] is None
    assert doc["ranks"][0]["first_difference"]["inherited_from"]["collective"]["op"] == "c10d.allreduce_.default"
