#!/usr/bin/env python3
# replaydiff.repro/1: written by `replaydiff repro`, whose --force replaces it
"""Standalone repro of one recorded op, for a kernel owner: needs only torch and safetensors (no replaydiff).

    python repro.py [--device cuda] [--import MODULE]

``replaydiff repro`` copies this module, unchanged, as ``DIR/repro.py`` next to ``DIR/repro.json`` (the op: its
name, how each argument sits on its storage, what is compared and the limits replay applies; plain JSON) and
``DIR/inputs.safetensors`` (the raw bytes of every storage version the op read or wrote, and a random op's
generator state). It runs the op on --device at its recorded dtypes and on the CPU at float64 (a random op: at its
recorded dtypes, from its recorded generator state, compared exactly), and prints the error of the recorded output
and of the device run against that reference, in the units of `replaydiff replay`: max_abs/(eps*absmax) and
rel_l2/eps, eps being the recorded dtype's machine epsilon, with the limits replay applies, and replay's verdict: an
output over those limits is still ok when the op run at its recorded dtypes on the CPU errs as much itself (within
FACTOR times: the op is ill-conditioned). Exit code 1 when the recorded output or the device run is divergent, as
replay judges it, 4 when --device is not available here.

A compiled unit (one call of a torch.compile graph) is described by its graph: repro.json's "unit" holds the node
list (each node's kind, name, target op name and arguments, {"node": i} naming an earlier node's value). The script
builds an FX graph from that list, resolving each target by name among aten and prims ops and the ``operator``
module's built-in functions only, runs it eagerly on the CPU at float64 (the reference) and at the recorded dtypes
(its own error), and compiled with the recorded backend on --device at the recorded dtypes (the device run).

This file is also the one definition of what the script shares with replaydiff, so that it cannot rebuild or judge
otherwise than replay: how a stored tensor is rebuilt over its storage's bytes (``typed_storage``,
``as_recorded``), how a result is picked out of an op's outputs and arguments (``pick``), and the verdict's pure
judging functions (``how_far_over``, ``calibrated_limits``, ``ill_conditioned_note``, ``same_scalar``). replaydiff's
trace reader, replayer and verdicts import them from here; so this module imports nothing but the standard library,
torch and (when run) safetensors.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import operator
import os
import sys
import types
from typing import Any

import torch

FORMAT = "replaydiff.repro/1"
DATA = "repro.json"  # the op's description, next to this script
INPUTS = "inputs.safetensors"


# -- rebuilding a stored tensor (the one definition: trace reader, replayer and this script) ---------------------
def typed_storage(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A storage's raw bytes (a flat uint8 tensor) as elements of ``dtype``: a view, trailing partial element
    dropped. Views of one storage are then taken of one such base, so they alias each other as when recorded."""
    n = raw.numel() - raw.numel() % dtype.itemsize
    return raw[:n].view(dtype)


def as_recorded(base: torch.Tensor, shape: Any, stride: Any, offset: int, conj: bool = False,
                neg: bool = False) -> torch.Tensor:
    """The tensor as recorded over its storage's elements ``base``: its size, stride and offset, and its conj and
    neg bits (the stored bytes are the values without them; the bits are lazy, as they were when recorded)."""
    t = base.as_strided(shape, stride, offset)
    if conj:
        t = t.conj()
    if neg:
        t = torch._neg_view(t)
    return t


def pick(result: Any, args: Any, kwargs: Any, where: Any, sizes: Any = None) -> Any:
    """The value at ``where`` of one run of an op: ("out", i...) in its result, ("arg", n, i...) or
    ("kwarg", name, i...) among its (written) arguments; the i are list positions. ``sizes``: the recorded length
    of each list stepped into (a run returning another structure is an error, not a silent index into a tensor)."""
    kind, rest = where[0], list(where[1:])
    if kind == "out":
        v = result
    else:
        v = args[rest[0]] if kind == "arg" else kwargs.get(rest[0])
        rest = rest[1:]
    for n, i in enumerate(rest):
        size = sizes[n] if sizes is not None else None
        if size is not None and (not isinstance(v, (list, tuple)) or len(v) != size):
            raise RuntimeError(f"op returned {type(v).__name__} where {size} values were recorded")
        v = v[i]
    return v


# -- the verdict's pure judging functions (replaydiff.compare.verdict imports them from here) ----------------------
def how_far_over(errors: tuple[float, float], limits: tuple[float, float]) -> float:
    """How far a pair of errors is over its pair of limits, in units of the limits: the larger ratio (1.0 is at the
    limit). An error over a zero limit, or one that is NaN, is infinitely far."""
    worst = 0.0
    for error, limit in zip(errors, limits):
        if error != error:  # NaN
            return math.inf
        worst = max(worst, error / limit if limit > 0 else (0.0 if error == 0 else math.inf))
    return worst


def calibrated_limits(own: tuple[float, float], ill: bool, factor: float) -> tuple[float, float] | None:
    """The limits on (max_abs, rel_l2) of an ill-conditioned op: ``factor`` times its own error at its recorded
    dtype (the op run there, against the same reference). None for an op whose own error is within the fixed
    limits (``ill`` False): it keeps those, or its rounding would hide a fault a few times that size."""
    return (factor * own[0], factor * own[1]) if ill else None


def ill_conditioned_note(dtype: str, own: tuple[float, float], error: tuple[float, float], factor: float) -> str:
    """Why an output over the fixed limits is ok: it is within ``factor`` times the op's own error at ``dtype``."""
    return (f"within its own {dtype} error (ill-conditioned: the op run at {dtype} is off by max_abs {own[0]:.3g}, "
            f"rel_l2 {own[1]:.3g}; the recorded output by {error[0]:.3g}, {error[1]:.3g}, within {factor:g}x that)")


def same_scalar(recorded: Any, reference: Any) -> bool:
    """A scalar output equals its recorded value (NaN equals NaN)."""
    if isinstance(recorded, float) and isinstance(reference, float) and recorded != recorded \
            and reference != reference:
        return True
    return bool(recorded == reference)


# -- the script ---------------------------------------------------------------------------------------------------
UPCAST = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
          torch.complex32: torch.complex128, torch.complex64: torch.complex128}


class Repro:
    """One op as ``replaydiff repro`` described it in repro.json, with its stored bytes."""

    def __init__(self, data: dict, storages: dict[str, torch.Tensor]) -> None:
        self.data = data
        self.storages = storages
        self.random = bool(data["random"])  # replayed at its recorded dtypes from the recorded generator state
        self.keep_dtypes = bool(data["keep_dtypes"])
        self.explicit_generator = _uses_generator([data["args"], list(data["kwargs"].values())])

    def op(self) -> Any:
        ns, packet, overload = self.data["op"].split(".")
        return getattr(getattr(getattr(torch.ops, ns), packet), overload)

    def tensors(self, device: str, upcast: bool):
        """T(name): the tensor named in repro.json on ``device`` (at float64 if ``upcast``), one base per storage."""
        bases: dict = {}

        def target(dt):
            return UPCAST.get(dt, dt) if upcast else dt

        def T(name):
            s = self.data["tensors"][name]
            dt = getattr(torch, s["dtype"])
            if s.get("zeros"):
                return torch._efficientzerotensor(s["shape"], dtype=target(dt), device=device)
            if s.get("meta"):
                return torch.empty_strided(s["shape"], s["stride"], dtype=dt, device="meta")
            key = (s["storage"], s["dtype"])
            if key not in bases:  # one base per storage: views of one storage alias each other, as when recorded
                bases[key] = typed_storage(self.storages[s["storage"]], dt).to(device=device, dtype=target(dt),
                                                                                copy=True)
            return as_recorded(bases[key], s["shape"], s["stride"], s["offset"], s["conj"], s["neg"])

        return T, target

    def value(self, v: Any, T: Any, target: Any, device: str, gen: Any) -> Any:
        """An argument from its JSON form: lists, plain values, and {"tensor"|"dtype"|"device"|...: ...}."""
        if isinstance(v, list):
            return [self.value(x, T, target, device, gen) for x in v]
        if not isinstance(v, dict):
            return v
        (kind, x), = v.items()
        if kind == "tensor":
            return T(x)
        if kind == "dtype":
            return target(getattr(torch, x))
        if kind == "device":
            return torch.device(x) if x == "meta" else torch.device(device)
        if kind in ("layout", "memory_format"):
            return getattr(torch, x)
        if kind == "complex":
            return complex(x[0], x[1])
        if kind == "generator":
            return gen
        raise ValueError(f"{DATA}: unknown argument kind {kind!r}")

    def run(self, device: str, upcast: bool, compiled: bool = False) -> tuple:
        """(result, args, kwargs) of one run of the op on ``device``, at float64 if ``upcast``; a compiled unit's
        graph is run eagerly, or ``compiled`` with its recorded backend (its result: the flat list of outputs)."""
        if "unit" in self.data:
            return self.run_unit(device, upcast, compiled)
        T, target = self.tensors(device, upcast)
        gen = None
        if self.random and self.explicit_generator:
            gen = torch.Generator(device=device)
            gen.set_state(self.storages["rng_state"].clone())
        args = [self.value(a, T, target, device, gen) for a in self.data["args"]]
        kwargs = {k: self.value(v, T, target, device, gen) for k, v in self.data["kwargs"].items()}
        if self.random and not self.explicit_generator:  # it drew from the device's default generator: restore it
            dev = torch.device(device)
            with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev]):
                if dev.type == "cpu":
                    torch.set_rng_state(self.storages["rng_state"].clone())
                else:
                    torch.cuda.set_rng_state(self.storages["rng_state"].clone(), dev)
                return self.op()(*args, **kwargs), args, kwargs
        return self.op()(*args, **kwargs), args, kwargs


    # -- a compiled unit: its graph rebuilt from the node list in repro.json ---------------------------------------
    def graph(self, T: Any, target: Any, device: str) -> torch.fx.GraphModule:
        """The unit's graph as an FX graph built from repro.json's node list (inputs, constants as buffers, one call
        per node by its target's name, the output); constant arguments as ``value`` reads them."""
        root = torch.nn.Module()
        g = torch.fx.Graph()
        env: list = []

        def arg(v: Any) -> Any:
            if isinstance(v, list):
                return [arg(x) for x in v]
            if isinstance(v, dict) and set(v) == {"node"}:
                return env[v["node"]]
            return self.value(v, T, target, device, None)

        unit = self.data["unit"]
        for n in unit["nodes"]:
            kind = n["kind"]
            if kind == "input":
                env.append(g.placeholder(f"in{len(env)}"))
            elif kind == "const":
                name = f"const{n['target']}"
                value = arg(unit["consts"][int(n["target"])])
                if isinstance(value, torch.Tensor):
                    root.register_buffer(name, value)
                    env.append(g.get_attr(name))
                else:
                    env.append(value)
            elif kind == "call":
                env.append(g.call_function(graph_target(n["target"]), tuple(arg(n["args"])),
                                           {k: arg(v) for k, v in n["kwargs"].items()}))
            elif kind == "output":
                env.append(None)
                g.output(arg(n["args"][0] if n["args"] else []))
            else:
                raise ValueError(f"{DATA}: node {n['name']} is of unknown kind {kind!r}")
        return torch.fx.GraphModule(root, g)

    def run_unit(self, device: str, upcast: bool, compiled: bool) -> tuple:
        T, target = self.tensors(device, upcast)
        args = [self.value(a, T, target, device, None) for a in self.data["args"]]
        fn: Any = self.graph(T, target, device)
        if compiled:
            torch._dynamo.reset()  # a fresh compile of this graph, not one cached by an earlier run
            fn = torch.compile(fn, backend=self.data["unit"]["backend"] or "inductor", dynamic=False)
        with torch.no_grad():
            out = fn(*args)
        return list(_flat(out)), args, {}


def graph_target(name: str) -> Any:
    """A graph node's target by its name: an aten or prims op, or a built-in function of the ``operator`` module
    (getitem, arithmetic on sizes). Nothing else is looked up: the graph is data, never code to run."""
    ns, _, rest = name.partition(".")
    if ns in ("aten", "prims"):
        packet, _, overload = rest.partition(".")
        return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")
    if ns == "operator":
        f = getattr(operator, rest, None)
        if isinstance(f, types.BuiltinFunctionType) and not rest.startswith("_"):
            return f
    raise ValueError(f"{DATA}: node target {name!r} is not an aten or prims op or an operator function")


def _flat(v: Any) -> list:
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _flat(item)]
    return [v]


def _uses_generator(v: Any) -> bool:
    if isinstance(v, list):
        return any(_uses_generator(x) for x in v)
    return isinstance(v, dict) and "generator" in v


def error(rec: torch.Tensor, ref: torch.Tensor) -> dict:
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
    return {"norm_max": norm_max, "norm_rel": rel / eps, "max_abs": max_abs, "rel_l2": rel,
            "nonfinite_mismatch": int(bad.sum())}


def mismatches(rec: torch.Tensor, ref: torch.Tensor) -> int:
    ref = ref.detach().to("cpu")
    if ref.dtype != rec.dtype:
        ref = ref.to(rec.dtype)
    same = rec == ref
    if rec.is_floating_point() or rec.is_complex():
        same = same | (torch.isnan(rec) & torch.isnan(ref))
    return int(same.numel() - int(same.sum()))


def same_nonfinite(rec: torch.Tensor, same: Any) -> bool:
    """The op run at its recorded dtypes makes exactly the recorded NaN/Inf itself (replay then judges the rest)."""
    if not isinstance(same, torch.Tensor) or tuple(same.shape) != tuple(rec.shape):
        return False
    same = same.detach().to("cpu", rec.dtype)
    a, b = ~torch.isfinite(rec), ~torch.isfinite(same)
    return bool(torch.equal(a, b)) and mismatches(rec[a], same[b]) == 0


def figures(rec: torch.Tensor, value: Any, limits: list, exact: bool) -> tuple[str, Any]:
    """One line in replay's units, and the measures behind it: (line, None) when it cannot be judged by them (not
    a tensor, another shape: divergent), (line, count of mismatches) for an exact comparison, (line, error dict)."""
    if not isinstance(value, torch.Tensor):
        return f"returned {type(value).__name__}, not a tensor", None
    if tuple(value.shape) != tuple(rec.shape):
        return f"shape {list(value.shape)} != recorded {list(rec.shape)}", None
    if exact or not (rec.is_floating_point() or rec.is_complex()):
        n = mismatches(rec, value)
        return f"mismatches {n} of {rec.numel()} (compared exactly)", n
    e = error(rec, value)
    line = (f"max_abs/(eps*absmax) {e['norm_max']:.3g} (limit {limits[0]:.3g})  rel_l2/eps {e['norm_rel']:.3g} "
            f"(limit {limits[1]:.3g})  max_abs {e['max_abs']:.3g}  rel_l2 {e['rel_l2']:.3g}")
    if e["nonfinite_mismatch"]:
        line += f"  {e['nonfinite_mismatch']} NaN/Inf mismatches"
    return line, e


def describe(rec: torch.Tensor, value: Any, limits: list, exact: bool, factor: float,
             same: Any = None) -> tuple[str, bool]:
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
        own_limits = calibrated_limits((own["max_abs"], own["rel_l2"]), ill, factor)
        if own_limits is not None:
            severity = how_far_over((e["max_abs"], e["rel_l2"]), own_limits)
        if severity <= 1:
            why = ill_conditioned_note(str(rec.dtype).removeprefix("torch."), (own["max_abs"], own["rel_l2"]),
                                       (e["max_abs"], e["rel_l2"]), factor)
        else:
            why = (f"{e['max_abs'] / own['max_abs']:.3g}x the op's own error at its recorded dtype"
                   if own["max_abs"] else "while the op itself is exact at its recorded dtype")
    return line + ("  DIVERGENT" if severity > 1 else "  ok") + (f" - {why}" if why else ""), severity > 1


def describe_against(reference: Any, value: Any, dtype: torch.dtype, limits: list, exact: bool, factor: float,
                     same: Any = None) -> tuple[str, bool]:
    """The device run (at the recorded dtype) measured against the reference, with eps of the recorded dtype."""
    if not isinstance(value, torch.Tensor):
        return f"returned {type(value).__name__}, not a tensor", True
    return describe(value.detach().to("cpu", dtype), reference, limits, exact, factor, same)


def main(argv: list[str] | None = None, directory: str | None = None) -> int:
    """Run the repro in ``directory`` (default: the one this file is in); the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="device to run the op on (default cpu), e.g. cuda or cuda:1")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (the one that defines a custom op)")
    a = p.parse_args(argv)
    try:  # a device this torch lacks is one line, not torch.cuda's AssertionError from deep inside the run
        torch.empty(0, device=a.device)
    except Exception as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"repro.py: device {a.device!r} is not available here: {why}", file=sys.stderr)
        return 4
    from safetensors.torch import load_file

    here = directory or os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, DATA), encoding="utf-8") as fh:
        data = json.load(fh)
    name, custom = data["op"], data.get("custom_module")
    for m in a.imports or ([custom] if custom and name.split(".")[0] != "aten" else []):
        sys.path.insert(0, os.getcwd())
        importlib.import_module(m)
    with reference_settings():
        return _report(a.device, data, Repro(data, load_file(os.path.join(here, INPUTS))))


@contextlib.contextmanager
def reference_settings():
    """The settings replay runs references under (deterministic algorithms, no TF32, float32 matmuls at full
    precision), put back as they were afterwards: a test that imports this module and runs it keeps its own."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]
        torch.set_float32_matmul_precision(saved[4])


def _report(device: str, data: dict, r: Repro) -> int:
    """Run the op as ``main`` asked and print what it finds; the exit code."""
    name, factor = data["op"], data["factor"]
    T_rec = r.tensors("cpu", False)[0]
    upcast = not (r.random or r.keep_dtypes)
    rng_device = data.get("rng_device")
    with torch.inference_mode():
        ref = r.run("cpu", upcast)
        # the op's own error at its recorded dtypes, as replay measures it (on the CPU): an ill-conditioned op's limit
        same = r.run("cpu", False) if upcast else None
        dev = torch.device(device)
        if r.random and rng_device and torch.device(rng_device).type != dev.type:
            mine, why = None, f"a random op recorded on {rng_device}: its draw can only be redone there"
        else:
            mine, why = r.run(device, False, compiled=True), None
    if data.get("planted"):
        print(f"PLANTED FAULT (record --plant): {data['planted']}")
    unit = data.get("unit")
    if unit is not None:
        print(f"unit #{data['index']} {name} (rank {data['rank']}) of {unit['region']}: reference = its graph run "
              f"eagerly on the CPU at float64; device run = the graph compiled with {unit['backend']} on {device} "
              f"at the recorded dtypes")
    else:
        print(f"op #{data['index']} {name} (rank {data['rank']}): reference = CPU at "
              f"{'the recorded dtypes from the recorded generator state' if r.random else 'float64'}; "
              f"device run = {device} at the recorded dtypes")
    failed = False
    width = max(len("recorded vs reference:"), len(device + " run vs reference:"))
    for c in data["checks"]:
        where, sizes = c["where"], c.get("sizes")
        got = pick(*ref, where, sizes)
        if "scalar" in c:
            ok = same_scalar(c["scalar"], got)
            print(f"{c['label']} scalar: recorded {c['scalar']!r}, reference {got!r}"
                  f"{'' if ok else '  DIVERGENT'}")
            failed |= not ok
            continue
        if "view" in c:  # a view of an input (shape, stride, offset) or a meta tensor (shape, stride)
            geo = {"shape": list(got.shape), "stride": list(got.stride()), "offset": got.storage_offset()}
            ok = {k: geo[k] for k in c["view"]} == c["view"]
            print(f"{c['label']}: shape {geo['shape']} stride {geo['stride']} offset {geo['offset']} - "
                  f"{'as recorded' if ok else 'RECORDED ' + str(c['view'])}")
            failed |= not ok
            continue
        rec = T_rec(c["tensor"])
        exact = r.random or r.keep_dtypes
        own = None if same is None else pick(*same, where, sizes)
        print(f"{c['label']} {rec.dtype}{list(rec.shape)}:")
        line, over = describe(rec, got, c["limits"], exact, factor, own)
        print(f"  {'recorded vs reference:':<{width}} {line}")
        failed |= over
        if mine is None:
            print(f"  {device} run: not run ({why})")
            continue
        theirs = pick(*mine, where, sizes)
        # the device run against the reference: the op's own error on this device, at its recorded dtype
        line, over = describe_against(got, theirs, rec.dtype, c["limits"], exact, factor, own)
        print(f"  {device + ' run vs reference:':<{width}} {line}")
        failed |= over
        # and against what was recorded: does this device reproduce the recording (bit for bit, on its backend)?
        if isinstance(theirs, torch.Tensor) and tuple(theirs.shape) == tuple(rec.shape):
            n = mismatches(rec, theirs.detach().to("cpu", rec.dtype))
            # figures only: the recording is no reference to judge the device run by
            line, _ = figures(theirs.detach().to("cpu", rec.dtype), rec, c["limits"], exact)
            print(f"  {device + ' run vs recorded:':<{width}} {line}  ({n} of {rec.numel()} elements "
                  f"differ bit for bit)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
