"""Shared helpers for the replay tests: small seeded training steps, recording with a planted fault, a per-process
cache of recorded traces and replay reports, and questions asked of a trace (where did a fault land?).

Traces are recorded once per test process into one temporary directory (removed at exit) and shared between test
modules: recording and replaying are the expensive parts of this battery.

Expected op numbers are never written down: they are read back from the trace (the ``occurrence``-th op of a name,
counted from 0, is the op a PlantedFault with call=occurrence + 1 perturbed, since the fault mode and the recorder see
the same ops).
"""
from __future__ import annotations

import atexit
import contextlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from replaydiff.faults import PlantedFault
from replaydiff.models import TinyCNN, TinyTransformer, make_step
from replaydiff.models.tiny import TransformerConfig
from replaydiff.record import record
from replaydiff.replay import OpResult, ReplayOptions, ReplayReport, Status, replay_trace
from replaydiff.trace import OpRecord, iter_refs, open_trace

# The brief's reference step shrunk in width, sequence and batch (same layers, heads, dropout and op mix): replay
# cost is dominated by the number of ops and the bytes per op, and this keeps every op while cutting the bytes.
SMALL = TransformerConfig(vocab=64, d_model=32, heads=4, layers=2, seq=16, batch=4)
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


class TinyMLP(nn.Module):
    """Two linear layers: a step of ~50-80 ops, for the tests where only the optimizer's ops matter."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)

    @staticmethod
    def example_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


# -- steps ------------------------------------------------------------------------------------------------------
def transformer_step(autocast_dtype: torch.dtype | None = None, **adamw: Any) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **adamw)
    return make_step(model, model.example_batch(), opt, autocast_dtype=autocast_dtype)


def cnn_step() -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = TinyCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return make_step(model, model.example_batch(), opt)


def mlp_step(**adamw: Any) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **adamw)
    return make_step(model, model.example_batch(), opt)


STEPS: dict[str, Callable[[], Callable[[], torch.Tensor]]] = {
    "transformer": transformer_step,
    "transformer_bf16": partial(transformer_step, autocast_dtype=torch.bfloat16),
    "cnn": cnn_step,
    "mlp": mlp_step,  # plain CPU AdamW: the for-loop path
    "mlp_forloop": partial(mlp_step, foreach=False),
    "mlp_foreach": partial(mlp_step, foreach=True),
    "mlp_fused": partial(mlp_step, fused=True),
}


# -- recording --------------------------------------------------------------------------------------------------
def record_fn(path: str | Path, fn: Callable[[], Any], fault: PlantedFault | None = None,
              **record_kw: Any) -> Path:
    """Record ``fn()``; the fault (if any) is entered first so that it sits below the recorder."""
    with contextlib.ExitStack() as stack:
        if fault is not None:
            stack.enter_context(fault)
        stack.enter_context(record(path, **record_kw))
        fn()
    if fault is not None:
        assert fault.planted, f"the step never ran {fault.op} (call {fault.call}): nothing was planted"
    return Path(path)


DDP_STEP = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    from replaydiff import record
    from replaydiff.faults import PlantedFault
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters())
    torch.manual_seed(dist.get_rank())
    x = torch.randn(4, 8)
    fault_rank = int(sys.argv[2])
    with PlantedFault("c10d.allreduce_.default", rel=1e-3, rank=fault_rank), record(sys.argv[1]):
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        t = torch.arange(3, dtype=torch.float32) + dist.get_rank()
        dist.all_reduce(t)
        out = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(out, torch.ones(2) * dist.get_rank())
    dist.barrier()  # gloo aborts a rank that destroys its group while the other still talks to it
    dist.destroy_process_group()
''')


def record_ddp_step(directory: Path, fault_rank: int) -> Path:
    """DDP_STEP run by torchrun on two gloo ranks, ``fault_rank``'s all-reduce corrupted: the trace
    ``directory/trace``."""
    script = directory / "ddp_step.py"
    script.write_text(DDP_STEP)
    trace = directory / "trace"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    subprocess.run(torchrun + [str(script), str(trace), str(fault_rank)], check=True, capture_output=True,
                   timeout=120)
    return trace


_dir: Path | None = None
_traces: dict[tuple, Path] = {}
_reports: dict[tuple, ReplayReport] = {}


def cache_dir() -> Path:
    global _dir
    if _dir is None:
        _dir = Path(tempfile.mkdtemp(prefix="replaydiff-replay-tests-"))
        atexit.register(shutil.rmtree, _dir, True)
    return _dir


def step_trace(step: str, fault_op: str | None = None, rel: float = 1e-3, occurrence: int = 0) -> Path:
    """The trace of one step from STEPS, with an optional planted fault; recorded once per process."""
    key = (step, fault_op, rel, occurrence)
    path = _traces.get(key)
    if path is None:
        path = cache_dir() / f"trace{len(_traces)}"
        fault = PlantedFault(fault_op, rel=rel, call=occurrence + 1) if fault_op else None
        record_fn(path, STEPS[step](), fault)
        _traces[key] = path
    return path


def replay(path: str | Path, workers: int = 1, **opts: Any) -> ReplayReport:
    """replay_trace on the CPU; reports for plain options (no Tolerances object) are cached per process."""
    cacheable = all(isinstance(v, (int, float, str, type(None))) for v in opts.values())
    key = (str(path), workers, tuple(sorted(opts.items())))
    if cacheable and key in _reports:
        return _reports[key]
    report = replay_trace(str(path), ReplayOptions(device="cpu", **opts), workers=workers)
    if cacheable:
        _reports[key] = report
    return report


def replay_trace_uncached(path: str | Path, workers: int = 1, **opts: Any) -> ReplayReport:
    """replay_trace on the CPU, never cached (for tests that patch the replayer or change global settings)."""
    return replay_trace(str(path), ReplayOptions(device="cpu", **opts), workers=workers)


# -- reading a trace --------------------------------------------------------------------------------------------
def trace_ops(path: str | Path, rank: int = 0) -> list[OpRecord]:
    return list(open_trace(path).rank(rank))


def occurrence_index(ops: list[OpRecord], name: str, occurrence: int = 0) -> int:
    """The op number of the ``occurrence``-th call of ``name``: where a PlantedFault with that occurrence landed."""
    hits = [op.index for op in ops if op.name == name]
    assert len(hits) > occurrence, f"{name} occurs {len(hits)} times in the trace, not {occurrence + 1}"
    return hits[occurrence]


def first_in_phase(ops: list[OpRecord], names: tuple[str, ...] | list[str], phase: str,
                   dtype: str | None = None) -> tuple[str, int, int]:
    """(name, occurrence, op number) of the first op named one of ``names`` in ``phase`` (with a ``dtype`` output)."""
    seen: dict[str, int] = {}
    for op in ops:
        name = op.name
        if name not in names:
            continue
        occ = seen.get(name, 0)
        seen[name] = occ + 1
        if op.phase == phase and (dtype is None or output_dtypes(op) == {dtype}):
            return name, occ, op.index
    raise AssertionError(f"no op among {names} in phase {phase}" + (f" with {dtype} outputs" if dtype else ""))


def output_dtypes(op: OpRecord) -> set[str]:
    return {r.dtype for r in iter_refs([op.outputs, [after for _, after in op.writes]])}


def input_versions(op: OpRecord) -> set:
    return {r.version for r in op.inputs()}


def by_status(report: ReplayReport, status: Status) -> list[OpResult]:
    return [r for r in report.ops if r.status is Status(status)]


def result_at(report: ReplayReport, index: int, rank: int = 0) -> OpResult:
    hits = [r for r in report.ops if r.index == index and r.rank == rank]
    assert len(hits) == 1, f"op #{index} appears {len(hits)} times in the report"
    return hits[0]


def describe(results: list[OpResult], limit: int = 8) -> str:
    """A short listing for assertion messages."""
    return "; ".join(f"#{r.index} {r.op} {r.status}: {r.reason}" for r in results[:limit]) + \
        (f" (+{len(results) - limit} more)" if len(results) > limit else "")


def assert_only_culprit(report: ReplayReport, index: int) -> None:
    """The planted op is the first divergent op and no other op diverged; nothing failed to replay."""
    divergent = by_status(report, Status.DIVERGENT)
    assert report.first_divergent is not None, "the planted fault was not found"
    assert report.first_divergent.index == index, \
        f"first divergent #{report.first_divergent.index}, planted #{index}: {describe(divergent)}"
    assert [r.index for r in divergent] == [index], f"other ops diverged too: {describe(divergent)}"
    assert not by_status(report, Status.ERROR), describe(by_status(report, Status.ERROR))


def faulty_gelu_pass(monkeypatch) -> None:
    """A compiler bug in aot_eager's nop compiler: each gelu's result is scaled by 1 + 1e-3 in the compiled code."""
    import torch._dynamo.backends.debugging as dbg

    nop = dbg.boxed_nop

    def faulty(gm, example_inputs):
        for node in list(gm.graph.nodes):
            if node.target is torch.ops.aten.gelu.default:
                with gm.graph.inserting_after(node):
                    bad = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.0 + 1e-3))
                node.replace_all_uses_with(bad, delete_user_cb=lambda user: user is not bad)
        gm.recompile()
        return nop(gm, example_inputs)

    monkeypatch.setattr(dbg, "boxed_nop", faulty)


# A module that registers a custom op and, when imported, leaves a mark beside itself: a file shipped with a trace.
SHIPPED_MODULE = textwrap.dedent('''
    import pathlib, torch
    pathlib.Path(__file__).with_name("imported.txt").write_text("ran")


    @torch.library.custom_op("rdtrust::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2


    @twice.register_fake
    def _fake(x):
        return torch.empty_like(x)
''')


def record_shipped_custom_op(home: Path, path: Path) -> Path:
    """A trace at ``path`` of a step calling rdtrust::twice, whose module (rdtrust_shipped) is written to ``home``;
    recorded in a process of its own, so that the op is not registered in this one (as where a received trace is
    opened)."""
    (home / "rdtrust_shipped.py").write_text(SHIPPED_MODULE)
    step = ("import torch, replaydiff, rdtrust_shipped as m\n"
            f"with replaydiff.record({str(path)!r}):\n"
            "    (m.twice(torch.randn(4, 3)) @ torch.randn(3, 2)).sum()\n")
    p = subprocess.run([sys.executable, "-c", step], cwd=home, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return path
