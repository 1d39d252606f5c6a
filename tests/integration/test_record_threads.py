"""Two threads recording at once (what autograd's device threads do in a backward pass that spans devices): every
op of both is recorded once, under its own number, and the trace reads back whole."""
from __future__ import annotations

import threading

import pytest

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import replaydiff
from replaydiff.trace import open_trace


class _Count(TorchDispatchMode):
    """The oracle: counts the ops that reach it (it sits below the recorder)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with self.lock:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_two_threads_recording_at_once_give_each_op_one_number_in_a_readable_trace(tmp_path):
    count = _Count()
    a = torch.randn(64, 64)
    go = threading.Barrier(2)

    def work() -> None:
        go.wait()
        x = a
        for _ in range(30):  # matmuls release the GIL: the two threads' ops interleave
            x = torch.tanh(x @ a)

    with count, replaydiff.record(tmp_path / "t", tensors="stats"):
        modes = _get_current_dispatch_mode_stack()  # the recorder's mode, entered again in the second thread

        def other() -> None:
            for m in modes:
                m.__enter__()
            try:
                work()
            finally:
                for m in reversed(modes):
                    m.__exit__(None, None, None)

        t = threading.Thread(target=other)
        t.start()
        work()
        t.join()
    rank = open_trace(tmp_path / "t").rank(0)
    ops = list(rank)  # reads every chunk: op numbers out of order would make it unreadable
    assert count.n == 120  # 2 threads x 30 x (mm, tanh), counted below the recorder
    assert [op.index for op in ops] == list(range(120))
    assert sorted(op.name for op in ops) == sorted(["aten.mm.default", "aten.tanh.default"] * 60)


_entered, _done = threading.Event(), threading.Event()


@torch.library.custom_op("replaydiff_test::wait_for_other_thread", mutates_args=())
def _wait_for_other_thread(x: torch.Tensor) -> torch.Tensor:
    """An op that cannot finish before another thread's op has run (a custom op joining its own worker)."""
    _entered.set()
    assert _done.wait(30), "the other thread's op never ran: the job hung on the recorder"
    return x.clone()


def test_an_op_waiting_for_another_threads_op_stops_the_recording_not_the_job(tmp_path, monkeypatch):
    from replaydiff.record import mode as rec_mode

    monkeypatch.setattr(rec_mode, "THREAD_WAIT_SECONDS", 0.5)
    _entered.clear()
    _done.clear()
    a = torch.randn(8, 8)
    results = {}
    with replaydiff.record(tmp_path / "t", tensors="stats"):
        modes = _get_current_dispatch_mode_stack()

        def other() -> None:
            for m in modes:
                m.__enter__()
            try:
                assert _entered.wait(30)
                results["other"] = torch.tanh(a)  # waits on the recorder's lock, held by the op waiting for it
            finally:
                for m in reversed(modes):
                    m.__exit__(None, None, None)
                _done.set()

        t = threading.Thread(target=other)
        t.start()
        with pytest.warns(RuntimeWarning, match="waited 0.5 s for another thread's op"):
            results["main"] = torch.ops.replaydiff_test.wait_for_other_thread(a)
            t.join()
    assert torch.equal(results["main"], a) and torch.equal(results["other"], torch.tanh(a))
    rank = open_trace(tmp_path / "t").rank(0)
    assert any("waited" in line for line in rank.lost)
