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
from dataclasses import replace

from replaydiff.compare.verdict import OutputName, Verdict
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.schema.values import TensorRef, iter_refs

VALUES, VIEW, META = "values", "view", "meta"  # how a result is compared


@dataclass(frozen=True)
class Compared:
    """One compared result: where it is in a run (``rebuild_and_judge.pick``), what was recorded there, and how."""

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


def output_names(op: OpRecord) -> list[OutputName]:
    """The name of each of the op's results, in the order of ``op.outputs_refs()`` (outputs, then written arguments
    not among them): index, role from the op's schema (``native_layer_norm``: out, mean, rstd) or the written
    argument's name, and how many there are."""
    roles: list[str | None] = []
    outputs = op.outputs
    top = outputs if isinstance(outputs, list) else [outputs]
    returns = aten.return_roles(op.name)
    for k, o in enumerate(top):
        role = returns[k] if len(returns) == len(top) else (returns[0] if len(returns) == 1 and not k else None)
        roles += [role] * sum(1 for _ in iter_refs(o))
    seen = {r.geometry for r in iter_refs(outputs)}
    for path, after in op.writes:
        for r in iter_refs(after):
            if r.geometry not in seen:
                seen.add(r.geometry)
                roles.append(aten.argument_name(op.name, path.key))
    return [OutputName(i, role, len(roles)) for i, role in enumerate(roles)]


def named_output(v: Verdict, op: OpRecord, position: int) -> Verdict:
    """``v`` saying which result of ``op`` it judges (position in ``op.outputs_refs()``), when the op has several."""
    names = output_names(op)
    return replace(v, output=names[position]) if len(names) > 1 and position < len(names) else v


def output_name(op: OpRecord, ref: Any) -> OutputName | None:
    """The name of the result ``ref`` (a recorded TensorRef of the op), or None when it is none of them."""
    if not isinstance(ref, TensorRef):
        return None
    names = output_names(op)
    for name, r in zip(names, op.outputs_refs()):
        if r.geometry == ref.geometry:
            return name
    return None
