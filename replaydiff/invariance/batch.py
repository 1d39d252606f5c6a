"""Where the step's batch dimension is in each recorded tensor, followed through the data flow.

A storage that holds the batch is described by where its rows sit in its bytes (``Layout``): row ``b`` of a tensor
laid out (B, T, C) starts ``b * T * C`` elements in; the same bytes seen as (B*T, C), (B, H, T, D) after a head
split, or transposed, hold the rows at the same places. So a view needs no rule of its own: the batch dimension of
any tensor over the storage is the dimension whose stride, times a whole number of its entries (the block: T for a
(B*T, C) view), steps from one row to the next, and that spans all B rows. A tensor an op computes gets its layout
from the op's slice run (``analysis``): the dimension of its output that shrank with the slice.
"""
from __future__ import annotations

from dataclasses import dataclass

from replaydiff import aten
from replaydiff.trace.schema import OpRecord, TensorRef


@dataclass(frozen=True)
class Layout:
    """The rows of a storage version: byte ``p`` is in row ``(p // row_bytes) % rows`` (the modulo describes a batch
    dimension that is not the outermost too, as in a (T, B, C) tensor). Row 0 starts at the storage's start: a
    tensor that starts inside it (x[:, 1:], the second third of a fused q/k/v projection) holds the same rows."""

    row_bytes: int
    rows: int

    def dim_of(self, ref: TensorRef) -> "BatchDim | None":
        """The batch dimension of a tensor over this storage, or None when it has none that spans the batch (a
        slice of some rows, a merged dimension with the batch inside it)."""
        if ref.stride is None:
            return None
        item = ref.torch_dtype.itemsize
        if (ref.offset * item // self.row_bytes) % self.rows:
            return None  # it starts past the first row
        for d, (size, stride) in enumerate(zip(ref.shape, ref.stride)):
            step = stride * item
            if step <= 0 or self.row_bytes % step:
                continue
            block = self.row_bytes // step
            if size == self.rows * block:
                return BatchDim(d, block)
        return None


@dataclass(frozen=True)
class BatchDim:
    """The batch as a tensor holds it: along ``dim``, each row ``block`` entries long (1 unless the batch was merged
    with the dimensions inside it, as (B, T, C) viewed as (B*T, C))."""

    dim: int
    block: int

    def layout(self, ref: TensorRef, rows: int) -> Layout | None:
        """The layout of ``ref``'s storage that puts the batch where this says it is in ``ref``."""
        if ref.stride is None or ref.stride[self.dim] <= 0:
            return None
        item = ref.torch_dtype.itemsize
        return Layout(ref.stride[self.dim] * self.block * item, rows)

    def span(self, rows: "tuple[int, int]") -> tuple[int, int]:
        """(start, length) along ``dim`` of the rows ``rows`` (start, stop)."""
        return rows[0] * self.block, (rows[1] - rows[0]) * self.block


def makes_batch(op: OpRecord) -> bool:
    """An op of the step that can make its batch: a collation (``stack``/``cat`` of rows, as a DataLoader's
    default_collate stacks the dataset's rows inside the step) or a random factory reading no tensor (``randn``)."""
    return aten.collates(op.name) or (aten.is_random(op.name) and not op.inputs())


def is_step_input(ref: TensorRef, produced: set, batch_size: int | None, min_rows: int = 2) -> bool:
    """A tensor the step reads from outside it that can hold the batch: made by no op of the trace, needing no
    gradient (a parameter needs one), with values, ``min_rows`` rows or more (as many as the batch, when its size is
    known: one row is a buffer broadcast to the batch, unless the run is a one-row run mapped onto a batch's),
    and not a floating vector (a buffer such as rotary embeddings' inverse frequencies or a norm's running mean; a
    vector of the batch is ids or labels)."""
    return ref.version is not None and ref.version not in produced and could_be_batch(ref, batch_size, min_rows)


def could_be_batch(ref: TensorRef, batch_size: int | None, min_rows: int = 2) -> bool:
    """The shape and kind of a batch, wherever the tensor was made (``is_step_input`` says why)."""
    return (not ref.requires_grad and ref.stride is not None and len(ref.shape) >= 1 and ref.shape[0] >= min_rows
            and (batch_size is None or ref.shape[0] == batch_size)
            and (len(ref.shape) >= 2 or not ref.torch_dtype.is_floating_point))
