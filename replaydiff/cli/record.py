"""Record one optimizer step of an unmodified training script: replaydiff record --step 3 -o trace/ -- python train.py

The child runs with replaydiff's step hook armed (also under torchrun: one rank<N>/ directory per process), its exit
code is passed through (a non-zero one is said on the last line, since it may be one of replaydiff's own
codes), and the next commands that fit the trace are printed. When the script never reaches the step
asked for (or no process has a rank of --ranks), nothing is recorded: that is said, the empty directory made for the
trace is removed, and the exit code is 2 (a usage error: the request named a step or rank the job does not have;
1 would claim a divergence) unless the script itself failed, whose code is passed through. A step begun after the
script's last one (``--step 6`` of a 5-step script) was never reached either: what the recorder wrote of the script's
tail is removed. A range partly reached (``--steps 4-6``) names the steps recorded and those never reached, exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from replaydiff.cli.estimate import run_estimate
from replaydiff.cli.filter_check import unmatched_filter_line
from replaydiff.errors import EXIT_USAGE, ReplaydiffError, TraceError, UsageError
from replaydiff.record.options import COMPILED_MODES, GRANULARITIES, TENSOR_MODES, RecordOptions
from replaydiff.record.child_arming import ENV_VAR
from replaydiff.record.step_range import StepRange
from replaydiff.trace import open_trace
from replaydiff.trace.removal import NotReplaceable, remove_trace, replaceable_files
from replaydiff.trace.schema import PlantedFaultInfo

NAME = "record"
HELP = "record the N-th optimizer step of a training command (or many steps: --steps, --flight)"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--out", default="trace", help="trace directory to write (default: trace)")
    p.add_argument("--step", type=int, default=1, action=_Given,
                   help="which optimizer step to record, from 1 (default 1; with several optimizers, the steps of "
                        "the first one to step)")
    p.add_argument("--tensors", choices=TENSOR_MODES, default="full",
                   help="full: tensor data (default); stats: per-tensor statistics; meta: shapes and dtypes only")
    p.add_argument("--no-compress", action="store_true", help="store raw bytes instead of zstd")
    p.add_argument("--module", dest="modules", action="append", metavar="GLOB",
                   help="tensor data only for ops inside these modules (the others: statistics)")
    p.add_argument("--op", dest="ops", action="append", metavar="GLOB",
                   help="tensor data only for ops whose name matches (the others: statistics)")
    p.add_argument("--max-tensor-bytes", type=int, metavar="N", help="store statistics for storages larger than N")
    p.add_argument("--budget", metavar="SIZE",
                   help="bytes each rank's trace may take, e.g. 500M, 2G: tensor data in step order (with --module/"
                        "--op, those ops first) while it fits, statistics for every op")
    p.add_argument("--verify-writes", action="store_true",
                   help="checksum stored CPU tensors to notice writes torch never sees (numpy, C extensions)")
    p.add_argument("--ranks", type=_rank_list, metavar="R,R,...",
                   help="record only these ranks of a multi-process job (the others run untouched)")
    p.add_argument("--plant", metavar="OP[:N[:REL]]",
                   help="plant a fault to check that replay finds it: the N-th call (from 1) of OP returns its output "
                        "times 1+REL (default N=1, REL=1e-3), e.g. aten.mm.default:2; the trace says so")
    p.add_argument("--steps", metavar="A-B[:EVERY]",
                   help="record these optimizer steps into one trace, e.g. 100-2000:10 (each op gets its step)")
    p.add_argument("--granularity", choices=GRANULARITIES, default="op",
                   help="op: every aten op (default); module: each module's outputs and gradients (much cheaper)")
    p.add_argument("--compiled", choices=COMPILED_MODES, default="capture",
                   help="torch.compile regions: capture (default) runs them compiled and records each compiled graph "
                        "call as one unit; eager runs them as eager aten ops, each recorded")
    p.add_argument("--flight", type=int, metavar="K",
                   help="keep the last K steps in memory; write them when a gradient or the loss turns NaN/Inf, "
                        "on SIGTERM/SIGUSR1, or when the script raises")
    p.add_argument("--flight-mib", type=float, default=64.0, metavar="MIB",
                   help="memory the flight recorder may hold, encoded (default 64)")
    p.add_argument("--flight-at-exit", action="store_true", help="also write the last K steps at a normal exit")
    p.add_argument("--estimate", action="store_true",
                   help="run the step with --tensors meta and print what --tensors full would write per rank, "
                        "module and phase, the time writing it takes here, and (with --budget) the flags that fit; "
                        "nothing is written to -o")
    p.add_argument("--json", metavar="FILE|-",
                   help="with --estimate: write the estimate as JSON (format replaydiff.estimate/1) to FILE, or - for "
                        "stdout (the job's own output then goes to stderr)")
    p.add_argument("--force", action="store_true",
                   help="replace the trace in -o DIR (a replaydiff trace only: a directory holding anything else, the "
                        "working directory and the home directory are refused)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run, e.g. python train.py")


class _Given(argparse.Action):
    """Stores the value and notes that the option was given (``--step 1`` too), for options whose default is a
    value: --step with --steps or --flight is refused, not ignored."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _rank_list(text: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks takes ranks separated by commas, e.g. 0,3, not {text!r}")


def options_from_args(args: argparse.Namespace) -> RecordOptions:
    return RecordOptions.make(tensors=args.tensors, compress=not args.no_compress, modules=args.modules,
                              ops=args.ops, max_tensor_bytes=args.max_tensor_bytes, verify_writes=args.verify_writes,
                              plant=args.plant, ranks=getattr(args, "ranks", None),
                              steps=args.steps, granularity=args.granularity, flight=args.flight,
                              flight_mib=args.flight_mib, flight_at_exit=args.flight_at_exit,
                              budget=getattr(args, "budget", None), compiled=args.compiled)


def plant_lines(out: Path, spec: str) -> list[str]:
    """What the end of a recording says of ``--plant SPEC``: where it landed and what it changed, or, as a warning,
    that it planted nothing or changed nothing (replay will then have nothing to find). Ranks told the same are told
    in one line."""
    try:
        found = []
        for rt in open_trace(out):
            p = rt.planted
            if p is not None:
                op = rt[p.index] if p.index is not None else None
                found.append((p, (op.module or "(no module)", op.phase) if op is not None else None))
    except ReplaydiffError as exc:
        return [f"replaydiff: --plant {spec}: where it landed is unknown: {exc}"]
    groups: dict[tuple, list] = {}
    for p, where in found:
        key = (p.op, p.call, p.landed, p.calls_seen, p.index, p.effect, where)
        groups.setdefault(key, []).append((p, where))
    lines = []
    for members in groups.values():
        ranks = [p.rank for p, _ in members]
        on = f" on rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}" if len(found) > 1 else ""
        lines.append("replaydiff: " + _plant_line(spec, *members[0], on))
    return lines


def _plant_line(spec: str, p: PlantedFaultInfo, where: tuple[str, str | None] | None, on: str) -> str:
    if not p.landed:
        if p.call is None:  # the manifest was never finished
            return f"warning: --plant {spec}: the recording did not finish{on}, so where the plant landed is unknown"
        made = f"never ran {p.op}" if not p.calls_seen else \
            f"made {p.calls_seen} call{'' if p.calls_seen == 1 else 's'} of {p.op}, not {p.call}"
        return f"warning: --plant {spec} planted nothing{on}: the recording {made} (`replaydiff show` lists the ops " \
               f"it ran)"
    at = f"op #{p.index} {p.op}" if p.index is not None else f"{p.op} call {p.call}"
    if where is not None:
        at += f" in {where[0]}" + (f" ({where[1]})" if where[1] else "")
    e = p.effect
    if e is not None and e.changed_nothing:
        # Values that round back to themselves (bf16 with rel 1e-3) need a larger REL; zeros or no floats need
        # another call or op.
        fix = "a larger REL (--plant OP:N:REL), or another call or op" if e.nonzero and e.elements else \
            "another call or op"
        return f"warning: the planted fault ({spec}) landed on {at}{on} but {e.describe()}; replay will have " \
               f"nothing to find: plant {fix}"
    if e is not None and e.hint:
        return f"warning: the planted fault ({spec}) landed on {at}{on} and {e.describe()}; a larger REL makes a " \
               f"fault replay can tell apart"
    return f"a fault was planted ({spec}): {at}{on}" + (f", {e.describe()}" if e is not None else "") + \
        "; replay should name that op; every report on this trace says so first"


def run(args: argparse.Namespace) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("no command to record: replaydiff record [options] -- python train.py ARGS")
    if getattr(args, "step_given", False) and (args.steps or args.flight):
        raise UsageError(f"--step {args.step} records one step, --{'steps' if args.steps else 'flight'} chooses "
                         f"the steps itself: give one of them")
    if args.step < 1:
        raise UsageError("--step counts from 1")
    made = _missing_dirs(Path(args.out).resolve())  # removed again if nothing is recorded into them
    try:
        options = options_from_args(args)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if getattr(args, "json", None) and not getattr(args, "estimate", False):
        raise UsageError("--json writes the estimate: record --estimate --json FILE|- -- COMMAND")
    if getattr(args, "estimate", False):  # a meta run into a temporary directory: -o is left alone
        return run_estimate(args, cmd, options, run_recorded)
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {args.out} is not a directory (a file is there); a trace is a directory")
    if out.exists() and any(out.iterdir()):
        if not args.force:
            try:  # offer --force only where it would replace what is there
                replaceable_files(args.out)
            except NotReplaceable as exc:
                raise UsageError(f"{args.out} exists and is not empty, and --force would not replace it: "
                                 f"{exc.why}; choose another -o") from None
            raise UsageError(f"{args.out} exists and holds a trace; pass --force to replace it")
        remove_trace(args.out)  # a trace only, file by file; anything else is refused
    out.mkdir(parents=True, exist_ok=True)
    try:
        code, steps_run, job_ranks = run_recorded(cmd, out, args.step, options)
    except UsageError:
        _remove_empty(made)
        raise
    ranks = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith("rank"))
    asked = StepRange.parse(options.steps) if options.steps else StepRange(args.step, args.step)
    done, missed = _reached(asked, steps_run) if ranks and not options.flight else ([], [])
    if ranks and not done and missed and not code:
        # The recorder began the first step asked for after the script's last one, and the script ended: what it
        # holds is the tail of the script after its last step, not a step. It was written by this run: removed, as
        # when the step is never begun (the CLI says why below).
        try:
            remove_trace(out)
            ranks = []
        except UsageError:
            pass
    if ranks and options.plant:
        sys.stderr.write("".join(line + "\n" for line in plant_lines(out, options.plant)))
    if ranks and options.budget:
        sys.stderr.write(_budget_warning(out, args.budget))
    if ranks and options.ranks is not None:
        sys.stderr.write(_absent_ranks_warning(out, options.ranks))
    if ranks:
        what = "the flight recorder" if options.flight else \
            _steps_text(done or missed) if missed else f"steps {options.steps}" if options.steps else f"step {args.step}"
        note = ""
        if missed:
            ran = _ran(steps_run, code)
            note = f" {_steps_text(missed).capitalize()} {'was' if len(missed) == 1 else 'were'} never " \
                   f"reached: {ran}." if done else \
                f" {_steps_text(missed).capitalize()} {'was' if len(missed) == 1 else 'were'} not completed: " \
                f"{ran}; the trace holds what ran of step {missed[0]} before the script ended."
        recorded = f"recorded {what}" if done or not missed else "recorded part of a step"
        stopped = _stopped(out)
        if code == _INTERRUPTED and (stopped or not _all_complete(out)):  # Ctrl-C inside a recorded step
            summary = f"the command was interrupted (Ctrl-C or SIGINT; exit code {code}) before the recording " \
                      f"finished. The trace {args.out} holds {_held_when_cut(out, args.step)}: it reads up to " \
                      f"there."
            note = ""
        elif stopped:  # the recorder gave up part-way: what was asked for is not all in the trace
            summary = f"recording STOPPED part-way: {stopped}. The trace {args.out} ({len(ranks)} rank(s)) holds " \
                      f"what was recorded before that, not all of {what}."
        elif code and not _all_complete(out):  # killed or crashed inside the recording: not a whole step
            summary = f"recording cut short: the command {_ended(code)} before the recording finished. The trace " \
                      f"{args.out} ({len(ranks)} rank(s)) holds the ops recorded before that, not all of {what}."
        else:
            summary = f"{recorded} into {args.out} ({len(ranks)} rank(s))" + \
                      (f", but then the command {_ended(code)}." if code else ".")
        sys.stderr.write(f"replaydiff: {summary}{note} " + next_commands(out, args.out))
        sys.stderr.write(unmatched_filter_line(out, options))  # a --module typo, said last
        if not summary.startswith("the command was interrupted"):  # that line gave the exit code already
            sys.stderr.write(_exit_line(code))
        return code
    _remove_empty(made)
    if options.flight:
        sys.stderr.write(f"replaydiff: the flight recorder wrote nothing: no NaN/Inf, signal or exception "
                         f"(--flight-at-exit writes the last {options.flight} steps at exit)\n")
        return code
    sys.stderr.write(f"replaydiff: nothing was recorded into {args.out}: "
                     f"{_why_nothing(options, args.step, steps_run, code, job_ranks)}\n")
    return code or EXIT_USAGE


def run_recorded(cmd: list[str], out: Path, step: int, options: RecordOptions,
                 stdout: int | None = None) -> tuple[int, int | None, list[int]]:
    """Run the command with the step hook armed to record into ``out``: its exit code (a signal as 128+N), the
    most optimizer steps a process of it ran and the ranks its processes had (``_reports``). ``stdout``: a file
    descriptor for the command's standard output (None: ours)."""
    env = dict(os.environ)
    status = tempfile.mkdtemp(prefix="replaydiff-record-")  # each process of the job says how many steps it ran
    env[ENV_VAR] = json.dumps({"out": str(out), "step": step, "options": options.to_dict(), "status": status,
                               "command": list(cmd)})
    autostart = str(Path(__file__).resolve().parent.parent / "record" / "autostart")
    env["PYTHONPATH"] = os.pathsep.join([autostart] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        code = _run_forwarding_signals(cmd, env, stdout)
    except FileNotFoundError:
        raise UsageError(f"command not found: {cmd[0]}") from None
    finally:
        steps_run, job_ranks = _reports(status)
        shutil.rmtree(status, ignore_errors=True)
    return (code if code >= 0 else 128 - code), steps_run, job_ranks


_FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
_INTERRUPTED = 130  # 128 + SIGINT: how a command that Ctrl-C ended exits


def _run_forwarding_signals(cmd: list[str], env: dict, stdout: int | None) -> int:
    """Run the command and wait for it; the signals above, sent to this process, are passed on to it (so that
    ``kill -USR1`` / ``kill -TERM`` of ``replaydiff record``'s pid reaches the job and its flight recorder, and the
    job is never left running orphaned). A SIGINT is not passed on while this process group has the terminal:
    Ctrl-C reached the command from the terminal already, and a second one would cut its recorder's last write."""
    import signal
    import threading

    proc = subprocess.Popen(cmd, env=env, stdout=stdout)

    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and _terminal_is_ours():
            return
        try:
            proc.send_signal(signum)
        except OSError:  # it has just ended
            pass

    before = {}
    if threading.current_thread() is threading.main_thread():
        for name in _FORWARDED:
            if hasattr(signal, name):
                before[name] = signal.signal(getattr(signal, name), forward)
    try:
        return proc.wait()
    finally:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)


def _terminal_is_ours() -> bool:
    """Whether this process group is the foreground group of the terminal on stdin (so the terminal's Ctrl-C went to
    the whole group, the command included)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def next_commands(out: Path, shown: str) -> str:
    """What to type next, for the kind of trace just written: replay needs tensor data (``--tensors full``), trend
    many steps; a trace of statistics or shapes is for diff (against a trace of another run) and show."""
    from replaydiff import open_trace
    from replaydiff.replay.engine import trace_uses

    try:
        t = open_trace(out)
        uses = trace_uses(t.rank(t.ranks[0]))
        tensors = t.rank(t.ranks[0]).options.tensors
    except TraceError:  # a job killed mid-write: show says what is there
        uses, tensors = ["show"], None
    lines = [f"replaydiff show {shown}"]
    lines += [f"replaydiff {verb} {shown}" for verb in ("replay", "trend") if verb in uses]
    if "replay" not in uses and "diff" in uses:
        lines.append(f"replaydiff diff OTHER {shown}   (OTHER: a trace of the same step from another run)")
    note = "" if "replay" in uses else f" (--tensors {tensors}: it cannot be replayed)"
    return f"Next{note}:\n" + "".join(f"  {line}\n" for line in lines)


def _ended(code: int) -> str:
    """How the command ended, from a non-zero exit code (128+N: killed by signal N)."""
    import signal

    if code == _INTERRUPTED:
        return f"was interrupted (Ctrl-C or SIGINT; exit code {code})"
    try:
        name = signal.Signals(code - 128).name if code > 128 else None
    except ValueError:
        name = None
    return f"was stopped by {name} (exit code {code})" if name else f"exited with code {code}"


def _held_when_cut(out: Path, step: int) -> str:
    """What a trace whose command was interrupted mid-step holds, per rank: the step cut short, up to its last
    complete op, after the steps recorded before it. ``step``: record --step (ops of a one-step trace carry none)."""
    try:
        t = open_trace(out)
        held = []
        for rank in t.ranks:
            r = t.rank(rank)
            last = r.last_index if r.complete else r.truncated_after
            first = next(iter(r), None)
            if last is None or last < 0 or first is None:
                held.append((rank, "no complete op"))
                continue
            cut = r[last].step
            before = f", after the steps recorded from step {first.step}" if first.step is not None and \
                cut is not None and first.step < cut else ""
            held.append((rank, f"step {cut if cut is not None else step} up to op #{last}, its last complete op"
                               f"{before}"))
    except ReplaydiffError:
        return "what was recorded before the interrupt (`replaydiff show` says what reads back)"
    if len(held) == 1:
        return held[0][1]
    return "; ".join(f"rank {rank}: {what}" for rank, what in held)


def _exit_line(code: int) -> str:
    """The last line of a recording whose command failed: record's exit code is the command's (as a wrapper's is),
    which may be one replaydiff gives a meaning of its own (3: unreadable trace), so it is said whose it is."""
    return f"replaydiff: the command {_ended(code)}; record exits with the command's code\n" if code else ""


def _all_complete(out: Path) -> bool:
    """Whether every rank's recording finished (its manifest was completed); False when the trace cannot be read."""
    try:
        t = open_trace(out)
        return all(t.rank(r).complete for r in t.ranks)
    except ReplaydiffError:
        return False


def _ran(steps_run: int | None, code: int) -> str:
    exited = f" (the command {_ended(code)})" if code else ""
    return f"the script ran {steps_run} step{'s' if steps_run != 1 else ''} of its first optimizer{exited}"


def _why_nothing(options: RecordOptions, step: int, steps_run: int | None, code: int,
                 job_ranks: list[int] | None = None) -> str:
    asked_ranks = ",".join(map(str, options.ranks or []))
    if options.ranks is not None and job_ranks and not set(job_ranks) & set(options.ranks):
        had = f"rank{'s' if len(job_ranks) > 1 else ''} {','.join(map(str, job_ranks))}"
        return f"no process of the command had a rank in --ranks {asked_ranks}: the job's processes had {had}" \
            if len(job_ranks) > 1 else f"no process of the command had a rank in --ranks {asked_ranks}: " \
                                       f"it ran as {had}"
    if steps_run is None:  # no process of the command told how many steps it ran
        if code:
            return f"the command {_ended(code)} before replaydiff's step hook saw it end"
        if job_ranks:
            return "the step hook ran, but no process said how many optimizer steps it ran"
        return "no process of the command ran replaydiff's step hook (is it a Python process that keeps PYTHONPATH?)"
    asked = StepRange.parse(options.steps) if options.steps else StepRange(step, step)
    if steps_run == 0 and code:  # it failed (a missing file, an exception) before any step: its error is above
        return f"the command {_ended(code)} before its first optimizer step (its output above may say why)"
    if steps_run == 0:  # an inference loop, a hand-written update: no torch.optim step to count
        return "record --step/--steps count optimizer steps (torch.optim's step hooks) and the command ran none; " \
               "to record code without an optimizer step, put `with replaydiff.record(\"trace/\"):` around it " \
               "(README, \"record: one step\")"
    ran = _ran(steps_run, code)
    if steps_run < asked.first:
        return f"step {step} was never reached: {ran}" if not options.steps else \
            f"steps {options.steps} were never reached: {ran}"
    if options.ranks is not None:
        return f"{ran}, but no process had a rank in --ranks {asked_ranks}"
    return f"{ran}, and none of them was recorded"


def _reached(asked: StepRange, steps_run: int | None) -> tuple[list[int], list[int]]:
    """The steps asked for that the script completed, and those it never completed (both empty when unknown: a
    recorder that finished its range reports no count, and an open range has no end to miss)."""
    if steps_run is None or asked.last is None or steps_run >= asked.last:
        return [], []
    chosen = range(asked.first, asked.last + 1, asked.every)
    return [s for s in chosen if s <= steps_run], [s for s in chosen if s > steps_run]


def _budget_warning(out: Path, budget: str) -> str:
    """One warning when ``--budget`` left tensor data out: which ops, and a budget that fits
    everything (for the rank that needs the most): what it wrote plus what it left out. Each rank names its own ops."""
    from replaydiff.record.budget import budget_that_fits, format_size
    from replaydiff.trace.schema import LEFT_OUT_BUDGET

    try:
        t = open_trace(out)
        per_rank = {r: [x for x in t.rank(r).data_left_out if x.reason == LEFT_OUT_BUDGET] for r in t.ranks}
    except ReplaydiffError:
        return ""
    left = [x for xs in per_rank.values() for x in xs]
    if not left:
        return ""
    need = max(sum(p.stat().st_size for p in (out / f"rank{r}").rglob("*") if p.is_file()) +
               sum(x.nbytes for x in xs) for r, xs in per_rank.items() if xs)
    if len(per_rank) > 1:  # each rank's ops by number: one range over several ranks would say nothing
        what = "; ".join(f"rank {r}: {x.describe()}" for r, xs in per_rank.items() for x in xs)
    else:
        what = left[0].describe()
    return f"replaydiff: warning: --budget {budget} was reached: {what}; --budget " \
           f"{format_size(budget_that_fits(need))} would fit everything (replay judges only the ops with data)\n"


def _absent_ranks_warning(out: Path, asked: list[int]) -> str:
    """One warning when --ranks names ranks the job does not have (``--ranks 0,3`` of a 2-process job), which
    would otherwise record rank 0 alone without a word."""
    try:
        t = open_trace(out)
        world = t.rank(t.ranks[0]).world_size
        recorded = t.ranks
    except (ReplaydiffError, IndexError):
        return ""
    absent = [r for r in asked if r >= world]
    if not absent:
        return ""
    names = f"rank{'s' if len(absent) > 1 else ''} {','.join(map(str, absent))} {'are' if len(absent) > 1 else 'is'}"
    job = f"ranks 0-{world - 1}" if world > 1 else "rank 0"
    return f"replaydiff: warning: --ranks {','.join(map(str, asked))}: {names} not in this job of {world} " \
           f"process{'es' if world > 1 else ''} ({job}); recorded rank{'s' if len(recorded) > 1 else ''} " \
           f"{','.join(map(str, recorded))}\n"


def _stopped(out: Path) -> str | None:
    """Why the recording of some rank stopped part-way ("rank 1: REASON" when the ranks differ), or None."""
    try:
        t = open_trace(out)
        why = {r: t.rank(r).stopped for r in t.ranks}
    except ReplaydiffError:
        return None
    reasons = {w for w in why.values() if w}
    if not reasons:
        return None
    if len(reasons) == 1 and len(why) == 1:
        return reasons.pop()
    return "; ".join(f"rank {r}: {w}" for r, w in sorted(why.items()) if w)


def _steps_text(steps: list[int]) -> str:
    """``step 6``, ``steps 4-5``, ``steps 2,4`` or ``steps 10-2000:10`` (the syntax of --steps)."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    every = steps[1] - steps[0]
    if len(steps) == 2 and every > 1:
        return f"steps {steps[0]},{steps[1]}"
    return f"steps {steps[0]}-{steps[-1]}" + (f":{every}" if every > 1 else "")


def _reports(folder: str) -> tuple[int | None, list[int]]:
    """What the job's processes reported at exit: the most optimizer steps any of them ran (None: none said, or one
    finished recording every step asked for: the count of a launcher such as torchrun, 0, says nothing then) and
    their ranks."""
    counts, ranks, finished = [], set(), False
    for p in Path(folder).glob("*.json"):
        try:
            report = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(report, dict):
            continue
        finished = finished or report.get("finished") is True
        if isinstance(report.get("steps"), int):
            counts.append(report["steps"])
        if isinstance(report.get("rank"), int):
            ranks.add(report["rank"])
    return (max(counts) if counts and not finished else None), sorted(ranks)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what mkdir(parents=True) makes."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories this run made for a trace that was never written; only empty ones (rmdir)."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return
