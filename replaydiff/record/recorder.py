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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from replaydiff.record.context import OpContext
from replaydiff.record.environment import environment_snapshot
from replaydiff.record.mode import OpBuilder, RecordingMode, record_after, record_before
from replaydiff.record.storage import StorageTable
from replaydiff.trace.format import MANIFEST, rank_dir_name
from replaydiff.trace.writer import RankWriter, Snapshot

log = logging.getLogger("replaydiff")

TENSOR_MODES = ("full", "stats", "meta")
DEFAULT_ZSTD_LEVEL = 1


@dataclass(frozen=True)
class RecordOptions:
    tensors: str = "full"
    compress: int | None = DEFAULT_ZSTD_LEVEL  # zstd level, None for raw bytes
    # Byte-shuffle before zstd: measured on the tiny transformer step it saves 1.6% of the bytes (13.61 -> 13.39 MB)
    # for ~0.5 ms per 128 KiB each way, so it is off unless asked for.
    shuffle: bool = False
    modules: list[str] | None = None  # module-path globs; ops outside them are numbered but not stored
    ops: list[str] | None = None  # op-name globs, e.g. "aten.mm.*"
    max_tensor_bytes: int | None = None  # larger storages get statistics instead of data
    source_lines: bool = True
    chunk_ops: int = 256
    chunk_bytes: int = 64 << 20
    # Checksum every stored CPU storage and check it each time the storage is read again, so that writes torch's
    # dispatcher never sees (through .numpy(), a C extension's pointer) become new versions. Costs a CRC32 pass
    # (~3 GB/s) per re-read: off by default.
    verify_writes: bool = False


def current_rank() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


class Recorder:
    """Records one block of a job into ``path/rank<N>/``. Use as a context manager, or ``start()``/``stop()``."""

    def __init__(self, path: str | os.PathLike, options: RecordOptions) -> None:
        if options.tensors not in TENSOR_MODES:
            raise ValueError(f"tensors must be one of {TENSOR_MODES}, not {options.tensors!r}")
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
                "options": {k: v for k, v in self.options.__dict__.items()},
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

    def rng_state(self, args: tuple, kwargs: dict) -> dict | None:
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
        return {"dev": str(device), "T": version, "f": chunk, "sb": state.numel()}

    def disable(self, why: str) -> None:
        if self._disabled_reason is None:
            self._disabled_reason = why
            self._warn(f"recording stopped: {why}")
            if self.writer is not None:
                self.writer.note_lost(f"{why}; ops from #{self.next_index - 1} on were not recorded")
        self.active = False

    def _warn(self, msg: str) -> None:
        warnings.warn(f"replaydiff: {msg}", RuntimeWarning, stacklevel=3)


def record(path: str | os.PathLike, tensors: str = "full", compress: bool | int = True, *,
           modules: list[str] | str | None = None, ops: list[str] | str | None = None,
           max_tensor_bytes: int | None = None, source_lines: bool = True, shuffle: bool = False,
           chunk_ops: int = 256, verify_writes: bool = False) -> Recorder:
    """Record every aten op run inside the ``with`` block into the trace directory ``path``.

    tensors: ``full`` stores tensor data, ``stats`` per-tensor statistics, ``meta`` only shapes and dtypes.
    compress: True for zstd at a fast level, an int for another zstd level, False for raw bytes.
    modules / ops: globs; only matching ops are stored (all are still numbered).
    max_tensor_bytes: storages larger than this get statistics instead of data.
    verify_writes: notice writes torch's dispatcher never sees (numpy, C extensions) with a CRC32 per re-read.
    """
    level: int | None
    if compress is True:
        level = DEFAULT_ZSTD_LEVEL
    elif compress is False or compress is None:
        level = None
    else:
        level = int(compress)
    as_list = (lambda v: [v] if isinstance(v, str) else (list(v) if v else None))
    return Recorder(path, RecordOptions(tensors=tensors, compress=level, shuffle=shuffle, modules=as_list(modules),
                                        ops=as_list(ops), max_tensor_bytes=max_tensor_bytes,
                                        source_lines=source_lines, chunk_ops=chunk_ops,
                                        verify_writes=verify_writes))
