"""Two threads recording at once (what autograd's device threads do in a backward pass that spans devices): every
op of both is recorded once, under its own number, and the trace reads back whole."""
from __future__ import annotations

import threading

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
