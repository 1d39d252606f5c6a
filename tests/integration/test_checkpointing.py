"""Activation checkpointing: an op of a checkpointed region run again in the backward is located at the forward code
it runs (module and line), marked as the recompute of the forward op it repeats, and every report says so alike.

The oracle for "the forward op it repeats" is the trace's own forward pass: the one forward op of that name in that
module. Source lines are read from this file by their marker comments, never typed in.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import replaydiff
from replaydiff.cli.main import main
from replaydiff.trace import open_trace

HERE = Path(__file__)


def _line(marker: str) -> str:
    """'path:LINE' of the line of this file ending with ``# marker``, as the recorder names it."""
    lines = HERE.read_text().splitlines()
    n = next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}"))
    return f"{os.path.relpath(HERE)}:{n}"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))  # tanh line
        return x + self.b(h)


class Net(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(8, 1)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "sequential":  # the last segment runs without checkpointing: block 0 alone is recomputed
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return self.head(x).sum()


def _step(how: str) -> None:
    torch.manual_seed(0)
    net = Net(how)
    x = torch.randn(4, 8, requires_grad=how == "reentrant")
    loss = net(x)
    loss.backward()  # backward line


def _forward_op(rank, name: str, module: str) -> int:
    found = [op.index for op in rank if op.phase == "forward" and op.name == name and op.module == module]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("how", ["non_reentrant", "reentrant", "sequential"])
def test_a_recomputed_op_is_at_its_forward_code_and_names_the_forward_op_it_repeats(tmp_path, capsys, how):
    with replaydiff.record(tmp_path / "t"):
        _step(how)
    rank = open_trace(tmp_path / "t").rank(0)
    fwd = _forward_op(rank, "aten.tanh.default", "Net.blocks.0")
    recomputes = [op for op in rank if op.recompute and op.name == "aten.tanh.default"]
    assert len(recomputes) == (1 if how == "sequential" else 2)
    rc = next(op for op in recomputes if op.recompute_of == fwd)
    assert (rc.phase, rc.module, rc.source) == ("backward", "Net.blocks.0", _line("tanh line"))
    assert rc.backward_call == _line("backward line")
    assert rc.index > fwd and rank[fwd].module == rc.module
    # Recomputes of the linear layers belong to those layers, never to a sibling the backward was in.
    for op in rank:
        if op.recompute and op.recompute_of is not None:
            assert op.module == rank[op.recompute_of].module, (op, rank[op.recompute_of])
    # The backward op of that tanh differentiates the forward op, whichever graph it was made in (the reentrant
    # checkpoint differentiates the recomputed one).
    tb = [op for op in rank if op.name == "aten.tanh_backward.default" and op.module == "Net.blocks.0"]
    assert [op.forward_index for op in tb] == [fwd]
    assert rank[tb[0].index].source == _line("backward line")
    # show --op says it as the reports do: the forward code, and what ran it
    capsys.readouterr()
    assert main(["show", str(tmp_path / "t"), "--op", str(rc.index)]) == 0
    out = capsys.readouterr().out
    assert f"source  {_line('tanh line')}" in out
    assert f"recompute of forward op #{fwd} (activation checkpointing); backward() called at " \
           f"{_line('backward line')}" in out
    assert main(["show", str(tmp_path / "t"), "--op", str(tb[0].index)]) == 0
    out = capsys.readouterr().out
    assert f"source  {_line('tanh line')}" in out and "(of the forward op)" in out
    assert f"backward of forward op #{fwd}; backward() called at {_line('backward line')}" in out
    # show --list marks every recompute (and nothing else) with the forward op it repeats
    assert main(["show", str(tmp_path / "t"), "--list"]) == 0
    marked = {int(line.split()[0]): line for line in capsys.readouterr().out.splitlines() if "recompute of #" in line}
    assert marked == {op.index: marked.get(op.index) for op in rank if op.recompute_of is not None}
    assert f"backward, recompute of #{fwd}" in marked[rc.index]


@pytest.mark.parametrize("how", ["non_reentrant", "reentrant"])
def test_a_fault_in_a_recomputed_op_is_named_at_the_forward_line_that_runs_it(tmp_path, capsys, how):
    # tanh runs twice in the forward (blocks 0 and 1), then block 1 is recomputed first: call 3 is its recompute
    with replaydiff.record(tmp_path / "t", plant="aten.tanh.default:3:1e-3"):
        _step(how)
    rank = open_trace(tmp_path / "t").rank(0)
    fwd = _forward_op(rank, "aten.tanh.default", "Net.blocks.1")
    planted = next(op for op in rank if op.recompute and op.recompute_of == fwd and op.name == "aten.tanh.default")
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "t")]) == 1
    out = capsys.readouterr().out
    assert f"first divergent op #{planted.index} aten.tanh.default  Net.blocks.1  (recompute of #{fwd})  " \
           f"{_line('tanh line')}\n" in out, out
    assert f"  recompute of forward op #{fwd} (activation checkpointing); backward() called at " \
           f"{_line('backward line')}\n" in out, out
    assert f"aten.tanh.default call 3 x(1+0.001), op #{planted.index} on rank 0" in out, out  # the plant landed there
    # The recompute differs from its forward op because it computed wrongly (a deterministic tanh, its inputs the
    # forward's): said so, with no guess at a generator state
    assert f"recompute #{planted.index} aten.tanh.default differs from forward op #{fwd}, which it runs again: " \
           f"output 0 max_abs" in out, out
    assert "(the recompute is itself divergent: replayed from its inputs it is wrong, so the backward " \
           "differentiates values the forward never made)" in out, out
    assert "generator state" not in out, out


def test_a_recompute_that_differs_from_a_faulty_forward_op_says_the_forward_op_is_wrong(tmp_path, capsys):
    """The fault in the forward op (call 2: block 1's forward tanh), not in its recompute: the recompute differs
    from it, and the finding says the forward op is the divergent one, not a generator state."""
    with replaydiff.record(tmp_path / "t", plant="aten.tanh.default:2:1e-3"):
        _step("non_reentrant")
    rank = open_trace(tmp_path / "t").rank(0)
    fwd = _forward_op(rank, "aten.tanh.default", "Net.blocks.1")
    rc = next(op for op in rank if op.recompute and op.recompute_of == fwd and op.name == "aten.tanh.default")
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "t")]) == 1
    out = capsys.readouterr().out
    assert f"first divergent op #{fwd} aten.tanh.default" in out, out
    assert f"recompute #{rc.index} aten.tanh.default differs from forward op #{fwd}" in out, out
    assert f"forward op #{fwd} is itself divergent, and the recompute is right given its inputs" in out, out
    assert "generator state" not in out, out


@pytest.mark.parametrize("bf16", [False, True])
def test_reentrant_recomputes_under_autocast_are_matched_to_their_forward_ops(tmp_path, bf16):
    """Under autocast the reentrant checkpoint's forward casts the weights with grad (autograd nodes of their own,
    made after the checkpoint's): its recompute is still matched, by the checkpoint's node itself."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(), Block()])
    x = torch.randn(4, 8, requires_grad=True)
    with replaydiff.record(tmp_path / "t"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=True)
            loss = h.float().square().mean()
        loss.backward()
    rank = open_trace(tmp_path / "t").rank(0)
    for name in ("aten.addmm.default", "aten.tanh.default"):  # each block's, in the forward and recomputed
        fwd = [op.index for op in rank if op.phase == "forward" and op.name == name]
        again = sorted(op.recompute_of for op in rank if op.recompute and op.name == name)
        assert len(fwd) == (4 if name == "aten.addmm.default" else 2) and again == fwd, (name, fwd, again)
    assert all(rank[op.recompute_of].name == op.name for op in rank if op.recompute_of is not None)


class DropBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.tanh(self.a(x)), 0.5, training=True)  # dropout line


@pytest.mark.parametrize("preserve", [True, False])
def test_a_recompute_that_does_not_reproduce_its_forward_op_is_a_finding(tmp_path, capsys, preserve):
    torch.manual_seed(0)
    block = DropBlock()
    x = torch.randn(4, 8)
    with replaydiff.record(tmp_path / "t"):
        y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve)
        y.sum().backward()
    rank = open_trace(tmp_path / "t").rank(0)
    drop = [op for op in rank if op.name == "aten.bernoulli_.float"]  # dropout's mask
    assert [op.recompute for op in drop] == [False, True] and drop[1].recompute_of == drop[0].index
    capsys.readouterr()
    code = main(["replay", str(tmp_path / "t")])
    out = capsys.readouterr().out
    said = f"recompute #{drop[1].index} aten.bernoulli_.float differs from forward op #{drop[0].index}"
    if preserve:  # the checkpoint runs it again with the forward's generator state: the same mask
        assert said not in out and code == 0, out
    else:
        assert said in out and code == 1, out
        assert "output 0 max_abs" in out
        assert "a random op run without the forward's generator state" in out, out


class NormBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.bn(self.conv(x)))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_batch_norm_updating_its_running_statistics_twice_is_a_note_not_a_finding(tmp_path, capsys,
                                                                                               reentrant):
    """The recompute of a BatchNorm in training updates its running statistics (and its counter) a second time:
    they differ from the forward op's, which read them before; the values the backward reads do not. Said as a note,
    exit 0 (found by a new-user trial on a Conformer: exit 1, 'the backward differentiates values the forward never
    made'); a fault in a recompute beside it is still the finding."""
    torch.manual_seed(0)
    block = NormBlock()
    x = torch.randn(2, 4, 6, requires_grad=reentrant)
    with replaydiff.record(tmp_path / "t"):
        checkpoint(block, x, use_reentrant=reentrant).sum().backward()
    rank = open_trace(tmp_path / "t").rank(0)
    norms = [op for op in rank if op.name == "aten.native_batch_norm.default"]
    assert [op.recompute for op in norms] == [False, True], norms
    capsys.readouterr()
    code = main(["replay", str(tmp_path / "t")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "not clean" not in out and "differentiates values the forward never made" not in out, out
    assert f"updates again the state forward op #" in out and "running statistics" in out, out
