"""The side file of DTensor placements (trace/placements.py): what the recorder appends reads back, a line cut
short is skipped, and each note is linked to the local op of its name that DTensor runs next."""
from __future__ import annotations

from dataclasses import dataclass

from replaydiff.trace.placements import (PLACEMENTS, DTensorArg, DTensorNote, Placement, append_note, declared_inputs,
                                         read_notes)


@dataclass
class Op:
    index: int
    name: str


def test_notes_read_back_and_a_cut_line_is_skipped(tmp_path):
    w = DTensorArg(("S(0)",), (2,), (8, 6))
    append_note(tmp_path, 3, "aten.t.default", [w])
    append_note(tmp_path, 4, "aten.addmm.default", [DTensorArg(("R",), (2,), (8,)), None, w])
    with open(tmp_path / PLACEMENTS, "a") as f:
        f.write('{"at": 9, "op": "aten.mm.def')  # the job killed mid-write
    notes = read_notes(tmp_path)
    assert [(n.at, n.op) for n in notes] == [(3, "aten.t.default"), (4, "aten.addmm.default")]
    assert notes[1].args == (DTensorArg(("R",), (2,), (8,)), None, w)
    assert read_notes(tmp_path / "absent") == []


def test_a_note_is_linked_to_the_next_local_op_of_its_name():
    w, r = DTensorArg(("S(1)",), (2,), (6, 8)), DTensorArg(("R",), (2,), (4, 6))
    notes = [DTensorNote(5, "aten.mm.default", (r, w))]
    # the op numbered 5 is a redistribution (a collective) DTensor ran first; the mm is op 7
    ops = [Op(4, "aten.t.default"), Op(5, "_c10d_functional.all_gather_into_tensor.default"), Op(6, "aten.view.default"),
           Op(7, "aten.mm.default"), Op(8, "aten.mm.default")]
    assert declared_inputs(notes, ops) == {(7, 0): r, (7, 1): w}


def test_placements_are_read_as_dtensor_writes_them():
    assert DTensorArg(("S(-1)",), (2,), (4, 6)).placement() == (Placement.SHARD, 1)
    assert DTensorArg(("Shard(dim=0)",), (2,), (4, 6)).placement() == (Placement.SHARD, 0)
    assert DTensorArg(("P(sum)",), (2,), (4,)).placement() == (Placement.PARTIAL, None)
    assert DTensorArg(("R",), (2,), (4,)).placement() == (Placement.REPLICATE, None)
    assert DTensorArg(("S(0)", "R"), (2, 2), (4,)).placement() == (Placement.OTHER, None)  # a 2-D mesh


def test_a_trace_with_its_placements_file_is_replaceable_whole(tmp_path):
    """`record --force` replaces a DTensor job's trace: the placements file is one of the trace's own files."""
    import torch

    import replaydiff
    from replaydiff.trace.removal import replaceable_files

    trace = tmp_path / "t"
    with replaydiff.record(trace):
        torch.ones(2).add(1)
    append_note(trace / "rank0", 0, "aten.add.Tensor", [DTensorArg(("R",), (2,), (2,))])
    assert trace / "rank0" / PLACEMENTS in replaceable_files(trace)
