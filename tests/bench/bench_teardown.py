"""Benchmark: how often a 2-rank gloo job dies at teardown, plain against recorded.

    nice -n 10 python tests/bench/bench_teardown.py [--runs 10] [--launcher torchrun|pair] [--step 2]

The job is what most DDP examples do: 2 CPU ranks, gloo, 3 SGD steps of a small DDP model, then
``destroy_process_group()`` with no barrier before it, so one rank may tear its group down while the other still
talks to it; torch then sometimes aborts a rank (SIGABRT, "terminate called without an active exception"). Each
round runs the job once plain and once under ``replaydiff record --step 2`` (the recorder closes at the end of step
2, a whole step before the teardown), the order alternating from round to round, and counts the runs that ended
clean, that aborted, and that failed otherwise. ``--launcher torchrun`` starts each job as users do
(``torchrun --standalone --nproc-per-node 2``); ``pair`` starts the two ranks directly with torchrun's variables
(as tests/test_multirank.py does; faster). Prints one table and the first line of each abort's message.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

JOB = textwrap.dedent('''
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()  # no barrier before it, as in most examples
''')

ABORT_MARKS = ("terminate called", "SIGABRT", "Signals.SIGABRT", "exitcode  : -6", "Aborted")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # PYTHONFAULTHANDLER: an aborting rank prints where its Python threads were (in the job, or already finalizing)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")


def _launch(script: Path, launcher: str) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    return [sys.executable, str(Path(__file__).resolve()), "--_pair", str(script)]


def _pair(script: str) -> int:
    """Start two ranks with torchrun's variables; exit -6 if a rank aborted, 1 if one failed otherwise."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, script],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    codes = [p.wait() for p in procs]
    for r, c in enumerate(codes):
        if c:
            print(f"rank {r} exitcode  : {c}", file=sys.stderr)
    return -6 if -6 in codes else (1 if any(codes) else 0)


def _aborting_thread_at(text: str) -> str:
    """What faulthandler printed for the thread that aborted: its innermost Python frame, or "<no Python frame>"."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Current thread") and i + 1 < len(lines):
            return lines[i + 1].strip()
    return "not reported"


def run_once(kind: str, script: Path, launcher: str, step: int, tmp: Path) -> tuple[str, str, float]:
    """One job: ("clean" | "abort" | "failed", first line of the abort message, seconds)."""
    cmd = _launch(script, launcher)
    if kind == "recorded":
        out = tmp / "trace"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "replaydiff", "record", "--step", str(step), "-o", str(out), "--", *cmd]
    t0 = time.perf_counter()
    rounds = 0
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    except subprocess.TimeoutExpired:
        return "failed", "timed out after 300 s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    text = p.stdout + p.stderr
    if p.returncode == 0:
        return "clean", "", seconds
    if any(m in text for m in ABORT_MARKS):
        first = next((line.strip() for line in text.splitlines() if "terminate called" in line), "SIGABRT")
        return "abort", f"{first}; aborting thread: {_aborting_thread_at(text)}", seconds
    return "failed", (text.strip().splitlines() or [f"exit {p.returncode}"])[-1][:200], seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="runs of each kind (plain, recorded), interleaved")
    ap.add_argument("--minutes", type=float, default=None, help="start no new round after this many minutes")
    ap.add_argument("--launcher", choices=("torchrun", "pair"), default="torchrun")
    ap.add_argument("--step", type=int, default=2, help="the step `replaydiff record --step` records (of 3)")
    ap.add_argument("--_pair", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._pair:
        sys.exit(_pair(args._pair))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import CpuMonitor, md_table  # here: a --_pair child has no use for torch

    tmp = Path(tempfile.mkdtemp(prefix="rd-teardown-"))
    script = tmp / "ddp_no_barrier.py"
    script.write_text(JOB)
    counts = {k: {"clean": 0, "abort": 0, "failed": 0} for k in ("plain", "recorded")}
    seconds: dict[str, list[float]] = {"plain": [], "recorded": []}
    notes: list[str] = []
    monitor = CpuMonitor()
    monitor.start()
    t0 = time.perf_counter()
    rounds = 0
    try:
        for i in range(args.runs):
            if args.minutes is not None and time.perf_counter() - t0 > 60 * args.minutes:
                break
            rounds = i + 1
            for kind in (("plain", "recorded") if i % 2 == 0 else ("recorded", "plain")):
                outcome, why, secs = run_once(kind, script, args.launcher, args.step, tmp)
                counts[kind][outcome] += 1
                seconds[kind].append(secs)
                print(f"round {i + 1:2d} {kind:8s} {outcome:6s} {secs:5.1f} s {why}", file=sys.stderr, flush=True)
                if why:
                    notes.append(f"{kind} run {i + 1}: {why}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    others = monitor.others_share()
    busy = f"; other processes used {100 * others:.0f}% of the CPUs" if others is not None else ""
    print(f"2-rank gloo DDP, 3 steps, destroy_process_group() without a barrier; launcher {args.launcher}; "
          f"recorded = `replaydiff record --step {args.step}`; {rounds} runs each, interleaved "
          f"({time.perf_counter() - t0:.0f} s{busy})\n")
    rows = [[k, str(rounds), str(c["clean"]), str(c["abort"]), str(c["failed"]),
             f"{sorted(seconds[k])[len(seconds[k]) // 2]:.1f} s" if seconds[k] else "-"]
            for k, c in counts.items()]
    print(md_table(["job", "runs", "clean", "aborted at teardown", "failed otherwise", "median wall"], rows))
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    main()
