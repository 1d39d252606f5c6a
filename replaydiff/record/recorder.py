"""The public recorder: ``with replaydiff.record("trace/"): ...`` records every aten op of the block.

The recorder is a guest in someone else's job. It never changes a bit of the results (it only reads tensors and
copies them), and any failure inside it (a full disk, an op it cannot describe) disables recording with one warning
and a line in the manifest; nothing is ever raised into the training code.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from replaydiff.aten import current_rank
from replaydiff.record.context import OpContext
from replaydiff.record.environment import environment_snapshot
from replaydiff.record.mode import OpBuilder, RecordingMode, record_after, record_before
from replaydiff.record.options import RecordOptions
from replaydiff.record.storage import StorageTable
from replaydiff.trace.format import MANIFEST, rank_dir_name
from replaydiff.trace.writer import RankWriter, Snapshot

log = logging.getLogger("replaydiff")


class Recorder:
    """Records one block of a job into ``path/rank<N>/``. Use as a context manager, or ``start()``/``stop()``."""

    def __init__(self, path: str | os.PathLike, options: RecordOptions) -> None:
        self.path = Path(path)
        self.options = options
        self.active = False
        self.next_index = 0
        self.rank_dir: Path | None = None
        self.writer: RankWriter | None = None
        self.storages = StorageTable()
        self.context = OpContext(options.source_lines)
        self._mode: RecordingMode | None = None
        self._builder: OpBuilder | None = None
        self._started = 0.0
        self._disabled_reason: str | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> "Recorder":
        try:
            rank, world = current_rank()
            self.rank_dir = self.path / rank_dir_name(rank)
            if (self.rank_dir / MANIFEST).exists():
                raise FileExistsError(f"{self.rank_dir} already holds a trace; choose another directory")
            manifest = {
                "rank": rank,
                "world_size": world,
                "environment": environment_snapshot(rank, world),
                "options": self.options.to_dict(),
                "started_at": time.time(),
            }
            self.writer = RankWriter(self.rank_dir, manifest, self.options.compress, self.options.shuffle,
                                     self.options.chunk_ops, self.options.chunk_bytes)
            self._builder = OpBuilder(self)
            self.context.install()
            self._mode = RecordingMode(self)
            self._mode.__enter__()
            self._started = time.perf_counter()
            self.active = True
        except Exception as exc:
            self._warn(f"recording is off: {type(exc).__name__}: {exc}")
            self._teardown()
        return self

    def stop(self) -> None:
        was_active = self.active
        self.active = False
        self._teardown()
        if self.writer is not None and (was_active or self._disabled_reason):
            try:
                unseen = self._builder.unseen_writes if self._builder is not None else 0
                if unseen:
                    self._warn(f"{unseen} storage(s) were written outside torch's dispatcher (numpy, a C extension) "
                               f"while recording; they were stored again as new versions")
                self.writer.close({
                    "unseen_writes": unseen,
                    "ops_seen": self.next_index,
                    "record_seconds": time.perf_counter() - self._started,
                    "disabled": self._disabled_reason,
                })
            except Exception as exc:
                self._warn(f"the trace could not be finished: {exc}")
        self.storages.clear()

    def _teardown(self) -> None:
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            except Exception as exc:
                log.debug("could not pop the recording mode: %s", exc)
            self._mode = None
        try:
            self.context.uninstall()
        except Exception as exc:
            log.debug("could not remove tracking hooks: %s", exc)

    def __enter__(self) -> "Recorder":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- called by the mode -----------------------------------------------------------------------------------
    def before(self, func: Any, types: Any, args: tuple, kwargs: dict):
        if self.writer.failed:
            # The writer has already warned and noted in the manifest what was lost: stop without a second warning.
            self._disabled_reason = self._disabled_reason or "the trace writer failed"
            self.active = False
            return None
        return record_before(self, self._builder, func, types, args, kwargs)

    def after(self, pending: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        record_after(self, self._builder, pending, func, args, kwargs, out)

    def rng_state(self, args: tuple, kwargs: dict) -> tuple[str, int, int, int] | None:
        """Store the generator state a random op is about to use: (device, storage version, chunk, bytes)."""
        gen = kwargs.get("generator")
        device = None
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, torch.Tensor):
                device = v.device
                break
        if device is None and isinstance(kwargs.get("device"), torch.device):
            device = kwargs["device"]
        device = device or torch.device("cpu")
        if gen is not None:
            state = gen.get_state()
        elif device.type == "cpu":
            state = torch.get_rng_state()
        elif device.type == "cuda":
            state = torch.cuda.get_rng_state(device)
        else:
            return None
        version = self.storages.new_version_id()
        with _disable_current_modes():
            state = state.clone()
        chunk = self.writer.add_snapshot(Snapshot(version, state, 1))
        return str(device), version, chunk, state.numel()

    def disable(self, why: str) -> None:
        if self._disabled_reason is None:
            self._disabled_reason = why
            self._warn(f"recording stopped: {why}")
            if self.writer is not None:
                self.writer.note_lost(f"{why}; ops from #{self.next_index - 1} on were not recorded")
        self.active = False

    def _warn(self, msg: str) -> None:
        warnings.warn(f"replaydiff: {msg}", RuntimeWarning, stacklevel=3)


def record(path: str | os.PathLike, tensors: str = "full", compress: bool | int = True, **options: Any) -> Recorder:
    """Record every aten op run inside the ``with`` block into the trace directory ``path``.

    tensors: ``full`` stores tensor data, ``stats`` per-tensor statistics, ``meta`` only shapes and dtypes.
    compress: True for zstd at a fast level, an int for another zstd level, False for raw bytes.
    Other options are the fields of RecordOptions: ``modules`` / ``ops`` (globs; only matching ops are stored, all
    are numbered), ``max_tensor_bytes`` (larger storages get statistics instead of data), ``verify_writes`` (notice
    writes torch's dispatcher never sees, with a CRC32 per re-read), ``source_lines``, ``shuffle``, ``chunk_ops``.
    """
    return Recorder(path, RecordOptions.make(tensors=tensors, compress=compress, **options))
