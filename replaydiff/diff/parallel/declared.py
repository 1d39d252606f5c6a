"""DTensor's recorded placements: which layout a rank's tensor was declared in, and the mesh they name."""
from __future__ import annotations

from replaydiff.compare.layout import KINDS, Layout
from replaydiff.trace.placements import DTensorArg, declared_inputs
from replaydiff.diff.parallel.alignment import Side


def declared_on(side: Side) -> dict[tuple[int, int], DTensorArg]:
    """{(op number, input position): placements} DTensor declared on this rank (empty: none recorded)."""
    notes = side.notes
    return declared_inputs(notes, (side.ops[i] for i in sorted(side.ops))) if notes else {}


def declared_output(side: Side, declared: dict[tuple[int, int], DTensorArg], index: int,
                     pos: int) -> DTensorArg | None:
    """The placements DTensor declared for output ``pos`` of a rank's op: those of the first later op that reads
    it as a DTensor argument (DTensor says how an op's result is laid out when the next op takes it)."""
    if not declared:
        return None
    for c in side.trace.consumers(index).get(pos, []):
        for q, p in side.trace.producers(c).items():
            if p == index and (c, q) in declared:
                return declared[(c, q)]
    return None


def declares(arg: DTensorArg, layout: Layout) -> bool:
    """Whether DTensor's placements on a one-dimensional mesh of the ranks are this layout."""
    kind, dim = arg.placement()
    if arg.mesh != (layout.world,) or layout.micro_batch is not None:
        return False
    return KINDS[layout.kind].declared_by(layout, kind.value, dim)


def mesh_of(side: Side, world: int) -> tuple[tuple[tuple[int, ...], ...], ...] | None:
    """The rows and the columns of the two-dimensional DeviceMesh over every rank that DTensor declared (rank
    d*T + t at row d, column t, as ``init_device_mesh`` lays them out), or None: none recorded."""
    for note in side.notes:
        for a in note.args:
            if a is not None and len(a.mesh) == 2 and a.mesh[0] * a.mesh[1] == world:
                rows, cols = a.mesh
                return (tuple(tuple(d * cols + t for t in range(cols)) for d in range(rows)),
                        tuple(tuple(d * cols + t for d in range(rows)) for t in range(cols)))
    return None
