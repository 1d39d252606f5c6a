"""Device semantics on a machine without an accelerator, through the device seam (tests/fake_device.py: the CPU as an
accelerator whose copies land when the test says).

What they pin: the writer never reads a device copy before its event completes; a device that never finishes (a hung
collective) holds back no record and no marker, and the trace then says which data is missing and is never clean;
ops under graph capture become placeholders, touching nothing on the device; the trace says what each device was.
The gpu-marked tests (and tests/bench/gpu_check.py) hold the same on a real GPU."""
from __future__ import annotations

import math
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff import device as seam
from replaydiff import open_trace
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.trace.schema import LEFT_OUT_DEVICE_PENDING
from tests.fake_device import FakeDevice


def _step():
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(5, 8)

    def step() -> None:
        lin(x).square().mean().backward()
        opt.step()
    return step


def _record(path: Path, fake: FakeDevice | None, tensors: str = "full") -> list[str]:
    step = _step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fake is None:
            with replaydiff.record(path, tensors=tensors):
                step()
        else:
            with seam.use(fake), replaydiff.record(path, tensors=tensors):
                step()
    return [str(w.message) for w in caught if "replaydiff" in str(w.message)]


def test_the_writer_waits_for_the_device_copies_before_it_reads_them(tmp_path: Path) -> None:
    fake = FakeDevice(hold=True)  # each pinned copy reads 0xFF until the device catches up
    timer = threading.Timer(0.5, fake.release)
    timer.start()
    try:
        said = _record(tmp_path / "t", fake)
    finally:
        timer.cancel()
    assert said == []
    assert fake.calls["pinned"] > 10 and fake.calls["record_event"] >= fake.calls["pinned"]
    rank = open_trace(tmp_path / "t").rank(0)
    assert rank.complete and rank.lost == []
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    # every copy read after its event: the bytes are the job's, and the step replays clean (0xFF would be NaN)
    assert not report.found_problem and report.counts()["ok"] > 10


def test_records_go_on_when_the_device_never_finishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seam, "EVENT_DEADLINE", 0.3)
    plain = tmp_path / "plain"
    _record(plain, None)
    fake = FakeDevice(hold=True)  # a hung kernel ahead of every copy: no event ever completes
    started = time.monotonic()
    said = _record(tmp_path / "hung", fake)
    took = time.monotonic() - started
    assert said == []
    assert took < 10  # one deadline for the whole recording, not one per copy
    ops = list(open_trace(tmp_path / "hung").rank(0))
    assert [op.name for op in ops] == [op.name for op in open_trace(plain).rank(0)]  # no record held back
    pending = [op for op in ops if op.data_left_out == LEFT_OUT_DEVICE_PENDING]
    assert pending and all(op.recorded for op in ops)
    rank = open_trace(tmp_path / "hung").rank(0)
    assert rank.complete and any("had not finished" in line for line in rank.lost)
    report = replay_trace(str(tmp_path / "hung"), ReplayOptions())
    assert report.found_problem  # data the recording meant to store is missing: never clean
    assert {r.index for r in report.not_judged} >= {op.index for op in pending}


def test_statistics_of_a_device_that_never_finishes_are_left_empty_not_wrong(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seam, "EVENT_DEADLINE", 0.2)
    from replaydiff.record import mode as rec_mode

    monkeypatch.setattr(rec_mode, "kernel_stats", lambda *a, **k: None)  # every tensor through the device path
    monkeypatch.setattr(rec_mode, "cpu_values", lambda *a, **k: None)
    said = _record(tmp_path / "t", FakeDevice(hold=True), tensors="stats")
    assert said == []
    refs = [r for op in open_trace(tmp_path / "t").rank(0) for r in op.outputs_refs()]
    assert refs and all(r.stats is None for r in refs)  # none of the 0xFF / NaN the pinned rows held


def test_ops_under_graph_capture_are_placeholders_that_touch_nothing(tmp_path: Path) -> None:
    fake = FakeDevice()
    x = torch.randn(4, 4)
    w = torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with seam.use(fake), replaydiff.record(tmp_path / "t"):
            y = x @ w
            before = dict(fake.calls)
            fake.capture = True
            z = torch.nn.functional.dropout(y, 0.5)  # a random op: its generator must not be read now
            z.mul_(2)
            fake.capture = False
            during = {k: fake.calls[k] - before.get(k, 0) for k in fake.calls}
            (z + 1).sum()
    said = [str(w.message) for w in caught if "replaydiff" in str(w.message)]
    assert during.get("during_capture", 0) == 0 and during.get("record_event", 0) == 0
    assert len(said) == 1 and "graph capture" in said[0]
    ops = open_trace(tmp_path / "t").rank(0)[:]
    captured = [op for op in ops if not op.recorded]
    assert [op.name for op in ops if op.recorded] == ["aten.mm.default", "aten.add.Tensor", "aten.sum.default"]
    assert [op.index for op in captured] == list(range(1, len(ops) - 2))  # every op between, numbered in order
    assert any("bernoulli" in op.name for op in captured) and captured[-1].name == "aten.mul_.Tensor"
    assert all("graph capture" in op.not_recorded_reason for op in captured)


def test_the_trace_says_what_each_device_is(tmp_path: Path) -> None:
    _record(tmp_path / "t", FakeDevice(processors=114))
    env = open_trace(tmp_path / "t").rank(0).environment
    assert [(d.label, d.name, d.capability, d.processors) for d in env.devices] == [
        ("cuda:0", "Fake H100", (9, 0), 114)]
    assert env.hip == "6.2.41133" and env.nccl == "2.21.5"


def test_device_statistics_of_a_large_batch_are_reduced_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from replaydiff.record.stats import DeviceStats, batch_stats

    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(1000, generator=g) for _ in range(7)] + [torch.randn(3, generator=g, dtype=torch.float64)]
    ts[2][5] = math.inf
    whole = DeviceStats(ts).result()
    monkeypatch.setattr(DeviceStats, "CHUNK_BYTES", 9000)  # about one float32 tensor's reduction copies a slice
    sliced = DeviceStats(ts).result()
    assert sliced == whole
    assert [s for i, s in enumerate(sliced) if i != 2] == [s for i, s in enumerate(batch_stats(ts)) if i != 2]


def _one_rank_group(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    return dist


@pytest.mark.parametrize("finishes", [True, False])
def test_a_collective_the_device_never_completes_is_left_as_the_marker(tmp_path: Path, finishes: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator a collective returns once issued; a rank hung in it is waiting on the device. The marker
    of the collective entered stays until the device has done it, so a rank killed then names it."""
    monkeypatch.setattr(seam, "EVENT_DEADLINE", 0.3)
    dist = _one_rank_group(tmp_path)
    try:
        fake = FakeDevice(hold=not finishes)
        x = torch.ones(4)
        with seam.use(fake), replaydiff.record(tmp_path / "t", tensors="stats"):
            dist.all_reduce(x)
            y = x * 2
            time.sleep(0.8)  # the writer's idle rounds (flush_seconds 0.5) look at the collective in flight
        assert torch.equal(y, torch.full((4,), 2.0))
    finally:
        dist.destroy_process_group()
    rank = open_trace(tmp_path / "t").rank(0)
    names = [op.name for op in rank]
    assert "c10d.allreduce_.default" in names  # recorded as issued, either way
    if finishes:
        assert rank.entered is None
    else:
        assert rank.entered is not None and rank.entered.name == "c10d.allreduce_.default"
        assert rank.entered.collective is not None and rank.entered.collective.size == 1


def test_the_flight_recorder_reads_device_statistics_at_the_end_of_a_step(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--flight with a device: statistics reach the host after the step's events (no synchronisation at each op),
    and a NaN they show (first in the model's output) still triggers the dump of the step it appeared in."""
    from replaydiff.record import mode as rec_mode

    monkeypatch.setattr(rec_mode, "kernel_stats", lambda *a, **k: None)  # every tensor through the device path
    monkeypatch.setattr(rec_mode, "cpu_values", lambda *a, **k: None)
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    fake = FakeDevice()
    with seam.use(fake), replaydiff.record(tmp_path / "t", tensors="stats", flight=2):
        for step in range(5):
            if step == 3:
                with torch.no_grad():
                    lin.weight[0, 0] = float("nan")
            lin(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert fake.calls["record_event"] > 0
    r = open_trace(tmp_path / "t").rank(0)
    steps = sorted({op.step for op in r})
    reason = r.manifest["flight"]["reason"]
    assert len(steps) == 2 and reason.startswith("the output of Linear.forward at ") and \
        reason.endswith(f" holds NaN at step {steps[-1]}")
    refs = [ref for op in r for ref in op.outputs_refs() if ref.stats is not None]
    assert refs and any(ref.stats.nan for ref in refs)
