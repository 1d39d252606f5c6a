"""Custom ops and wrong fused kernels: a bug in a kernel that replay would repeat at float64 is found against a
registered reference (``replaydiff.register_reference`` / ``replay --reference-module``) or, for an aten op with a
``torch._decomp`` decomposition, with ``--reference decomp``."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaydiff
from replaydiff.cli.main import main
from replaydiff.replay import ReplayOptions, Status, replay_trace


# -- a custom op with a buggy kernel: the unbiased variance where LayerNorm uses the biased one --------------------
@torch.library.custom_op("rdtest::fused_ln", mutates_args=())
def fused_ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.var(dim=-1, keepdim=True, unbiased=True)  # the bug: LayerNorm normalises by the biased variance
    return (x - x.mean(dim=-1, keepdim=True)) / torch.sqrt(var + eps) * w + b


@fused_ln.register_fake
def _(x, w, b, eps):
    return torch.empty_like(x)


REFERENCE_MODULE = '''
import torch.nn.functional as F
import replaydiff

def fused_ln(x, w, b, eps):
    return F.layer_norm(x, x.shape[-1:], w, b, eps)

replaydiff.register_reference("rdtest::fused_ln", fused_ln)
'''


def _custom_op_step() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    w, b = torch.ones(16), torch.zeros(16)
    with torch.no_grad():
        y = torch.ops.rdtest.fused_ln(lin(torch.randn(4, 16)), w, b, 1e-5)
        F.mse_loss(y, torch.zeros_like(y))


@pytest.fixture(scope="module")
def custom_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "trace"
    with replaydiff.record(path):
        _custom_op_step()
    return path


def _index_of(path, name: str) -> int:
    return next(op.index for op in replaydiff.open_trace(path).rank(0) if op.name == name)


def test_custom_op_kernel_bug_is_repeated_by_its_own_kernel_and_found_against_a_registered_reference(custom_trace):
    culprit = _index_of(custom_trace, "rdtest.fused_ln.default")
    plain = replay_trace(str(custom_trace), ReplayOptions())
    assert plain.first_divergent is None  # the fp64 replay runs the same wrong kernel
    try:
        replaydiff.register_reference("rdtest::fused_ln", lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b,
                                                                                          eps))
        report = replay_trace(str(custom_trace), ReplayOptions())
    finally:
        replaydiff.unregister_reference("rdtest::fused_ln")
    divergent = [r for r in report.ops if r.status is Status.DIVERGENT]
    assert [r.index for r in divergent] == [culprit]
    assert "registered" in divergent[0].reason


def test_reference_module_is_loaded_by_the_replay_command(custom_trace, tmp_path, monkeypatch):
    (tmp_path / "rdtest_refs.py").write_text(REFERENCE_MODULE)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    try:
        code = main(["replay", str(custom_trace), "--reference-module", "rdtest_refs", "--json", str(out)])
    finally:
        replaydiff.unregister_reference("rdtest::fused_ln")
    d = json.loads(out.read_text())
    assert code == 1
    assert d["first_divergent"]["index"] == _index_of(custom_trace, "rdtest.fused_ln.default")
    assert d["summary"]["divergent"] == 1
    assert d["options"]["reference_modules"] == ["rdtest_refs"]
    assert main(["replay", str(custom_trace), "--reference-module", "no_such_module_here"]) == 4


# -- a wrong fused aten kernel on the recording device: gelu that always takes the tanh approximation -------------
def _tanh_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.fixture
def wrong_gelu_kernel():
    """aten::gelu's CPU kernel replaced, for the recording and for the replay alike (the same device's kernel)."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
        lib.impl("gelu", _tanh_gelu, "CPU")
    yield
    lib._destroy()


def test_decomp_reference_finds_a_wrong_aten_kernel_the_reference_device_shares(wrong_gelu_kernel, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(4, 8) * 2
    with replaydiff.record(tmp_path / "t"):
        F.mse_loss(model(x), torch.zeros(4, 4)).backward()
    culprit = _index_of(tmp_path / "t", "aten.gelu.default")
    plain = replay_trace(str(tmp_path / "t"), ReplayOptions())
    assert plain.first_divergent is None  # the float64 replay runs the same wrong kernel
    report = replay_trace(str(tmp_path / "t"), ReplayOptions(reference="decomp"))
    divergent = [r for r in report.ops if r.status is Status.DIVERGENT]
    assert [r.index for r in divergent] == [culprit]
    assert "decomposition" in divergent[0].reason
    assert not [r for r in report.ops if r.status is Status.ERROR]
    assert report.options["reference"] == "decomp"


def test_decomp_replay_of_a_healthy_step_is_clean(tmp_path):
    from replay_helpers import replay, step_trace  # the module the other tests share its trace cache with

    report = replay(step_trace("transformer"), reference="decomp")
    assert report.first_divergent is None
    assert not [r for r in report.ops if r.status is Status.ERROR]
    assert report.counts()["ok"] > 700


def test_a_decomposition_that_declines_the_arguments_falls_back_to_the_kernel(tmp_path):
    """max_pool2d_with_indices_backward's decomposition returns NotImplemented for arguments it does not cover (here:
    the ones a CNN's pooling gives it): that is no decomposition for this call, so the op is replayed through its own
    kernel, as an op without one is, and the healthy step is clean (no "op returned NotImplementedType" error)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 2))
    with replaydiff.record(tmp_path / "t"):
        model(torch.randn(2, 1, 4, 4)).sum().backward()
    pool_bw = _index_of(tmp_path / "t", "aten.max_pool2d_with_indices_backward.default")
    report = replay_trace(str(tmp_path / "t"), ReplayOptions(reference="decomp"))
    assert [(r.index, r.reason) for r in report.ops if r.status is Status.ERROR] == []
    (r,) = [r for r in report.ops if r.index == pool_bw]
    assert r.status is Status.OK
    assert not report.found_problem
