"""A parallel run judged by what it keeps: the gradients as the optimizer reads them, the parameters after the step,
the optimizer's state. A job that holds an intermediate value at a factor it cancels later (a summed loss whose
gradients are divided by the global token count after their all-reduce) agrees, and says the factor; a bug is named
where it enters: a scale once too many with the net factor at the sink, an lr multiplied by the world size with both
values, every rank reading the same shard, a per-rank mean over unequal token counts with the counts.

One script holds every variant; one plain run (the reference) and one torchrun launch of 2 gloo ranks record them
all. The lines the diff names are read from the script, never written down.
"""
from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from replaydiff.cli.main import main
from replaydiff.diff import diff_traces
from replaydiff.diff.parallel import Departure

pytestmark = pytest.mark.slow

STEPS = r'''"""Jobs judged at what they keep: each variant at any world size; world size 1 is the single process."""
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


def step(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 11))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (8, 5), generator=g)
    labels = torch.randint(0, 11, (8, 5), generator=g)
    labels[::4, 3:] = -100  # padding, as much on every rank
    if mode == "token_mean":  # BUG: a per-rank mean over ranks holding different numbers of tokens
        labels[:2, 1:] = -100
    lr = 0.1 * world if mode == "lr" else 0.1  # BUG in lr: the learning rate multiplied by the world size
    if mode == "lr_one_rank" and rank == 1:
        lr = 0.3  # BUG in lr_one_rank: one rank's learning rate differs
    if mode.startswith("fsdp_clip") and world > 1:  # FSDP2, the gradient norm clipped over every shard (DTensor's _NormP)
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if mode in ("adam_sum", "fsdp_clip", "fsdp_clip_halved") else \
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    part = 0 if mode == "same_shard" else rank  # BUG in same_shard: every rank reads rank 0's shard
    max_norm = None
    if mode == "clip_sum":  # a clipping limit between the reference's gradient norm and twice it (not recorded)
        probe = nn.Sequential(*[layer for layer in __import__("copy").deepcopy(model)])
        F.cross_entropy(probe(ids).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        max_norm = 1.5 * float(torch.stack([p.grad.norm() for p in probe.parameters()]).norm())
    if mode.startswith("dealt"):  # a shuffling DistributedSampler's batch, dealt out before the step is recorded
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        data = TensorDataset(ids, labels.clamp(min=0))
        dealer = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        dealt = next(iter(DataLoader(data, batch_size=8 // world, sampler=dealer)))
    with replaydiff.record(out / mode):
        if mode.startswith("dealt"):
            xs, ys = dealt
        elif mode.startswith("sampler") or mode == "rank_scaled_rows":  # a DataLoader over a map-style dataset:
            from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # dataset[i] picks one row

            order = [0, 4, 1, 5, 2, 6, 3, 7]  # the padded rows 0 and 4 on two ranks, as tensor_split puts them
            data = TensorDataset(ids[order], labels[order].clamp(min=0) if mode == "rank_scaled_rows" else
                                 labels[order])
            sampler = DistributedSampler(data, num_replicas=world, seed=0,  # rank r takes rows r, r+W, ...
                                         shuffle=mode == "rank_scaled_rows",  # (of a permutation, shuffled)
                                         rank=0 if mode == "sampler_same_rank" else rank)  # BUG in sampler_same_rank
            xs, ys = next(iter(DataLoader(data, batch_size=8 // world, sampler=sampler)))
        else:
            xs, ys = torch.tensor_split(ids, world)[part], torch.tensor_split(labels, world)[part]
        if mode == "local_index":  # an index over the rank's own rows (as a mask built from local sizes is)
            rows = torch.arange(xs.shape[0])
            xs, ys = xs[rows], ys[rows]
        if mode == "attention":  # attention without dropout (its kernels are tagged random all the same)
            h = model[0](xs).unflatten(-1, (2, 4)).transpose(1, 2)
            h = F.scaled_dot_product_attention(h, h, h, dropout_p=0.0).transpose(1, 2).flatten(-2)
            logits = model[1:](h).flatten(0, 1)
        elif not (mode.startswith("dealt_accum") and world > 1):  # (the micro-batches' forward is their own)
            logits = model(xs).flatten(0, 1)
        if world > 1 and mode.startswith("per_token"):
            # per-token normalisation: each rank sums its tokens' losses, the gradients are divided by the global
            # token count after their all-reduce (the single process takes the mean)
            loss = F.cross_entropy(logits, ys.flatten(), reduction="sum", ignore_index=-100)  # scale: token count
            if mode == "per_token_extra":
                loss = loss * world  # BUG: scaled once more
            tokens = (ys != -100).sum()
            dist.all_reduce(tokens)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= tokens  # brings the gradients back to the mean's
        elif mode.startswith("dealt_accum") and world > 1:  # 2 micro-batches on each rank, gradients accumulated
            for k, (x, y) in enumerate(zip(xs.tensor_split(2), ys.tensor_split(2))):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / 2
                if mode == "dealt_accum_scaled" and rank == 1 and k == 1:
                    loss = 1.01 * loss  # BUG in dealt_accum_scaled: one rank's loss 1% off
                if mode == "dealt_accum_halved":
                    loss = loss / world  # BUG in dealt_accum_halved: the loss divided by the world size too
                loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world  # the micro-batches' gradients averaged over the ranks
        else:
            loss = F.cross_entropy(logits, ys.flatten(), ignore_index=-100)
            if mode == "rank_scaled_divided":
                loss = loss / 1  # over 1 micro-batch: an op both runs run, between rank 1's scale and the loss
            if mode.startswith("rank_scaled") and rank == 1:
                loss = loss * 1.01  # BUG in rank_scaled: one rank's loss 1% off
            if mode == "rank_own_scale" and rank == 1:
                loss = loss * 1.25  # BUG in rank_own_scale: one rank's loss scaled by a plain factor
            loss.backward()
            for p in model.parameters():
                if world > 1 and not mode.startswith("fsdp_clip"):
                    dist.all_reduce(p.grad)
                    if mode not in ("adam_sum", "clip_sum"):  # BUG in adam_sum and clip_sum: sums not divided
                        p.grad /= world
        if mode == "fsdp_clip_halved" and world > 1:
            for p in model.parameters():
                p.grad.div_(world)  # divided once more than FSDP2's average: the clipping below cancels it
        if mode.startswith("fsdp_clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
        if mode == "clip_sum":  # clips the ranks' doubled gradients only
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        opt.step()


for m in modes:
    step(m)
'''
MODES = ["plain", "local_index", "attention", "fsdp_clip", "fsdp_clip_halved", "per_token", "per_token_extra", "lr", "lr_one_rank",
         "same_shard", "adam_sum", "token_mean", "sampler", "sampler_same_rank", "clip_sum",
         "rank_scaled", "rank_scaled_rows", "rank_scaled_divided", "rank_own_scale", "dealt", "dealt_accum", "dealt_accum_scaled", "dealt_accum_halved"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """{world size: directory holding one trace per variant}."""
    root = tmp_path_factory.mktemp("sinks")
    script = root / "steps.py"
    script.write_text(STEPS)
    dirs = {w: root / f"world{w}" for w in (1, 2)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for cmd in ([sys.executable, str(script), str(dirs[1]), ",".join(MODES)],
                torchrun + [str(script), str(dirs[2]), ",".join(MODES)]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return dirs


def _line(marker: str) -> str:
    """'steps.py:N' for the script's line holding ``marker``."""
    return f"steps.py:{next(n for n, line in enumerate(STEPS.splitlines(), 1) if marker in line)}"


def _diff(runs, mode, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["diff", str(runs[1] / mode), str(runs[2] / mode)])
    return code, capsys.readouterr().out


def test_a_correct_data_parallel_run_agrees(runs, capsys):
    code, text = _diff(runs, "plain", capsys)
    assert code == 0 and "agree: every compared op maps" in text


def test_an_index_over_each_rank_s_own_rows_is_not_compared_and_what_it_indexes_is(runs, capsys):
    pd = diff_traces(runs[1] / "local_index", runs[2] / "local_index").parallel
    assert pd.departure is None
    (i,) = pd.per_rank_index
    assert next(op for op in pd.ops if op.ref == i).name.startswith("aten.arange")
    # the rows it picks are compared: sharded on dim 0 like the batch
    index = [op for op in pd.ops if op.name == "aten.index.Tensor"]
    assert index and all(t.layout is not None and t.layout.dim == 0 for op in index for t in op.tensors
                         if t.kind == "out")
    code, text = _diff(runs, "local_index", capsys)
    assert code == 0 and "make each rank's own index from its local sizes" in text


def test_attention_without_dropout_is_compared_as_deterministic(runs, capsys):
    pd = diff_traces(runs[1] / "attention", runs[2] / "attention").parallel
    assert pd.departure is None and pd.random_ops == 0 and not pd.same_draws
    assert any("scaled_dot_product" in op.name for op in pd.ops)
    code, text = _diff(runs, "attention", capsys)
    assert code == 0 and "dropout" not in text


def test_fsdp2_gradient_clipping_maps_each_rank_s_norm_of_its_shard_as_a_norm_over_ranks(runs, capsys):
    """clip_grad_norm_ on FSDP2's DTensor gradients: each rank's norm of its shard (DTensor's _NormP placement) is
    neither replicated nor a partial sum; the 2-norm over the ranks' norms is the single process's norm."""
    pd = diff_traces(runs[1] / "fsdp_clip", runs[2] / "fsdp_clip").parallel
    assert pd.departure is None, pd.departure
    assert any(f.startswith("norm over ranks") for f in pd.families.get("forward", {}))
    # the clipping runs between backward() and step(), and is said there
    assert {op.phase for op in pd.ops if "norm" in op.name} == {"between backward and step"}
    code, text = _diff(runs, "fsdp_clip", capsys)
    assert code == 0


def test_fsdp2_gradients_divided_twice_and_clipped_agree_and_the_norm_is_said_at_its_factor(runs, capsys):
    """The gradients divided by the world size once more than FSDP2's average, then clipped (active both ways): what
    the optimizer reads is the single process's (exit 0). The norm on the way is a norm over the ranks at 1/2x with
    the division's line, not 'partial sums ... an all-reduce is missing' (it went through the reduce-scatter), and
    no scalar is read as a sum at a ratio like 41/58x (found by a new-user trial)."""
    pd = diff_traces(runs[1] / "fsdp_clip_halved", runs[2] / "fsdp_clip_halved").parallel
    assert pd.departure is None, pd.departure
    norm = next(c for c in pd.cancelled if c.op.name == "aten._foreach_norm.Scalar")
    assert norm.tensor.layout is not None and norm.tensor.layout.factor == 2, norm
    assert "all-reduce is missing" not in norm.why and norm.via.endswith(f"{_line('p.grad.div_(world)')})"), norm
    code, text = _diff(runs, "fsdp_clip_halved", capsys)
    assert code == 0 and "norm over ranks (each rank's norm of its shard) at 1/2x" in text, text
    odd = [f for fam in pd.families.values() for f in fam if "x" in f and "/" in f.split(" at ")[-1]]
    assert all(max(map(int, f.split(" at ")[-1].rstrip("x").split("/"))) <= 8 for f in odd), odd


def test_a_summed_loss_whose_gradients_are_divided_after_their_all_reduce_agrees_at_the_sinks(runs, capsys):
    """The ranks sum their tokens' losses (a value the single process holds as a mean: their sum is the token count
    times it) and divide the all-reduced gradients by the global token count: the factor cancels before the
    optimizer, and is said as information, with the line that brings it back."""
    pd = diff_traces(runs[1] / "per_token", runs[2] / "per_token").parallel
    assert pd.departure is None and pd.sinks > 0
    (site,) = pd.cancelled
    assert site.op.target_source.endswith(_line("scale: token count")) and site.tensor.layout is not None
    # the factor is the global count of tokens the script keeps (labels other than -100)
    g = torch.Generator().manual_seed(1)
    torch.randint(0, 11, (8, 5), generator=g)
    labels = torch.randint(0, 11, (8, 5), generator=g)
    labels[::4, 3:] = -100
    assert 1 / site.tensor.layout.factor == int((labels != -100).sum())
    code, text = _diff(runs, "per_token", capsys)
    assert code == 0 and "agree at the sinks" in text and "the factors above cancel" in text
    assert "brought back to the single process's by aten.div_.Tensor" in text and _line("brings the gradients") in text


def test_a_loss_scaled_once_more_is_named_with_its_line_and_the_net_factor_at_the_sink(runs, capsys):
    pd = diff_traces(runs[1] / "per_token_extra", runs[2] / "per_token_extra").parallel
    d = pd.departure
    assert d is not None and d.kind is Departure.SCALED and _line("BUG: scaled once more") in d.why
    assert pd.sink is not None and pd.sink.op.phase == "optimizer" and pd.sink.tensor.layout.factor == 1 / 2
    code, text = _diff(runs, "per_token_extra", capsys)
    assert code == 1 and "net at the sink: replicated on 2 ranks at 2x the reference" in text


def test_an_lr_multiplied_by_the_world_size_is_named_at_the_update_with_both_values(runs, capsys):
    """Each rank's update is right given its own lr: it is not 'amplified rounding', and the settings of both runs
    name the difference."""
    pd = diff_traces(runs[1] / "lr", runs[2] / "lr").parallel
    d = pd.departure
    assert d is not None and d.op.phase == "optimizer" and d.op.name == "aten.add_.Tensor"
    assert "alpha -0.2 on the ranks, -0.1 in the single process (2x: the world size)" in d.why
    assert [(s.kind, s.name, s.ref, s.theirs) for s in pd.settings] == [("SGD", "lr", 0.1, 0.2)]
    code, text = _diff(runs, "lr", capsys)
    assert code == 1 and "the optimizer's settings differ: SGD group 0: lr 0.2 on rank 0, 0.1 in the single " \
        "process (2x: the world size) (the optimizer built at " in text
    # the line that assigns the optimizer, found by the recorder in the code that calls its step
    assert f"{_line('torch.optim.AdamW')})" in text


def test_one_rank_s_learning_rate_is_named_with_its_rank_and_both_values(runs, capsys):
    """What the optimizer makes is held alike by every rank in a correct run: never a sum or an average over the
    ranks, whatever factor it fits at (this crashed the diff); the differing rank is named, not 'the ranks'."""
    code, text = _diff(runs, "lr_one_rank", capsys)
    assert code == 1, text
    assert "(optimizer)" in text and "the ranks have parted from each other" in text, text
    assert "alpha -0.3 on rank 1, -0.1 in the single process" in text, text
    assert "SGD group 0: lr 0.3 on rank 1, 0.1 in the single process" in text, text


def test_rows_a_distributed_sampler_interleaves_are_the_same_global_batch(runs, capsys):
    """A DataLoader over a map-style dataset picks row by row (select); DistributedSampler's rank r takes rows r, r+W,
    ...: the ranks' rows joined in rank order are the single process's batch permuted, which is no departure and no
    'not the same global batch' (found by a new-user trial at --step 2)."""
    pd = diff_traces(runs[1] / "sampler", runs[2] / "sampler").parallel
    assert pd.departure is None and pd.batch_warning is None and pd.rows_reordered is not None
    code, text = _diff(runs, "sampler", capsys)
    assert code == 0 and "the ranks hold the single process's rows of the batch between them in another order" in text


@pytest.mark.parametrize("mode", ["dealt", "dealt_accum"])
def test_a_batch_a_sampler_dealt_out_before_the_step_maps_in_its_order(runs, capsys, mode):
    """A shuffling DistributedSampler's batch drawn before the step: rank r holds rows r, r+W, ... of the single
    process's; with 2 micro-batches a rank, no layout in rank order fits any activation (a new-user trial's DDP
    no_sync job read 'the runs began apart'). The rows are matched, and the activations mapped in that order."""
    pd = diff_traces(runs[1] / mode, runs[2] / mode).parallel
    assert pd.departure is None and pd.batch_warning is None, pd.departure
    if mode == "dealt_accum":
        assert pd.rank_micro_batches == 2 and pd.rows_reordered is not None
        # the forward's activations are compared, in the batch's order, not set aside
        assert any(t.layout is not None and t.layout.order is not None for op in pd.ops if op.phase == "forward"
                   for t in op.tensors if t.kind == "out")
    code, text = _diff(runs, mode, capsys)
    assert code == 0 and "agree: every compared op maps" in text, text


def test_one_micro_batch_s_own_scale_is_named_with_its_rank_and_line(runs):
    """Rank 1's second micro-batch's loss 1% off, the batch dealt out in another order: that micro-batch alone is
    off, and the op it alone reads is named (not 'an all-reduce is missing', not the batch's order)."""
    d = diff_traces(runs[1] / "dealt_accum_scaled", runs[2] / "dealt_accum_scaled").parallel.departure
    assert d is not None and d.op.phase == "backward" and "all-reduce" not in d.why, d
    assert "rank 1's micro-batch 2 does not" in d.why and "rank 0's micro-batch 1" in d.why, d.why
    assert f"{_line('loss = 1.01 * loss')}) made" in d.why, d.why


def test_a_loss_divided_by_the_world_size_where_the_gradients_are_too_names_both_scales(runs, capsys):
    """Gradients at 1/2x the single process's: the division of the gradients and the loss's, both the ranks' own,
    are named with their lines, not 'a sum not divided by the world size'."""
    pd = diff_traces(runs[1] / "dealt_accum_halved", runs[2] / "dealt_accum_halved").parallel
    e = pd.departure.enters
    assert e is not None and e.factor == Fraction(1, 2) and e.source.endswith(_line("averaged over the ranks")), e
    assert e.also is not None and f"{_line('loss = loss / world')}): 1/2" in e.also, e.also
    # the division every micro-batch's loss takes is said to be that
    assert f"{_line('y.flatten()) / 2')}): 1/2 (1 over the 2 micro-batches a rank accumulates)" in e.also, e.also
    code, text = _diff(runs, "dealt_accum_halved", capsys)
    assert code == 1 and "one scale too many" in text and "not divided" not in text, text


def test_every_rank_picking_the_same_rows_through_its_sampler_is_the_same_shard(runs):
    d = diff_traces(runs[1] / "sampler_same_rank", runs[2] / "sampler_same_rank").parallel.departure
    assert d is not None and d.kind is Departure.SAME_SHARD and d.op.name == "aten.select.int"
    assert "every rank picks the same 4 rows (0, 2, 4, 6)" in d.why, d.why
    assert f"{_line('sampler = DistributedSampler')} was given rank=0 on rank 1" in d.why, d.why


def test_summed_gradients_that_clipping_scales_are_named_at_the_norm_with_the_all_reduce(runs):
    """Gradients all-reduced and not divided, clipped on the ranks only: the clipping coefficient of the doubled
    norm is half the reference's on each rank, which fits as partial sums too; it is not 'an all-reduce is missing'
    but the doubled norm, reading what the all-reduce made, with its line (found by a new-user trial)."""
    d = diff_traces(runs[1] / "clip_sum", runs[2] / "clip_sum").parallel.departure
    assert d is not None and d.op.name == "aten._foreach_norm.Scalar", d
    assert "at 2x" in d.why and "all-reduce is missing" not in d.why, d.why
    # the all-reduce of the branch without per-token normalisation (the script's second)
    line = [n for n, text in enumerate(STEPS.splitlines(), 1) if "dist.all_reduce(p.grad)" in text][1]
    assert "c10d.allreduce_.default (#" in d.why and f"steps.py:{line}) made" in d.why, d.why


def test_one_rank_s_loss_scaled_by_one_percent_is_named_on_that_rank_at_its_line(runs):
    """Rank 1's loss 1% off: rank 0's slice of the loss's gradient is the reference's, rank 1's not; not 'an
    all-reduce is missing' (every rank's part would be off), and the line of rank 1's own scale is named."""
    d = diff_traces(runs[1] / "rank_scaled", runs[2] / "rank_scaled").parallel.departure
    assert d is not None and d.op.name == "aten.nll_loss_backward.default" and d.op.phase == "backward", d
    assert "rank 0 holds its slice of the reference's value, rank 1 does not" in d.why, d.why
    assert "all-reduce" not in d.why, d.why
    assert f"on rank 1 it reads what aten.mul.Tensor (#" in d.why and \
        f"{_line('loss = loss * 1.01')}) made" in d.why, d.why


def test_one_rank_s_own_scale_behind_an_op_both_runs_run_is_named_there(runs, capsys):
    """Rank 1's 1% scale read through a division both runs run (the loss over 1 micro-batch): the division's
    backward parts on rank 1, which reads what rank 1 alone computed; the min over the ranks (rank 0's 1 against rank
    1's 1.01) is no layout in a job that reduces with no min, and the partial loss that nll_loss_backward reads is not
    'an all-reduce is missing' (found by a new-user trial: plain DDP, rank 1's loss scaled)."""
    code, text = _diff(runs, "rank_scaled_divided", capsys)
    d = diff_traces(runs[1] / "rank_scaled_divided", runs[2] / "rank_scaled_divided").parallel
    dep = d.departure
    assert code == 1 and dep is not None and dep.op.name == "aten.div.Tensor" and dep.op.phase == "backward", dep
    assert "rank 0 holds the reference's value, rank 1 does not" in dep.why and "all-reduce" not in dep.why, dep.why
    assert f"on rank 1 it reads what aten.mul.Tensor (#" in dep.why and \
        f"{_line('loss = loss * 1.01')}) made" in dep.why, dep.why
    assert "min over ranks" not in text and "max over ranks" not in text, text
    # rank 1's own mul (its forward and backward) is said as what some rank alone runs, not as a layout's op
    assert "ops some ranks run and others do not: aten.mul.Tensor (rank 1 x2)" in text, text
    assert d.uneven_ops == {"aten.mul.Tensor": (0, 2)}, d.uneven_ops
    layout_line = next(line for line in text.splitlines() if line.startswith("  layout ops"))
    assert "aten.mul.Tensor" not in layout_line, layout_line


def test_one_rank_s_own_plain_scale_heads_the_verdict_at_its_line(runs, capsys):
    """Rank 1 alone multiplies its loss by 1.25: that op (which neither the single process nor rank 0 runs) heads the
    verdict with its line and factor, then where it shows (found by a new-user trial: the headline named the loss's
    line, the scale's only in the line below)."""
    code, text = _diff(runs, "rank_own_scale", capsys)
    line = _line("BUG in rank_own_scale")
    head = next(t for t in text.splitlines() if t.startswith("the runs part at "))
    assert code == 1 and head.startswith("the runs part at rank 1 #") and "aten.mul.Tensor  (forward)" in head and \
        head.endswith(f"{line}, which only rank 1 runs"), head
    assert "it multiplies the loss by 5/4 on rank 1, and neither the single process nor rank 0 runs such an op" \
        in text, text
    d = diff_traces(runs[1] / "rank_own_scale", runs[2] / "rank_own_scale").parallel.departure
    assert d.enters is not None and d.enters.alone == (1,) and d.enters.source.endswith(line), d.enters


def test_one_rank_s_own_scale_is_named_where_the_ranks_rows_are_not_slices_in_rank_order(runs):
    """The same bug with a shuffling DistributedSampler: no rank's rows are a slice of the reference's in rank order,
    so the rank that alone computed what the op reads is named, with its line (found by a new-user trial, FSDP2)."""
    d = diff_traces(runs[1] / "rank_scaled_rows", runs[2] / "rank_scaled_rows").parallel.departure
    assert d is not None and d.op.phase == "backward" and "all-reduce" not in d.why, d
    assert "on rank 1 it reads what aten.mul.Tensor (#" in d.why and \
        f"{_line('loss = loss * 1.01')}) made, which neither the single process nor rank 0 runs" in d.why, d.why


def test_every_rank_reading_the_same_shard_is_said_at_the_slice(runs):
    d = diff_traces(runs[1] / "same_shard", runs[2] / "same_shard").parallel.departure
    assert d is not None and d.kind is Departure.SAME_SHARD and d.op.phase == "forward"
    assert d.op.source.endswith(_line("xs, ys = torch.tensor_split"))
    assert "ranks 0 and 1 hold the same 4 rows" in d.why and "each rank reads the same shard" in d.why


def test_gradients_summed_and_not_averaged_under_adamw_are_named_where_they_reach_the_optimizer(runs):
    """AdamW's first update hides a gradient twice too large (it divides by its root mean square); its state does
    not: the diff names the gradient as the optimizer reads it, with the all-reduce it went through."""
    d = diff_traces(runs[1] / "adam_sum", runs[2] / "adam_sum").parallel.departure
    assert d is not None and d.kind is Departure.SCALED and d.op.phase == "optimizer"
    assert "replicated at 2x the reference after c10d.allreduce_" in d.why and "not divided by the world size" in d.why


def test_a_per_rank_mean_over_unequal_token_counts_is_named_with_the_counts(runs):
    g = torch.Generator().manual_seed(1)
    torch.randint(0, 11, (8, 5), generator=g)
    labels = torch.randint(0, 11, (8, 5), generator=g)
    labels[::4, 3:] = -100
    labels[:2, 1:] = -100
    counts = [int((part != -100).sum()) for part in torch.tensor_split(labels, 2)]
    d = diff_traces(runs[1] / "token_mean", runs[2] / "token_mean").parallel.departure
    assert d is not None and d.op.name == "aten.nll_loss_forward.default" and d.op.phase == "forward"
    assert f"a per-rank mean over each rank's own count, and the counts differ ({counts[0]} and {counts[1]}" in d.why
    assert f"the mean over all {sum(counts)}" in d.why


def test_the_json_report_carries_the_sinks_the_cancelled_factor_and_the_settings(runs, tmp_path):
    out = tmp_path / "d.json"
    assert main(["diff", str(runs[1] / "per_token"), str(runs[2] / "per_token"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())["parallel"]
    assert doc["sinks"] > 0 and doc["departure"] is None and len(doc["cancelled"]) == 1
    out2 = tmp_path / "lr.json"
    assert main(["diff", str(runs[1] / "lr"), str(runs[2] / "lr"), "--json", str(out2)]) == 1
    doc = json.loads(out2.read_text())["parallel"]
    (setting,) = doc["optimizer_settings"]
    assert setting.pop("built").endswith(_line("torch.optim.AdamW"))
    assert setting == {"optimizer": "SGD", "group": 0, "name": "lr", "ref": 0.1, "target": 0.2, "rank": 0}
