"""How an all-to-all cuts its tensors: the split sizes of one recorded ``all_to_all_single``, read in one place.

An all-to-all (``c10d.alltoall_base_``, ``_c10d_functional.all_to_all_single``) sends the first ``sends[n]`` rows
of its input (dim 0) to rank n of its group, the next rows to the next rank, and receives ``receives[n]`` rows from
rank n, in group order; with no split sizes given, every rank gets an equal share. Two readers need this and nothing
above the trace may be shared between them: replay checks each received chunk against the peer's rows it came from,
and the parallel diff lays out the rows routed to experts (expert parallelism: each rank's tokens grouped by the
rank that holds their expert, joined over the ranks in the single process's order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replaydiff import aten
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.schema.values import TensorRef

# argument positions of (output split sizes, input split sizes), and of (output, input) where the form takes its
# output as an argument (None: the op returns it), per form of the op
_SPLIT_ARGS: dict[tuple[str, str], tuple[int, int]] = {
    ("c10d", "alltoall_base_"): (3, 4),
    ("functional", "all_to_all_single"): (1, 2),
}
_TENSOR_ARGS: dict[tuple[str, str], tuple[int | None, int]] = {
    ("c10d", "alltoall_base_"): (0, 1),
    ("functional", "all_to_all_single"): (None, 0),
}


def _form(name: str) -> tuple[str, str]:
    ns = aten.namespace(name)
    return "c10d" if ns == "c10d" else "functional" if ns in ("_c10d_functional", "c10d_functional") else ns, \
        aten.packet(name)


def split_positions(name: str) -> tuple[int, int] | None:
    """The argument positions of an all-to-all's (output split sizes, input split sizes); None for another op."""
    return _SPLIT_ARGS.get(_form(name))


def split_sizes(v: Any, total: int, parts: int) -> list[int]:
    """Split sizes along dim 0 as recorded, or equal chunks of ``total`` when none were given."""
    if isinstance(v, (list, tuple)) and len(v) > 0:
        return [int(x) for x in v]
    return [total // parts] * parts


@dataclass(frozen=True)
class Exchange:
    """One rank's all-to-all: the rows it sends to each rank of the group, and receives from each, in group order."""

    index: int  # the op's number on its rank
    sends: tuple[int, ...]
    receives: tuple[int, ...]
    source: TensorRef  # the tensor whose rows it sends
    dest: TensorRef  # the tensor it receives into


def exchange_of(op: OpRecord, parts: int) -> Exchange | None:
    """The split sizes of one all-to-all record over a group of ``parts`` ranks (equal shares where none were
    given); None for another op, or one whose tensors were not recorded."""
    form = _form(op.name)
    at = _SPLIT_ARGS.get(form)
    if at is None:
        return None
    out_at, in_at = _TENSOR_ARGS[form]
    src = op.args[in_at] if in_at < len(op.args) else None
    dst = op.outputs if out_at is None else (op.args[out_at] if out_at < len(op.args) else None)
    if isinstance(dst, (list, tuple)) and len(dst) == 1:
        dst = dst[0]
    if not isinstance(src, TensorRef) or not isinstance(dst, TensorRef) or not src.shape or not dst.shape:
        return None
    args = [op.args[p] if p < len(op.args) else None for p in at]
    return Exchange(op.index, tuple(split_sizes(args[1], int(src.shape[0]), parts)),
                    tuple(split_sizes(args[0], int(dst.shape[0]), parts)), src, dst)
