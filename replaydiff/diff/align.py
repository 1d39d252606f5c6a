"""Aligning the op streams of two runs: which op of one trace corresponds to which op of the other.

Two runs of one training step rarely issue the very same op sequence: autocast adds casts, another GPU picks another
kernel, a foreach optimizer replaces a for-loop one, DDP adds bucket copies and all-reduces. So ops are aligned in
three steps, on two keys per op: the strict key (op name, module path, phase, input and output shapes) and the loose
key (op name, module path, phase).

1. Anchors: a strict key that occurs as often in both traces pairs its n-th occurrence on one side with its n-th
   occurrence on the other; the longest increasing run of these pairs (patience sorting, O(n log n)) is kept, so an
   op moved elsewhere does not pull the alignment out of order. Keys whose counts differ (an extra cast on one side)
   are left to step 2: numbering their occurrences would pair each one with its neighbour's counterpart.
2. Between consecutive anchors, a difflib matcher (longest matching blocks) over the strict keys;
3. inside what is still unmatched, the same matcher over the loose keys: the same op on other shapes (another batch
   split, another world size).

Whatever is left is a structural difference: listed, never fatal. Anchoring keeps long traces linear: difflib alone
is quadratic on long streams of repeated keys (40 identical micro-batches of the tiny step, 29k ops, took 34 s).

Module paths are compared without their root class name and without the attributes wrappers add (DDP's ``module``,
torch.compile's ``_orig_mod``, FSDP's and checkpointing's wrapped modules): ``DistributedDataParallel.module.0`` and
``Sequential.0`` are the same layer. Dtypes are left out of the keys on purpose: autocast changes them.
"""
from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Sequence

from replaydiff.trace.schema.ops import OpRecord

# Attributes a wrapper module inserts between the root and the user's layers.
_WRAPPER_ATTRS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def module_key(path: str | None) -> str:
    """A module path without its root class name and without wrapper attributes."""
    if not path:
        return ""
    parts = path.split(".")[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_ATTRS)


@dataclass(frozen=True)
class OpKeys:
    """The two keys of one op: ``strict`` (anchors) and ``loose`` (alignment between anchors)."""

    index: int
    strict: Hashable
    loose: Hashable


def op_keys(op: OpRecord) -> OpKeys:
    loose = (op.name, module_key(op.module), op.phase)
    ins = tuple(r.shape for r in op.inputs())
    outs = tuple(r.shape for r in op.outputs_refs())
    return OpKeys(op.index, (*loose, ins, outs), loose)


@dataclass(frozen=True)
class Alignment:
    """Aligned pairs (ref op number, target op number) in order, and the ops of each side left unaligned."""

    pairs: list[tuple[int, int]]
    ref_only: list[int]
    target_only: list[int]


def _match(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[tuple[str, int, int, int, int]]:
    # autojunk off: in a training step the frequent ops (mm, add, view) are exactly the ones to align.
    return difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()


def _anchors(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[tuple[int, int]]:
    """Positions (i, j) pairing the n-th occurrence of a key on both sides, for keys as frequent on both sides, then
    thinned to the longest run increasing on both sides."""
    count_a, count_b = Counter(a), Counter(b)
    seen: Counter = Counter()
    where_b: dict[tuple[Hashable, int], int] = {}
    for j, k in enumerate(b):
        if count_a[k] == count_b[k]:
            where_b[(k, seen[k])] = j
            seen[k] += 1
    seen.clear()
    cand: list[tuple[int, int]] = []
    for i, k in enumerate(a):
        if count_a[k] == count_b[k]:
            cand.append((i, where_b[(k, seen[k])]))
            seen[k] += 1
    # Longest increasing subsequence of j (i already increases): patience sorting with back pointers.
    tails: list[int] = []  # tails[n]: index into cand of the smallest j ending an increasing run of length n + 1
    back: list[int] = [-1] * len(cand)
    for c, (_, j) in enumerate(cand):
        n = _bisect_tails(tails, cand, j)
        if n > 0:
            back[c] = tails[n - 1]
        if n == len(tails):
            tails.append(c)
        else:
            tails[n] = c
    out: list[tuple[int, int]] = []
    c = tails[-1] if tails else -1
    while c >= 0:
        out.append(cand[c])
        c = back[c]
    return out[::-1]


def _bisect_tails(tails: list[int], cand: list[tuple[int, int]], j: int) -> int:
    """The first position n in ``tails`` whose run ends at a j not below ``j``."""
    lo, hi = 0, len(tails)
    while lo < hi:
        mid = (lo + hi) // 2
        if cand[tails[mid]][1] < j:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _align_gap(ref: Sequence[OpKeys], target: Sequence[OpKeys], out: "Alignment") -> None:
    """Steps 2 and 3 on one gap between anchors."""
    for tag, i1, i2, j1, j2 in _match([k.strict for k in ref], [k.strict for k in target]):
        if tag == "equal":
            out.pairs.extend((ref[i].index, target[j].index) for i, j in zip(range(i1, i2), range(j1, j2)))
            continue
        for tag2, a1, a2, b1, b2 in _match([k.loose for k in ref[i1:i2]], [k.loose for k in target[j1:j2]]):
            if tag2 == "equal":
                out.pairs.extend((ref[i1 + i].index, target[j1 + j].index)
                                 for i, j in zip(range(a1, a2), range(b1, b2)))
            else:
                out.ref_only.extend(k.index for k in ref[i1 + a1:i1 + a2])
                out.target_only.extend(k.index for k in target[j1 + b1:j1 + b2])


def align(ref: Sequence[OpKeys], target: Sequence[OpKeys]) -> Alignment:
    """Align two key sequences (one per recorded op, in op order)."""
    out = Alignment([], [], [])
    anchors = _anchors([k.strict for k in ref], [k.strict for k in target])
    pi, pj = -1, -1
    for i, j in [*anchors, (len(ref), len(target))]:
        if i > pi + 1 or j > pj + 1:
            _align_gap(ref[pi + 1:i], target[pj + 1:j], out)
        if i < len(ref):
            out.pairs.append((ref[i].index, target[j].index))
        pi, pj = i, j
    return out
