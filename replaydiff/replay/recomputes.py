"""Recomputes that do not reproduce their forward op.

An op of a checkpointed region run again in the backward (activation checkpointing) runs the same code on the same
inputs as the forward op it repeats, with the same generator state when the checkpoint preserves it: its outputs are
those of the forward op, bit for bit. One that differs is a finding of its own, whatever replay says of each op alone
(each can be right given its own inputs): a random op run with another generator state, a region whose inputs were
written in between, a kernel that does not give the same bits twice. The backward then differentiates values the
forward never made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from replaydiff.aten import is_random
from replaydiff.trace.reader import Trace
from replaydiff.trace.schema import TensorRef


@dataclass(frozen=True)
class RecomputeDiffers:
    rank: int
    index: int  # the recompute
    op: str
    of: int  # the forward op it runs again
    output: int  # the first output that differs
    how: str  # e.g. "max_abs 0.0012", "float32[4, 8] against float32[8]"
    # the forward op is itself divergent (replayed from its inputs, it is wrong; the recompute is not): the
    # difference is that op's, not the recompute's
    forward_wrong: bool = False
    # the recompute is itself divergent (replayed from its inputs, it is wrong): it computed wrongly, whatever the
    # forward op did
    recompute_wrong: bool = False
    # Where neither is wrong, what can make a recompute differ: its op draws from a generator (run without the
    # forward's state), or its inputs differ from the forward op's (written in between; None: the trace cannot tell,
    # False: the same inputs, so the kernel gave other bits)
    random: bool = False
    inputs_differ: bool | None = None
    # only state the op writes in place differs (a BatchNorm's running statistics, its counter: tensors that need no
    # gradient), every value the backward reads is the forward op's: the recompute updates that state a second time,
    # which checkpointing a BatchNorm in training does; nothing the gradients depend on
    state: bool = False

    def describe(self) -> str:
        if self.state:
            return (f"recompute #{self.index} {self.op} updates again the state forward op #{self.of} updated "
                    f"(output {self.output}, written in place, needs no gradient: {self.how}): activation "
                    f"checkpointing runs this op twice a step, so state it keeps (a BatchNorm's running statistics) "
                    f"moves twice; the gradients do not depend on it")
        head = f"recompute #{self.index} {self.op} differs from forward op #{self.of}, which it runs again: " \
               f"output {self.output} {self.how}"
        if self.forward_wrong:
            return f"{head} (forward op #{self.of} is itself divergent, and the recompute is right given its " \
                   f"inputs: the backward differentiates the values the forward should have made)"
        if self.recompute_wrong:
            return f"{head} (the recompute is itself divergent: replayed from its inputs it is wrong, so the " \
                   f"backward differentiates values the forward never made)"
        if self.random:
            why = "a random op run without the forward's generator state, which " \
                  "checkpoint(preserve_rng_state=False) does"
        elif self.inputs_differ:
            why = "its inputs differ from the forward op's: written between the forward and the backward"
        elif self.inputs_differ is False:
            why = "from the same inputs: a kernel that does not give the same bits twice"
        else:
            why = "a random op's generator state, inputs written in between, or a kernel that does not give the " \
                  "same bits twice?"
        return f"{head} (activation checkpointing: the backward differentiates values the forward never made; {why})"

    def to_json(self) -> dict:
        return {"rank": self.rank, "index": self.index, "op": self.op, "of": self.of, "output": self.output,
                "how": self.how, "forward_wrong": self.forward_wrong, "recompute_wrong": self.recompute_wrong,
                "random": self.random, "inputs_differ": self.inputs_differ, "state": self.state}


def _differs(trace_rank, a: TensorRef, b: TensorRef) -> str | None:
    """How recorded tensors ``a`` (the recompute's) and ``b`` (the forward op's) differ (None: they do not, or
    the trace cannot tell)."""
    if (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
        return f"{a.describe()} against {b.describe()}"
    if a.stored_data and b.stored_data:
        x, y = trace_rank.tensor(a), trace_rank.tensor(b)
        if x.is_complex() or not x.is_floating_point():
            return None if torch.equal(x, y) else "values differ"
        same_nan = torch.isnan(x) == torch.isnan(y)
        if bool(same_nan.all()) and torch.equal(torch.nan_to_num(x), torch.nan_to_num(y)):
            return None
        d = (x.double() - y.double()).abs().nan_to_num(nan=float("inf"))
        return f"max_abs {float(d.max()):.3g}"
    sa, sb = a.stats, b.stats
    if sa is not None and sb is not None and sa != sb:
        return "statistics differ"
    return None


def check_recomputes(trace: Trace, ops: Iterable[tuple[int, int]],
                     wrong: set[tuple[int, int]] = frozenset()) -> list[RecomputeDiffers]:
    """The recomputes among ``ops`` ((rank, index) pairs) whose recorded outputs are not their forward op's;
    ``wrong``: the (rank, index) of ops replay found divergent (a forward op among them explains its recompute's
    difference, unless the recompute is wrong too)."""
    found = []
    for rank, index in ops:
        rt = trace.rank(rank)
        op = rt[index]
        of = op.recompute_of
        if of is None or op.uninitialised:  # an empty* op's output is whatever memory held: nothing to reproduce
            continue
        fwd = rt[of]
        if fwd.name != op.name:
            found.append(RecomputeDiffers(rank, index, op.name, of, 0, f"is another op ({fwd.name})"))
            continue
        outs = op.outputs_refs()
        differ = [(k, how) for k, (a, b) in enumerate(zip(outs, fwd.outputs_refs()))
                  if (how := _differs(rt, a, b)) is not None]
        if not differ:
            continue
        k, how = differ[0]
        mine = (rank, index) in wrong
        state = not mine and all(outs[j].version in _kept_state(rt, op) for j, _ in differ)
        found.append(RecomputeDiffers(rank, index, op.name, of, k, how,
                                      forward_wrong=(rank, of) in wrong and not mine, recompute_wrong=mine,
                                      random=is_random(op.name), inputs_differ=_inputs_differ(rt, op, fwd),
                                      state=state))
    return found


def _kept_state(trace_rank, op) -> set[int]:
    """The storage versions, after the op, of the tensors a recompute writes in place that are state the job keeps
    (a BatchNorm's running statistics, its counter): they need no gradient and come from outside the recomputed
    region (a module's buffer, or what the forward op wrote into it). A tensor the region itself made and writes (a
    dropout mask drawn into an empty tensor) is a value the backward reads, not state."""
    before = {ref.version: k for k, ref in enumerate(op.inputs())}
    producers = trace_rank.producers(op.index)
    kept = set()
    for path, after in op.writes:
        if not isinstance(after, TensorRef) or after.requires_grad:
            continue
        held = op.args if path.kind == "arg" else op.kwargs  # as it was before the op
        arg = held.get(path.key) if isinstance(held, dict) else held[path.key] if path.key < len(held) else None
        k = before.get(arg.version) if isinstance(arg, TensorRef) else None
        made = None if k is None else producers.get(k)
        if k is not None and (made is None or not trace_rank[made].recompute):
            kept.add(after.version)
    return kept


def _inputs_differ(trace_rank, op, fwd) -> bool | None:
    """Whether the recompute ``op`` read other inputs than forward op ``fwd`` (None: the trace cannot tell, for
    one of them: no data and no statistics)."""
    a, b = op.inputs(), fwd.inputs()
    if len(a) != len(b):
        return True
    known = True
    for x, y in zip(a, b):
        if x.stored_data and y.stored_data or x.stats is not None and y.stats is not None:
            if _differs(trace_rank, x, y) is not None:
                return True
        elif (x.dtype, tuple(x.shape)) != (y.dtype, tuple(y.shape)):
            return True
        else:
            known = False
    return False if known else None
