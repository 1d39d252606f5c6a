"""Checking records read back (the reader's side): an op's index row, and the frame of an ops chunk."""
from __future__ import annotations

from typing import Any, NamedTuple

from replaydiff.trace.schema.keys import (_ARGS, _BACKWARD_CALL, _CHUNK, _COLL, _DEVICE, _DTYPE, _FORWARD, _INDEX,
                                          _ISSUED, _KWARGS, _LEFT_OUT, _MODULE, _NAME, _NBYTES, _NOT_RECORDED,
                                          _OFFSET, _OUTPUTS, _PATH_ARG, _PATH_KWARG, _PHASE, _RECOMPUTE, _RNG,
                                          _SHAPE, _SOURCE, _SOURCE_TEXT, _STEP, _STRIDE, _UNINIT, _UNIT, _VERSION,
                                          _WRITES)

class IndexRow(NamedTuple):
    """What the index needs of one op record, read straight from the wire dict (no TensorRef, no torch objects:
    the writer thread builds the index while the job runs, so this must be cheap)."""

    index: int
    name: str
    phase: str | None
    module: str | None
    source: str | None
    forward: int | None
    recorded: bool
    collective: bool
    uninitialised: bool
    random: bool
    inputs: list  # (version, geometry) per input tensor, in OpRecord.inputs() order
    outputs: list  # (version, geometry) per output tensor, in OpRecord.outputs_refs() order
    first_output: str | None  # e.g. "float32[8, 32, 64]"
    recompute: int | None = None  # a checkpointed op run again in the backward: the forward op it repeats


def _list_refs(vs: list, out: list) -> None:
    """The tensor references (maps holding a storage version key) in a list and the lists nested in it, in order."""
    for v in vs:
        if isinstance(v, dict):
            if _VERSION in v:
                out.append(v)
        elif isinstance(v, list):
            _list_refs(v, out)


def _geom(w: dict) -> tuple:
    return (w.get(_VERSION), w[_DTYPE], tuple(w[_SHAPE]), tuple(w.get(_STRIDE) or ()), w.get(_OFFSET, 0))


def _geoms(vs: Any) -> list:
    """[(version, _geom(r))] for the tensor references in ``vs`` (a reference, or a list as ``_list_refs`` walks it;
    anything else holds none), in one loop for the common shapes: the writer thread runs this for every op."""
    out: list = []
    if isinstance(vs, dict):
        vs = [vs]
    elif not isinstance(vs, list):
        return out
    for r in vs:
        if isinstance(r, dict):
            if _VERSION in r:
                v = r[_VERSION]
                out.append((v, (v, r[_DTYPE], tuple(r[_SHAPE]), tuple(r.get(_STRIDE) or ()), r.get(_OFFSET, 0))))
        elif isinstance(r, list):
            raw: list = []
            _list_refs(r, raw)
            out.extend((w.get(_VERSION), _geom(w)) for w in raw)
    return out


def index_row(w: dict) -> IndexRow:
    """Raises KeyError/TypeError/ValueError on a malformed record."""
    recorded = _NOT_RECORDED not in w
    ins: list = []
    outs: list = []
    first = None
    if recorded:
        ins = _geoms(w.get(_ARGS))
        kwargs = w.get(_KWARGS)
        if kwargs:
            for v in kwargs.values():
                ins.extend(_geoms(v))
        outs = _geoms(w.get(_OUTPUTS))
        if outs:
            g = outs[0][1]
            first = f"{g[1]}{list(g[2])}"
        writes = w.get(_WRITES)
        if writes:
            seen = {g for _, g in outs}
            for _, v in writes:
                for version, g in _geoms(v):
                    if g not in seen:
                        seen.add(g)
                        outs.append((version, g))
    return IndexRow(w[_INDEX], w[_NAME], w.get(_PHASE), w.get(_MODULE), w.get(_SOURCE), w.get(_FORWARD), recorded,
                    _COLL in w, bool(w.get(_UNINIT)), isinstance(w.get(_RNG), dict), ins, outs, first,
                    w.get(_RECOMPUTE))


# Each field of an op record a reader acts on, and the types it may hold (absent: allowed). Checked once, when its
# chunk is read; tensor references and values inside ``a k w o`` are checked as they are decoded (``values``).
_NONE = type(None)
_OP_FIELDS: tuple[tuple[str, tuple[type, ...]], ...] = (
    (_PHASE, (str, _NONE)), (_MODULE, (str, _NONE)), (_SOURCE, (str, _NONE)), (_SOURCE_TEXT, (str, _NONE)),
    (_FORWARD, (int, _NONE)), (_NOT_RECORDED, (str, _NONE)), (_LEFT_OUT, (str, _NONE)), (_STEP, (int, _NONE)),
    (_UNINIT, (bool, _NONE)), (_ARGS, (list, _NONE)), (_KWARGS, (dict, _NONE)), (_WRITES, (list, _NONE)),
    (_COLL, (dict,)), (_RNG, (dict,)), (_UNIT, (dict,)), (_RECOMPUTE, (int, _NONE)), (_BACKWARD_CALL, (str, _NONE)),
    (_ISSUED, (bool, _NONE)),
)


def check_op(op: dict) -> None:
    """ValueError unless every field of the op record that a reader acts on has its type."""
    for key, kinds in _OP_FIELDS:
        v = op.get(key, _NONE)
        if v is not _NONE and (not isinstance(v, kinds) or (type(v) is bool and bool not in kinds)):
            raise ValueError(f"op #{op[_INDEX]}: field {key!r} is {type(v).__name__}")
    for key in (_FORWARD, _RECOMPUTE):
        fwd = op.get(key)
        if fwd is not None and fwd < 0:
            raise ValueError(f"op #{op[_INDEX]}: forward op #{fwd}")
    kwargs = op.get(_KWARGS)
    if kwargs and not all(type(k) is str for k in kwargs):
        raise ValueError(f"op #{op[_INDEX]}: a keyword argument without a name")
    for w in op.get(_WRITES) or ():
        if not (type(w) is list and len(w) == 2 and type(w[0]) is list and len(w[0]) == 2
                and w[0][0] in (_PATH_ARG, _PATH_KWARG) and type(w[0][1]) in (int, str)):
            raise ValueError(f"op #{op[_INDEX]}: a written argument that is not [[a|k, position], value]")
    if _COLL in op:
        _check_collective(op[_INDEX], op[_COLL])
    rng = op.get(_RNG)
    if rng is not None and not (isinstance(rng.get(_DEVICE), str) and all(
            type(rng.get(k)) is int and rng[k] >= 0 for k in (_VERSION, _CHUNK, _NBYTES))):
        raise ValueError(f"op #{op[_INDEX]}: a generator state that is not (device, version, chunk, bytes)")


def _check_collective(index: int, c: dict) -> None:
    ranks = c.get("ranks")
    ok = (ranks is None or (type(ranks) is list and all(type(r) is int for r in ranks))) and all(
        c.get(k) is None or type(c[k]) is int for k in ("size", "group_rank")) and all(
        c.get(k) is None or type(c[k]) is str for k in ("group_name", "reduce_op")) and (
        c.get("problems") is None or (type(c["problems"]) is list and all(type(x) is str for x in c["problems"])))
    if not ok:
        raise ValueError(f"op #{index}: a collective whose group is not ranks, size and names")


def check_chunk(frame: Any, first: int) -> list[dict]:
    """The op records of an ops chunk, after checking their structure and the type of every field a reader acts on;
    ValueError if it is not sound."""
    if not isinstance(frame, dict):
        raise ValueError("chunk is not a map")
    ops = frame.get("ops")
    if frame.get("first") != first or not isinstance(ops, list) or not ops:
        raise ValueError("chunk does not match its name")
    prev = first - 1
    for op in ops:
        if not isinstance(op, dict) or type(op.get(_INDEX)) is not int or op[_INDEX] <= prev:
            raise ValueError("op numbers out of order")
        if not isinstance(op.get(_NAME), str):
            raise ValueError("op without a name")
        check_op(op)
        prev = op[_INDEX]
    return ops


def chunk_frame(ops: list[dict], number: int) -> dict:
    return {"chunk": number, "first": ops[0][_INDEX], "ops": ops}
