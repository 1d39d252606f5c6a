"""Replaying one op in isolation from its recorded inputs, and judging what it produced.

Inputs are rebuilt per op from the recorded storage bytes: one base tensor per (storage version, dtype), and each
argument as a strided view of it, so aliasing inside the op survives and an in-place op writes only into its own
copy. Floating data and floating dtype arguments follow the precision policy; random ops keep their recorded dtype
and get their recorded generator state back, so the draw is redone and compared exactly.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch

from replaydiff.compare.metrics import tensor_metrics
from replaydiff.compare.tolerance import reduction_length
from replaydiff.errors import TraceError
from replaydiff.record.encode import TENSOR_KEY, decode_value, dtype_from_name, iter_tensor_refs
from replaydiff.replay.policy import FALLBACKS, ReplayOptions, target_dtype
from replaydiff.replay.result import OpResult
from replaydiff.trace.reader import RankReader

COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}
COLLECTIVE_SKIP = "collective: cannot run alone; checked across ranks when all its ranks are in the trace"
# Markers, not computations. Other namespaces (a user's custom kernels) are replayed when the op is registered here.
NON_COMPUTE_NAMESPACES = {"profiler", "prims_debug"}
# Ops that only reinterpret bits or shapes: their meaning depends on the exact recorded dtype.
_DTYPE_EXACT = {"aten.view.dtype", "aten.view_as_real.default", "aten.view_as_complex.default"}


class Skip(Exception):
    """This op is not replayed; the message is the reason."""


def op_packet(name: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 else name


_RESOLVED: dict[str, Any] = {}


def resolve_op(name: str) -> Any:
    """``aten.mm.default`` -> torch.ops.aten.mm.default, looked up in registered ops only."""
    func = _RESOLVED.get(name)
    if func is None:
        func = _RESOLVED[name] = _resolve(name)
    return func


def _resolve(name: str) -> Any:
    parts = name.split(".")
    if len(parts) != 3:
        raise Skip(f"op name {name!r} is not namespace.op.overload")
    ns, op, overload = parts
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise Skip(f"op {name} is not registered here (load the extension that defines it)") from None


class OpReplayer:
    def __init__(self, reader: RankReader, options: ReplayOptions) -> None:
        self.reader = reader
        self.opts = options
        self.device = torch.device(options.device)
        self._base: dict[tuple, torch.Tensor] = {}
        self._precision = options.precision

    # -- inputs -----------------------------------------------------------------------------------------------
    def _tensor(self, ref: dict, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
        if ref.get(TENSOR_KEY) is None or not self.reader.has_data(ref):
            raise Skip("inputs not stored in the trace" + (" (recorded with tensors=meta/stats or a filter)"
                                                           if ref.get(TENSOR_KEY) is not None else ""))
        rec_dtype = dtype_from_name(ref["dt"])
        target = dtype or rec_dtype
        key = (ref[TENSOR_KEY], ref["dt"], target)
        base = self._base.get(key)
        if base is None:
            data = self.reader.storage_bytes(int(ref[TENSOR_KEY]), int(ref.get("f", -1)), int(ref.get("sb", 0)))
            itemsize = torch.empty(0, dtype=rec_dtype).element_size()
            n = data.numel() - data.numel() % itemsize
            base = data[:n].view(rec_dtype).to(device=device, dtype=target, copy=True)
            self._base[key] = base
        return base.as_strided(ref["sh"], ref["st"], ref["of"])

    def _inputs(self, rec: dict, keep_dtype: bool, rng_gen: torch.Generator | None,
                device: torch.device | None = None) -> tuple[list, dict]:
        self._base = {}
        device = device or self.device

        def tensor(ref: dict) -> torch.Tensor:
            rd = dtype_from_name(ref["dt"])
            return self._tensor(ref, None if keep_dtype else self._target(rd), device)

        def convert(v: Any) -> Any:
            v = decode_value(v, tensor, marker)
            return v

        def marker(key: str, val: Any) -> Any:
            if key == "generator":
                if rng_gen is None:
                    raise Skip("a generator argument without recorded state")
                return rng_gen
            raise Skip(f"an argument of kind {key!r} cannot be rebuilt")

        args = [self._rewrite(convert(a), keep_dtype, device) for a in rec.get("a", [])]
        kwargs = {k: self._rewrite(convert(v), keep_dtype, device) for k, v in (rec.get("k") or {}).items()}
        return args, kwargs

    def _target(self, dtype: torch.dtype) -> torch.dtype:
        return target_dtype(self._precision, dtype)

    def _rewrite(self, v: Any, keep_dtype: bool, device: torch.device) -> Any:
        """Floating dtype arguments follow the policy; devices become the replay device."""
        if isinstance(v, torch.dtype):
            return v if keep_dtype else self._target(v)
        if isinstance(v, torch.device):
            return device
        if isinstance(v, list):
            return [self._rewrite(x, keep_dtype, device) for x in v]
        return v

    # -- one op -----------------------------------------------------------------------------------------------
    def replay(self, rec: dict) -> OpResult:
        name = rec["op"]
        res = OpResult(rank=self.reader.rank, index=rec["i"], op=name, status="ok", module=rec.get("mod"),
                       phase=rec.get("ph"), source=rec.get("src"), forward_index=rec.get("fwd"))
        self._outputs_nonfinite: bool | None = None
        try:
            self._replay(rec, res)
        except TraceError:
            raise  # a damaged trace is the user's problem to hear about (exit 3), not one op's error
        except Skip as s:
            res.status, res.reason = "skipped", str(s)
        except Exception as exc:  # one failing op never stops the replay
            first = (str(exc).strip().splitlines() or [""])[0]
            res.status, res.reason = "error", f"{type(exc).__name__}: {first}"[:300]
        finally:
            self._base = {}
        try:
            self._check_nonfinite_origin(rec, res)
        except Exception:
            pass  # the origin is a hint; the op's status already says what went wrong reading it
        return res

    def _replay(self, rec: dict, res: OpResult) -> None:
        name = rec["op"]
        ns = name.split(".", 1)[0]
        if ns in COLLECTIVE_NAMESPACES:
            if op_packet(name) in ("_wrap_tensor_autograd", "wait_tensor"):
                raise Skip("collective bookkeeping: no data of its own")
            raise Skip(COLLECTIVE_SKIP)
        if ns in NON_COMPUTE_NAMESPACES:
            raise Skip(f"non-aten op ({ns})")
        if rec.get("u"):
            raise Skip("uninitialised output (empty*)")
        if self.opts.ops and not any(fnmatch.fnmatchcase(name, g) for g in self.opts.ops):
            raise Skip("not selected by --ops")
        func = resolve_op(name)
        packet = func.overloadpacket.__name__
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        keep_dtype = seeded or name in _DTYPE_EXACT or self.opts.precision == "same"
        exact = self.opts.precision == "same" or seeded
        rng = rec.get("rng")
        if seeded:
            if not rng:
                raise Skip("random op without a recorded generator state")
            rec_dev = torch.device(rng["dev"])
            if rec_dev.type != self.device.type:
                raise Skip(f"random op recorded on {rec_dev.type}: its draw can only be redone on {rec_dev.type}")
        if self.opts.precision == "same":
            devs = {r["dev"].split(":")[0] for r in iter_tensor_refs(rec.get("o")) if isinstance(r.get("dev"), str)}
            if devs and devs != {self.device.type}:
                exact = False  # another backend: judged by the dtype's tolerance instead of bit for bit

        # Some kernels have no float64 (or float32) version (aten._grouped_mm in MoE layers): such an op is replayed
        # at the next precision down, and the report says so.
        ladder = [self.opts.precision] if keep_dtype else list(FALLBACKS[self.opts.precision])
        first_failure = None
        for step, self._precision in enumerate(ladder):
            keep = keep_dtype or self._precision == "same"
            try:
                runs = self._runs(rec, func, rng, seeded, keep)
                break
            except (RuntimeError, NotImplementedError) as exc:
                if step == len(ladder) - 1:
                    raise
                first_failure = first_failure or f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:200]
        fallback = None
        if self._precision != ladder[0]:
            fallback = f"replayed at {self._precision}: at {ladder[0]} the op failed ({first_failure})"
            keep_dtype = keep

        self._judge(rec, func, packet, runs, exact, keep_dtype, res)
        if fallback:
            res.reason = fallback if res.reason is None else f"{res.reason}; {fallback}"
            if res.metrics is not None:
                res.metrics["precision"] = self._precision

    def _runs(self, rec: dict, func: Any, rng: dict | None, seeded: bool, keep_dtype: bool) -> list[tuple]:
        runs = []
        for _ in range(max(1, self.opts.repeat)):
            gen = self._generator(rec, rng) if seeded else None
            args, kwargs = self._inputs(rec, keep_dtype, gen)
            if seeded and gen is None:
                with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
                    self._set_global_rng(rng)
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            runs.append((out, args, kwargs))
        return runs

    def _judge(self, rec: dict, func: Any, packet: str, runs: list, exact: bool, keep_dtype: bool,
               res: OpResult) -> None:
        out, args, kwargs = runs[0]
        in_shapes = [r["sh"] for r in iter_tensor_refs(rec.get("a")) if isinstance(r.get("sh"), list)]
        in_versions = {r.get(TENSOR_KEY) for r in iter_tensor_refs([rec.get("a"), list((rec.get("k") or {}).values())])}
        pairs = self._pairs(rec, out, args, kwargs, in_versions)
        judged: list[tuple[int, dict, str | None]] = []  # (pair index, metrics, why divergent)
        for n, (ref, value) in enumerate(pairs):
            if isinstance(ref, dict) and "stride" in ref:
                res.status, res.reason = "divergent", "view has another shape, stride or offset than recorded"
                res.metrics = {"recorded": ref, "reference": value}
                return
            if not isinstance(value, torch.Tensor):
                if isinstance(ref, dict):
                    raise RuntimeError(f"op returned {type(value).__name__} where a tensor was recorded")
                if not _same_scalar(ref, value):
                    res.status, res.reason = "divergent", f"scalar output {value!r} != recorded {ref!r}"
                    res.metrics = {"recorded": ref, "reference": value}
                    return
                continue
            recorded = self.reader.tensor(ref)
            m = tensor_metrics(recorded, value, exact=exact)
            k = reduction_length(packet, in_shapes, max(1, recorded.numel()))
            bad, why = self.opts.tolerances.diverges(m, recorded.dtype, k)
            m["reduction_k"] = k
            judged.append((n, m, why if bad else None))
            if m.get("nonfinite_recorded"):
                self._outputs_nonfinite = True
        if self._outputs_nonfinite is None and len(judged) == len(pairs):
            # Every output was compared and all were finite, or all are views of inputs (whose bytes they share:
            # a NaN there started earlier).
            self._outputs_nonfinite = False
        if not keep_dtype and any(why and "norm_max" in m and not m["nonfinite_mismatch"] for _, m, why in judged):
            judged = self._calibrate(rec, func, pairs, judged, in_versions)
        bad_ones = [(m, why) for _, m, why in judged if why]
        if bad_ones:
            res.status, res.reason, res.metrics = "divergent", bad_ones[0][1], bad_ones[0][0]
        elif judged:
            res.metrics = max((m for _, m, _ in judged), key=lambda m: m.get("norm_max", m.get("mismatches", 0)))
        elif res.reason is None:
            res.reason = ("scalar result compared exactly" if pairs else
                          "nothing to compare (views of inputs are checked by shape and stride only)")
        if len(runs) > 1:
            self._check_repeats(runs, res)

    def _calibrate(self, rec: dict, func: Any, pairs: list, judged: list, in_versions: set) -> list:
        """Is an error over the fixed limit explained by the op's own conditioning?

        The op is run again at its recorded dtypes (on the CPU), and that run's error against the
        upcast reference is the op's own error at this precision (large for ill-conditioned ops: a LayerNorm of
        an input with a large mean, a gradient sum that cancels to almost zero). An output is divergent only if
        its recorded error is more than CONDITIONING_FACTOR times that.
        """
        # On the CPU whatever the replay device: a kernel bug on the replay GPU must not explain itself away.
        args, kwargs = self._inputs(rec, True, None, torch.device("cpu"))
        out = func(*args, **kwargs)
        same_pairs = self._pairs(rec, out, args, kwargs, in_versions)
        f = self.opts.tolerances.conditioning_factor
        result = []
        for n, m, why in judged:
            if why and "norm_max" in m and not m["nonfinite_mismatch"] and n < len(same_pairs):
                same = same_pairs[n][1]
                if isinstance(same, torch.Tensor):
                    ms = tensor_metrics(same, pairs[n][1])
                    m["same_dtype_max_abs"], m["same_dtype_rel_l2"] = ms["max_abs"], ms["rel_l2"]
                    # Only an op whose own error at its dtype already breaks the limit is ill-conditioned; a
                    # well-conditioned op's bf16 rounding must not hide a 1e-2 fault (only ~6x that rounding).
                    ill, _ = self.opts.tolerances.diverges(dict(ms), same.dtype, m.get("reduction_k", 1))
                    if ill and m["max_abs"] <= f * ms["max_abs"] and m["rel_l2"] <= f * ms["rel_l2"]:
                        why = None  # as far off as the reference's own rounding: ill-conditioned, not wrong
                    else:
                        own = ms["max_abs"]
                        ratio = f"{m['max_abs'] / own:.3g}x the op's own error" if own else "while the op itself is exact"
                        why = f"{why}, {ratio} at its recorded dtype"
            result.append((n, m, why))
        return result

    def _pairs(self, rec: dict, out: Any, args: list, kwargs: dict, in_versions: set) -> list[tuple[Any, Any]]:
        """(recorded, replayed) pairs for every output and every written argument."""
        pairs: list[tuple[Any, Any]] = []
        written = set()
        for path, after in rec.get("w") or []:
            where, key = path[0], path[1]
            value = args[key] if where == "a" else kwargs.get(key)
            for r in iter_tensor_refs(after):
                written.add(r.get(TENSOR_KEY))
            _zip(after, value, pairs)
        outs: list[tuple[Any, Any]] = []
        _zip(rec.get("o"), out, outs)
        for ref, value in outs:
            if isinstance(ref, dict) and TENSOR_KEY in ref:
                if ref.get(TENSOR_KEY) in written:
                    continue  # the output is the written argument: already compared
                if ref.get(TENSOR_KEY) in in_versions:  # a view of an input: the bytes are the input's
                    if isinstance(value, torch.Tensor) and (list(value.shape) != ref["sh"]
                                                            or list(value.stride()) != ref["st"]
                                                            or value.storage_offset() != ref["of"]):
                        pairs.append(({"shape": ref["sh"], "stride": ref["st"], "offset": ref["of"]},
                                      {"shape": list(value.shape), "stride": list(value.stride()),
                                       "offset": value.storage_offset()}))
                    continue
                if ref.get("u") or not self.reader.has_data(ref):
                    continue
            pairs.append((ref, value))
        return pairs

    def _check_repeats(self, runs: list, res: OpResult) -> None:
        first: list[tuple[Any, Any]] = []
        _zip_values(runs[0], first)
        for other in runs[1:]:
            vals: list[tuple[Any, Any]] = []
            _zip_values(other, vals)
            for (a, _), (b, _) in zip(first, vals):
                if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                    if tensor_metrics(a, b, exact=True).get("mismatches", 1):
                        if res.status == "ok":
                            res.status = "nondeterministic"
                            res.reason = f"{len(runs)} replays of the op disagree with each other"
                        return

    # -- random ops -------------------------------------------------------------------------------------------
    def _rng_state(self, rng: dict) -> torch.Tensor:
        return self.reader.storage_bytes(int(rng[TENSOR_KEY]), int(rng["f"]), int(rng["sb"])).clone()

    def _generator(self, rec: dict, rng: dict) -> torch.Generator | None:
        """A generator holding the recorded state when the op was given one explicitly; None when it drew from
        the device's default generator (whose state _set_global_rng restores instead)."""
        kwargs = rec.get("k") or {}
        if not any(isinstance(v, dict) and "generator" in v for v in list(kwargs.values()) + list(rec.get("a", []))):
            return None
        gen = torch.Generator(device=self.device)
        gen.set_state(self._rng_state(rng))
        return gen

    def _set_global_rng(self, rng: dict) -> None:
        state = self._rng_state(rng)
        if self.device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, self.device)

    # -- NaN / Inf origin -------------------------------------------------------------------------------------
    def _check_nonfinite_origin(self, rec: dict, res: OpResult) -> None:
        if self._outputs_nonfinite is False:
            return
        outs = [r for r in iter_tensor_refs([rec.get("o"), [a for _, a in rec.get("w") or []]])
                if not r.get("u") and self.reader.has_data(r) and _floating(r["dt"])]
        if not outs or all(bool(torch.isfinite(self.reader.tensor(r)).all()) for r in outs):
            return
        args = [rec.get("a"), list((rec.get("k") or {}).values())]
        if any(isinstance(x, float) and not math.isfinite(x) for x in _scalars(args)):
            return  # a NaN/Inf passed in as a scalar (masked_fill(-inf) in attention): not an origin
        ins = [r for r in iter_tensor_refs(args) if _floating(r.get("dt", "")) and not r.get("u")]
        for r in ins:
            if not self.reader.has_data(r) or not bool(torch.isfinite(self.reader.tensor(r)).all()):
                return
        res.nonfinite_origin = True


def _scalars(v: Any):
    if isinstance(v, list):
        for x in v:
            yield from _scalars(x)
    elif not isinstance(v, dict):
        yield v


def _floating(dt: str) -> bool:
    return dt.startswith(("float", "bfloat", "complex"))


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _zip(rec: Any, value: Any, out: list) -> None:
    if isinstance(rec, list):
        if not isinstance(value, (list, tuple)) or len(value) != len(rec):
            raise RuntimeError(f"op returned {type(value).__name__} where {len(rec)} values were recorded")
        for r, v in zip(rec, value):
            _zip(r, v, out)
    elif isinstance(rec, dict) and TENSOR_KEY in rec:
        out.append((rec, value))
    elif rec is None:
        return
    elif isinstance(rec, (int, float, bool)):
        out.append((rec, value))


def _zip_values(run: tuple, out: list) -> None:
    value, args, kwargs = run

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append((v, None))
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(value)
    walk(args)
    walk(list(kwargs.values()))
