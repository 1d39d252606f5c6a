"""The recording mode runs an exact OpOverload through its ``_op`` (a Python frame fewer an op) only where torch's
``OpOverload.__call__`` is the one line that does just that (``mode.calls_its_op``); a torch whose ``__call__`` did more
keeps its own call, so the job runs what it would run unrecorded. Oracles: the bytecode of hand-written ``__call__``s
that do more, and the trace a recording through ``__call__`` writes (the same op files, byte for byte)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff.record import mode as rec_mode


class Plain:
    def __call__(self_, *args, **kwargs):  # torch 2.1 on: the argument is self_ (an aten op may take a `self`)
        return self_._op(*args, **kwargs)


class KwargsOrEmpty:
    def __call__(self, *args, **kwargs):  # torch 2.0's
        return self._op(*args, **kwargs or {})


class Hooked:
    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._op(*args, **kwargs)


class OtherTarget:
    def __call__(self, *args, **kwargs):
        return self._fallback(*args, **kwargs)


def test_only_the_one_line_call_is_taken_for_its_op() -> None:
    assert rec_mode.calls_its_op(Plain)
    assert rec_mode.calls_its_op(torch._ops.OpOverload), "this torch's OpOverload.__call__ is no longer one line"
    assert rec_mode._OP_OVERLOAD is torch._ops.OpOverload  # so the mode calls _op itself here
    for cls in (KwargsOrEmpty, Hooked, OtherTarget, int):
        assert not rec_mode.calls_its_op(cls), cls.__name__


def _step():
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(5, 12)

    def step() -> torch.Tensor:
        loss = lin(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, lin


def _ops_bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((path / "rank0" / "ops").iterdir())}


@pytest.mark.parametrize("tensors", ["meta", "stats"])
def test_a_recording_through_call_writes_the_same_trace_and_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     tensors: str) -> None:
    results = []
    for name, direct in (("direct", rec_mode._OP_OVERLOAD), ("call", None)):
        monkeypatch.setattr(rec_mode, "_OP_OVERLOAD", direct)  # None: every op through func(...), as another torch
        step, lin = _step()
        with replaydiff.record(tmp_path / name, tensors=tensors, compress=False):
            loss = step()
        results.append((loss, [p.detach().clone() for p in lin.parameters()]))
    (loss_a, params_a), (loss_b, params_b) = results
    assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    ops = _ops_bytes(tmp_path / "direct")
    assert ops and ops == _ops_bytes(tmp_path / "call")
