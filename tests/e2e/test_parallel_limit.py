"""The agreement limit scales with the model: a correct 4-rank data-parallel step of the tiny transformer widened to
16x its parameters (d_model 256) maps onto the single process, each value within the limit its own sums give it
(compare/reordered.py), and a 1% bug planted in the same step (rank 1's loss, and so its gradients, scaled by 1.01)
still makes the diff part, at the backward of the loss it scales, naming the line.

One script records both variants in each process: one plain run (the reference) and one torchrun launch of 4 gloo
ranks. ~2 minutes on the shared 2-core machine (the diff of each pair reads ~200 MB of traces).
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from replaydiff.cli.main import main
from replaydiff.diff import diff_traces
from replaydiff.report.diff_text import render_diff

pytestmark = pytest.mark.slow

WIDE = r'''
"""A data-parallel step of the tiny transformer widened 4x (d_model 256: 16x its parameters), gradients all-reduced
by hand and averaged; world size 1 is the single-process reference. Variants: ``correct``; ``scaled``, where rank 1
scales its loss, and so its gradients, by 1.01."""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import replaydiff
from replaydiff.models import TinyTransformer
from replaydiff.models.tiny import TransformerConfig

out = Path(sys.argv[1])
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if world > 1:
    dist.init_process_group("gloo")
for mode in ("correct", "scaled"):
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(d_model=256, dropout=0.0, batch=8, seq=16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = model.example_batch()
    xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
    with replaydiff.record(out / mode):
        loss = model(xs, ys)
        if mode == "scaled":
            loss = loss * (1.01 if rank == 1 else 1.0)  # BUG: rank 1's loss, and so its gradients, 1% too large
        loss.backward()
        for p in model.parameters():
            if world > 1:
                dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wide")
    script = root / "wide.py"
    script.write_text(WIDE)
    for world, out in ((1, "single"), (4, "multi")):
        cmd = [sys.executable, str(script), str(root / out)]
        if world > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"] + cmd[1:]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
    return root


def test_a_correct_run_of_a_model_16x_the_size_agrees_within_limits_its_sums_give(runs):
    report = diff_traces(runs / "single" / "correct", runs / "multi" / "correct")
    pd = report.parallel
    assert pd is not None and pd.world == 4 and pd.departure is None and not pd.random_parted, pd.departure
    judged = [m for op in pd.ops for m in op.tensors if m.error is not None and m.bound is not None]
    counted = [m for m in judged if m.bound.counted]
    # the weight gradients (matrix products over the batch's 128 tokens, partial over the ranks) and the bias
    # gradients (sums over them) have their limits counted from their terms, not the fixed sqrt(eps)
    assert any(m.bound.terms == 128 and m.layout.kind.value == "partial" for m in counted)
    assert all(m.error <= m.limit for m in judged)
    assert 0 < pd.worst <= pd.worst_limit
    assert not report.found_difference
    out = io.StringIO()
    render_diff(report, out)  # what `replaydiff diff` prints
    text = out.getvalue()
    bound = pd.worst_bound
    assert bound is not None and f"against its limit of {pd.worst_limit:.3g} eps ({bound.describe()})" in text


def test_a_one_percent_bug_in_the_wide_run_still_parts_and_names_its_line(runs, capsys, tmp_path):
    line = next(n for n, text in enumerate(WIDE.splitlines(), 1) if "# BUG" in text)
    single, multi = runs / "single" / "scaled", runs / "multi" / "scaled"
    out = tmp_path / "diff.json"
    assert main(["diff", str(single), str(multi), "--json", str(out)]) == 1
    text = capsys.readouterr().out
    d = json.loads(out.read_text())["parallel"]["departure"]
    # where the runs part: the mul that scales rank 1's loss, with its argument and the bug's line (not a missing
    # all-reduce of the per-rank loss it reads, nor the backward where the scale shows)
    assert d["phase"] == "forward" and d["op"] == "aten.mul.Tensor" and d["source"].endswith(f"wide.py:{line}")
    assert "argument 1 1.01 on rank 1, 1 in the single process" in text and "all-reduce is missing" not in text
