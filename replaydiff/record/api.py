"""``replaydiff.record()``: the one public entry point, a Recorder for one block or a MultiStepRecorder for many steps."""
from __future__ import annotations

import os
from typing import Any

from replaydiff.record.options import RecordOptions
from replaydiff.record.recorder import Recorder
from replaydiff.record.multi_step import MultiStepRecorder
from replaydiff.trace.modes import TensorMode


def record(path: str | os.PathLike, tensors: TensorMode | str = TensorMode.FULL, compress: bool | int = True,
           **options: Any) -> Recorder | MultiStepRecorder:
    """Record every aten op run inside the ``with`` block into the trace directory ``path``.

    tensors: ``full`` stores tensor data, ``stats`` per-tensor statistics, ``meta`` only shapes and dtypes.
    compress: True for zstd at a fast level wherever it costs the job no time (while the job waits for the writer,
    a blob is stored raw when that is faster, judged from the write and compression rates measured as it goes), an
    int for that zstd level on every blob, False for raw bytes.
    Other options are the fields of RecordOptions: ``modules`` / ``ops`` (globs; only matching ops are stored, all
    are numbered), ``max_tensor_bytes`` (larger storages get statistics instead of data), ``verify_writes`` (notice
    writes torch's dispatcher never sees, with a CRC32 per re-read), ``source_lines``, ``shuffle``, ``chunk_ops``,
    ``queue_bytes`` (host memory for copies waiting to be written, 256 MiB: the most ``full`` adds for them).
    Many steps: with ``steps="100-2000:10"`` (or ``flight=K``) the ``with`` block wraps the training loop and only
    the chosen optimizer steps are recorded, each op with its step; ``granularity="module"`` records each module
    call's outputs and gradients instead of every op; ``flight=K`` keeps the last K steps in memory and writes them
    only when the loss, a model's output, a value read with ``.item()``, a gradient or a parameter turns NaN/Inf, on
    SIGTERM/SIGUSR1 or an exception (``flight_mib``, ``flight_at_exit``).
    torch.compile regions: ``compiled="capture"`` (default) runs them compiled, as the job does, and records each
    call of a compiled graph as one unit (its inputs, outputs and aten graph); ``compiled="eager"`` runs them as eager
    aten ops, each recorded.
    """
    opts = RecordOptions.make(tensors=tensors, compress=compress, **options)
    if opts.steps or opts.flight:
        return MultiStepRecorder(path, opts)
    return Recorder(path, opts)
