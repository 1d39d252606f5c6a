"""A parallel run diffed against the single-process run of the same script: correct data- and tensor-parallel steps
agree (exit 0), and a parallelism bug planted in the training script (not in the tool) is named at the op and line
that brings it in.

One script holds every variant; each process records all of them, so one plain run (world size 1, the reference)
and one torchrun launch per world size make every trace. The lines the departures name are read from the script,
never written down.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replaydiff import aten
from replaydiff.cli.main import main
from replaydiff.diff import diff_traces
from replaydiff.diff.parallel import Departure
from replaydiff.trace import open_trace

pytestmark = pytest.mark.slow

STEPS = r'''
"""Variants of one training step at any world size; world size 1 is the single-process reference."""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import replaydiff

out, modes = Path(sys.argv[1]), sys.argv[2].split(",")
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
if world > 1:
    dist.init_process_group("gloo")


class AllReduce(torch.autograd.Function):
    """Sum over the ranks in forward, the gradient passed through (a row-parallel layer's reduction)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        if world > 1:
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class Encoder(nn.Module):
    """Six tokens of one feature each, embedded, one encoder layer (batch_first), pooled, projected."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(1, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(self.embed(x.unsqueeze(-1))).mean(1))


def batch(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def data_parallel(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    if mode.startswith("dropout"):
        model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Dropout(0.5), nn.Linear(8, 3))
    if mode == "encoder":  # stock attention (which flattens batch and sequence together), AdamW
        model = Encoder()
    x, y = batch(7 if mode.startswith("uneven") else 8)
    if mode == "other_batch":  # BUG: each rank draws its own global batch (a seed that differs by rank)
        x, y = batch(8, seed=1 + rank)
    if mode == "ddp" and world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    if mode == "fsdp" and world > 1:  # FSDP2: each Linear's parameters sharded over the ranks
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if mode != "encoder" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "dropout_apart":  # each rank's dropout seeded apart (in "dropout" every rank has seed 0)
        torch.manual_seed(100 + rank)
    with replaydiff.record(out / mode, tensors="stats" if mode == "stats" else "full"):
        if mode == "drawn":  # the global batch drawn inside the step, every rank alike
            x, y = batch(8)
        if mode == "overlap":  # BUG: each rank's slice starts 2 rows early, so neighbours share rows
            n = len(x) // world
            lo = max(rank * n - 2, 0)
            xs, ys = x[lo:lo + n], y[lo:lo + n]
        else:
            xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
        if mode == "accumulate" and world == 1:  # the reference as two micro-batches, gradients accumulated
            for k in range(2):
                (F.mse_loss(model(x[k * 4:(k + 1) * 4]), y[k * 4:(k + 1) * 4]) / 2).backward()
            opt.step()
            return
        if mode == "uneven_sum":  # the right way with uneven shards: each rank's sum over the global count
            loss = F.mse_loss(model(xs), ys, reduction="sum") / y.numel()
        else:
            loss = F.mse_loss(model(xs), ys)
        if mode == "double":
            loss = loss * world  # BUG: the gradients are averaged below as well
        loss.backward()
        if mode == "subgroups" and world > 1:  # a second mesh dimension: gradients reduced within pairs of ranks
            pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
            for p in model.parameters():
                dist.all_reduce(p.grad, group=pairs[rank // 2])
                p.grad /= 2
        elif mode not in ("ddp", "fsdp"):
            for i, p in enumerate(model.parameters()):
                if mode == "skip_ar" and i == 2:
                    continue  # BUG: this parameter's gradient is never all-reduced
                if world > 1:
                    dist.all_reduce(p.grad)
                if mode not in ("uneven_sum", "sum_no_div"):  # BUG in sum_no_div: the sum is not divided
                    p.grad /= world
        opt.step()


def several_steps(mode):
    """Three steps of a hand data-parallel MLP, a batch of its own each; the trace holds the steps the mode names."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = [batch(8, seed=10 + s) for s in range(3)]
    with replaydiff.record(out / mode, steps={"step2": "2", "step3": "3", "steps23": "2-3", "double_steps": "2"}[mode]):
        for x, y in data:
            xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
            loss = F.mse_loss(model(xs), ys)
            if mode == "double_steps":
                loss = loss * world  # BUG at every step: from step 2 on the step's inputs differ
            loss.backward()
            for p in model.parameters():
                if world > 1:
                    dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            opt.zero_grad()


def tensor_parallel(mode):
    """Each rank holds its shards as parameters, as tensor parallelism does: the first Linear's rows (column
    parallel), the second's columns (row parallel), whose partial sums an all-reduce adds up."""
    torch.manual_seed(0)
    w1, b1 = torch.randn(8, 6) * 0.3, torch.randn(8) * 0.1
    w2, b2 = torch.randn(3, 8) * 0.3, torch.randn(3) * 0.1
    h = 8 // world
    mine = (rank + 1) % world if mode == "tp_offset" else rank  # BUG in tp_offset: another rank's shard of w1
    params = [w1[mine * h:(mine + 1) * h].clone(), b1[rank * h:(rank + 1) * h].clone(),
              w2[:, rank * h:(rank + 1) * h].clone(), b2.clone()]
    c1, cb, r2, b2 = [p.requires_grad_() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = batch(8)
    with replaydiff.record(out / mode):
        a = F.gelu(F.linear(x, c1, cb))
        part = a @ r2.t() if not mode.startswith("tp_linear") else None
        if mode == "tp_linear_noreduce":  # the second Linear with its bias, one addmm on one process
            # BUG: each rank adds the bias to its partial sums, never all-reduced
            part = F.linear(a, r2, b2) if world == 1 else F.linear(a, r2) + b2
            b2 = torch.zeros(())
        elif mode == "tp_linear":  # the same, correct: the partial sums all-reduced, then the bias
            part = F.linear(a, r2, b2) if world == 1 else AllReduce.apply(F.linear(a, r2)) + b2
            b2 = torch.zeros(())
        elif mode == "tp_bias_before":  # BUG: the bias added to each rank's partial sums, then all-reduced
            part = AllReduce.apply(part + b2)
            b2 = torch.zeros(())
        elif mode == "tp_nn":
            part = torch.distributed.nn.functional.all_reduce(part) if world > 1 else part  # BUG: backward too
        elif mode != "tp_noreduce":  # BUG in tp_noreduce: the partial sums used as they are
            part = AllReduce.apply(part)
        loss = F.mse_loss(part + b2, y)
        loss.backward()
        opt.step()


def torch_parallel(mode):
    """torch's own: DTensor tensor parallelism (parallelize_module), or data parallelism with a BatchNorm whose
    statistics stay per rank (BUG in bn: no SyncBatchNorm)."""
    torch.manual_seed(0)
    if mode == "bn":
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 3))
    else:
        model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    x, y = batch(8)
    if mode == "dtensor" and world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if mode.startswith("fsdp_tp") and world > 1:  # 2-D: tensor parallel within pairs of ranks, FSDP across the pairs
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh["dp"].get_local_rank()
        x, y = torch.tensor_split(x, world // 2)[dp], torch.tensor_split(y, world // 2)[dp]
    if mode == "bn":
        x, y = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
        if world > 1:  # DDP broadcasts the buffers (running statistics) from rank 0 as each forward begins
            model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with replaydiff.record(out / mode):
        loss = F.mse_loss(model(x), y)
        if mode == "fsdp_tp_double":
            loss = loss * world  # BUG: the 2-D job's loss scaled by the world size
        loss.backward()
        opt.step()


for mode in modes:
    run = several_steps if mode.startswith(("step", "double_steps")) else tensor_parallel if mode.startswith("tp") else \
        torch_parallel if mode in ("dtensor", "bn") or mode.startswith("fsdp_tp") else data_parallel
    run(mode)
if world > 1:
    dist.barrier()  # gloo aborts a rank that destroys its group while another still talks to it
    dist.destroy_process_group()
'''
DP_MODES = ["manual", "ddp", "fsdp", "double", "uneven_sum", "uneven_mean", "dropout", "accumulate", "encoder",
            "skip_ar", "overlap", "other_batch", "sum_no_div", "drawn", "step2", "steps23", "double_steps", "dropout_apart",
            "stats"]
TP_MODES = ["tp", "tp_noreduce", "tp_nn", "tp_offset", "dtensor", "bn", "tp_linear_noreduce", "tp_linear",
            "tp_bias_before"]


def _run(script: Path, out: Path, world: int, modes: list[str]) -> None:
    cmd = [sys.executable, str(script), str(out), ",".join(modes)]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] + cmd[1:]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """The traces of every variant: {world size: directory holding one trace per variant}."""
    root = tmp_path_factory.mktemp("parallel")
    script = root / "steps.py"
    script.write_text(STEPS)
    dirs = {w: root / f"world{w}" for w in (1, 2, 4, 8)}
    # the single process records every variant in one launch: those only the 4-rank run is compared with too
    _run(script, dirs[1], 1, DP_MODES + TP_MODES + ["subgroups", "fsdp_tp", "fsdp_tp_double", "step3"])
    _run(script, dirs[2], 2, DP_MODES + TP_MODES)
    _run(script, dirs[4], 4, ["manual", "uneven_sum", "double", "subgroups", "ddp", "tp", "fsdp", "fsdp_tp",
                                "fsdp_tp_double", "drawn"])
    _run(script, dirs[8], 8, ["manual", "double"])
    return dirs


def _line(marker: str) -> int:
    """The script's line number of the line holding ``marker``."""
    return next(n for n, line in enumerate(STEPS.splitlines(), 1) if marker in line)


@pytest.mark.parametrize("world,mode", [(2, "manual"), (2, "ddp"), (2, "fsdp"), (2, "uneven_sum"), (2, "tp"),
                                        (2, "dtensor"), (2, "encoder"),
                                        (4, "manual"),
                                        (4, "uneven_sum"),
                                        (8, "manual")])
def test_a_correct_parallel_run_agrees_with_the_single_process(runs, world, mode, capsys):
    ref, target = runs[1] / mode, runs[world] / mode
    report = diff_traces(ref, target)
    pd = report.parallel
    assert pd is not None and pd.world == world and pd.departure is None, pd.departure
    # every op of the single process is run by every rank, but for views FSDP2 does not take (a detach)
    ref_ops = open_trace(ref).rank(0)
    assert all(aten.is_cheap(ref_ops[i].name) for i in pd.not_aligned)
    assert pd.aligned + len(pd.not_aligned) == pd.ref_ops
    assert pd.compared >= 0.9 * pd.aligned  # all but ops that hold no tensor to compare (uninitialised outputs)
    assert not report.found_difference
    capsys.readouterr()
    assert main(["diff", str(ref), str(target)]) == 0
    text = capsys.readouterr().out
    assert f"{world} ranks against one process" in text and "agree: every compared op maps" in text
    assert "inputs of the step already differ" not in text and "structural differences" not in text


def test_data_parallel_layouts_are_said_per_phase(runs, capsys):
    capsys.readouterr()
    main(["diff", str(runs[1] / "manual"), str(runs[2] / "manual")])
    text = capsys.readouterr().out
    assert "forward outputs:" in text and "sharded on dim 0" in text
    assert "partial (a per-rank mean)" in text  # the loss, and the local gradients before their all-reduce
    assert "optimizer outputs:" in text and "c10d.allreduce_.default" in text  # layout ops, not differences


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_loss_scaled_twice_is_named_at_its_line(runs, world):
    pd = diff_traces(runs[1] / "double", runs[world] / "double").parallel
    d = pd.departure
    assert d is not None and d.kind is Departure.SCALED
    assert d.op.name == "aten.mul.Tensor" and d.op.source.endswith(f"steps.py:{_line('BUG: the gradients')}")
    assert f"{world}x what a correct parallel run holds here" in d.why


def test_a_per_rank_mean_over_uneven_shards_is_named_at_the_loss(runs):
    d = diff_traces(runs[1] / "uneven_mean", runs[2] / "uneven_mean").parallel.departure
    assert d is not None and d.kind in (Departure.SCALED, Departure.NO_LAYOUT)
    assert d.op.name == "aten.mse_loss.default"
    assert d.op.source.endswith(f"steps.py:{_line('loss = F.mse_loss(model(xs), ys)')}")
    assert "means over shards of unequal size" in d.why and "scaled by the world size" not in d.why


def test_partial_sums_used_without_their_all_reduce_are_named(runs):
    d = diff_traces(runs[1] / "tp_noreduce", runs[2] / "tp_noreduce").parallel.departure
    assert d is not None and d.kind is Departure.UNREDUCED
    assert d.op.source.endswith(f"steps.py:{_line('loss = F.mse_loss(part + b2, y)')}")
    assert "used without a reduction" in d.why


def test_a_gradient_all_reduced_in_backward_too_is_named_with_the_collective(runs):
    d = diff_traces(runs[1] / "tp_nn", runs[2] / "tp_nn").parallel.departure
    assert d is not None and d.kind is Departure.SCALED and d.op.phase == "backward"
    assert "2x what a correct parallel run holds here" in d.why and "c10d.allreduce_" in d.why


def test_a_shard_taken_at_the_wrong_offset_is_named_at_the_slice(runs):
    d = diff_traces(runs[1] / "tp_offset", runs[2] / "tp_offset").parallel.departure
    assert d is not None and d.kind is Departure.SHARD_OFFSET
    assert d.op.source.endswith(f"steps.py:{_line('a = F.gelu(F.linear(x, c1, cb))')}")
    assert "rank 0: 4, rank 1: 0" in d.why


def test_the_json_report_carries_the_mapping(runs, tmp_path, capsys):
    out = tmp_path / "d.json"
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "double"), str(runs[2] / "double"), "--json", str(out)]) == 1
    text = capsys.readouterr().out
    import json
    import re

    whole = json.loads(out.read_text())
    # the summary holds what the text says (it was all zeros for a parallel diff): the ops line, the op where the
    # runs part and the later ops that part reading what it made
    s = whole["summary"]
    ref_ops, aligned, compared = map(int, re.search(r"ops: (\d+) ref ops, (\d+) run by every rank, (\d+) compared",
                                                    text).groups())
    later = int(re.search(r"(\d+) later op\(s\) part from the reference too", text).group(1))
    assert (s["ref_ops"], s["aligned"], s["compared"], s["divergent"], s["inherited"]) == \
        (ref_ops, aligned, compared, 1, later), s
    assert s["parted"] >= 1 + later and s["same"] + s["parted"] + s["not_compared"] == aligned, s
    assert s["target_only"] > 0 and s["ref_only"] == ref_ops - aligned, s
    doc = whole["parallel"]
    assert doc["world"] == 2 and doc["departure"]["kind"] == "scaled"
    assert doc["departure"]["tensor"]["layout"]["kind"] == "partial"
    # what exit code 1 says, where a check of a rank-by-rank diff looks for it (both were empty: summary all zeros)
    first = whole["first_divergent"]
    assert whole["found_difference"] is True and first["parallel"] is True and first["status"] == "divergent"
    assert (first["index"]["ref"], first["op"], first["source"]) == \
        (doc["departure"]["ref"], doc["departure"]["op"], doc["departure"]["source"])
    assert main(["diff", str(runs[1] / "manual"), str(runs[2] / "manual"), "--json", str(out)]) == 0
    clean = json.loads(out.read_text())
    assert clean["found_difference"] is False and clean["first_divergent"] is None
    s = clean["summary"]
    assert s["compared"] > 0 and s["same"] == s["compared"] and (s["divergent"], s["parted"]) == (0, 0), s


def test_rank_picks_one_rank_op_by_op_without_mapping(runs):
    report = diff_traces(runs[1] / "manual", runs[2] / "manual", options=None)
    assert report.parallel is not None
    from replaydiff.diff import DiffOptions

    one = diff_traces(runs[1] / "manual", runs[2] / "manual", DiffOptions(rank=1))
    assert one.parallel is None and [rd.target_rank for rd in one.ranks] == [1]


def test_the_tui_s_diff_mode_colours_every_rank_s_rows_from_the_mapping(runs):
    from replaydiff.replay.result import Status
    from replaydiff.tui.diff_mode import diff_results

    report = diff_traces(runs[1] / "double", runs[2] / "double")
    d = report.parallel.departure
    rows = diff_results(report)
    divergent = sorted((r.rank, r.index) for r in rows if r.status is Status.DIVERGENT)
    assert divergent == [(rank, index) for rank, index in enumerate(d.op.targets)]
    ok = diff_results(diff_traces(runs[1] / "manual", runs[2] / "manual"))
    assert ok and {r.rank for r in ok} == {0, 1} and all(r.status is Status.OK for r in ok)


def test_a_run_with_more_ranks_as_the_reference_is_refused_in_one_line(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs[4] / "manual"), str(runs[2] / "manual")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a 4-rank run against a 2-rank run is not mapped" in err
    assert "put the run with fewer ranks first, as the reference" in err


@pytest.mark.parametrize("mode", ["manual", "ddp", "uneven_sum", "tp"])
def test_a_run_of_2_ranks_agrees_with_the_same_step_on_4(runs, mode, capsys):
    """Each rank q of the 2-rank run holds the share of the global batch (or of the weights) that ranks 2q and 2q+1
    of the 4-rank run hold between them: each is mapped onto those two as a single process would be."""
    report = diff_traces(runs[2] / mode, runs[4] / mode)
    pd = report.parallel
    assert pd is not None and pd.world == 4 and pd.ref_world == 2 and pd.departure is None, pd.departure
    assert [g.world for g in pd.groups] == [2, 2] and all(g.compared >= 0.8 * g.aligned for g in pd.groups)
    assert {op.ranks for op in pd.groups[1].ops} == {(2, 3)} and {op.ref_rank for op in pd.groups[1].ops} == {1}
    assert pd.ref_layout_ops and all(aten.is_collective(n) for n in pd.ref_layout_ops)
    assert not report.found_difference and not report.warnings
    capsys.readouterr()
    assert main(["diff", str(runs[2] / mode), str(runs[4] / mode)]) == 0
    text = capsys.readouterr().out
    assert "4 ranks against 2 ranks" in text and "agree: every compared op maps" in text


def test_a_loss_scaled_by_the_world_size_on_4_ranks_against_2_is_named_with_its_line(runs):
    d = diff_traces(runs[2] / "manual", runs[4] / "double").parallel.departure
    assert d is not None and d.kind is Departure.SCALED and d.op.ref_rank == 0 and d.op.ranks == (0, 1)
    assert "4x what a correct parallel run holds here" in d.why
    assert f"aten.mul.Tensor (#" in d.why and f"steps.py:{_line('BUG: the gradients')})" in d.why


def test_fsdp_at_two_world_sizes_is_refused_in_one_line(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs[2] / "fsdp"), str(runs[4] / "fsdp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a 2-rank run against a 4-rank run with FSDP" in err


def test_the_readme_s_diff_example_is_what_the_documented_commands_print(tmp_path, capsys):
    """docs/examples/data_parallel.py's commands, run as its docstring says (from a folder holding the script at the
    same relative path, so the source lines read as in the README), print the README's diff example."""
    root = Path(__file__).resolve().parents[2]
    here = tmp_path / "docs" / "examples"
    here.mkdir(parents=True)
    script = here / "data_parallel.py"
    script.write_text((root / "docs" / "examples" / "data_parallel.py").read_text())
    rel = "docs/examples/data_parallel.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for cmd in ([sys.executable, rel, "single-double/", "--mode", "double"],
                torchrun + [rel, "double/", "--mode", "double"]):
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    import os

    capsys.readouterr()
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["diff", "single-double/", "double/"]) == 1
    finally:
        os.chdir(old)
    printed = capsys.readouterr().out
    readme = (root / "README.md").read_text()
    block = readme.split("$ replaydiff diff single-double/ double/\n...\n", 1)[1].split("```", 1)[0]
    assert block and block in printed


def test_ops_after_dropout_are_not_judged_and_the_diff_is_not_clean(runs, capsys):
    pd = diff_traces(runs[1] / "dropout", runs[2] / "dropout").parallel
    assert pd.departure is None and pd.random_ops >= 1 and pd.random_parted
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "dropout"), str(runs[2] / "dropout")]) == 1
    text = capsys.readouterr().out
    assert "read random draws (dropout, a batch drawn inside the step) that each rank makes its own" in text
    assert "record with dropout off" in text
    assert "agree: every compared op" not in text


def test_a_batch_norm_with_per_rank_statistics_is_named_at_the_batch_norm(runs):
    """Under DDP, which broadcasts the running statistics from rank 0 before the forward: the broadcast brings each
    rank the single process's buffers, so it is not named as what the batch norm reads that parts (a new-user
    trial read 'on the ranks it reads what c10d.broadcast_.default ... made, which the single process does not
    run')."""
    pd = diff_traces(runs[1] / "bn", runs[2] / "bn").parallel
    d = pd.departure
    assert d is not None and d.kind is Departure.NO_LAYOUT
    assert d.op.name == "aten.native_batch_norm.default" and d.op.module.endswith(".1")
    assert "per-rank statistics that should be global" in d.why
    assert "c10d.broadcast_.default" in pd.layout_ops  # DDP's, read by the batch norm through copies
    assert "broadcast" not in d.why and "which the single process does not run" not in d.why, d.why


def test_a_reference_of_micro_batches_agrees_with_one_rank_per_micro_batch(runs, capsys):
    """The single process runs the global batch as 2 micro-batches (loss / 2, gradients accumulated); each of 2
    ranks runs one, gradients all-reduced and averaged: rank r's ops map onto micro-batch r's."""
    pd = diff_traces(runs[1] / "accumulate", runs[2] / "accumulate").parallel
    assert pd.departure is None and pd.micro_batches == 2 and not pd.random_parted
    on = {op.ranks for op in pd.ops}
    assert on == {(0,), (1,), ()}  # each micro-batch's ops on its rank alone, the optimizer's on every rank
    assert pd.compared >= 0.9 * pd.aligned
    # what the reference runs alone: the accumulation of the gradients and the division of each loss, no more
    ref_ops = open_trace(runs[1] / "accumulate").rank(0)
    assert {ref_ops[i].name for i in pd.not_aligned if not aten.is_cheap(ref_ops[i].name)} <= \
        {"aten.add_.Tensor", "aten.div.Tensor"}
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "accumulate"), str(runs[2] / "accumulate")]) == 0
    text = capsys.readouterr().out
    assert "as 2 micro-batches, gradients accumulated" in text and "agree: every compared op maps" in text


def test_a_loss_scaled_twice_against_micro_batches_is_named_with_its_line(runs):
    d = diff_traces(runs[1] / "accumulate", runs[2] / "double").parallel.departure
    assert d is not None and d.kind is Departure.SCALED and d.op.phase == "backward" and d.op.ranks == (0,)
    assert "2x what a correct parallel run holds here" in d.why
    assert f"aten.mul.Tensor (#" in d.why and f"steps.py:{_line('BUG: the gradients')})" in d.why


def test_micro_batches_that_are_not_one_per_rank_are_refused_in_one_line(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "accumulate"), str(runs[4] / "manual")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs 2 forward-backward passes (gradient-accumulation micro-batches)" in err
    assert "as many micro-batches as ranks" in err


def test_collectives_over_groups_of_some_ranks_are_refused_in_one_line(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "subgroups"), str(runs[4] / "subgroups")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a mesh of more than one dimension" in err


def test_fsdp_by_tensor_parallel_on_a_2x2_mesh_agrees_through_the_mesh_dtensor_declared(runs, capsys):
    """fully_shard over the mesh's rows' dimension (dp), ColwiseParallel/RowwiseParallel over its columns' (tp):
    the mesh is read from DTensor's recorded placements, and each value is laid out over the mesh's rows or columns,
    then over the groups (the batch sharded over dp, the hidden units over tp, the loss a per-rank mean over dp)."""
    report = diff_traces(runs[1] / "fsdp_tp", runs[4] / "fsdp_tp")
    pd = report.parallel
    assert pd is not None and pd.world == 4 and pd.departure is None, pd.departure
    assert pd.compared >= 0.9 * pd.aligned
    nested = [t.layout for op in pd.ops for t in op.tensors if t.layout is not None and t.layout.inner is not None]
    assert {lay.groups for lay in nested} == {((0, 1), (2, 3)), ((0, 2), (1, 3))}  # the mesh's rows and columns
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "fsdp_tp"), str(runs[4] / "fsdp_tp")]) == 0
    assert "agree: every compared op maps" in capsys.readouterr().out


def test_a_loss_scaled_by_the_world_size_on_a_2x2_mesh_is_named_at_its_line(runs):
    d = diff_traces(runs[1] / "fsdp_tp_double", runs[4] / "fsdp_tp_double").parallel.departure
    assert d is not None and d.kind is Departure.SCALED and d.op.name == "aten.mul.Tensor"
    assert d.op.source.endswith(f"steps.py:{_line('BUG: the 2-D job')}")
    assert "4x what a correct parallel run holds here" in d.why and d.tensor.layout.inner is not None


def test_runs_that_did_not_see_the_same_global_batch_are_warned_in_one_line(runs, capsys):
    report = diff_traces(runs[1] / "other_batch", runs[2] / "other_batch")
    d = report.parallel.departure
    assert d is not None and d.op.ref == 0 and d.kind in (Departure.INPUTS, Departure.NO_LAYOUT)  # the batch's slice
    assert [w for w in report.warnings if "did not see the same global batch" in w] == [report.parallel.batch_warning]
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "other_batch"), str(runs[2] / "other_batch")]) == 1
    err = capsys.readouterr().err
    assert err.count("did not see the same global batch") == 1 and "float32[8, 6]" in err
    # a correct run, and one whose bug is elsewhere, are not warned
    for mode in ("manual", "double"):
        assert diff_traces(runs[1] / mode, runs[2] / mode).warnings == []


def test_a_gradient_never_all_reduced_is_named_where_it_reaches_the_optimizer(runs):
    d = diff_traces(runs[1] / "skip_ar", runs[2] / "skip_ar").parallel.departure
    assert d is not None and d.kind is Departure.UNREDUCED and d.op.phase == "optimizer"
    assert "reaches the optimizer without its all-reduce" in d.why and "Sequential.2" in d.why


def test_the_tui_detail_of_a_mapped_row_lists_the_layouts_and_the_reason(runs):
    from replaydiff.tui.details import diff_lines
    from replaydiff.tui.diff_mode import diff_results

    report = diff_traces(runs[1] / "double", runs[2] / "double")
    d = report.parallel.departure
    row = next(r for r in diff_results(report) if (r.rank, r.index) == (1, d.op.targets[1]))
    text = "\n".join(diff_lines(row))
    assert "PARTS HERE" in text and f"ref #{d.op.ref}" in text and "TARGET ONLY" not in text
    assert "partial over 2 ranks" in text and "2x what a correct parallel run holds here" in text


def test_overlapping_batch_slices_are_named_with_their_offsets(runs):
    d = diff_traces(runs[1] / "overlap", runs[2] / "overlap").parallel.departure
    assert d is not None and d.kind is Departure.SHARD_OFFSET
    assert "rank 0: 0, rank 1: 2" in d.why and "slices that overlap" in d.why


def test_the_tui_colours_every_rank_s_rows_against_a_parallel_reference(runs):
    from replaydiff.replay.result import Status
    from replaydiff.tui.details import diff_lines
    from replaydiff.tui.diff_mode import diff_results

    report = diff_traces(runs[2] / "manual", runs[4] / "double")
    d = report.parallel.departure
    rows = diff_results(report)
    assert {r.rank for r in rows} == {0, 1, 2, 3}
    divergent = {(r.rank, r.index) for r in rows if r.status is Status.DIVERGENT}
    assert {(rank, index) for rank, index in zip(d.op.ranks, d.op.targets)} <= divergent
    row = next(r for r in rows if (r.rank, r.index) == (1, d.op.targets[1]))
    assert f"ref rank 0 #{d.op.ref}" in "\n".join(diff_lines(row))


def test_the_json_report_and_the_tui_carry_micro_batches_and_a_parallel_reference(runs, tmp_path):
    import json

    from replaydiff.tui.diff_mode import diff_results

    out = tmp_path / "micro.json"
    assert main(["diff", str(runs[1] / "accumulate"), str(runs[2] / "double"), "--json", str(out)]) == 1
    doc = json.loads(out.read_text())["parallel"]
    assert doc["micro_batches"] == 2 and set(doc["ref_only"]) <= {"aten.add_.Tensor", "aten.div.Tensor"}
    assert doc["departure"]["ranks"] == [0] and doc["departure"]["tensor"]["layout"]["micro_batch"] == 0
    report = diff_traces(runs[1] / "accumulate", runs[2] / "accumulate")
    rows = diff_results(report)
    mine = {(op.ranks, op.targets) for op in report.parallel.ops if op.ranks}
    assert mine and all(((r.rank,), (r.index,)) in mine or r.source.ranks == () for r in rows)
    out = tmp_path / "groups.json"
    assert main(["diff", str(runs[2] / "manual"), str(runs[4] / "double"), "--json", str(out)]) == 1
    doc = json.loads(out.read_text())["parallel"]
    assert doc["world"] == 4 and doc["ref_world"] == 2 and [g["world"] for g in doc["groups"]] == [2, 2]
    assert doc["departure"]["ref_rank"] == 0 and doc["departure"]["ranks"] == [0, 1]


def test_dtensor_s_placements_are_recorded_and_each_compared_layout_says_where_it_came_from(runs, tmp_path, capsys):
    """parallelize_module's ColwiseParallel shards the first Linear's weight on dim 0: the recorder notes DTensor's
    placements before DTensor unwraps the op, and the mapping uses them (the weight's layout from placements); a
    value DTensor never saw (ColwiseParallel hands back a local tensor) is inferred."""
    report = diff_traces(runs[1] / "dtensor", runs[2] / "dtensor")
    pd = report.parallel
    assert pd.departure is None and pd.from_placements is not None
    from_placements, inferred = pd.from_placements
    assert from_placements > 0 and inferred > 0
    weight = next(t for op in pd.ops if op.module == "Sequential.0" and op.phase == "forward"
                  for t in op.tensors if t.kind == "in" and len(t.describe.split(",")) == 2)
    assert weight.declared is not None and weight.declared.mesh == (2,) and weight.layout_from == "placements"
    assert weight.layout.kind.value == "sharded" and weight.layout.dim == 0
    # a job without DTensor: nothing recorded, nothing said
    assert diff_traces(runs[1] / "manual", runs[2] / "manual").parallel.from_placements is None
    capsys.readouterr()
    out = tmp_path / "d.json"
    assert main(["diff", str(runs[1] / "dtensor"), str(runs[2] / "dtensor"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"layouts: {from_placements} of {from_placements + inferred} compared tensors as DTensor's recorded " \
           f"placements declare them" in text
    import json

    doc = json.loads(out.read_text())["parallel"]
    assert (doc["layouts_from_placements"], doc["layouts_inferred"]) == (from_placements, inferred)


def test_traces_of_different_steps_are_refused_and_step_picks_the_step_compared(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "step3"), str(runs[2] / "step2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the traces share no step (the reference holds step 3, the target step 2)" in err
    assert main(["diff", str(runs[1] / "steps23"), str(runs[2] / "step2"), "--step", "3"]) == 2
    assert "step 3 is not in the target trace" in capsys.readouterr().err
    # steps 2-3 against step 2: step 2 alone compared, its parameters (step 1's update) entering from outside
    for extra in ([], ["--step", "2"]):
        assert main(["diff", str(runs[1] / "steps23"), str(runs[2] / "step2"), *extra]) == 0
        text = capsys.readouterr().out
        assert "comparing step 2" in text and "agree: every compared op maps" in text
    report = diff_traces(runs[1] / "steps23", runs[2] / "step2")
    ref = open_trace(runs[1] / "steps23").rank(0)
    assert {ref[op.ref].step for op in report.parallel.ops} == {2}


def test_a_parallel_run_given_first_against_the_single_process_is_refused_with_the_order(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs[2] / "manual"), str(runs[1] / "manual")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a 2-rank run against a single process" in err
    assert "put the single process (the run with fewer ranks) first" in err


def test_inputs_that_differ_after_the_first_step_point_to_an_earlier_step(runs, tmp_path, capsys):
    d = diff_traces(runs[1] / "double_steps", runs[2] / "double_steps").parallel.departure
    assert d is not None and d.kind is Departure.INPUTS and d.step == 2
    assert "began apart (initial weights" not in d.why and "parted before step 2" in d.why
    assert "record step 1 of both runs (replaydiff record --step 1)" in d.earlier
    # every op that parts in step 2 descends from the parameters step 1 scaled: none parts with agreeing inputs
    pd = diff_traces(runs[1] / "double_steps", runs[2] / "double_steps").parallel
    assert pd.within is None and len(pd.parted) > 10
    out = tmp_path / "d.json"
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "double_steps"), str(runs[2] / "double_steps"), "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "record step 1 of both runs" in text and "no op parts from the reference with agreeing inputs" in text
    import json

    whole = json.loads(out.read_text())["parallel"]
    doc = whole["departure"]
    assert doc["step"] == 2 and doc["earlier_step"]["command"] == "replaydiff record --step 1"
    assert "within" in whole and whole["within"] is None
    # at step 1 of a trace without step numbers the wording stays the first step's
    first = diff_traces(runs[1] / "manual", runs[2] / "other_batch").parallel.departure
    assert first is not None and first.earlier is None


def test_a_gradient_sum_not_divided_by_the_world_size_is_named_with_its_all_reduce(runs):
    d = diff_traces(runs[1] / "sum_no_div", runs[2] / "sum_no_div").parallel.departure
    assert d is not None and d.kind is Departure.SCALED and d.op.phase == "optimizer"
    assert "replicated at 2x the reference after c10d.allreduce_" in d.why
    assert f"steps.py:{_line('dist.all_reduce(p.grad)')})" in d.why and "a sum not divided by the world size" in d.why
    assert "without its all-reduce" not in d.why


def test_a_batch_drawn_inside_the_step_agrees_on_2_ranks_against_4(runs, capsys):
    """Each reference rank cuts every rank's slice of the batch it draws; the slices it does not compute with are
    not judged."""
    for ref, target in ((runs[2], runs[4]), (runs[1], runs[2])):
        report = diff_traces(ref / "drawn", target / "drawn")
        assert report.parallel.departure is None, report.parallel.departure
        capsys.readouterr()
        assert main(["diff", str(ref / "drawn"), str(target / "drawn")]) == 0


def test_a_row_parallel_linear_whose_sums_are_never_reduced_is_named_at_the_ranks_own_op(runs):
    """The single process runs the second Linear as one addmm; the ranks as mm, then the bias: no op every rank runs
    made the next op's input, so the line named is the ranks' own op that did, with no collective on the way."""
    d = diff_traces(runs[1] / "tp_linear_noreduce", runs[2] / "tp_linear_noreduce").parallel.departure
    assert d is not None and d.kind is Departure.NO_LAYOUT and d.op.name == "aten.add.Tensor"
    assert d.op.source.endswith(f"steps.py:{_line('loss = F.mse_loss(part + b2, y)')}")
    assert "no collective on the way" in d.why and "its all-reduce is missing" in d.why
    assert f"steps.py:{_line('else F.linear(a, r2) + b2')})" in d.why
    assert "BatchNorm" not in d.why


def test_a_correct_row_parallel_linear_with_its_bias_agrees(runs, capsys):
    """One addmm on one process; on each rank mm, the all-reduce, then the bias: the backward's t and mm ops come in
    another order on the ranks (the bias's gradient first), and the weight's transpose and the gradient's have one
    shape. Each is paired with the op that reads what its counterpart reads, so the run agrees, every op but the
    addmm compared (it said the runs part at a backward aten.t)."""
    ref, target = runs[1] / "tp_linear", runs[2] / "tp_linear"
    pd = diff_traces(ref, target).parallel
    assert pd.departure is None, pd.departure
    ref_ops = open_trace(ref).rank(0)
    assert [ref_ops[i].name for i in pd.not_aligned if not aten.is_cheap(ref_ops[i].name)] == ["aten.addmm.default"]
    backward_t = [op.index for op in ref_ops if op.name == "aten.t.default" and op.phase == "backward"]
    compared = {m.ref for m in pd.ops if m.tensors}
    assert backward_t and set(backward_t) <= compared
    capsys.readouterr()
    assert main(["diff", str(ref), str(target)]) == 0
    assert "agree: every compared op maps" in capsys.readouterr().out


def test_a_parallel_diff_of_statistics_traces_is_refused(runs, capsys):
    """Layouts map values (a shard is a slice, a partial value a term of a sum): statistics cannot be mapped so, and
    the diff of two `stats` traces compared nothing and exited 0 ("agree") whatever the runs did."""
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "stats"), str(runs[2] / "stats")]) == 2
    err = capsys.readouterr().err
    assert "holds --tensors stats (no tensor data)" in err and "record both runs with --tensors full" in err, err
    assert main(["diff", str(runs[1] / "manual"), str(runs[2] / "stats")]) == 2


def test_a_bias_added_before_the_all_reduce_is_named_with_the_reduction_after_it(runs):
    """The all-reduce is there, after the op: the line says so (it said one was missing), naming the op that adds the
    bias to the partial sums and the all-reduce that then sums the bias once per rank."""
    d = diff_traces(runs[1] / "tp_bias_before", runs[2] / "tp_bias_before").parallel.departure
    assert d is not None and d.kind is Departure.UNREDUCED and d.op.name == "aten.add.Tensor"
    assert d.op.source.endswith(f"steps.py:{_line('part = AllReduce.apply(part + b2)')}")
    assert "an all-reduce is missing" not in d.why and "c10d.allreduce_.default" in d.why, d.why
    assert "belongs after the reduction" in d.why and "summed 2 times" in d.why
    noreduce = diff_traces(runs[1] / "tp_noreduce", runs[2] / "tp_noreduce").parallel.departure
    assert "an all-reduce is missing before this op" in noreduce.why


def test_the_same_dropout_seed_on_every_rank_is_said(runs, capsys):
    """Every rank seeded alike draws the same mask for its own slice of the batch; seeded apart, they differ. Both
    stay not judged (no rank's mask is the single process's)."""
    same = diff_traces(runs[1] / "dropout", runs[2] / "dropout").parallel
    apart = diff_traces(runs[1] / "dropout_apart", runs[2] / "dropout_apart").parallel
    ref = open_trace(runs[1] / "dropout").rank(0)
    assert len(same.same_draws) == 1 and aten.is_random(ref[same.same_draws[0]].name)
    assert apart.random_parted and not apart.same_draws
    capsys.readouterr()
    assert main(["diff", str(runs[1] / "dropout"), str(runs[2] / "dropout")]) == 1
    assert "every rank drew the same numbers at 1 random op(s)" in capsys.readouterr().out
    assert main(["diff", str(runs[1] / "dropout_apart"), str(runs[2] / "dropout_apart")]) == 1
    assert "every rank drew the same numbers" not in capsys.readouterr().out
