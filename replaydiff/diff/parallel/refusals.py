"""Runs whose layouts this mapping cannot read (pipeline stages, collectives over groups it does not know): refused
in one line rather than misread."""
from __future__ import annotations

from replaydiff import aten
from replaydiff.errors import UsageError
from replaydiff.diff.parallel.alignment import Side


def refuse_point_to_point(sides: list[Side]) -> None:
    """A UsageError when a rank sends or receives point to point: pipeline stages, each rank running other layers
    than the others, which a mapping of every rank's ops onto the single process's would misread."""
    for side in sides:
        for op in side.ops.values():
            if aten.is_point_to_point(op.name):
                raise UsageError(
                    f"rank {side.trace.rank}'s #{op.index} {op.name} sends or receives point to point: pipeline "
                    f"stages, each rank running other layers, are not mapped onto the single process; replay each "
                    f"run (replay checks each send against its receive), or diff one rank op by op with --rank N")


def refuse_sub_groups(side: Side, world: int, mesh: tuple[tuple[tuple[int, ...], ...], ...] | None = None) -> None:
    """A UsageError when the ranks' collectives run over groups of some of them: a mesh of more than one
    dimension (FSDP x TP, pipeline stages), whose values this mapping over one dimension of ranks would misread;
    unless the group is a row or a column of the two-dimensional ``mesh`` DTensor declared."""
    lines = set() if mesh is None else {g for grouping in mesh for g in grouping}
    for op in side.ops.values():
        info = op.collective
        if info is not None and info.ranks and 1 < len(info.ranks) < world and tuple(sorted(info.ranks)) not in lines:
            raise UsageError(
                f"the ranks' collectives run over groups of some of them (#{op.index} {op.name} over ranks "
                f"{list(info.ranks)} of {world}): a mesh of more than one dimension (FSDP x TP, pipeline stages), "
                f"which is not mapped onto the single process yet; diff one rank op by op with --rank N")
