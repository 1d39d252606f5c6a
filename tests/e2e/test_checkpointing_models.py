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


FSDP2_AC = '''
import os, sys, torch, torch.distributed as dist, replaydiff
from torch.distributed.fsdp import fully_shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
class Block(torch.nn.Module):
    def __init__(s):
        super().__init__(); s.a = torch.nn.Linear(8, 8); s.b = torch.nn.Linear(8, 8)
    def forward(s, x):
        return x + s.b(torch.tanh(s.a(x)))  # block line
m = torch.nn.Sequential(checkpoint_wrapper(Block()), checkpoint_wrapper(Block()), torch.nn.Linear(8, 1))
for blk in m[:2]:
    fully_shard(blk, mesh=mesh)
fully_shard(m, mesh=mesh)
with replaydiff.record(sys.argv[1]):
    m(torch.randn(4, 8)).sum().backward()  # backward line
dist.destroy_process_group()
'''


def test_fsdp2_with_activation_checkpointing_recomputes_are_at_their_forward_ops(tmp_path):
    import socket
    import subprocess
    import sys

    (tmp_path / "fsdp_ac.py").write_text(FSDP2_AC)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.run([sys.executable, "fsdp_ac.py", "t"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    rank = open_trace(tmp_path / "t").rank(0)
    lines = (tmp_path / "fsdp_ac.py").read_text().splitlines()
    block = next(i for i, t in enumerate(lines, 1) if t.endswith("# block line"))
    call = next(i for i, t in enumerate(lines, 1) if t.endswith("# backward line"))
    tanh = [op for op in rank if op.recompute and op.name == "aten.tanh.default"]
    assert len(tanh) == 2  # both wrapped blocks run again in the backward
    for op in tanh:
        fwd = rank[op.recompute_of]
        assert (fwd.name, fwd.phase, fwd.module) == (op.name, "forward", op.module)
        assert op.source == fwd.source == f"fsdp_ac.py:{block}" and op.backward_call == f"fsdp_ac.py:{call}"
    assert {op.module for op in tanh} == {f"FSDPSequential.{k}._checkpoint_wrapped_module" for k in (0, 1)}
