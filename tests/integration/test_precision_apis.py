"""The recorder under numerics settings jobs really use: torch's newer TF32 API (``torch.backends.fp32_precision``,
which transformers' ``tf32`` option sets) and FP8 casts recorded with ``--tensors stats``. Each once switched the
recording off or killed the job."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch

import replaydiff
from replaydiff import open_trace
from replaydiff.replay import ReplayOptions, replay_trace

# (backend, op) of the new API's settings a job can set; saved and put back around each test (process-wide).
_SETTINGS = [("generic", "all"), ("cuda", "matmul"), ("cuda", "all"), ("cuda", "conv"), ("cuda", "rnn"),
             ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn")]


@pytest.fixture
def new_tf32_api() -> Iterator[None]:
    if not hasattr(torch._C, "_get_fp32_precision_getter"):
        pytest.fail("this torch has no fp32_precision API: the test needs torch >= 2.9")
    saved = [(b, o, torch._C._get_fp32_precision_getter(b, o)) for b, o in _SETTINGS]
    legacy = (torch._C._get_cublas_allow_tf32(), torch._C._get_float32_matmul_precision(),
              torch._C._get_cudnn_allow_tf32())
    # torch's defaults, whatever an earlier test left: the job below starts from a fresh process's settings
    torch._C._set_cublas_allow_tf32(False)
    torch._C._set_float32_matmul_precision("highest")
    torch._C._set_cudnn_allow_tf32(True)
    for b, o in _SETTINGS:
        torch._C._set_fp32_precision_setter(b, o, "none")
    yield
    for b, o, v in saved:
        torch._C._set_fp32_precision_setter(b, o, v)
    torch._C._set_cublas_allow_tf32(legacy[0])
    torch._C._set_float32_matmul_precision(legacy[1])
    torch._C._set_cudnn_allow_tf32(legacy[2])


def _mlp_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("how", ["global", "matmul"])
def test_a_job_on_the_new_tf32_api_is_recorded_and_its_tf32_said(tmp_path: Path, new_tf32_api, how: str) -> None:
    if how == "global":
        torch.backends.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    # torch itself refuses the legacy read now: the state the recorder once read and died on
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t"):
            _mlp_step()
    assert not [w for w in caught if "replaydiff" in str(w.message)], [str(w.message) for w in caught]
    rank = open_trace(tmp_path / "t").rank(0)
    assert rank.complete and len(rank) > 10
    flags = rank.environment.flags
    assert flags.matmul_tf32 is True and flags.matmul_fp32_precision == "tf32"
    assert flags.float32_matmul_precision == "high"
    assert flags.fp32_precision == ("tf32" if how == "global" else "none")


def test_replay_runs_its_reference_in_a_process_on_the_new_tf32_api(tmp_path: Path, new_tf32_api) -> None:
    with replaydiff.record(tmp_path / "t"):
        _mlp_step()
    torch.backends.fp32_precision = "tf32"  # as an --import'ed module of the user's might
    before = {(b, o): torch._C._get_fp32_precision_getter(b, o) for b, o in _SETTINGS}
    counts = replay_trace(str(tmp_path / "t"), ReplayOptions()).counts()
    assert counts["divergent"] == 0 and counts["error"] == 0 and counts["ok"] > 10, counts
    # the reference ran in IEEE fp32 and the process's own settings are back as they were
    assert {(b, o): torch._C._get_fp32_precision_getter(b, o) for b, o in _SETTINGS} == before


def _fp8_step() -> torch.Tensor:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    w8 = lin.weight.to(torch.float8_e4m3fn)  # an FP8 weight, dequantised for the matmul
    y = x.to(torch.float8_e5m2).to(torch.float32) @ w8.to(torch.float32).t() + lin.bias
    y.pow(2).mean().backward()
    opt.step()
    return lin.weight.detach().clone()


def test_an_fp8_cast_recorded_with_statistics_keeps_the_job_and_measures_the_fp8_values(tmp_path: Path) -> None:
    plain = _fp8_step()
    with replaydiff.record(tmp_path / "t", tensors="stats"):
        recorded = _fp8_step()
    assert torch.equal(plain, recorded)
    rank = open_trace(tmp_path / "t").rank(0)
    assert rank.complete
    casts = [op for op in rank if op.name == "aten._to_copy.default" and op.phase == "forward"
             and op.outputs_refs()[0].dtype == "float8_e4m3fn"]
    assert len(casts) == 1
    out = casts[0].outputs_refs()[0]
    torch.manual_seed(0)
    expected = torch.nn.Linear(16, 16).weight.detach().to(torch.float8_e4m3fn).to(torch.float64)
    assert out.stats is not None
    assert out.stats.absmax == pytest.approx(expected.abs().max().item(), rel=1e-12)
    assert out.stats.l2 == pytest.approx(expected.norm().item(), rel=1e-12)


def test_a_tensor_no_statistics_can_be_made_of_is_recorded_without_them_and_said_once(tmp_path: Path) -> None:
    # torch can store uint3 values but not convert them: the statistics of such a tensor fail inside torch
    def step() -> torch.Tensor:
        x = torch.arange(8, dtype=torch.uint8)
        packed = x.view(torch.uint3)
        y = packed.view(torch.uint8) + 1
        z = (x.float() * 2).sum()
        return y.view(torch.uint3).view(torch.uint8) + z.to(torch.uint8)

    plain = step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replaydiff.record(tmp_path / "t", tensors="stats"):
            recorded = step()
    assert torch.equal(plain, recorded)
    said = [str(w.message) for w in caught if "statistics of some tensors could not be computed" in str(w.message)]
    assert len(said) == 1 and "UInt3" in said[0], [str(w.message) for w in caught]
    rank = open_trace(tmp_path / "t").rank(0)
    views = [op for op in rank if op.outputs_refs() and op.outputs_refs()[0].dtype == "uint3"]
    assert views and all(op.outputs_refs()[0].stats is None for op in views)
    # the other tensors were measured all the same
    sums = [op for op in rank if op.name == "aten.sum.default"]
    assert sums and sums[0].outputs_refs()[0].stats is not None
    assert any("could not be computed" in line for line in rank.lost)
