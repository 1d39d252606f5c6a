"""Collectives are checked across ranks: each kind of collective reaches the check registered for it, and that check
names a wrong result (a corrupted all-reduce of a 2-rank job: tests/e2e/test_collectives_replay_e2e.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replaydiff.compare.tolerance import Tolerances
from replaydiff.replay import Status
from replaydiff.replay.collectives import Call, NotChecked, check_for, checked_kinds, checks, layout


# -- the checks, registered per kind (quick: no processes, tensors made here) ---------------------------------------
# Every collective the recorder names, as (op name, the kind of check it gets).
COLLECTIVES = [
    ("c10d.allreduce_.default", "all_reduce"), ("c10d.allreduce_coalesced_.default", "all_reduce"),
    ("_c10d_functional.all_reduce.default", "all_reduce"), ("_c10d_functional.all_reduce_.default", "all_reduce"),
    ("_c10d_functional.all_reduce_coalesced.default", "all_reduce"),
    ("c10d.allgather_.default", "all_gather_list"), ("c10d._allgather_base_.default", "all_gather"),
    ("c10d.allgather_into_tensor_coalesced_.default", "all_gather"),
    ("_c10d_functional.all_gather_into_tensor.default", "all_gather"),
    ("_c10d_functional.all_gather_into_tensor_out.default", "all_gather"),
    ("_c10d_functional.all_gather_into_tensor_coalesced.default", "all_gather"),
    ("c10d.reduce_scatter_.default", "reduce_scatter_list"), ("c10d._reduce_scatter_base_.default", "reduce_scatter"),
    ("c10d.reduce_scatter_tensor_coalesced_.default", "reduce_scatter"),
    ("_c10d_functional.reduce_scatter_tensor.default", "reduce_scatter"),
    ("_c10d_functional.reduce_scatter_tensor_coalesced.default", "reduce_scatter"),
    ("c10d.broadcast_.default", "broadcast"), ("_c10d_functional.broadcast.default", "broadcast"),
    ("_c10d_functional.broadcast_.default", "broadcast"), ("c10d.alltoall_.default", "all_to_all_list"),
    ("c10d.alltoall_base_.default", "all_to_all"), ("_c10d_functional.all_to_all_single.default", "all_to_all"),
]


def test_every_collective_reaches_the_check_registered_for_its_kind() -> None:
    assert [(name, layout(name).kind) for name, _ in COLLECTIVES] == COLLECTIVES
    assert {kind for _, kind in COLLECTIVES} == checked_kinds()  # and every registered check serves some collective
    assert {check_for(kind).__name__ for _, kind in COLLECTIVES} == {
        "_all_reduce", "_all_gather_list", "_all_gather", "_reduce_scatter_list", "_reduce_scatter", "_broadcast",
        "_all_to_all_list", "_all_to_all"}


def test_a_kind_without_a_check_is_left_unchecked_and_says_so() -> None:
    with pytest.raises(NotChecked, match=r"^collective: no cross-rank check for collectives of kind 'send_recv'$"):
        check_for("send_recv")
    with pytest.raises(ValueError, match="collective kind 'all_reduce' already has a check"):
        checks("all_reduce")(lambda call: None)
    assert "send_recv" not in checked_kinds()


T = torch.tensor
# Per kind, for rank 0 of a group of ranks (0, 1): each rank's inputs (ins[n]: group rank n's), rank 0's correct
# outputs, what a correct call is checked against, and what a call is told whose last output element is 1 off.
CASES = {
    "all_reduce": ([[T([1., 2.])], [T([3., 4.])]], [T([4., 6.])], "output vs the float64 sum of all ranks' inputs",
                   "collective: output vs the float64 sum of all ranks' inputs (max_abs/(eps*absmax) 1.4e+06 > 16)"),
    "reduce_scatter": ([[T([1., 2., 3., 4.])], [T([10., 20., 30., 40.])]], [T([11., 22.])],
                       "output vs the float64 sum of every rank's chunk 0",
                       "collective: output vs the float64 sum of every rank's chunk 0 (max_abs/(eps*absmax) 3.81e+05 > "
                       "16)"),
    "reduce_scatter_list": ([[T([1., 2.]), T([5., 6.])], [T([10., 20.]), T([50., 60.])]], [T([11., 22.])],
                            "output vs the float64 sum of every rank's chunk 0",
                            "collective: output vs the float64 sum of every rank's chunk 0 (max_abs/(eps*absmax) "
                            "3.81e+05 > 16)"),
    "all_gather_list": ([[T([1., 2.])], [T([3., 4.])]], [T([1., 2.]), T([3., 4.])],
                        "gathered slot 1 vs rank 1's input",
                        "collective: gathered slot 1 vs rank 1's input (1 elements differ)"),
    "all_gather": ([[T([1., 2.])], [T([3., 4.])]], [T([1., 2., 3., 4.])], "gathered chunk 1 vs rank 1's input",
                   "collective: gathered chunk 1 vs rank 1's input (1 elements differ)"),
    "broadcast": ([[T([7., 8.])], [T([0., 0.])]], [T([7., 8.])], "output vs rank 0's input",
                  "collective: output vs rank 0's input (1 elements differ)"),
    "all_to_all_list": ([[T([1.]), T([2.])], [T([3.]), T([4.])]], [T([1.]), T([3.])],
                        "every chunk vs what its peer sent",
                        "collective: the chunk(s) received from rank(s) [1] differ from what they sent (rank 1: its "
                        "input chunk 0; 1 elements differ)"),
    "all_to_all": ([[T([1., 2., 3., 4.])], [T([5., 6., 7., 8.])]], [T([1., 2., 5., 6.])],
                   "every chunk vs what its peer sent",
                   "collective: the chunk(s) received from rank(s) [1] differ from what they sent (rank 1: its input "
                   "rows 0:2; 1 elements differ)"),
}


def _call(kind: str, outputs: list[torch.Tensor]) -> Call:
    ins = CASES[kind][0]
    data = {f"in{n}.{j}": t for n, refs in enumerate(ins) for j, t in enumerate(refs)}
    data.update({f"out.{j}": t for j, t in enumerate(outputs)})
    # the functional all-to-all's split sizes sit at argument positions (1, 2): none given, so equal chunks
    op = SimpleNamespace(name="_c10d_functional.all_to_all_single.default",
                         collective=SimpleNamespace(reduce_op="sum", root=0), args=[None, [], []])
    return Call(op, [op, op], (0, 1), 0, [f"out.{j}" for j in range(len(outputs))],
                [[f"in{n}.{j}" for j in range(len(refs))] for n, refs in enumerate(ins)],
                lambda ref: data[ref], lambda n, ref: data[ref], Tolerances())


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_kind_s_check_passes_the_right_result_and_names_a_wrong_one(kind: str) -> None:
    _, outputs, what, told = CASES[kind]
    ok = check_for(kind)(_call(kind, outputs))
    assert (ok.status, ok.reason) == (Status.OK, f"collective checked across ranks: {what}")
    wrong = [o.clone() for o in outputs]
    wrong[-1][-1] += 1.0  # the last element received: from rank 1, or reduced with its input
    bad = check_for(kind)(_call(kind, wrong))
    assert (bad.status, bad.reason, bad.verdict.divergent) == (Status.DIVERGENT, told, True)


def test_a_reduction_whose_op_was_not_read_is_not_checked() -> None:
    call = _call("all_reduce", CASES["all_reduce"][1])
    call.op.collective.reduce_op = "unknown"
    with pytest.raises(NotChecked, match="its reduce op could not be read when recording"):
        check_for("all_reduce")(call)
