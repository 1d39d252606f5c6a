"""Statistics of device tensors reach the host without a synchronisation of the job's stream: reduced on the device,
copied asynchronously, read by the writer thread (record.stats.DeviceStats, RankWriter.defer).

The CPU tests drive the same code with CPU tensors (no pinned memory, no event); the gpu-marked test records a CUDA
step under torch.cuda.set_sync_debug_mode("error"), which raises at any synchronisation."""
from __future__ import annotations

import math
import threading
import warnings
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff import open_trace
from replaydiff import device as seam
from replaydiff.record import mode as rec_mode
from replaydiff.record.stats import DeviceStats, _finite_stats, batch_stats
from tests.fake_device import FakeDevice


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 11, generator=g)
    return [x, x.t(), x[::3], torch.randn(5, generator=g, dtype=torch.float64), x.to(torch.float16),
            x.to(torch.bfloat16), torch.arange(-7, 9, dtype=torch.int64), torch.tensor([True, False, True]),
            torch.empty(0), torch.randn(4, dtype=torch.complex64, generator=g), torch.full((3,), 2.5)]


def test_device_statistics_of_finite_values_are_batch_stats_own() -> None:
    ts = _tensors()
    assert DeviceStats(ts).result() == batch_stats(ts)  # bit for bit, None for the complex one included


def test_non_finite_values_are_counted_and_the_finite_ones_measured() -> None:
    x = torch.tensor([1.0, float("nan"), -3.0, float("inf"), 2.0, float("-inf"), float("nan")])
    got = DeviceStats([x, torch.tensor([float("nan"), float("inf")])]).result()
    want = _finite_stats(x)
    assert got[0][0] == want[0] == 7 and got[0][5:] == want[5:] == [2, 2]
    assert got[0][2] == want[2] == 3.0  # absmax of the finite values
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(got[0][1:5], want[1:5]))
    assert got[1] == [2, 0.0, 0.0, 0.0, 0.0, 1, 1]


def _stats_by_ref(path: Path) -> list:
    out = []
    for op in open_trace(path).rank(0):
        for ref in [*op.inputs(), *op.outputs_refs()]:
            out.append((op.index, ref.version, ref.stats))
    return out


def _step():
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(6, 16)
    x[0, 0] = float("nan")  # one non-finite input: counted, and the rest of the tensor measured

    def step() -> None:
        lin(x).nan_to_num().square().mean().backward()
        opt.step()
    return step


def test_deferred_statistics_are_filled_by_the_writer_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every CPU tensor through the device path (not numpy's), synchronous first, then deferred
    monkeypatch.setattr(rec_mode, "kernel_stats", lambda *a, **k: None)
    monkeypatch.setattr(rec_mode, "cpu_values", lambda *a, **k: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = _step()
        with replaydiff.record(tmp_path / "sync", tensors="stats"):
            step()
    threads: list[str] = []
    fill = rec_mode._fill_device_cells

    def spy(*args):
        threads.append(threading.current_thread().name)
        return fill(*args)

    monkeypatch.setattr(rec_mode, "_fill_device_cells", spy)
    fake = FakeDevice()  # the CPU as an accelerator: statistics reduced "on the device", read after an event
    with warnings.catch_warnings(record=True) as caught2, seam.use(fake):
        warnings.simplefilter("always")
        step = _step()
        with replaydiff.record(tmp_path / "deferred", tensors="stats"):
            step()
    assert fake.calls["record_event"] > 0 and fake.calls["pinned"] > 0
    assert [str(w.message) for w in caught + caught2 if "replaydiff" in str(w.message)] == []
    assert threads and set(threads) == {"replaydiff-writer"}
    sync, deferred = _stats_by_ref(tmp_path / "sync"), _stats_by_ref(tmp_path / "deferred")
    assert [(i, v) for i, v, _ in sync] == [(i, v) for i, v, _ in deferred]
    nonfinite = measured = 0
    for (i, _, a), (_, _, b) in zip(sync, deferred):
        assert (a is None) == (b is None), f"op #{i}"
        if a is None:  # outputs of ops that write nothing in (empty*): no statistics either way
            continue
        measured += 1
        if a.nan or a.inf:
            nonfinite += 1
            assert (a.numel, a.absmax, a.nan, a.inf) == (b.numel, b.absmax, b.nan, b.inf)
            assert math.isclose(a.mean, b.mean, rel_tol=1e-9) and math.isclose(a.l2, b.l2, rel_tol=1e-9)
        else:
            assert a == b, f"op #{i}"
    assert nonfinite >= 2 and measured > 30


@pytest.mark.gpu
@pytest.mark.parametrize("tensors", ["meta", "stats", "full"])
def test_a_cuda_step_records_without_a_synchronisation(tmp_path: Path, tensors: str) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(32, 64, device=dev), torch.randn(32, 8, device=dev)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: cuBLAS handles, the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with replaydiff.record(tmp_path / "t", tensors=tensors):
                step()  # a synchronisation raises here (the job's own) or inside the recorder (a warning, below)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if "replaydiff" in str(w.message)] == []
    rank = open_trace(tmp_path / "t").rank(0)
    assert rank.complete and rank.lost == [] and rank.stopped is None
    ops = list(rank)
    assert len(ops) > 20 and all(op.recorded for op in ops)
    if tensors == "stats":
        refs = [r for op in ops for r in op.outputs_refs() if r.device.startswith("cuda")]
        assert refs and all(r.stats is not None and r.stats.numel == math.prod(r.shape) for r in refs)
