"""What tests/integration/test_diff_outputs.py and tests/e2e/test_diff_outputs_e2e.py share: a model with layer norm
recorded eager or compiled, and the check that diff aligns both units of it."""
from __future__ import annotations

import subprocess
from pathlib import Path

import torch

import replay_helpers as rh
from replaydiff import record
from replaydiff.cli.main import main
from replaydiff.diff import PairStatus, diff_traces


LN = "aten.native_layer_norm.default"


def _run(capsys, *args: str) -> subprocess.CompletedProcess:
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["replaydiff", *args], code, out, err)


class _Centred(torch.nn.Module):
    """A LayerNorm of an input already centred: its mean output is ~1e-8 where the input is ~1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 64)
        self.ln = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.ln(h - h.mean(-1, keepdim=True)))


def _index(path: Path, name: str, occurrence: int = 0) -> int:
    return rh.occurrence_index(rh.trace_ops(path), name, occurrence)


# -- eager against compiled: both units aligned -----------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln1(x))


class _Net(torch.nn.Module):
    """A LayerNorm one module down (Net.block.ln1), as in a transformer block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.block = _Block()
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inp(x)))


def _net_step(path: Path, backend: str | None) -> Path:
    model = _Net()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    f = model if backend is None else torch.compile(model, backend=backend)
    torch._dynamo.reset()
    try:
        with record(path):
            f(x).square().mean().backward()
    finally:
        torch._dynamo.reset()
    return path


def _both_units_aligned(tmp_path: Path, capsys, backend: str) -> None:
    eager = _net_step(tmp_path / "eager", None)
    compiled = _net_step(tmp_path / "compiled", backend)
    report = diff_traces(eager, compiled)
    rd = report.ranks[0]
    units = {u.op: u for u in rd.units}
    assert set(units) == {"compiled.unit.forward", "compiled.unit.backward"}, rd.target_only
    assert all(u.status is PairStatus.SAME for u in units.values()), [(u.op, u.status, u.reason) for u in rd.units]
    fw = units["compiled.unit.forward"]
    eager_fw = [op.index for op in rh.trace_ops(eager) if op.phase == "forward" and op.module]
    assert set(eager_fw) <= set(fw.eager), (eager_fw, fw.eager)  # every forward op of the model stands for a node
    assert not any("compiled.unit" in n for u in rd.target_only for n in u.names)
    proc = _run(capsys, "diff", str(eager), str(compiled))
    assert proc.returncode == 0, proc.stdout
    assert f"compiled unit target #{fw.unit} compiled.unit.forward  _Net.forward (" in proc.stdout, proc.stdout
    assert "): same" in proc.stdout and "not_compared" not in proc.stdout and "target only #0 " not in proc.stdout
