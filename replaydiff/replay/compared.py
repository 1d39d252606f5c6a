"""Which results of an op are compared: the one list that replay judges and the standalone repro script checks.

Every argument the op wrote (as it was after the op) and every output that is new data is compared by value; an
output that is a view of an input (its bytes are the input's) by its shape, stride and offset, one on the meta
device by its shape and stride. An output that is the written argument is compared once, as the argument; outputs
holding uninitialised memory, or whose values the trace does not hold, are not compared; nor, when the op runs at
another precision than recorded, outputs that are bookkeeping of the kernel's path (``aten.KERNEL_PATH_OUTPUTS``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from replaydiff import aten
from replaydiff.trace.schema import OpRecord, TensorRef, iter_refs

VALUES, VIEW, META = "values", "view", "meta"  # how a result is compared


@dataclass(frozen=True)
class Compared:
    """One compared result: where it is in a run (``repro_script.pick``), what was recorded there, and how."""

    where: tuple  # ("out",) or ("out", i, ...), ("arg", n, ...), ("kwarg", name, ...): then list positions
    sizes: tuple  # the recorded length of each list stepped into after the first one or two entries of where
    recorded: Union[TensorRef, int, float, bool]
    label: str  # as the repro script prints it: "output 0", "arg 0 (written)", "output 1[2]"
    how: str = VALUES  # VALUES, VIEW (shape, stride, offset) or META (shape, stride)

    @property
    def geometry(self) -> dict | None:
        """The recorded geometry a VIEW or META result is compared by (the keys it is compared on)."""
        if self.how == VALUES or not isinstance(self.recorded, TensorRef):
            return None
        r = self.recorded
        g: dict = {"shape": list(r.shape), "stride": list(r.stride or ())}
        if self.how == VIEW:
            g["offset"] = r.offset
        return g


def compared_outputs(op: OpRecord, recorded_dtypes: bool) -> list[Compared]:
    """The results of ``op`` compared, in order: written arguments, then outputs. ``recorded_dtypes``: the op is
    run at its recorded dtypes (outputs that are kernel-path bookkeeping are then compared too)."""
    found: list[Compared] = []
    written = set()
    for path, after in op.writes:
        for r in iter_refs(after):
            written.add(r.version)
        _walk(after, (path.kind, path.key), (), f"{path.kind} {path.key} (written)", found, written=None)
    in_versions = {r.version for r in op.inputs()}
    outputs = op.outputs
    skip = () if recorded_dtypes else aten.KERNEL_PATH_OUTPUTS.get(aten.packet(op.name), ())
    if isinstance(outputs, list):
        for i, o in enumerate(outputs):
            if i not in skip:
                _walk(o, ("out", i), (len(outputs),), f"output {i}", found, written, in_versions)
    else:
        _walk(outputs, ("out",), (), "output 0", found, written, in_versions)
    return found


def _walk(rec: Any, where: tuple, sizes: tuple, label: str, found: list[Compared], written: set | None,
          in_versions: set | None = None) -> None:
    """Add what is compared in ``rec`` (a written argument when ``written`` is None, else an output)."""
    if isinstance(rec, list):
        for i, r in enumerate(rec):
            _walk(r, where + (i,), sizes + (len(rec),), f"{label}[{i}]", found, written, in_versions)
        return
    if isinstance(rec, TensorRef):
        if written is not None:  # an output
            if rec.meta:  # no values: the geometry is what the op computed
                found.append(Compared(where, sizes, rec, label, META))
                return
            if rec.version in written:
                return  # the output is the written argument: already compared
            if in_versions and rec.version in in_versions:  # a view of an input: the bytes are the input's
                found.append(Compared(where, sizes, rec, f"{label} (a view of an input)", VIEW))
                return
            if rec.uninitialised or not rec.stored:
                return
        found.append(Compared(where, sizes, rec, label))
    elif isinstance(rec, (int, float, bool)):
        found.append(Compared(where, sizes, rec, label))
