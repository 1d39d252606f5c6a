"""Multi-rank jobs as they are run today, on 2 CPU ranks with gloo: FSDP2 replays clean and complete, every
collective form is checked across ranks (a wrong all-to-all chunk names its peer), a hung job says who never arrived,
data-parallel replicas are compared, the culprit across ranks follows collective order, a subset of ranks can be
recorded, and a torchrun-sharded replay writes the same report as one process.

Jobs run as 2 real processes (torchrun where the test is about torchrun, else two processes with torchrun's
variables, which starts faster). Faults are planted with dispatch modes below the recorder; expected op numbers
are read back from the traces.
"""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from replaydiff.cli.main import main
from replaydiff.replay import ReplayOptions, Status, replay_trace
from replaydiff.report import render_replay
from replaydiff.trace import open_trace

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

# One pair of processes records every scenario below into its own directory under argv[1] (starting processes is
# what costs: each scenario in its own job would take minutes on a small machine).
JOB_SCRIPT = '''
import contextlib, sys, torch, torch.distributed as dist
import torch.distributed._functional_collectives as fc
from pathlib import Path
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from replaydiff import record
from replaydiff.faults import PlantedFault
dist.init_process_group("gloo")
rank = dist.get_rank()
out = Path(sys.argv[1])

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

def recorded(name, *faults):
    """Record into out/name with the faults entered first (below the recorder)."""
    stack = contextlib.ExitStack()
    for f in faults:
        stack.enter_context(f)
    stack.enter_context(record(out / name))
    return stack

# -- FSDP2: fully_shard per layer and at the root, AdamW; a clean step, then rank 1's first reduce-scatter wrong
model = mlp()
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
torch.manual_seed(rank)
x = torch.randn(4, 8)
def fsdp_step():
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
with recorded("fsdp_clean"):
    fsdp_step()
fault = PlantedFault("c10d._reduce_scatter_base_.default", rel=1e-3, rank=1)
with recorded("fsdp_fault", fault):
    fsdp_step()
assert fault.planted or rank != 1
with recorded("fsdp_gather_fault", PlantedFault("c10d._allgather_base_.default", rel=1e-3, rank=1)):
    fsdp_step()  # rank 1's first all-gather: its unsharded parameters are no longer the replicas of rank 0's

# -- every collective training uses, c10d and functional forms; then rank 0 gets a wrong chunk from rank 1
class WrongChunkFromPeer(TorchDispatchMode):
    """Rank 0's first alltoall_base_: the rows that came from rank 1 are scaled (a corrupted transfer)."""
    done = False
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        if str(func) == "c10d.alltoall_base_.default" and rank == 0 and not self.done:
            res.wait()
            output, out_splits = args[0], args[3]
            with torch.no_grad():
                output[out_splits[0]:].mul_(1.001)
            self.done = True
            fut = torch.futures.Future()  # a completed Work: gloo would copy the result again on the next wait
            fut.set_result([output])
            res = torch._C._distributed_c10d._create_work_from_future(fut).boxed()
        return res

def collectives():
    base = torch.arange(4, dtype=torch.float32) + 1 + rank * 10
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        dist.all_reduce(base.clone(), op=op)
    dist.all_reduce(torch.tensor([6, 3]) + rank, op=dist.ReduceOp.BAND)  # a reduction replay does not check
    dist.all_gather([torch.zeros(4) for _ in range(2)], base)
    dist.all_gather_into_tensor(torch.zeros(8), base)
    dist.reduce_scatter_tensor(torch.zeros(2), base)
    dist.reduce_scatter(torch.zeros(2), [base[:2].clone(), base[2:].clone()])
    dist.broadcast(base.clone(), src=1)
    sends = [3, 1] if rank == 0 else [1, 2]          # uneven split sizes, recorded with the op
    receives = [3, 1] if rank == 0 else [1, 2]
    dist.all_to_all_single(torch.zeros(sum(receives)), torch.arange(sum(sends), dtype=torch.float32) + 100 * rank,
                           output_split_sizes=receives, input_split_sizes=sends)
    dist.all_to_all([torch.zeros(2) for _ in range(2)], [base[:2].clone(), base[2:].clone()])
    group = dist.group.WORLD
    for y in (fc.all_reduce(base, "sum", group), fc.all_reduce(base, "max", group),
              fc.all_gather_tensor(base, 0, group), fc.reduce_scatter_tensor(base, "sum", 0, group),
              fc.all_to_all_single(base, None, None, group), fc.broadcast(base, 0, group)):
        y + 0  # waits

with recorded("collectives_clean"):
    collectives()
with recorded("collectives_fault", WrongChunkFromPeer()):
    collectives()

# -- DDP. replica: rank 1's first addcdiv_ (the optimizer step). ordered: rank 0's first addcdiv_ (after the
# gradient all-reduce) and rank 1's first addmm (before it). undecided: both ranks' first addmm (no collective
# between them).
for name, faults in (("ddp_replica", [("aten.addcdiv_.default", 1)]),
                     ("ddp_ordered", [("aten.addcdiv_.default", 0), ("aten.addmm.default", 1)]),
                     ("ddp_undecided", [("aten.addmm.default", 0), ("aten.addmm.default", 1)])):
    ddp = torch.nn.parallel.DistributedDataParallel(mlp())
    opt = torch.optim.AdamW(ddp.parameters())
    with recorded(name, *[PlantedFault(op, rel=1e-3, rank=r) for op, r in faults]):
        ddp(x).pow(2).mean().backward()
        opt.step()
dist.barrier()  # gloo aborts a rank that destroys its group while the other still talks to it
dist.destroy_process_group()
'''

# Rank 1 skips the second all-reduce; rank 0 waits in it until both are killed.
HANG_SCRIPT = '''
import sys, time, datetime, torch, torch.distributed as dist
from replaydiff import record
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
with record(sys.argv[1]):
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t)
    u = t * 2
    if rank != 1:
        dist.all_reduce(u)
    v = u + 1
time.sleep(120)
'''

# A plain DDP loop with no replaydiff in it, for `replaydiff record --ranks`.
PLAIN_DDP_SCRIPT = '''
import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
dist.barrier()  # gloo aborts a rank (SIGABRT) that destroys its group while the other still talks to it
dist.destroy_process_group()
'''

# A 1-rank gloo DDP job that, after its 3 steps, says what the process still holds: threads (Python and native),
# replaydiff objects still alive (an exit handler or a hook left behind keeps its recorder alive) and what they
# reach, torch's global hooks, signal handlers, dispatch modes.
LEFTOVERS_SCRIPT = '''
import enum, gc, json, os, signal, sys, threading, types
import torch, torch.distributed as dist
import torch.nn.modules.module as module_hooks, torch.optim.optimizer as optimizer_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
gc.collect()
c10d = torch._C._distributed_c10d
DIST = (torch.Tensor, torch.nn.Module, c10d.Work, c10d.ProcessGroup, torch.ScriptObject)
modules = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}

def ours(obj):
    return str(getattr(type(obj), "__module__", "")).startswith("replaydiff") or \\
        type(obj) is types.MethodType and ours(obj.__self__)

def reaches(root, recorder_objects):
    """Kinds of job objects (tensors, modules, Work, process groups), and with recorder_objects replaydiff
    objects, reached from root; module globals and classes are not followed (a function's globals are not
    held state)."""
    seen, todo, found = {id(root)}, [root], set()
    while todo:
        o = todo.pop()
        if o is not root and (isinstance(o, DIST) or recorder_objects and ours(o)):
            found.add(type(o).__name__)
            continue
        if isinstance(o, (type, types.ModuleType)) or id(o) in modules:
            continue
        for r in gc.get_referents(o):
            if id(r) not in seen:
                seen.add(id(r))
                todo.append(r)
    return sorted(found)

hooks = {name: sorted({k for fn in getattr(m, name).values()
                       for k in reaches(fn, True) + (["replaydiff"] if ours(fn) else [])})
         for m in (module_hooks, optimizer_hooks) for name in dir(m)
         if name.startswith("_global_") and name.endswith("hooks")}
tasks = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")) \\
    if os.path.isdir("/proc/self/task") else None
# The recorder's objects (aten's table of op facts, replay's constants and enum members such as TensorMode.FULL are
# per process, not per recording); an exit handler or a hook left behind keeps its recorder alive.
alive = [o for o in gc.get_objects() if ours(o) and not isinstance(o, enum.Enum)
         and type(getattr(o, "__self__", o)).__module__.startswith(("replaydiff.record", "replaydiff.trace"))]
print(json.dumps({
    "threads": sorted(t.name for t in threading.enumerate()), "native_threads": tasks,
    "alive": sorted({type(o).__name__ for o in alive}), "hooks": hooks,
    "signals": [ours(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGUSR1)],
    "excepthook": ours(sys.excepthook), "modes": len(_get_current_dispatch_mode_stack()),
    "held": sorted({k for o in alive for k in reaches(o, False)})}))
dist.destroy_process_group()
'''


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


def _script(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(textwrap.dedent(text))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two(script: Path, *args: str) -> list[subprocess.Popen]:
    """Two processes with the variables torchrun sets (faster to start than torchrun's agent)."""
    port = _free_port()
    procs = []
    for r in range(2):
        env = dict(_env(), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    return procs


def _run_two(script: Path, *args: str) -> None:
    procs = _start_two(script, *args)
    outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)


def _nth(path: Path, rank: int, name: str, n: int = 0) -> int:
    hits = [op.index for op in open_trace(path).rank(rank) if op.name == name]
    assert len(hits) > n, f"{name} occurs {len(hits)} times on rank {rank}"
    return hits[n]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """Every scenario of JOB_SCRIPT, recorded by one 2-rank job."""
    tmp = tmp_path_factory.mktemp("job")
    _run_two(_script(tmp, "job.py", JOB_SCRIPT), str(tmp / "traces"))
    return tmp / "traces"


@pytest.fixture(scope="module")
def fsdp(job) -> tuple[Path, Path]:
    return job / "fsdp_clean", job / "fsdp_fault"


@pytest.fixture(scope="module")
def collectives(job) -> tuple[Path, Path]:
    return job / "collectives_clean", job / "collectives_fault"


# -- 1. FSDP2 ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fsdp2_step_replays_clean_and_complete(fsdp) -> None:
    report = replay_trace(str(fsdp[0]), ReplayOptions())
    c = report.counts()
    assert c["divergent"] == 0 and c["error"] == 0, [(r.rank, r.index, r.op, r.reason) for r in report.ops
                                                     if r.status in (Status.DIVERGENT, Status.ERROR)]
    reasons = {r.reason for r in report.ops if r.status is Status.SKIPPED}
    assert not [x for x in reasons if "not stored" in x or "not registered" in x or "collective" in x], reasons
    names = {r.op for r in report.ops if r.status is Status.OK}
    # the sharded parameter path itself was checked: FSDP's own ops and both collectives, on both ranks
    assert {"fsdp.all_gather_copy_in.default", "fsdp.split_with_sizes_copy.default", "fsdp.chunk_cat.default",
            "c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"} <= names
    # the optimizer ran on the local shards (DTensor unwrapped), not on DTensors that replay could not read
    assert any(r.op == "aten._foreach_addcdiv_.Scalar" or r.op == "aten.addcdiv_.default" for r in report.ops
               if r.phase == "optimizer" and r.status is Status.OK)
    assert report.replicas is None
    # all_gather_copy_in leaves the other rank's slots of the all-gather buffer as torch.empty made them: no origin
    assert report.nonfinite_origin is None
    assert report.nonfinite_entry is None


def test_fsdp2_reduce_scatter_fault_is_first_divergent_on_its_rank(fsdp) -> None:
    report = replay_trace(str(fsdp[1]), ReplayOptions())
    planted = _nth(fsdp[1], 1, "c10d._reduce_scatter_base_.default")
    first = report.first_divergent
    assert (first.rank, first.index) == (1, planted), (first.rank, first.index, first.reason)
    assert "float64 avg of every rank's chunk 1" in first.reason  # FSDP2 averages gradients
    assert [(r.rank, r.index) for r in report.first_per_rank] == [(1, planted)]


# -- 2. every collective ------------------------------------------------------------------------------------------
def test_every_collective_form_is_checked_across_ranks(collectives) -> None:
    report = replay_trace(str(collectives[0]), ReplayOptions())
    results = [r for r in report.ops if r.collective and "bookkeeping" not in (r.reason or "")]
    band = [_nth(collectives[0], rank, "c10d.allreduce_.default", 5) for rank in (0, 1)]
    unchecked = [r for r in results if r.index == band[r.rank]]
    assert [(r.status, r.reason) for r in unchecked] == [(Status.SKIPPED, "collective: reduce op band is not "
                                                                         "checked")] * 2  # never taken for a sum
    results = [r for r in results if r not in unchecked]
    assert results and all(r.status is Status.OK for r in results), \
        [(r.rank, r.index, r.op, r.status, r.reason) for r in results if r.status is not Status.OK]
    checked = {r.op for r in results}
    assert checked >= {"c10d.allreduce_.default", "c10d.allgather_.default", "c10d._allgather_base_.default",
                       "c10d._reduce_scatter_base_.default", "c10d.reduce_scatter_.default",
                       "c10d.broadcast_.default", "c10d.alltoall_base_.default", "c10d.alltoall_.default",
                       "_c10d_functional.all_reduce.default", "_c10d_functional.all_gather_into_tensor.default",
                       "_c10d_functional.reduce_scatter_tensor.default",
                       "_c10d_functional.all_to_all_single.default", "_c10d_functional.broadcast.default"}
    reduce_ops = {r.reason.split("float64 ")[1].split(" ")[0] for r in results if r.op == "c10d.allreduce_.default"}
    assert reduce_ops == {"sum", "avg", "min", "max", "product"}
    # the uneven all_to_all split sizes are in the record
    a2a = open_trace(collectives[0]).rank(0)[_nth(collectives[0], 0, "c10d.alltoall_base_.default")]
    assert (a2a.args[3], a2a.args[4]) == ([3, 1], [3, 1])


def test_wrong_all_to_all_chunk_names_its_peer(collectives) -> None:
    report = replay_trace(str(collectives[1]), ReplayOptions())
    bad = [r for r in report.ops if r.status is Status.DIVERGENT]
    assert [(r.rank, r.index) for r in bad] == [(0, _nth(collectives[1], 0, "c10d.alltoall_base_.default"))]
    assert "received from rank(s) [1]" in bad[0].reason


# -- 3. a hang ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_hung_job_says_who_never_entered_the_collective(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace"
    procs = _start_two(_script(tmp_path, "hang.py", HANG_SCRIPT), str(trace))
    try:
        # the timeout: rank 0 has been waiting in the all-reduce long enough to say so, rank 1 has finished
        deadline = time.time() + 60
        while time.time() < deadline and not ((trace / "rank0" / "entered.rdt").exists()
                                              and (trace / "rank1" / "index.rdt").exists()):
            time.sleep(0.2)
    finally:
        for p in procs:  # what a launcher does to a hung job: SIGTERM, then SIGKILL for whoever does not leave
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    t = open_trace(trace)
    waiting = t.rank(0).entered
    assert waiting is not None and waiting.name == "c10d.allreduce_.default" and not waiting.recorded
    assert t.rank(1).entered is None
    completed = [op for op in t.rank(0) if op.name == "c10d.allreduce_.default"]
    assert len(completed) == 1 and waiting.index > completed[0].index  # the first completed, the second did not
    assert main(["show", str(trace)]) == 3  # a hung job's trace is partial: described whole, never clean
    shown = capsys.readouterr().out
    group = waiting.collective.group_name
    assert (f"group {group} ranks [0, 1]: collective #1 of the group (c10d.allreduce_.default): entered by ranks "
            f"[0], never by ranks [1]; rank 0 waiting in op #{waiting.index}") in shown
    last1 = t.rank(1)[t.rank(1).last_index]
    assert f"rank 1: last completed op #{last1.index} {last1.name}" in shown
    assert f"rank 0: last completed op #{waiting.index - 1} " in shown
    assert main(["show", str(trace), "--json"]) == 3
    js = json.loads(capsys.readouterr().out)
    # the cut trace still replays: rank 0's completed all-reduce is checked against rank 1's
    report = replay_trace(str(trace), ReplayOptions())
    assert report.counts()["error"] == report.counts()["divergent"] == 0
    assert {(r.rank, r.status) for r in report.ops if r.op == "c10d.allreduce_.default"} == \
        {(0, Status.OK), (1, Status.OK)}
    assert js["collectives"] == [{"group_name": group, "ranks": [0, 1], "call": 1, "op": "c10d.allreduce_.default",
                                  "entered": [0], "waiting": {"0": waiting.index}, "never": [1],
                                  "not_in_trace": []}]


# -- 4 and 5. replicas, and the culprit across ranks -------------------------------------------------------------
def test_fsdp2_unsharded_parameters_stop_agreeing_at_the_faulty_all_gather(job) -> None:
    trace = job / "fsdp_gather_fault"
    report = replay_trace(str(trace), ReplayOptions())
    gathers = [_nth(trace, rank, "c10d._allgather_base_.default") for rank in (0, 1)]
    b = report.replicas
    assert b is not None and (b.rank, b.index, b.other_rank, b.other_index) == (0, gathers[0], 1, gathers[1]), b
    assert "result differs between the ranks" in b.what
    assert [(r.rank, r.index) for r in report.first_per_rank] == [(1, gathers[1])]


def test_ddp_replicas_stop_agreeing_at_the_faulty_optimizer_op(job) -> None:
    trace = job / "ddp_replica"
    report = replay_trace(str(trace), ReplayOptions())
    planted = _nth(trace, 1, "aten.addcdiv_.default")
    b = report.replicas
    assert b is not None and (b.rank, b.index, b.other_rank, b.other_index) == \
        (0, _nth(trace, 0, "aten.addcdiv_.default"), 1, planted), b
    assert "same inputs on both ranks" in b.what
    assert (report.first_divergent.rank, report.first_divergent.index) == (1, planted)


def test_culprit_across_ranks_follows_collective_order(job) -> None:
    ordered, undecided = job / "ddp_ordered", job / "ddp_undecided"
    report = replay_trace(str(ordered), ReplayOptions())
    late0 = _nth(ordered, 0, "aten.addcdiv_.default")  # after the gradient all-reduce on rank 0
    early1 = _nth(ordered, 1, "aten.addmm.default")      # before it on rank 1
    assert [(r.rank, r.index) for r in report.first_per_rank] == [(0, late0), (1, early1)]
    assert (report.first_divergent.rank, report.first_divergent.index) == (1, early1)
    assert report.undecided == []

    report = replay_trace(str(undecided), ReplayOptions())
    mm0, mm1 = _nth(undecided, 0, "aten.addmm.default"), _nth(undecided, 1, "aten.addmm.default")
    assert [(r.rank, r.index) for r in report.first_per_rank] == [(0, mm0), (1, mm1)]
    assert (report.first_divergent.rank, report.first_divergent.index) == (0, mm0)
    assert report.undecided == [(1, mm1)]
    text = io.StringIO()
    render_replay(report, text)
    assert f"the order between rank 0 #{mm0} and rank 1 #{mm1} cannot be decided" in text.getvalue()


# -- 6. a subset of ranks -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_record_of_one_rank_writes_it_alone_and_skips_its_collectives(tmp_path: Path, cli_here, monkeypatch) -> None:
    trace = tmp_path / "trace"
    script = _script(tmp_path, "plain_ddp.py", PLAIN_DDP_SCRIPT)
    for name in ("PYTHONPATH", "OMP_NUM_THREADS"):  # the job's environment, as _env() gives a subprocess
        monkeypatch.setenv(name, _env()[name])
    run = cli_here("record", "--ranks", "1", "-o", trace, "--", *TORCHRUN, script)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in trace.iterdir()) == ["rank1"]
    report = replay_trace(str(trace), ReplayOptions())
    colls = [r for r in report.ops if r.op == "c10d.allreduce_.default"]
    assert colls and all(r.status is Status.SKIPPED and r.reason == "collective: ranks [0] of its group are not "
                         "in the trace" for r in colls)
    assert report.counts()["divergent"] == report.counts()["error"] == 0


# -- 7. sharded replay over torchrun ------------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_sharded_replay_writes_the_single_process_report(fsdp, tmp_path: Path) -> None:
    single, sharded = tmp_path / "single.json", tmp_path / "sharded.json"
    assert main(["replay", str(fsdp[1]), "--json", str(single)]) == 1  # the planted fault
    two = subprocess.run([*TORCHRUN, "-m", "replaydiff", "replay", str(fsdp[1]), "--json", str(sharded)],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert sharded.exists(), two.stderr
    a, b = json.loads(single.read_text()), json.loads(sharded.read_text())
    assert a == b
    assert a["summary"]["divergent"] == 1 and len(a["ops"]) == sum(len(list(r)) for r in open_trace(fsdp[1]))


# -- 8. nothing of the recorder's outlives it ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_closed_recorder_leaves_nothing_in_the_process(tmp_path: Path) -> None:
    """After ``record --step 2`` of 3 has closed, the process holds what the plain job holds: no recorder thread,
    exit handler, hook, signal handler or mode, and no replaydiff object reaches a tensor, module, Work or process
    group (gloo's teardown races with whatever still holds its objects)."""
    script = _script(tmp_path, "ddp1.py", LEFTOVERS_SCRIPT)
    env = dict(_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")

    def facts(*prefix: str) -> dict:
        run = subprocess.run([*prefix, sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                             env=dict(env, MASTER_PORT=str(_free_port())))
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout.strip().splitlines()[-1])

    plain = facts()
    trace = tmp_path / "trace"
    recorded = facts(sys.executable, "-m", "replaydiff", "record", "--step", "2", "-o", str(trace), "--")
    assert open_trace(trace).rank(0).complete and {op.step for op in open_trace(trace).rank(0)} == {2}
    assert plain["alive"] == plain["held"] == [] and plain["hooks"] == {k: [] for k in plain["hooks"]}
    for what in plain:
        assert (what, recorded[what]) == (what, plain[what])
