"""What a parallel run keeps, and so what it is judged by.

A parallel run is correct when what it keeps equals the single process's: the gradients as the optimizer reads them
(after their reduction, scaling and clipping), the parameters after the step, the optimizer's state, and buffers
(BatchNorm's running statistics). These are the sinks. On the way to them a job may hold a value at a factor the
single process does not (a loss multiplied by the world size that the gradients' average divides again, a summed
loss whose gradients are divided by the global token count after their all-reduce): such a factor is information,
not a departure, when every sink agrees. When a sink parts, the diff walks back to the values it descends from:
the first is where the difference enters, and every one that applies a factor is a site on its way.
"""
from __future__ import annotations

from fractions import Fraction

from replaydiff import aten
from replaydiff.diff.parallel.paths import collective_behind, computing_behind
from replaydiff.diff.parallel.result import Departure, Mapped, MappedOp, ParallelDeparture
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord, TensorRef


def is_sink(op: OpRecord, producers: dict[int, int | None]) -> bool:
    """Whether the single process's op makes a value the job keeps: an optimizer op (the update reads the gradients
    and writes the parameters and the state), or an op of a module that writes into a tensor from outside the step
    that needs no gradient (a buffer: BatchNorm's running statistics)."""
    if aten.is_cheap(op.name):
        return False  # a view computes nothing: what it shows is kept, or not, by the op that made it
    if op.phase == "optimizer":
        return True
    if op.module is None:
        return False  # a write outside any module (a loss accumulated for logging) is bookkeeping, not a buffer
    ins = op.inputs()
    for path, _ in op.writes:
        if path.kind != "arg" or not isinstance(path.key, int) or path.key >= len(op.args):
            continue
        written = op.args[path.key]
        if isinstance(written, TensorRef) and not written.requires_grad and any(
                r.version == written.version and producers.get(pos) is None for pos, r in enumerate(ins)):
            return True
    return False


def departure_of(root: tuple[MappedOp, Mapped, Departure, str], inherited: int,
                 applied: Fraction | None = None, via: str | None = None) -> ParallelDeparture:
    op, tensor, kind, why = root
    return ParallelDeparture(op, tensor, kind, why, inherited, step=None, applied=applied, via=via)


def restored_by(ref: RankTrace, sinks: list[int], by_ref: dict[int, MappedOp], side,
                aligned: dict[int, int]) -> str | None:
    """Where the values the first optimizer op reads were brought back to the reference's on the ranks: the rank's
    own computing op it reads from, or the op both run that reads what a collective made (the gradients divided
    after their all-reduce), as 'name (#N on rank R, line)'; None where neither is found."""
    for s in sinks:
        op = by_ref.get(s)
        if op is None or op.phase != "optimizer":
            continue
        found = computing_behind(side, aligned, op.targets[0])
        if found is not None:
            return found
        for p in ref.producers(s).values():
            if p is None or p not in aligned:
                continue
            j = aligned[p]
            behind = collective_behind(side, aligned, j)
            if behind is not None and not aten.is_cheap(side.ops[j].name):
                line = side.ops[j].source
                return f"{side.ops[j].name} (#{j} on rank {side.trace.rank}{', ' + line if line else ''}) after " \
                       f"{behind[1]}"
    return None
