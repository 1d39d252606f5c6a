"""Sharded replay under torchrun: ``torchrun --nproc-per-node K -m replaydiff replay TRACE``.

Each of the K processes replays its share of ``plan(...).split(K)`` (on its own GPU where there are GPUs, on the CPU
otherwise), the OpResults are gathered to process 0, and process 0 alone runs ``finish`` and writes the one report:
the same plan/run_shard/finish path as one process or a pool, so the report is the same. The results travel with
``gather_object`` (pickle between our own processes, never anything read from a trace); the process group is gloo,
which carries Python objects on any machine.
"""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch

from replaydiff import device as seam
from replaydiff.errors import ReplaydiffError
from replaydiff.replay.engine import Progress, finish, plan, run_shard
from replaydiff.replay.policy import ReplayOptions
from replaydiff.replay.result import OpResult, ReplayReport
from replaydiff.trace.reader import open_trace

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """This process is one of several that torchrun (or srun with the same variables) started."""
    return all(v in os.environ for v in _TORCHRUN_VARS) and int(os.environ.get("WORLD_SIZE", "1")) > 1


def process_rank() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _device_for(opts: ReplayOptions) -> ReplayOptions:
    """``--device cuda`` means one GPU per process: this process's LOCAL_RANK (modulo the GPUs there are)."""
    dev = torch.device(opts.device)
    runtime = seam.RUNTIME
    if dev.type not in seam.HOST_TYPES and dev.index is None and runtime.available(dev.type):
        local = int(os.environ.get("LOCAL_RANK", "0")) % runtime.count(dev.type)
        runtime.set_device(torch.device(dev.type, local))
        return dataclasses.replace(opts, device=f"{dev.type}:{local}")
    return opts


def _raise(failure: BaseException | str, process: int) -> None:
    if isinstance(failure, BaseException):
        raise failure
    raise RuntimeError(f"replay process {process} failed: {failure}")


def replay_sharded(path: str, opts: ReplayOptions, progress_total=None,
                   progress: Progress | None = None) -> ReplayReport | None:
    """Replay this process's shards; process 0 returns the whole report, the others None."""
    import torch.distributed as dist

    rank, world = process_rank()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    try:
        trace = open_trace(path)
        local = _device_for(opts)
        p = plan(trace, local)
        payload: tuple[list[OpResult] | None, BaseException | str | None]
        try:
            shards = p.split(world)
            mine = shards[rank::world]
            if progress_total:
                progress_total(sum(len(s.indices) for s in mine))
            results: list[OpResult] = []
            for shard in mine:
                results += run_shard(trace.rank(shard.rank), local, shard, progress)
            payload = (results, None)
        except ReplaydiffError as exc:  # travels as itself (each carries its exit code)
            payload = (None, exc)
        except Exception as exc:  # a bug: its text travels; process 0 must not wait for results that never come
            payload = (None, f"{type(exc).__name__}: {exc}")
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        if payload[1] is not None:
            _raise(payload[1], rank)
        if rank != 0:
            return None
        for k, (_, failure) in enumerate(gathered):
            if failure is not None:
                _raise(failure, k)
        p.options = opts  # the report states the options asked for, as a one-process replay would
        return finish(trace, p, [r for part, _ in gathered for r in part])
    finally:
        if own_group:
            dist.destroy_process_group()
