"""A standalone repro of one recorded op: ``DIR/repro.py`` and ``DIR/inputs.safetensors``, for a kernel owner.

The script needs only torch and safetensors (no replaydiff, no trace). The safetensors file holds the raw bytes of
every storage version the op read or wrote (one uint8 tensor each, read back with ``safetensors.torch.load_file``:
no pickle) and the generator state of a random op; the script carries, as Python literals, how each argument sits
on its storage (dtype, shape, stride, offset, conj and neg bits), so views and aliasing inside the op are rebuilt
exactly as recorded. It runs the op on ``--device`` at the recorded dtypes and on the CPU at float64 (random ops:
at their recorded dtypes from the recorded generator state), and prints, for every output and written argument,
the error of the recorded value and of the device run against that reference in the replay report's units
(``max_abs/(eps*absmax)`` and ``rel_l2/eps``, eps of the recorded dtype, limits as replay would apply them), and the
verdict replay gives: an output over the fixed limits is still ok when the op, run at its recorded dtypes on the CPU,
errs as much itself (an ill-conditioned op). The script judges with the verdict module's own functions, copied into
it as source (``how_far_over``, ``calibrated_limits``, ``ill_conditioned_note``), so it cannot judge otherwise.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replaydiff import aten
from replaydiff.compare import verdict
from replaydiff.compare.tolerance import Tolerances, reduction_length
from replaydiff.errors import UsageError
from replaydiff.trace.format import write_atomic_via
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import Opaque, OpRecord, TensorRef, iter_refs

REPRO_FORMAT = "replaydiff.repro/1"
SCRIPT = "repro.py"
INPUTS = "inputs.safetensors"


@dataclass(frozen=True)
class ReproFiles:
    script: Path
    inputs: Path
    nbytes: int  # bytes of tensor data written


class _Collector:
    """Turns an op's recorded values into Python source, gathering the tensors and storages they need."""

    def __init__(self, trace: RankTrace, op: OpRecord) -> None:
        self.trace = trace
        self.op = op
        self.tensors: dict[str, dict] = {}  # name -> geometry over a storage
        self.storages: dict[str, torch.Tensor] = {}  # key -> uint8 bytes
        self._names: dict[tuple, str] = {}

    def tensor(self, ref: TensorRef, prefix: str) -> str:
        key = (ref.geometry, ref.conj, ref.neg, ref.zero)
        name = self._names.get(key)
        if name is not None:
            return name
        name = f"{prefix}{sum(n.startswith(prefix) for n in self.tensors)}"
        spec: dict[str, Any] = {"dtype": ref.dtype, "shape": list(ref.shape)}
        if ref.zero:
            spec["zeros"] = True
        elif ref.meta:
            spec.update(meta=True, stride=list(ref.stride or ()))
        elif not ref.stored:
            raise UsageError(f"op #{self.op.index} {self.op.name}: tensor {ref.describe()} is not stored in the trace "
                             f"(recorded with --tensors stats/meta, a filter or --max-tensor-bytes): no repro")
        else:
            skey = f"s{ref.version}"
            if skey not in self.storages:
                self.storages[skey] = self.trace.data(ref).clone()
            spec.update(storage=skey, stride=list(ref.stride or ()), offset=ref.offset, conj=ref.conj, neg=ref.neg)
        self.tensors[name] = spec
        self._names[key] = name
        return name

    def source(self, v: Any) -> str:
        """A Python expression rebuilding an argument inside the script's ``build(T, D, DEV, GEN)``."""
        if isinstance(v, TensorRef):
            return f'T("{self.tensor(v, "in")}")'
        if isinstance(v, list):
            return "[" + ", ".join(self.source(x) for x in v) + "]"
        if isinstance(v, Opaque):
            if v.kind == "generator":
                return "GEN"
            raise UsageError(f"op #{self.op.index} {self.op.name}: an argument of kind {v.kind!r} cannot be rebuilt")
        if isinstance(v, torch.dtype):
            return f'D("{str(v).removeprefix("torch.")}")'
        if isinstance(v, torch.device):
            return f'DEV("{v}")'
        if isinstance(v, (torch.layout, torch.memory_format)):
            return str(v)  # torch.strided, torch.contiguous_format ...
        if isinstance(v, float) and not math.isfinite(v):
            return f'float("{v}")'
        return repr(v)


def _checks(c: _Collector, op: OpRecord, tol: Tolerances) -> list[dict]:
    """What the script compares: every written argument (as it was after) and every output that is new data."""
    in_shapes = [list(r.shape) for r in iter_refs(op.args)]
    in_versions = {r.version for r in op.inputs()}
    packet = aten.packet(op.name)
    checks: list[dict] = []
    written: set = set()

    def add(ref: Any, where: list, label: str) -> None:
        if isinstance(ref, list):
            for i, r in enumerate(ref):
                add(r, where + [i], f"{label}[{i}]")
            return
        if not isinstance(ref, TensorRef):
            if isinstance(ref, (int, float, bool)):
                checks.append({"label": label, "where": where, "scalar": ref})
            return
        if ref.uninitialised:
            return
        if ref.version in in_versions and where[0] == "out":  # a view of an input: its geometry is what the op did
            checks.append({"label": label + " (a view of an input)", "where": where, "view": {
                "shape": list(ref.shape), "stride": list(ref.stride or ()), "offset": ref.offset}})
            return
        if not (ref.stored or ref.zero):
            return
        k = reduction_length(packet, in_shapes, max(1, math.prod(ref.shape)))
        lmax, lrel = tol.limit_for(ref.dtype, k)
        checks.append({"label": label, "where": where, "tensor": c.tensor(ref, "rec"),
                       "limits": [round(lmax, 6), round(lrel, 6)], "k": k})

    for path, after in op.writes:
        for r in iter_refs(after):
            written.add(r.version)
        add(after, [path.kind, path.key], f"{path.kind} {path.key} (written)")
    outs = op.outputs if isinstance(op.outputs, list) else [op.outputs]
    for i, o in enumerate(outs):
        if isinstance(o, TensorRef) and o.version in written:
            continue  # the output is the written argument, compared above
        add(o, ["out", i] if isinstance(op.outputs, list) else ["out"], f"output {i}")
    return checks


def is_repro_file(path: Path) -> bool:
    """Whether ``path`` is a repro's script or inputs as ``write_repro`` wrote them (so --force may replace it)."""
    try:
        if path.name == INPUTS:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return (f.metadata() or {}).get("format") == REPRO_FORMAT
        with open(path, "rb") as fh:
            return REPRO_FORMAT.encode() in fh.read(256)  # the script's second line
    except Exception:  # unreadable, or not safetensors at all: not ours
        return False


def write_repro(trace: RankTrace, op: OpRecord, out_dir: str | Path, source_trace: str = "",
                tolerances: Tolerances | None = None) -> ReproFiles:
    """Write ``out_dir/repro.py`` and ``out_dir/inputs.safetensors`` for ``op``; UsageError if it cannot run alone."""
    from safetensors.torch import save_file

    name = op.name
    if not op.recorded:
        raise UsageError(f"op #{op.index} was not recorded ({op.not_recorded_reason})")
    if aten.is_collective(name):
        raise UsageError(f"op #{op.index} {name} is a collective: it cannot run alone (replay checks it across ranks)")
    if aten.is_marker(name):
        raise UsageError(f"op #{op.index} {name} is a profiler marker: it computes nothing")
    if op.uninitialised:
        raise UsageError(f"op #{op.index} {name} makes uninitialised memory (empty*): nothing to compare")
    parts = name.split(".")
    if len(parts) != 3:
        raise UsageError(f"op #{op.index}: {name!r} is not namespace.op.overload")
    try:
        func = aten.resolve(name)
        seeded = aten.facts(func).seeded
    except aten.UnknownOp:
        seeded = False  # a custom op not loaded here: the script imports its module (--import)
    c = _Collector(trace, op)
    args_src = [c.source(a) for a in op.args]
    kwargs_src = {k: c.source(v) for k, v in op.kwargs.items()}
    tol = tolerances or Tolerances()
    checks = _checks(c, op, tol)
    rng_device = None
    tensors = dict(c.storages)
    if seeded:
        if op.rng is None:
            raise UsageError(f"op #{op.index} {name} is random but its generator state was not recorded")
        tensors["rng_state"] = trace.rng_state(op.rng).contiguous()
        rng_device = op.rng.device
    custom = trace.custom_ops.get(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs = out / INPUTS
    meta = {"format": REPRO_FORMAT, "op": name, "index": str(op.index), "rank": str(trace.rank)}
    write_atomic_via(inputs, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                                                   metadata=meta))
    script = out / SCRIPT
    script.write_text(_SCRIPT.format(
        repro_format=REPRO_FORMAT, doc=_docstring(trace, op, source_trace),
        op=name, ns=parts[0], packet=parts[1], overload=parts[2],
        index=op.index, rank=trace.rank,
        random=seeded, keep_dtypes=seeded or name in aten.DTYPE_EXACT_OPS,
        rng_device=repr(rng_device), explicit_gen="GEN" in args_src + list(kwargs_src.values()),
        custom_module=repr(custom),
        planted=repr(trace.planted.describe() if trace.planted is not None else None),
        tensors=_literal(c.tensors), checks=_list_literal(checks), factor=repr(tol.conditioning_factor),
        judging=_JUDGING,
        args="[" + ", ".join(args_src) + "]",
        kwargs="{" + ", ".join(f"{k!r}: {v}" for k, v in kwargs_src.items()) + "}",
    ))
    return ReproFiles(script, inputs, sum(t.numel() for t in tensors.values()))


def _literal(d: dict) -> str:
    """A dict literal with one entry per line (a tensor's description reads on one line)."""
    return "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in d.items()) + "}"


def _list_literal(items: list) -> str:
    return "[\n" + "".join(f"    {v!r},\n" for v in items) + "]"


def _docstring(trace: RankTrace, op: OpRecord, source_trace: str) -> str:
    where = ", ".join(x for x in (op.module, op.phase, op.source) if x)
    lines = [f"Standalone repro of op #{op.index} {op.name} (rank {trace.rank}) from the replaydiff trace "
             f"{source_trace or trace.root}", f"({where})." if where else ""]
    planted = trace.planted
    if planted is not None:
        lines.insert(0, f"PLANTED FAULT in the trace (record --plant): {planted.describe()}")
    env = trace.environment
    lines.append(f"Recorded with torch {env.torch}, CUDA {env.cuda}, "
                 f"{env.num_threads} CPU thread(s), devices {[d.name for d in env.devices]}.")
    return "\n".join(x for x in lines if x)


# The verdict's own judging functions (pure Python), carried by the script as source: it judges as replay does.
_JUDGING = "\n\n".join(inspect.getsource(f).rstrip() for f in (verdict.how_far_over, verdict.calibrated_limits,
                                                                   verdict.ill_conditioned_note))

# The generated script. It must run with `python -I` on a machine with only torch and safetensors.
_SCRIPT = '''#!/usr/bin/env python3
# {repro_format}: written by `replaydiff repro`, whose --force replaces it
"""{doc}

Needs only torch and safetensors:  python repro.py [--device cuda] [--import MODULE]
Runs the op on --device at its recorded dtypes and on the CPU at float64 (a random op: at its recorded dtypes, from
its recorded generator state, compared exactly), and prints the error of the recorded output and of the device run
against that reference, in the units of `replaydiff replay`: max_abs/(eps*absmax) and rel_l2/eps, eps being the
recorded dtype's machine epsilon, with the limits replay applies, and replay's verdict: an output over those limits
is still ok when the op run at its recorded dtypes on the CPU errs as much itself (within FACTOR times: the op is
ill-conditioned). Exit code 1 when the recorded output or the device run is divergent, as replay judges it,
4 when --device is not available here.
Inputs (raw storage bytes) are in inputs.safetensors next to this file.
"""
import argparse
import importlib
import math
import os
import sys

import torch
from safetensors.torch import load_file

OP = "{op}"
INDEX, RANK = {index}, {rank}
RANDOM = {random}  # a random op: replayed at its recorded dtypes from the recorded generator state, compared exactly
KEEP_DTYPES = {keep_dtypes}
RNG_DEVICE = {rng_device}
EXPLICIT_GENERATOR = {explicit_gen}
CUSTOM_MODULE = {custom_module}  # the Python module that defined a custom op when it was recorded
PLANTED = {planted}  # a fault planted while recording (record --plant): this trace's culprit is there on purpose

# Each tensor argument (in*) and recorded result (rec*): dtype, and where it sits on a stored storage (uint8 bytes in
# inputs.safetensors under "storage"): shape, stride, offset, conj and neg bits. Arguments sharing a storage alias.
TENSORS = {tensors}

# What is compared: where in the result ("out", i) or which written argument ("arg", i) / ("kwarg", name), and the
# recorded value with the limits on max_abs/(eps*absmax) and rel_l2/eps replay applies (k: reduction length).
CHECKS = {checks}

# An ill-conditioned op's output may err this many times the op's own error at its recorded dtype (replay's
# --conditioning factor); the op's own error is measured by running it at its recorded dtypes on the CPU.
FACTOR = {factor}

UPCAST = {{torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
          torch.complex32: torch.complex128, torch.complex64: torch.complex128}}


def build(T, D, DEV, GEN):
    """The op's arguments as recorded."""
    return {args}, {kwargs}


def op():
    ns = getattr(torch.ops, "{ns}")
    return getattr(getattr(ns, "{packet}"), "{overload}")


def tensors(storages, device, upcast):
    bases = {{}}

    def target(dt):
        return UPCAST.get(dt, dt) if upcast else dt

    def T(name):
        s = TENSORS[name]
        dt = getattr(torch, s["dtype"])
        if s.get("zeros"):
            return torch._efficientzerotensor(s["shape"], dtype=target(dt), device=device)
        if s.get("meta"):
            return torch.empty_strided(s["shape"], s["stride"], dtype=dt, device="meta")
        key = (s["storage"], s["dtype"])
        if key not in bases:  # one base per storage: views of one storage alias each other, as when recorded
            raw = storages[s["storage"]]
            n = raw.numel() - raw.numel() % dt.itemsize
            bases[key] = raw[:n].view(dt).to(device=device, dtype=target(dt), copy=True)
        t = bases[key].as_strided(s["shape"], s["stride"], s["offset"])
        if s["conj"]:
            t = t.conj()
        if s["neg"]:
            t = torch._neg_view(t)
        return t

    def D(name):
        return target(getattr(torch, name))

    def DEV(name):
        return torch.device(name) if name == "meta" else torch.device(device)

    return T, D, DEV


def run(storages, device, upcast):
    """(result, args, kwargs) of one run of the op on ``device``, at float64 if ``upcast``."""
    T, D, DEV = tensors(storages, device, upcast)
    gen = None
    if RANDOM and EXPLICIT_GENERATOR:
        gen = torch.Generator(device=device)
        gen.set_state(storages["rng_state"].clone())
    args, kwargs = build(T, D, DEV, gen)
    if RANDOM and not EXPLICIT_GENERATOR:  # the op drew from the device's default generator: restore its state
        dev = torch.device(device)
        with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev]):
            if dev.type == "cpu":
                torch.set_rng_state(storages["rng_state"].clone())
            else:
                torch.cuda.set_rng_state(storages["rng_state"].clone(), dev)
            return op()(*args, **kwargs), args, kwargs
    return op()(*args, **kwargs), args, kwargs


def pick(result, args, kwargs, where):
    kind, rest = where[0], where[1:]
    if kind == "out":
        v = result
    else:
        v = args[rest[0]] if kind == "arg" else kwargs[rest[0]]
        rest = rest[1:]
    for i in rest:
        v = v[i]
    return v


def error(rec, ref):
    """replaydiff's measures of ``ref`` against ``rec`` over positions finite in both, in float64."""
    eps = torch.finfo(rec.dtype).eps
    if rec.is_complex():
        rec, ref = torch.view_as_real(rec.resolve_conj()), torch.view_as_real(ref.to(rec.dtype).resolve_conj())
    a = rec.detach().to("cpu", torch.float64)
    b = ref.detach().to("cpu", torch.float64)
    both = torch.isfinite(a) & torch.isfinite(b)
    rounded = b.to(rec.dtype).to(torch.float64)
    bad = (~both) & ~((a == b) | (torch.isinf(a) & (a == rounded)) | (torch.isnan(a) & torch.isnan(b)))
    d = torch.where(both, a - b, 0.0)
    bf = torch.where(both, b, 0.0)
    max_abs = float(d.abs().max()) if d.numel() else 0.0
    absmax = float(bf.abs().max()) if bf.numel() else 0.0
    l2d, l2b = float(torch.linalg.vector_norm(d)), float(torch.linalg.vector_norm(bf))
    rel = l2d / l2b if l2b > 0 else (0.0 if l2d == 0 else math.inf)
    norm_max = max_abs / (eps * absmax) if absmax > 0 else (0.0 if max_abs == 0 else math.inf)
    return {{"norm_max": norm_max, "norm_rel": rel / eps, "max_abs": max_abs, "rel_l2": rel,
            "nonfinite_mismatch": int(bad.sum())}}


def mismatches(rec, ref):
    ref = ref.detach().to("cpu")
    if ref.dtype != rec.dtype:
        ref = ref.to(rec.dtype)
    same = rec == ref
    if rec.is_floating_point() or rec.is_complex():
        same = same | (torch.isnan(rec) & torch.isnan(ref))
    return int(same.numel() - int(same.sum()))


# -- replaydiff.compare.verdict, verbatim --
{judging}
# -- end of replaydiff.compare.verdict --


def same_nonfinite(rec, same):
    """The op run at its recorded dtypes makes exactly the recorded NaN/Inf itself (replay then judges the rest)."""
    if not isinstance(same, torch.Tensor) or tuple(same.shape) != tuple(rec.shape):
        return False
    same = same.detach().to("cpu", rec.dtype)
    a, b = ~torch.isfinite(rec), ~torch.isfinite(same)
    return bool(torch.equal(a, b)) and mismatches(rec[a], same[b]) == 0


def figures(rec, value, limits, exact):
    """One line in replay's units, and the measures behind it: (line, None) when it cannot be judged by them (not
    a tensor, another shape: divergent), (line, count of mismatches) for an exact comparison, (line, error dict)."""
    if not isinstance(value, torch.Tensor):
        return f"returned {{type(value).__name__}}, not a tensor", None
    if tuple(value.shape) != tuple(rec.shape):
        return f"shape {{list(value.shape)}} != recorded {{list(rec.shape)}}", None
    if exact or not (rec.is_floating_point() or rec.is_complex()):
        n = mismatches(rec, value)
        return f"mismatches {{n}} of {{rec.numel()}} (compared exactly)", n
    e = error(rec, value)
    line = (f"max_abs/(eps*absmax) {{e['norm_max']:.3g}} (limit {{limits[0]:.3g}})  rel_l2/eps {{e['norm_rel']:.3g}} "
            f"(limit {{limits[1]:.3g}})  max_abs {{e['max_abs']:.3g}}  rel_l2 {{e['rel_l2']:.3g}}")
    if e["nonfinite_mismatch"]:
        line += f"  {{e['nonfinite_mismatch']}} NaN/Inf mismatches"
    return line, e


def describe(rec, value, limits, exact, same=None):
    """The figures and replay's verdict on them, and whether that is divergent: over the limits, unless the op run
    at its recorded dtypes (``same``; None: not asked) errs as much itself."""
    line, e = figures(rec, value, limits, exact)
    if e is None or isinstance(e, int):
        return line + ("  ok" if e == 0 else "  DIVERGENT"), e != 0
    if e["nonfinite_mismatch"] and (same is None or not same_nonfinite(rec, same)):
        return line + "  DIVERGENT", True
    severity, why = how_far_over((e["norm_max"], e["norm_rel"]), limits), None
    if severity > 1 and same is not None and tuple(same.shape) == tuple(rec.shape):
        own = error(same.detach().to("cpu", rec.dtype), value)  # the op's own error at the recorded dtype
        ill = how_far_over((own["norm_max"], own["norm_rel"]), limits) > 1
        own_limits = calibrated_limits((own["max_abs"], own["rel_l2"]), ill, FACTOR)
        if own_limits is not None:
            severity = how_far_over((e["max_abs"], e["rel_l2"]), own_limits)
        if severity <= 1:
            why = ill_conditioned_note(str(rec.dtype).removeprefix("torch."), (own["max_abs"], own["rel_l2"]),
                                       (e["max_abs"], e["rel_l2"]), FACTOR)
        else:
            why = (f"{{e['max_abs'] / own['max_abs']:.3g}}x the op's own error at its recorded dtype"
                   if own["max_abs"] else "while the op itself is exact at its recorded dtype")
    return line + ("  DIVERGENT" if severity > 1 else "  ok") + (f" - {{why}}" if why else ""), severity > 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="device to run the op on (default cpu), e.g. cuda or cuda:1")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (the one that defines a custom op)")
    a = p.parse_args(argv)
    try:  # a device this torch lacks is one line, not torch.cuda's AssertionError from deep inside the run
        torch.empty(0, device=a.device)
    except Exception as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"repro.py: device {{a.device!r}} is not available here: {{why}}", file=sys.stderr)
        return 4
    for m in a.imports or ([CUSTOM_MODULE] if CUSTOM_MODULE and OP.split(".")[0] != "aten" else []):
        sys.path.insert(0, os.getcwd())
        importlib.import_module(m)
    storages = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "inputs.safetensors"))
    # Reference settings, as replay uses them: deterministic algorithms, no TF32, float32 matmuls at full precision.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    T_rec = tensors(storages, "cpu", False)[0]
    upcast = not (RANDOM or KEEP_DTYPES)
    with torch.inference_mode():
        ref = run(storages, "cpu", upcast)
        # the op's own error at its recorded dtypes, as replay measures it (on the CPU): an ill-conditioned op's limit
        same = run(storages, "cpu", False) if upcast else None
        dev = torch.device(a.device)
        if RANDOM and RNG_DEVICE and torch.device(RNG_DEVICE).type != dev.type:
            mine, why = None, f"a random op recorded on {{RNG_DEVICE}}: its draw can only be redone there"
        else:
            mine, why = run(storages, a.device, False), None
    if PLANTED:
        print(f"PLANTED FAULT (record --plant): {{PLANTED}}")
    print(f"op #{{INDEX}} {{OP}} (rank {{RANK}}): reference = CPU at "
          f"{{'the recorded dtypes from the recorded generator state' if RANDOM else 'float64'}}; "
          f"device run = {{a.device}} at the recorded dtypes")
    failed = False
    width = max(len("recorded vs reference:"), len(a.device + " run vs reference:"))
    for c in CHECKS:
        if "scalar" in c:
            got = pick(ref[0], ref[1], ref[2], c["where"])
            print(f"{{c['label']}} scalar: recorded {{c['scalar']!r}}, reference {{got!r}}")
            continue
        if "view" in c:
            v = pick(ref[0], ref[1], ref[2], c["where"])
            geo = {{"shape": list(v.shape), "stride": list(v.stride()), "offset": v.storage_offset()}}
            same = geo == c["view"]
            print(f"{{c['label']}}: shape {{geo['shape']}} stride {{geo['stride']}} offset {{geo['offset']}} - "
                  f"{{'as recorded' if same else 'RECORDED ' + str(c['view'])}}")
            failed |= not same
            continue
        rec = T_rec(c["tensor"])
        exact = RANDOM or KEEP_DTYPES
        own = None if same is None else pick(same[0], same[1], same[2], c["where"])
        print(f"{{c['label']}} {{rec.dtype}}{{list(rec.shape)}}:")
        line, over = describe(rec, pick(ref[0], ref[1], ref[2], c["where"]), c["limits"], exact, own)
        print(f"  {{'recorded vs reference:':<{{width}}}} {{line}}")
        failed |= over
        if mine is None:
            print(f"  {{a.device}} run: not run ({{why}})")
            continue
        theirs = pick(mine[0], mine[1], mine[2], c["where"])
        # the device run against the reference: the op's own error on this device, at its recorded dtype
        line, over = describe_against(pick(ref[0], ref[1], ref[2], c["where"]), theirs, rec.dtype, c["limits"], exact,
                                      own)
        print(f"  {{a.device + ' run vs reference:':<{{width}}}} {{line}}")
        failed |= over
        # and against what was recorded: does this device reproduce the recording (bit for bit, on its backend)?
        if isinstance(theirs, torch.Tensor) and tuple(theirs.shape) == tuple(rec.shape):
            n = mismatches(rec, theirs.detach().to("cpu", rec.dtype))
            # figures only: the recording is no reference to judge the device run by
            line, _ = figures(theirs.detach().to("cpu", rec.dtype), rec, c["limits"], exact)
            print(f"  {{a.device + ' run vs recorded:':<{{width}}}} {{line}}  ({{n}} of {{rec.numel()}} elements "
                  f"differ bit for bit)")
    return 1 if failed else 0


def describe_against(reference, value, dtype, limits, exact, same=None):
    """The device run (at the recorded dtype) measured against the reference, with eps of the recorded dtype."""
    if not isinstance(value, torch.Tensor):
        return f"returned {{type(value).__name__}}, not a tensor", True
    return describe(value.detach().to("cpu", dtype), reference, limits, exact, same)


if __name__ == "__main__":
    sys.exit(main())
'''
