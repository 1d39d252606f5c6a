"""Replay raises the cyclic collector's young threshold while it replays ops, and puts the user's back after,
however the shards overlap (engine.fewer_collections)."""
from __future__ import annotations

import gc
import threading

import torch

import replaydiff
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.replay.engine import fewer_collections


def test_threshold_raised_while_replaying_and_restored_after(tmp_path):
    path = tmp_path / "t"
    with replaydiff.record(path, tensors="full"):
        (torch.randn(8, 8) @ torch.randn(8, 8)).relu().sum()
    saved = gc.get_threshold()
    gc.set_threshold(700, 9, 8)
    try:
        seen = []
        report = replay_trace(str(path), ReplayOptions(), on_result=lambda r: seen.append(gc.get_threshold()))
        assert len(seen) == len(report.ops) > 2
        assert all(t == (10_000, 9, 8) for t in seen)
        assert gc.get_threshold() == (700, 9, 8)
    finally:
        gc.set_threshold(*saved)


def test_overlapping_shards_restore_the_first_threshold():
    saved = gc.get_threshold()
    gc.set_threshold(500, 10, 10)
    try:
        inside, leave = threading.Event(), threading.Event()

        def other() -> None:
            with fewer_collections():
                inside.set()
                leave.wait(10)

        t = threading.Thread(target=other)
        with fewer_collections():
            t.start()
            assert inside.wait(10)
        # the first shard is done, the other still replays: the threshold stays raised for it
        assert gc.get_threshold()[0] == 10_000
        leave.set()
        t.join(10)
        assert gc.get_threshold() == (500, 10, 10)
    finally:
        gc.set_threshold(*saved)
