"""Activation checkpointing as transformers turns it on (``gradient_checkpointing_enable``), reentrant and not: every
recomputed op is located at the forward op it runs again (same op, module and source line), and a fault planted in
one is named by replay at that forward line as a recompute."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers  # part of the `test` extra

from replaydiff import record
from replaydiff.cli.main import main
from replaydiff.trace import open_trace


def _step(reentrant: bool):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=16, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 64, (2, 8))

    def step() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(input_ids=ids, labels=ids).loss.backward()  # backward line
    return step


def _backward_line() -> str:
    lines = open(__file__).read().splitlines()
    n = next(i for i, t in enumerate(lines, 1) if t.rstrip().endswith("# backward line"))
    return f"{os.path.relpath(__file__)}:{n}"


@pytest.mark.parametrize("reentrant", [False, True])
def test_gpt2_gradient_checkpointing_recomputes_are_at_their_forward_ops(tmp_path, capsys, reentrant):
    with record(tmp_path / "t"):
        _step(reentrant)()
    rank = open_trace(tmp_path / "t").rank(0)
    recomputes = [op for op in rank if op.recompute and op.recompute_of is not None]
    # both blocks are recomputed: each of their matmuls (Conv1D's addmm) once more
    fwd_mm = [op for op in rank if op.phase == "forward" and op.name == "aten.addmm.default"
              and ".h." in (op.module or "")]
    assert sorted(op.recompute_of for op in recomputes if op.name == "aten.addmm.default") == \
        [op.index for op in fwd_mm]
    for op in recomputes:
        fwd = rank[op.recompute_of]
        assert (op.name, op.module, op.source) == (fwd.name, fwd.module, fwd.source), (op, fwd)
        assert op.backward_call == _backward_line()
    # a fault planted in block 1's recomputed attention projection: the 5th addmm call (2 blocks x 4 in the forward
    # come first; block 1 is recomputed first, c_attn first)
    plant = fwd_mm[4]
    with record(tmp_path / "p", plant="aten.addmm.default:9:1e-3"):
        _step(reentrant)()
    planted = open_trace(tmp_path / "p").rank(0)
    culprit = next(op for op in planted if op.recompute and op.recompute_of == plant.index)
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "p")]) == 1
    out = capsys.readouterr().out
    assert f"first divergent op #{culprit.index} aten.addmm.default  {plant.module}  (recompute of " \
           f"#{plant.index})  {plant.source}\n" in out, out
    assert f"op #{culprit.index} on rank 0" in out, out  # where the plant landed, as the trace says
