"""Aligning the op streams of two runs: which op of one trace corresponds to which op of the other.

Two runs of one training step rarely issue the very same op sequence: autocast adds casts, another GPU picks another
kernel, a foreach optimizer replaces a for-loop one, DDP adds bucket copies and all-reduces. So ops are aligned in two
passes. Anchors first: a difflib matcher (longest matching blocks, recursively) over strict keys (op name, module path,
phase, input and output shapes), which pins the long runs the two traces share. Then, inside each gap between
anchors, the same matcher over loose keys (op name, module path, phase): the same op on other shapes (another batch
split, another world size). Whatever is left is a structural difference: listed, never fatal.

Module paths are compared without their root class name and without the attributes wrappers add (DDP's ``module``,
torch.compile's ``_orig_mod``, FSDP's and checkpointing's wrapped modules): ``DistributedDataParallel.module.0`` and
``Sequential.0`` are the same layer. Dtypes are left out of the keys on purpose: autocast changes them.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Hashable, Sequence

from replaydiff.trace.schema import OpRecord

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


def align(ref: Sequence[OpKeys], target: Sequence[OpKeys]) -> Alignment:
    """Align two key sequences (one per recorded op, in op order)."""
    pairs: list[tuple[int, int]] = []
    ref_only: list[int] = []
    target_only: list[int] = []
    strict_a = [k.strict for k in ref]
    strict_b = [k.strict for k in target]
    for tag, i1, i2, j1, j2 in _match(strict_a, strict_b):
        if tag == "equal":
            pairs.extend((ref[i].index, target[j].index) for i, j in zip(range(i1, i2), range(j1, j2)))
            continue
        # A gap between anchors: align on the loose keys inside it.
        loose_a = [k.loose for k in ref[i1:i2]]
        loose_b = [k.loose for k in target[j1:j2]]
        for tag2, a1, a2, b1, b2 in _match(loose_a, loose_b):
            if tag2 == "equal":
                pairs.extend((ref[i1 + i].index, target[j1 + j].index)
                             for i, j in zip(range(a1, a2), range(b1, b2)))
            else:
                ref_only.extend(k.index for k in ref[i1 + a1:i1 + a2])
                target_only.extend(k.index for k in target[j1 + b1:j1 + b2])
    return Alignment(pairs, ref_only, target_only)
