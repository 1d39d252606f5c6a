"""diff of eager against inductor on a model with layer norm: both units aligned, and a centred input rounded
differently is no divergence (the rest, eager and aot_eager: tests/integration/test_diff_outputs.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from replaydiff import record
from replaydiff.diff import PairStatus, diff_traces

from diff_outputs_helpers import _both_units_aligned, _Centred, _index, _run, LN


def test_eager_against_inductor_aligns_both_units_of_a_model_with_layer_norm(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _both_units_aligned(tmp_path, capsys, "inductor")


def test_an_eager_layer_norm_of_an_inductor_centred_input_is_no_divergence(tmp_path, capsys, monkeypatch):
    """The user's case: the centring compiled with inductor (it rounds otherwise than eager), the LayerNorm after it
    eager on both sides; its mean output is ~1e-8."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def step(path: Path, compiled: bool) -> Path:
        model = _Centred()
        centre = (lambda h: h - h.mean(-1, keepdim=True))
        fn = torch.compile(centre, backend="inductor") if compiled else centre
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        torch._dynamo.reset()
        try:
            with record(path):
                model.head(model.ln(fn(model.inp(x)))).square().mean().backward()
        finally:
            torch._dynamo.reset()
        return path

    eager, compiled = step(tmp_path / "eager", False), step(tmp_path / "compiled", True)
    proc = _run(capsys, "diff", str(eager), str(compiled))
    assert proc.returncode == 0, proc.stdout
    assert "first divergence" not in proc.stdout
    ln = diff_traces(eager, compiled).ranks[0].by_target[_index(compiled, LN)]
    assert ln.status is PairStatus.SAME and ln.verdict.output.role in ("out", "mean", "rstd")
