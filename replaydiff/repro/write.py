"""A standalone repro of one recorded op for a kernel owner: ``DIR/repro.py``, ``DIR/repro.json`` and
``DIR/inputs.safetensors``.

The script is ``replaydiff/rebuild_and_judge.py`` copied as it is: it needs only torch and safetensors (no replaydiff,
no trace). The safetensors file holds the raw bytes of every storage version the op read or wrote (one uint8 tensor
each, read back with ``safetensors.torch.load_file``: no pickle) and the generator state of a random op; repro.json
says, as plain JSON, how each argument sits on its storage (dtype, shape, stride, offset, conj and neg bits), so views
and aliasing inside the op are rebuilt exactly as recorded, which results are compared (``compared_outputs``, the
list replay judges) and the limits replay applies. The script rebuilds, measures and judges tensors, under the
reference settings and with the graph targets replay allows, by the very definitions replay uses: they are the
script's module.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replaydiff import aten, rebuild_and_judge
from replaydiff.compare.tolerance import Tolerances, reduction_length
from replaydiff.errors import UsageError
from replaydiff.replay.compared import compared_outputs
from replaydiff.replay.unit_replay import Graph, Refused, flat, interpret, node_k
from replaydiff.trace.format import write_atomic_via
from replaydiff.trace.damage import describe_missing
from replaydiff.trace.reader import RankTrace, Trace
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.schema.units import NodeRef
from replaydiff.trace.schema.values import Opaque, TensorRef, encode_value, iter_refs

REPRO_FORMAT = rebuild_and_judge.FORMAT
SCRIPT = "repro.py"
DATA = rebuild_and_judge.DATA
INPUTS = rebuild_and_judge.INPUTS


@dataclass(frozen=True)
class ReproFiles:
    script: Path
    inputs: Path
    data: Path
    nbytes: int  # bytes of tensor data written


@dataclass(frozen=True)
class ReproOutcome:
    """What ``repro_op`` wrote, and the planted fault of the op's rank (said beside the files)."""

    files: ReproFiles
    planted: str | None
    op_name: str = ""
    custom_module: str | None = None  # the module the trace says defines the op, which the script never imports


def rank_damage(trace: Trace, rank: int | None = None) -> tuple[str, ...]:
    """One line per run of ops missing from the rank a repro reads (said before an op among them fails to read)."""
    return tuple(describe_missing(trace.rank(trace.ranks[0] if rank is None else rank).missing_ops))


def repro_op(trace: Trace, op_index: int, out_dir: str | Path, rank: int | None = None, force: bool = False,
             source_trace: str = "") -> ReproOutcome:
    """The repro verb: check the op and the directory (UsageError, one line, for what cannot be done), then write.

    ``force`` replaces a repro ``write_repro`` wrote in ``out_dir``, never a user's file of the same name."""
    rt = trace.rank(trace.ranks[0] if rank is None else rank)  # UsageError for a rank the trace does not hold
    if not 0 <= op_index < len(rt):
        raise UsageError(f"op {op_index} is not in rank {rt.rank} (ops 0..{len(rt) - 1})")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out_dir} is not a directory (a file is there)")
    existing = [p for p in (out / SCRIPT, out / DATA, out / INPUTS) if p.exists()]
    if existing and not force:
        raise UsageError(f"{existing[0]} exists; pass --force to overwrite it")
    foreign = [p for p in existing if not is_repro_file(p)]
    if foreign:
        raise UsageError(f"{foreign[0]} was not written by `replaydiff repro`: not overwriting it (move it or "
                         f"choose another -o)")
    beside = _importable_beside(out)
    if beside is not None:
        raise UsageError(f"{beside} is in -o {out_dir}: `python {out / SCRIPT}` would import it in place of an "
                         f"installed module (Python puts the script's directory first on sys.path); choose another "
                         f"directory")
    op = rt[op_index]
    files = write_repro(rt, op, out, source_trace=source_trace)
    module = rt.custom_ops.get(op.name)
    return ReproOutcome(files, rt.planted.describe() if rt.planted is not None else None, op.name,
                        module if module is not None and not module.startswith("torch.") else None)


def _importable_beside(out: Path) -> Path | None:
    """A file or package in ``out`` that Python would import from there (the script's directory comes first on
    sys.path), or None: a trace directory or a download folder may hold a ``torch.py`` of someone else's."""
    if not out.is_dir():
        return None
    for p in sorted(out.iterdir()):
        if p.name == SCRIPT:
            continue
        if p.suffix in (".py", ".pyc", ".so", ".pyd") or (p / "__init__.py").exists():
            return p
    return None


class _Collector:
    """Turns an op's recorded values into JSON for repro.json, gathering the tensors and storages they need."""

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
                             f"(recorded with --tensors stats/meta, a filter, --max-tensor-bytes or --budget, or "
                             f"the disk was full): no repro")
        else:
            skey = f"s{ref.version}"
            if skey not in self.storages:
                self.storages[skey] = self.trace.data(ref).clone()
            spec.update(storage=skey, stride=list(ref.stride or ()), offset=ref.offset, conj=ref.conj, neg=ref.neg)
        self.tensors[name] = spec
        self._names[key] = name
        return name

    def value(self, v: Any) -> Any:
        """An argument as JSON: lists and plain values as they are, the rest as {"tensor"|"dtype"|...: ...}
        (``rebuild_and_judge.Repro.value`` reads it back)."""
        if isinstance(v, TensorRef):
            return {"tensor": self.tensor(v, "in")}
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, Opaque):
            if v.kind == "generator":
                return {"generator": None}
            raise UsageError(f"op #{self.op.index} {self.op.name}: an argument of kind {v.kind!r} cannot be rebuilt")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (complex, torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return encode_value(v, _no_tensor)  # the trace's own markers ({"dtype": ...}), which the script reads
        raise UsageError(f"op #{self.op.index} {self.op.name}: an argument of type {type(v).__name__} cannot be "
                         f"rebuilt")


def _checks(c: _Collector, op: OpRecord, tol: Tolerances, recorded_dtypes: bool) -> list[dict]:
    """What the script compares (``compared_outputs``, as replay), with the limits replay applies to each."""
    in_shapes = [list(r.shape) for r in iter_refs(op.args)]
    packet = aten.packet(op.name)
    checks: list[dict] = []
    for x in compared_outputs(op, recorded_dtypes):
        check: dict[str, Any] = {"label": x.label, "where": list(x.where), "sizes": list(x.sizes)}
        geometry = x.geometry
        if geometry is not None:
            check["view"] = geometry
        elif not isinstance(x.recorded, TensorRef):
            check["scalar"] = x.recorded  # NaN/Inf as Python's json writes and reads them
        else:
            ref = x.recorded
            k = reduction_length(packet, in_shapes, max(1, math.prod(ref.shape)))
            lmax, lrel = tol.limit_for(ref.dtype, k)
            check.update(tensor=c.tensor(ref, "rec"), limits=[round(lmax, 6), round(lrel, 6)], k=k)
        checks.append(check)
    return checks


def is_repro_file(path: Path) -> bool:
    """Whether ``path`` is a repro's script, description or inputs as ``write_repro`` wrote them (so --force may
    replace it)."""
    try:
        if path.name == DATA:
            with open(path, encoding="utf-8") as fh:
                return json.load(fh).get("format") == REPRO_FORMAT
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
    """Write ``out_dir/repro.py``, ``repro.json`` and ``inputs.safetensors`` for ``op``; UsageError if it cannot run
    alone."""
    name = op.name
    if not op.recorded:
        raise UsageError(f"op #{op.index} was not recorded ({op.not_recorded_reason})")
    if aten.is_collective(name):
        raise UsageError(f"op #{op.index} {name} is a collective: it cannot run alone (replay checks it across ranks)")
    if aten.is_marker(name):
        raise UsageError(f"op #{op.index} {name} is a profiler marker: it computes nothing")
    if aten.is_unit(name):
        return _write_unit_repro(trace, op, out_dir, source_trace, tolerances or Tolerances())
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
    args = [c.value(a) for a in op.args]
    kwargs = {k: c.value(v) for k, v in op.kwargs.items()}
    tol = tolerances or Tolerances()
    keep_dtypes = seeded or name in aten.DTYPE_EXACT_OPS  # replay's choice at its default precision
    checks = _checks(c, op, tol, recorded_dtypes=keep_dtypes)
    rng_device = None
    tensors = dict(c.storages)
    if seeded:
        if op.rng is None:
            raise UsageError(f"op #{op.index} {name} is random but its generator state was not recorded")
        tensors["rng_state"] = trace.rng_state(op.rng).contiguous()
        rng_device = op.rng.device
    data = {
        "format": REPRO_FORMAT,
        "about": _docstring(trace, op, source_trace).splitlines(),
        "op": name, "index": op.index, "rank": trace.rank,
        # a random op: replayed at its recorded dtypes from the recorded generator state, compared exactly
        "random": seeded, "keep_dtypes": keep_dtypes, "rng_device": rng_device,
        "custom_module": trace.custom_ops.get(name),  # the Python module that defined a custom op when recorded
        "planted": trace.planted.describe() if trace.planted is not None else None,
        # An ill-conditioned op's output may err this many times the op's own error at its recorded dtype.
        "factor": tol.conditioning_factor,
        # Each tensor argument (in*) and recorded result (rec*): its dtype, and where it sits on a stored storage
        # (uint8 bytes in inputs.safetensors under "storage"): shape, stride, offset, conj and neg bits.
        "tensors": c.tensors,
        "args": args, "kwargs": kwargs,
        # What is compared (where in a run, as rebuild_and_judge.pick reads it) and the limits replay applies.
        "checks": checks,
    }
    return _write(out_dir, trace, op, data, tensors)


def _write(out_dir: str | Path, trace: RankTrace, op: OpRecord, data: dict, tensors: dict[str, torch.Tensor]
           ) -> ReproFiles:
    """The three files of a repro: the tensors, repro.json and the script (rebuild_and_judge.py as it is)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs = out / INPUTS
    meta = {"format": REPRO_FORMAT, "op": op.name, "index": str(op.index), "rank": str(trace.rank)}
    write_atomic_via(inputs, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                                                   metadata=meta))
    data_file = out / DATA
    data_file.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    script = out / SCRIPT
    script.write_text(Path(rebuild_and_judge.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    return ReproFiles(script, inputs, data_file, sum(t.numel() for t in tensors.values()))


def _write_unit_repro(trace: RankTrace, op: OpRecord, out_dir: str | Path, source_trace: str, tol: Tolerances
                      ) -> ReproFiles:
    """A compiled unit's repro: its graph as the node list in repro.json (the script builds an FX graph from it,
    resolving each target by name among aten/prims ops and ``operator`` functions), its recorded inputs, constants
    and outputs; the script runs the graph eagerly at float64 (the reference) and at the recorded dtypes (the
    graph's own error), and compiled with the recorded backend at the recorded dtypes, and judges as replay does."""
    info = op.unit
    if info is None or info.note or not info.nodes:
        raise UsageError(f"op #{op.index} {op.name} is a compiled unit without a stored graph "
                         f"({info.note if info else 'none stored'}): no repro")
    try:
        g = Graph(info)  # every target resolvable among aten/prims ops and the allowed operators, or refused
    except Refused as exc:
        raise UsageError(f"op #{op.index} {op.name}: the unit's graph cannot be rebuilt ({exc})") from None
    c = _Collector(trace, op)

    def node_value(v: Any) -> Any:
        if isinstance(v, NodeRef):
            return {"node": v.index}
        if isinstance(v, list):
            return [node_value(x) for x in v]
        return c.value(v)

    nodes = [{"kind": n.kind, "name": n.name, "target": n.target, "args": node_value(n.args),
              "kwargs": {k: node_value(v) for k, v in n.kwargs.items()}, "module": n.module} for n in info.nodes]
    args = [c.value(a) for a in op.args]
    consts = [c.value(x) for x in info.consts]
    # The limits replay applies: the longest sum behind any node (the graph run once at its recorded dtypes here)
    ks = [1]

    def convert(v: Any) -> Any:
        if isinstance(v, TensorRef):
            return trace.tensor(v, copy=True)
        if isinstance(v, Opaque):
            raise UsageError(f"op #{op.index} {op.name}: an argument of kind {v.kind!r} cannot be rebuilt")
        return v

    unscaled = None
    try:
        interpret(g, [convert(a) for a in op.args], [convert(x) for x in info.consts], convert,
                  lambda i, n, out, a, kw: ks.append(node_k(n, out, a, kw)))
    except UsageError:
        raise
    except Exception as exc:  # the script still runs the graph; its limits are then those of no long sum
        unscaled = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
    k = max(ks)
    random, behind = g.random_nodes(), g.output_nodes()
    outputs = [x for x in flat(op.outputs)]
    checks: list[dict] = []
    left_out: list[str] = []
    for pos, ref in enumerate(outputs):
        if not isinstance(ref, TensorRef) or not ref.stored or ref.uninitialised:
            continue
        if pos < len(behind) and behind[pos] in random:
            left_out.append(f"output {pos} (depends on random node {random[behind[pos]]})")
            continue
        lmax, lrel = tol.limit_for(ref.dtype, k)
        checks.append({"label": f"output {pos}", "where": ["out", pos], "sizes": [len(outputs)],
                       "tensor": c.tensor(ref, "rec"), "limits": [round(lmax, 6), round(lrel, 6)], "k": k})
    about = _docstring(trace, op, source_trace).splitlines()
    about.append(f"Compiled unit: {info.kind} graph {info.graph_id} of {info.region}, compiled by {info.backend} "
                 f"({len(info.calls())} nodes; kernels {', '.join(info.kernels) or 'not named'}).")
    if left_out:
        about.append("Not compared (drawn by the backend's own generator, which cannot be drawn again): "
                     + ", ".join(left_out) + ".")
    if unscaled is not None:
        about.append(f"Limits not scaled for long sums: the graph did not run where the repro was written "
                     f"({unscaled}).")
    if g.mutated_inputs():
        about.append("Inputs the graph writes in place are not compared (only its outputs).")
    data = {
        "format": REPRO_FORMAT, "about": about, "op": op.name, "index": op.index, "rank": trace.rank,
        "random": False, "keep_dtypes": False, "rng_device": None, "custom_module": None,
        "planted": trace.planted.describe() if trace.planted is not None else None,
        "factor": tol.conditioning_factor,
        "tensors": c.tensors, "args": args, "kwargs": {},
        # The graph as data: nodes in order; an argument {"node": i} is node i's value, targets are op names.
        "unit": {"backend": info.backend, "region": info.region, "kind": info.kind, "nodes": nodes,
                 "consts": consts},
        "checks": checks,
    }
    return _write(out_dir, trace, op, data, dict(c.storages))


def _docstring(trace: RankTrace, op: OpRecord, source_trace: str) -> str:
    try:  # where every report places it (trace/location.py)
        loc = trace.location(op)
        where = ", ".join(x for x in (loc.module, loc.phase_text, loc.source, loc.origin()) if x)
    except Exception:  # a damaged chunk elsewhere: the op's own fields
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


def _no_tensor(t: torch.Tensor) -> dict:
    raise AssertionError("tensor arguments are TensorRefs here")  # encode_value is only given plain values
