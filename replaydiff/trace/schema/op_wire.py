"""Building op records and tensor references as the recorder writes them (the ``wire_*`` functions)."""
from __future__ import annotations

from typing import Any

from replaydiff.trace.schema.keys import (_ARGS, _BACKWARD_CALL, _CHUNK, _COLL, _CONJ, _DEVICE, _DTYPE, _FORWARD,
                                          _INDEX, _ISSUED, _KWARGS, _LEFT_OUT, _MODULE, _NAME, _NBYTES, _NEG,
                                          _NOT_RECORDED, _OFFSET, _OUTPUTS, _PATH_ARG, _PATH_KWARG, _PHASE,
                                          _RECOMPUTE, _REQ_GRAD, _RNG, _SHAPE, _SOURCE, _SOURCE_TEXT, _STATS, _STEP,
                                          _STRIDE, _UNINIT, _UNSUPPORTED, _VERSION, _WRITES, _ZERO)
from replaydiff.trace.schema.index_rows import check_op
from replaydiff.trace.schema.ops import CollectiveInfo, wire_collective

def wire_op(index: int, name: str, phase: str | None, module: str | None, forward: int | None, source: str | None,
            source_text: str | None = None) -> dict:
    rec: dict[str, Any] = {_INDEX: index, _NAME: name, _PHASE: phase}
    if module:
        rec[_MODULE] = module
    if forward is not None:
        rec[_FORWARD] = forward
    if source:
        rec[_SOURCE] = source
        if source_text is not None:
            rec[_SOURCE_TEXT] = source_text
    return rec


def wire_set_recompute(rec: dict, of: int | None, backward_call: str | None) -> None:
    """Mark an op record as a recompute (activation checkpointing) of forward op ``of`` (None: of no forward op the
    recorder could match), run by the ``backward()`` called at ``backward_call``."""
    rec[_RECOMPUTE] = of
    if backward_call:
        rec[_BACKWARD_CALL] = backward_call


def wire_set_step(rec: dict, step: int) -> None:
    rec[_STEP] = step


def _any_nonfinite(todo: list) -> bool:
    """Whether any tensor reference in these (nested) values has statistics counting NaN or Inf values."""
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            s = v.get(_STATS)
            if s and (s[5] or s[6]):
                return True
    return False


def wire_nonfinite(rec: dict) -> bool:
    """Whether any output or written argument of an op record has statistics counting NaN or Inf values."""
    return _any_nonfinite([rec.get(_OUTPUTS), [v for _, v in rec.get(_WRITES) or []]])


def wire_nonfinite_inputs(rec: dict) -> bool:
    """Whether any tensor argument of an op record has statistics counting NaN or Inf values (as the op read it)."""
    return _any_nonfinite([rec.get(_ARGS), list((rec.get(_KWARGS) or {}).values())])


def wire_ref_nonfinite(ref: dict) -> tuple[int, int] | None:
    """(NaN count, Inf count) of a tensor reference's statistics; None where it has none, or none yet (a cell the
    recorder fills later)."""
    s = ref.get(_STATS)
    if not s:
        return None
    return int(s[5]), int(s[6])


def wire_not_recorded(rec: dict, why: str) -> dict:
    """Mark an op record as numbered but not recorded (filtered out, or not describable), with the reason."""
    rec[_NOT_RECORDED] = why
    return rec


ENTERED_REASON = "entered, not completed while recording (the rank was waiting in it)"


def wire_entered(index: int, name: str, phase: str | None, module: str | None, source: str | None,
                 info: CollectiveInfo) -> dict:
    """The stub a rank leaves when it enters a collective: numbered, its group known, no tensors (those come with
    the full record once it completes). Read back as an OpRecord with ``recorded`` False."""
    rec = wire_op(index, name, phase, module, None, source)
    rec[_COLL] = wire_collective(info)
    rec[_NOT_RECORDED] = ENTERED_REASON
    return rec


ISSUED_REASON = "issued to the device, not completed by it while recording (the device was waiting in it)"


def wire_issued(stub: dict) -> dict:
    """The marker of a collective a device was still running (NCCL: the call returned at once, its op is recorded):
    the entered stub, saying so, so that a reader keeps it beside the op's record."""
    return dict(stub, **{_NOT_RECORDED: ISSUED_REASON, _ISSUED: True})


def wire_is_issued(rec: dict) -> bool:
    return rec.get(_ISSUED) is True


def check_entered(frame: Any) -> dict:
    """An entered-collective stub, after checking its structure; ValueError if it is not sound."""
    if not isinstance(frame, dict) or type(frame.get(_INDEX)) is not int or not isinstance(frame.get(_NAME), str) \
            or not isinstance(frame.get(_COLL), dict):
        raise ValueError("not an entered-collective record")
    check_op(frame)
    return frame


def wire_set_left_out(rec: dict, why: str) -> None:
    """Mark a recorded op whose tensor data is (partly) left out, with the reason (a LEFT_OUT_* value)."""
    rec[_LEFT_OUT] = why


def wire_left_out(rec: dict) -> str | None:
    return rec.get(_LEFT_OUT)


def wire_strip_chunks(rec: dict, first_lost: int, why: str) -> bool:
    """Drop every reference of ``rec`` to data files numbered ``first_lost`` and up (never written: the disk filled),
    marking the op's data left out for ``why``; whether any was dropped."""
    todo: list = [rec.get(_ARGS), list((rec.get(_KWARGS) or {}).values()), rec.get(_OUTPUTS), rec.get(_WRITES)]
    dropped = False
    rng = rec.get(_RNG)
    if isinstance(rng, dict) and isinstance(rng.get(_CHUNK), int) and rng[_CHUNK] >= first_lost:
        del rec[_RNG]
        dropped = True
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            c = v.get(_CHUNK) if _VERSION in v else None  # other dicts are markers ({"dtype": ...}): no data
            if isinstance(c, int) and c >= first_lost:
                del v[_CHUNK]
                dropped = True
    if dropped and _LEFT_OUT not in rec:
        rec[_LEFT_OUT] = why
    return dropped


def wire_strip_versions(rec: dict, versions: set[int], why: str) -> bool:
    """Drop every reference of ``rec`` to the data of storage ``versions`` (never written: a device never finished
    the copy), marking the op's data left out for ``why``; whether any was dropped."""
    todo: list = [rec.get(_ARGS), list((rec.get(_KWARGS) or {}).values()), rec.get(_OUTPUTS), rec.get(_WRITES)]
    dropped = False
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict) and _CHUNK in v and v.get(_VERSION) in versions:
            del v[_CHUNK]
            dropped = True
    if dropped and _LEFT_OUT not in rec:
        rec[_LEFT_OUT] = why
    return dropped


def wire_set_collective(rec: dict, info: CollectiveInfo) -> None:
    rec[_COLL] = wire_collective(info)


def wire_set_rng(rec: dict, device: str, version: int, chunk: int, nbytes: int) -> None:
    rec[_RNG] = {_DEVICE: device, _VERSION: version, _CHUNK: chunk, _NBYTES: nbytes}


def wire_set_inputs(rec: dict, args: list, kwargs: dict) -> None:
    rec[_ARGS] = args
    rec[_KWARGS] = kwargs


def wire_set_outputs(rec: dict, outputs: Any, writes: list[tuple[tuple[str, int | str], Any]] | None,
                     uninitialised: bool) -> None:
    if uninitialised:
        rec[_UNINIT] = True
    if writes:
        rec[_WRITES] = [[[_PATH_ARG if kind == "arg" else _PATH_KWARG, key], v] for (kind, key), v in writes]
    rec[_OUTPUTS] = outputs


def wire_is_collective(rec: dict) -> bool:
    return _COLL in rec


def wire_index(rec: dict) -> int:
    return rec[_INDEX]


def wire_tensor(dtype: str, shape: list, stride: list | None, offset: int, device: str) -> dict:
    return {_DTYPE: dtype, _SHAPE: shape, _STRIDE: stride, _OFFSET: offset, _DEVICE: device, _VERSION: None}


def wire_stored_tensor(dtype: str, shape: list | tuple, stride: list | tuple, offset: int, device: str, version: int,
                       nbytes: int, requires_grad: bool, uninitialised: bool, conj: bool, neg: bool) -> dict:
    """A stored tensor's reference in one call (the recorder's hot path: one per tensor of every op): ``wire_tensor``'s
    keys, then the storage's version and size, then the flags that are set."""
    ref = {_DTYPE: dtype, _SHAPE: shape, _STRIDE: stride, _OFFSET: offset, _DEVICE: device, _VERSION: version,
           _NBYTES: nbytes}
    if requires_grad:
        ref[_REQ_GRAD] = True
    if uninitialised:
        ref[_UNINIT] = True
    if conj:
        ref[_CONJ] = True
    if neg:
        ref[_NEG] = True
    return ref


def wire_unsupported(ref: dict, why: str) -> dict:
    ref[_VERSION] = None
    ref[_UNSUPPORTED] = why
    return ref


def wire_zero(ref: dict) -> dict:
    """A ZeroTensor (autograd's efficient zeros): values known without bytes, and no storage to identify."""
    ref[_VERSION] = None
    ref[_ZERO] = True
    return ref


def wire_set_chunk(ref: dict, chunk: int) -> None:
    ref[_CHUNK] = chunk


def wire_rechunk(rec: dict, chunks: dict[int, int]) -> int:
    """Point every stored tensor of an op record (and its generator state) at the data file ``chunks`` names for its
    storage version; a version ``chunks`` lacks has no bytes any more (the flight recorder left it out to stay
    within its memory) and is marked not stored (a generator state: dropped). Returns how many were left out."""
    left_out = 0
    rng = rec.get(_RNG)
    if isinstance(rng, dict) and _CHUNK in rng:
        chunk = chunks.get(rng.get(_VERSION))
        if chunk is None:
            del rec[_RNG]
            left_out += 1
        else:
            rng[_CHUNK] = chunk
    todo: list = [rec.get(_ARGS), rec.get(_KWARGS), rec.get(_OUTPUTS), [v for _, v in rec.get(_WRITES) or []]]
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            if _VERSION in v and _DTYPE in v:  # a tensor reference
                if _CHUNK in v:
                    chunk = chunks.get(v[_VERSION])
                    if chunk is None:
                        del v[_CHUNK]
                        left_out += 1
                    else:
                        v[_CHUNK] = chunk
            else:  # kwargs, or a marker of a torch object (holds no tensors, cheap to look through)
                todo.extend(v.values())
    return left_out


def wire_set_stats(ref: dict, stats: list | None) -> None:
    ref[_STATS] = stats


def wire_stats_key(ref: dict) -> tuple:
    return (ref[_VERSION], ref[_DTYPE], tuple(ref[_SHAPE]), tuple(ref[_STRIDE]), ref[_OFFSET])
