"""GPU check: the device semantics the CPU tests drive through a fake device (tests/fake_device.py), on a real one.
One prepared script for a session that has a CUDA (or ROCm) GPU; each check asserts, and the script exits 1 when
any verdict is wrong (0 when all hold, 4 without a GPU). About 3-6 minutes on one H100.

    python tests/bench/gpu_check.py [--out DIR] [--only NAME ...]

Checks (each prints one row: name, pass/FAIL, what it saw):
  environment    the trace records the GPU's type, compute capability and multiprocessor count (and HIP on ROCm)
  sync-free      stats, full and meta recordings of a bf16-autocast, TF32, fused-AdamW step under
                 torch.cuda.set_sync_debug_mode("error"): no synchronisation, no recorder warning, every op recorded
  flight         --flight 2 with statistics under the same sync debug mode, a NaN planted at step 3: dumped, with
                 the NaN in the statistics
  replay         the full trace replays clean on the CPU (fp64) and on the GPU (fp64); a fault planted in one CUDA
                 matmul is named exactly on both; --precision same on the GPU judges the TF32 step bit for bit
  side-stream    an op on a side stream behind a long kernel: its tensors are copied in that stream's order
  to-cpu         x.to("cpu", non_blocking=True) and pinned_buf.copy_(gpu, non_blocking=True) behind a long kernel:
                 the host outputs are recorded as they land, not as they were when the call returned
  nccl           a one-rank NCCL group: all_reduce (sync and async_op), all_gather, reduce_scatter, a functional
                 all_reduce; the job's own waits work, the trace replays clean
  dropout        dropout over more elements than SMs x 2048: replayed bit for bit on this GPU at --precision same;
                 with the device said to have another SM count, skipped with that reason
  capture        a CUDA graph captured inside the recording: the job's graph replays right, the captured ops are
                 placeholders with the reason, one warning, no crash
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

import replaydiff
from replaydiff import device as seam
from replaydiff.faults import PlantedFault
from replaydiff.models import TinyTransformer, TransformerConfig, make_step
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.trace import open_trace

CHECKS: dict[str, Callable[[Path], str]] = {}


def check(fn: Callable[[Path], str]) -> Callable[[Path], str]:
    CHECKS[fn.__name__.replace("_", "-")] = fn
    return fn


def _recorder_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "replaydiff" in str(w.message)]


def _record(path: Path, job: Callable[[], object], sync_debug: bool = False, **kw) -> list[str]:
    """Run ``job`` under record(path, **kw); the recorder's warnings. With ``sync_debug`` any synchronisation (the
    job's own, the recorder's) raises."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if sync_debug:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with replaydiff.record(path, **kw):
                job()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return _recorder_warnings(caught)


def _tiny_step(autocast: bool = True) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = TinyTransformer(TransformerConfig()).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    step = make_step(model, model.example_batch("cuda"), opt, autocast_dtype=torch.bfloat16 if autocast else None)
    step()  # warm-up: cuBLAS handles, the optimizer's state
    torch.cuda.synchronize()
    return step


def _assert_complete(path: Path, min_ops: int = 10) -> list:
    rank = open_trace(path).rank(0)
    assert rank.complete and rank.lost == [] and rank.stopped is None, (rank.complete, rank.lost, rank.stopped)
    ops = list(rank)
    assert len(ops) >= min_ops and all(op.recorded for op in ops), len(ops)
    return ops


def _clean(path: Path, **opts) -> replaydiff.replay.ReplayReport:  # type: ignore[name-defined]
    rep = replay_trace(str(path), ReplayOptions(**opts))
    bad = [(r.index, r.op, str(r.status), r.reason) for r in rep.ops
           if str(r.status) in ("divergent", "error", "nondeterministic")]
    assert not rep.found_problem, f"replay {opts} found a problem: {bad[:5]} counts {rep.counts()}"
    return rep


# -- the checks ------------------------------------------------------------------------------------------------
@check
def environment(root: Path) -> str:
    _record(root / "env", lambda: torch.ones(4, device="cuda").sum())
    env = open_trace(root / "env").rank(0).environment
    props = torch.cuda.get_device_properties(0)
    d = env.devices[0]
    assert (d.type, d.index, d.name) == ("cuda", 0, props.name), d
    assert d.capability == tuple(torch.cuda.get_device_capability(0)), d.capability
    assert d.processors == props.multi_processor_count, d.processors
    assert env.hip == torch.version.hip and env.cuda == torch.version.cuda
    return f"{d.name}: sm {'.'.join(map(str, d.capability))}, {d.processors} SMs, cuda {env.cuda} hip {env.hip}"


@check
def sync_free(root: Path) -> str:
    out = []
    for tensors in ("meta", "stats", "full"):
        step = _tiny_step()
        t = time.perf_counter()
        said = _record(root / f"sync-{tensors}", step, sync_debug=True, tensors=tensors)
        dt = time.perf_counter() - t
        assert said == [], said
        ops = _assert_complete(root / f"sync-{tensors}")
        if tensors == "stats":
            refs = [r for op in ops for r in op.outputs_refs() if r.device.startswith("cuda")]
            assert refs and all(r.stats is not None and r.stats.numel == math.prod(r.shape) for r in refs)
        out.append(f"{tensors} {len(ops)} ops {dt:.2f}s")
    return "; ".join(out)


@check
def flight(root: Path) -> str:
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, foreach=True)
    x = torch.randn(32, 64, device="cuda")
    lin(x).square().mean().backward()  # warm-up
    opt.zero_grad()
    torch.cuda.synchronize()

    def job() -> None:
        for step in range(5):
            if step == 3:
                with torch.no_grad():
                    lin[0].weight[0, 0] = float("nan")  # a device-side fill: no synchronisation
            lin(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    said = _record(root / "flight", job, sync_debug=True, tensors="stats", flight=2)
    assert said == [], said
    r = open_trace(root / "flight").rank(0)
    steps = sorted({op.step for op in r})
    reason = r.manifest["flight"]["reason"]
    assert len(steps) == 2 and f"at step {steps[-1]}" in reason and "NaN" in reason, (steps, reason)
    refs = [ref for op in r for ref in op.outputs_refs() if ref.stats is not None]
    assert refs and any(ref.stats.nan for ref in refs)
    return f"dumped steps {steps}: {reason}"


@check
def replay(root: Path) -> str:
    clean, faulty = root / "replay-clean", root / "replay-faulty"
    step = _tiny_step()
    assert _record(clean, step) == []
    step = _tiny_step()
    fault = PlantedFault("aten.mm.default", rel=1e-2, call=3)
    with fault:
        assert _record(faulty, step) == []
    planted = [op.index for op in open_trace(faulty).rank(0) if op.name == "aten.mm.default"][2]
    rows = []
    for device in ("cpu", "cuda"):
        t = time.perf_counter()
        rep = _clean(clean, device=device, precision="fp64")
        rows.append(f"clean on {device} fp64: {rep.counts()['ok']} ok ({len(rep.ops) / (time.perf_counter() - t):,.0f}"
                    f" ops/s)")
        rep = replay_trace(str(faulty), ReplayOptions(device=device, precision="fp64"))
        first = rep.first_divergent
        assert first is not None and first.index == planted, (device, first and first.index, planted)
    rep = replay_trace(str(clean), ReplayOptions(device="cuda", precision="same"))
    c = rep.counts()
    # the recorded TF32 settings applied: the matmuls redo the job's own TF32 kernels bit for bit (with TF32 forced
    # off they diverged); ops with atomics (embedding backward) may differ in their last bits, as in the job itself
    matmuls = [r for r in rep.ops if r.op.split(".")[1] in ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation")]
    assert matmuls and all(str(r.status) == "ok" for r in matmuls), \
        [(r.index, r.op, str(r.status)) for r in matmuls if str(r.status) != "ok"][:5]
    assert c["error"] == 0, c
    rows.append(f"same on cuda: {len(matmuls)} matmuls bit for bit; {c}")
    return "; ".join(rows) + f"; fault #{planted} named on both"


def _long_kernel() -> None:
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time ahead of what follows on this stream


@check
def side_stream(root: Path) -> str:
    x = torch.randn(512, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    result: list[torch.Tensor] = []

    def job() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _long_kernel()
            y = torch.relu(x @ w)  # still queued behind the long kernel when the call returns
            z = y * 2
        torch.cuda.current_stream().wait_stream(side)
        result.append(z.sum())

    assert _record(root / "side", job) == []
    _assert_complete(root / "side", min_ops=3)
    rep = _clean(root / "side", device="cpu", precision="fp64")
    return f"{rep.counts()['ok']} ok on the CPU: side-stream copies read in that stream's order"


@check
def to_cpu(root: Path) -> str:
    x = torch.randn(1 << 20, device="cuda")
    pinned = torch.empty(1 << 20, pin_memory=True)
    torch.cuda.synchronize()
    seen: list[float] = []

    def job() -> None:
        _long_kernel()
        y = x * 3 + 1  # lands after the long kernel
        h = y.to("cpu", non_blocking=True)  # returns at once; h's bytes arrive later
        pinned.copy_(y, non_blocking=True)
        torch.cuda.synchronize()  # the job waits before it reads them, as it must
        seen.append(float(h[:10].sum() + pinned[:10].sum()))

    assert _record(root / "to-cpu", job) == []
    ops = _assert_complete(root / "to-cpu", min_ops=4)
    rep = _clean(root / "to-cpu", device="cpu", precision="fp64")
    copies = [r for r in rep.ops if r.op in ("aten._to_copy.default", "aten.copy_.default")]
    assert copies and all(str(r.status) == "ok" for r in copies), [(r.op, str(r.status), r.reason) for r in copies]
    for tensors in ("stats",):  # the host outputs' statistics too: measured once the copy has landed
        assert _record(root / f"to-cpu-{tensors}", job, tensors=tensors) == []
        want = (x * 3 + 1).double()
        for op in open_trace(root / f"to-cpu-{tensors}").rank(0):
            if op.name == "aten._to_copy.default":
                s = op.outputs_refs()[0].stats
                assert s is not None and math.isclose(s.mean, float(want.mean()), rel_tol=1e-6), s
    return f"{len(copies)} copies to the host replay ok ({len(ops)} ops)"


@check
def nccl(root: Path) -> str:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if not dist.is_nccl_available():
        raise AssertionError("this torch has no NCCL")
    dist.init_process_group("nccl", init_method=f"file://{root / 'nccl-store'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        x = torch.randn(1 << 16, device="cuda")
        out: list[torch.Tensor] = []

        def job() -> None:
            y = x * 2
            dist.all_reduce(y)
            work = dist.all_reduce(y, async_op=True)
            work.wait()  # the job's own wait: its work must still be waitable (the recorder waits too)
            gathered = torch.empty_like(y)
            dist.all_gather_into_tensor(gathered, y)
            scattered = torch.empty_like(y)
            dist.reduce_scatter_tensor(scattered, gathered)
            z = funcol.all_reduce(scattered, "sum", dist.group.WORLD)  # an AsyncCollectiveTensor
            out.append((z + 1).sum())

        said = _record(root / "nccl", job)
        assert said == [], said
        ops = _assert_complete(root / "nccl", min_ops=5)
        colls = [op for op in ops if op.collective is not None]
        assert len(colls) >= 4, [op.name for op in ops]
        rep = _clean(root / "nccl", device="cpu", precision="fp64")
        assert open_trace(root / "nccl").rank(0).entered is None
        return f"{len(colls)} collectives recorded; replay {rep.counts()}"
    finally:
        dist.destroy_process_group()


@check
def dropout(root: Path) -> str:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = sms * 2048 * 4 + 17  # past the count where Philox's element-to-number mapping depends on the SMs
    x = torch.randn(n, device="cuda")
    torch.manual_seed(0)
    assert _record(root / "dropout", lambda: torch.nn.functional.dropout(x, 0.3, training=True) * 1) == []
    rep = _clean(root / "dropout", device="cuda", precision="same")
    drops = [r for r in rep.ops if "dropout" in r.op or "bernoulli" in r.op]
    assert drops and all(str(r.status) == "ok" for r in drops), [(r.op, str(r.status), r.reason) for r in drops]

    class OtherSMs(seam.Runtime):  # this GPU, said to have one SM fewer than the recording's
        def facts(self):  # type: ignore[override]
            return [replace(d, processors=(d.processors or 0) - 1) for d in super().facts()]

    with seam.use(OtherSMs()):
        rep2 = replay_trace(str(root / "dropout"), ReplayOptions(device="cuda", precision="same"))
    drops2 = [r for r in rep2.ops if "dropout" in r.op or "bernoulli" in r.op]
    assert drops2 and all(str(r.status) == "skipped" and "multiprocessors" in (r.reason or "") for r in drops2), \
        [(r.op, str(r.status), r.reason) for r in drops2]
    return f"{n:,} elements: ok on {sms} SMs, skipped with the reason on {sms - 1}"


@check
def capture(root: Path) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    static_x = torch.randn(16, 64, device="cuda")
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                model(static_x)  # warm-up on a side stream, as torch's graph docs ask
        torch.cuda.current_stream().wait_stream(s)
        want = model(static_x).clone()
    torch.cuda.synchronize()
    got: list[torch.Tensor] = []

    def job() -> None:
        with torch.no_grad():
            before = model(static_x) * 1  # recorded as usual
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_y = model(static_x)
            g.replay()
            got.append(static_y.clone() + before * 0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # the writer thread is busy around the capture: it must never query an event in it
            torch.cuda.synchronize()
            with replaydiff.record(root / f"capture-{_}", tensors="full"):
                job()
    torch.cuda.synchronize()
    said = _recorder_warnings(caught)
    assert all(torch.equal(g, want) for g in got), "the captured graph computes something else"
    assert len(said) == 3 and all("graph capture" in s for s in said), said
    r = open_trace(root / "capture-0").rank(0)
    stubs = [op for op in r[:] if not op.recorded]
    assert stubs and all("graph capture" in op.not_recorded_reason for op in stubs)
    assert r.complete
    return f"{len(stubs)} captured ops as placeholders; graph output right in 3 runs"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="keep the traces here (default: a temporary directory)")
    p.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run these checks only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA/ROCm device: nothing to check", file=sys.stderr)
        return 4
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    root = Path(args.out or tempfile.mkdtemp(prefix="replaydiff-gpu-"))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  traces in {root}")
    failed = 0
    for name in args.only or CHECKS:
        t = time.perf_counter()
        try:
            detail, ok = CHECKS[name](root), True
        except Exception as exc:  # a wrong verdict (AssertionError) or a crash: the row says which
            detail, ok = f"{type(exc).__name__}: {exc}"[:400], False
            traceback.print_exc(file=sys.stderr)
        failed += not ok
        print(f"| {name:<12} | {'pass' if ok else 'FAIL'} | {time.perf_counter() - t:6.1f}s | {detail} |", flush=True)
    print(f"{len(args.only or CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
