"""``record -- COMMAND``: run the command with the step hook armed, and what became of the recording.

The child runs with the hook's settings in an environment variable and the ``autostart`` folder on its PYTHONPATH
(also under torchrun: one rank<N>/ directory per process); signals sent to this process are passed on to it; each of
its processes writes, at exit, how many optimizer steps it ran and its rank into a status folder (``_reports``).
``record_command`` then reads the finished trace once into a frozen ``RecordingOutcome``, which
``replaydiff.report.record`` words and whose ``exit_code`` the CLI returns. When the script never reaches the step
asked for (or no process has a rank of --rank), nothing is recorded: the empty directory made for the trace is
removed, and the exit code is 2 (a usage error: the request named a step or rank the job does not have; 1 would
claim a divergence) unless the script itself failed, whose code is passed through. A step begun after the script's
last one (``--step 6`` of a 5-step script) was never reached either: what the recorder wrote of the script's tail is
removed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from replaydiff.errors import EXIT_USAGE, ReplaydiffError, UsageError
from replaydiff.record.filter_check import unmatched_filter
from replaydiff.record.options import RecordOptions
from replaydiff.record.child_arming import ENV_VAR
from replaydiff.record.owner_token import OWNER_KEY, new_token
from replaydiff.record.step_range import StepRange
from replaydiff.trace import open_trace
from replaydiff.trace.ownership import OWNER, DirectoryHeld, NotWritable, claim, owns, release
from replaydiff.trace.removal import NotReplaceable, remove_trace, replaceable_files
from replaydiff.trace.schema import LEFT_OUT_BUDGET, FlightDump, LeftOut, PlantedFaultInfo
from replaydiff.trace.summary import trace_uses

INTERRUPTED = 130  # 128 + SIGINT: how a command that Ctrl-C ended exits
_FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


@dataclass(frozen=True)
class HeldRank:
    """What a rank of a trace whose command was interrupted mid-step holds: ``step`` cut short up to op ``last``, its
    last complete op (None: no complete op), after the steps recorded from ``since`` (None: none before it)."""

    rank: int
    step: int | None
    last: int | None
    since: int | None = None


@dataclass(frozen=True)
class PlantLanding:
    """A rank's planted fault, with the module and phase of the op it landed on (None: not on a recorded op)."""

    plant: PlantedFaultInfo
    where: tuple[str, str | None] | None


@dataclass(frozen=True)
class RecordingOutcome:
    """What a ``record`` run did. ``code``: the command's exit code (a signal as 128+N); ``steps_run``: the most
    optimizer steps a process ran (None: unknown); ``ranks``: the rank directories written (none: nothing was
    recorded); ``done``/``missed``: the steps asked for that the script completed or never did. The rest is read from
    the finished trace (each None or empty where it cannot be read)."""

    options: RecordOptions
    step: int
    code: int
    steps_run: int | None
    job_ranks: list[int]
    ranks: list[str]
    done: list[int] = field(default_factory=list)
    missed: list[int] = field(default_factory=list)
    stopped: str | None = None  # why the recording of some rank stopped part-way ("rank 1: REASON" when they differ)
    all_complete: bool = False  # every rank's manifest was completed
    held: list[HeldRank] | None = None  # for an interrupted command: what each rank holds (None: unreadable)
    plants: list[PlantLanding] = field(default_factory=list)
    plants_unknown: str | None = None  # why where the plant landed is unknown (the trace could not be read)
    budget_left: dict[int, list[LeftOut]] = field(default_factory=dict)  # rank -> what --budget left out
    budget_need: int | None = None  # bytes the rank that needs the most would take whole
    world_size: int | None = None
    not_recorded: str | None = None  # why a process recorded nothing of a step it ran (said by the process)
    recorded_ranks: list[int] = field(default_factory=list)  # the ranks the trace holds
    uses: list[str] = field(default_factory=lambda: ["show"])  # the verbs that can use the trace
    tensors: str | None = None
    unmatched_filter: str | None = None  # a --module/--op filter under which no op came
    flight: FlightDump | None = None  # why the flight recorder wrote, and the steps it kept

    @property
    def recorded(self) -> bool:
        return bool(self.ranks)

    @property
    def interrupted(self) -> bool:
        """Ctrl-C inside a recorded step: the trace reads up to where it was cut."""
        return self.code == INTERRUPTED and (self.stopped is not None or not self.all_complete)

    @property
    def exit_code(self) -> int:
        """The command's code (record is a wrapper); 2 when nothing was recorded though the command succeeded: the
        request named a step or rank the job does not have (a flight recorder with nothing to write is no error)."""
        if self.ranks or self.options.flight:
            return self.code
        return self.code or EXIT_USAGE


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what mkdir(parents=True) makes."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty(dirs: list[Path]) -> None:
    """Remove the directories this run made for a trace that was never written; only empty ones (rmdir)."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def prepare_out(out: Path, shown: str, force: bool) -> None:
    """Make the trace directory ``out`` (``shown``: as the user typed it), claimed by this recording already; one
    that holds a trace is replaced only with ``force``, and anything else is refused."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {shown} is not a directory (a file is there); a trace is a directory")
    if out.exists() and any(p.name != OWNER for p in out.iterdir()):
        if not force:
            try:  # offer --force only where it would replace what is there
                replaceable_files(shown)
            except NotReplaceable as exc:
                raise UsageError(f"{shown} exists and is not empty, and --force would not replace it: "
                                 f"{exc.why}; choose another -o") from None
            raise UsageError(f"{shown} exists and holds a trace; pass --force to replace it")
        remove_trace(shown)  # a trace only, file by file; anything else is refused
    out.mkdir(parents=True, exist_ok=True)


def claim_out(out: Path, shown: str, token: str) -> None:
    """Take ``out`` for this recording before anything is written or the job starts: UsageError, one line, when
    another recording holds it or it cannot be written (a read-only file system, a file in the way)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {shown} is not a directory (a file is there); a trace is a directory")
    try:
        claim(out, token)
    except (DirectoryHeld, NotWritable) as exc:
        raise UsageError(f"-o {shown}: {exc}") from None


def record_command(cmd: list[str], out: Path, shown: str, step: int, options: RecordOptions,
                   force: bool = False) -> RecordingOutcome:
    """Record ``cmd`` into ``out`` (``shown``: as the user typed it) and say what became of it."""
    made = missing_dirs(out)  # removed again if nothing is recorded into them
    token = new_token()
    try:
        claim_out(out, shown, token)
    except UsageError:
        remove_empty(made)
        raise
    try:
        return _record_claimed(cmd, out, shown, step, options, force, token, made)
    finally:
        release(out, token)
        if made and out.is_dir() and not any(out.iterdir()):  # nothing recorded into directories this run made
            remove_empty(made)


def _record_claimed(cmd: list[str], out: Path, shown: str, step: int, options: RecordOptions, force: bool,
                    token: str, made: list[Path]) -> RecordingOutcome:
    prepare_out(out, shown, force)
    missed_why: list[str] = []
    code, steps_run, job_ranks = run_recorded(cmd, out, step, options, missed=missed_why, owner=token)
    # Only this recording writes here while it holds the directory: the rank directories are its own
    ranks = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith("rank"))
    asked = StepRange.parse(options.steps) if options.steps else StepRange(step, step)
    done, missed = reached(asked, steps_run) if ranks and not options.flight else ([], [])
    if ranks and not done and missed and not code and owns(out, token):
        # The recorder began the first step asked for after the script's last one, and the script ended: what it
        # holds is the tail of the script after its last step, not a step. It was written by this run (the marker
        # says so): removed, as when the step is never begun.
        try:
            remove_trace(out)
            ranks = []
        except UsageError:
            pass
    if not ranks:
        return RecordingOutcome(options, step, code, steps_run, job_ranks, ranks,
                                not_recorded=missed_why[0] if missed_why else None)
    return RecordingOutcome(options, step, code, steps_run, job_ranks, ranks, done, missed,
                            **_read_back(out, step, options, code))


def _read_back(out: Path, step: int, options: RecordOptions, code: int) -> dict:
    """What the finished trace says, opened once; each fact left at its default where the trace cannot be read (a
    job killed mid-write: ``show`` says what is there)."""
    facts: dict = {"unmatched_filter": unmatched_filter(out, options)}
    try:
        t = open_trace(out)
        readers = [t.rank(r) for r in t.ranks]
    except ReplaydiffError as exc:
        if options.plant:
            facts["plants_unknown"] = str(exc)
        return facts
    try:
        why = {r.rank: r.stopped for r in readers}
        reasons = {w for w in why.values() if w}
        if len(reasons) == 1 and len(why) == 1:
            facts["stopped"] = reasons.pop()
        elif reasons:
            facts["stopped"] = "; ".join(f"rank {r}: {w}" for r, w in sorted(why.items()) if w)
        facts["all_complete"] = all(r.complete for r in readers)
    except ReplaydiffError:
        pass
    if code == INTERRUPTED:
        facts["held"] = _held_when_cut(readers, step)
    if options.plant:
        try:
            facts["plants"] = [PlantLanding(r.planted, _landed_on(r, r.planted)) for r in readers
                               if r.planted is not None]
        except ReplaydiffError as exc:
            facts["plants_unknown"] = str(exc)
    if options.budget:
        try:
            per_rank = {r.rank: [x for x in r.data_left_out if x.reason == LEFT_OUT_BUDGET] for r in readers}
            if any(per_rank.values()):
                facts["budget_left"] = per_rank
                facts["budget_need"] = max(
                    sum(p.stat().st_size for p in (out / f"rank{r}").rglob("*") if p.is_file()) +
                    sum(x.nbytes for x in xs) for r, xs in per_rank.items() if xs)
        except ReplaydiffError:
            pass
    try:
        if readers:
            facts["world_size"] = readers[0].world_size
            facts["recorded_ranks"] = [r.rank for r in readers]
            facts["uses"] = trace_uses(readers[0])
            facts["tensors"] = readers[0].options.tensors
            facts["flight"] = readers[0].flight
    except ReplaydiffError:
        facts.pop("world_size", None)
    return facts


def _landed_on(r, p: PlantedFaultInfo) -> tuple[str, str | None] | None:
    op = r[p.index] if p.index is not None else None
    return (op.module or "(no module)", op.phase) if op is not None else None


def _held_when_cut(readers: list, step: int) -> list[HeldRank] | None:
    """What each rank holds of the step an interrupt cut short. ``step``: record --step (ops of a one-step trace
    carry none)."""
    try:
        held = []
        for r in readers:
            last = r.last_index if r.complete else r.truncated_after
            first = next(iter(r), None)
            if last is None or last < 0 or first is None:
                held.append(HeldRank(r.rank, None, None))
                continue
            cut = r[last].step
            since = first.step if first.step is not None and cut is not None and first.step < cut else None
            held.append(HeldRank(r.rank, cut if cut is not None else step, last, since))
    except ReplaydiffError:
        return None
    return held


def reached(asked: StepRange, steps_run: int | None) -> tuple[list[int], list[int]]:
    """The steps asked for that the script completed, and those it never completed (both empty when unknown: a
    recorder that finished its range reports no count, and an open range has no end to miss)."""
    if steps_run is None or asked.last is None or steps_run >= asked.last:
        return [], []
    chosen = range(asked.first, asked.last + 1, asked.every)
    return [s for s in chosen if s <= steps_run], [s for s in chosen if s > steps_run]


def run_recorded(cmd: list[str], out: Path, step: int, options: RecordOptions, stdout: int | None = None,
                 missed: list[str] | None = None, owner: str | None = None) -> tuple[int, int | None, list[int]]:
    """Run the command with the step hook armed to record into ``out``: its exit code (a signal as 128+N), the
    most optimizer steps a process of it ran and the ranks its processes had (``_reports``). ``stdout``: a file
    descriptor for the command's standard output (None: ours). ``missed``: gets why a process recorded nothing of a
    step it ran (step 1 with no module call), as the processes said it. ``owner``: the token of this recording's
    claim on ``out``, which the job's processes join."""
    env = dict(os.environ)
    status = tempfile.mkdtemp(prefix="replaydiff-record-")  # each process of the job says how many steps it ran
    armed = {"out": str(out), "step": step, "options": options.to_json(), "status": status, "command": list(cmd)}
    if owner is not None:  # the job's processes share this recording's claim on ``out``
        armed[OWNER_KEY] = owner
    env[ENV_VAR] = json.dumps(armed)
    autostart = str(Path(__file__).resolve().parent / "autostart")
    env["PYTHONPATH"] = os.pathsep.join([autostart] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        code = _run_forwarding_signals(cmd, env, stdout)
    except FileNotFoundError:
        raise UsageError(f"command not found: {cmd[0]}") from None
    finally:
        steps_run, job_ranks = _reports(status, missed)
        shutil.rmtree(status, ignore_errors=True)
    return (code if code >= 0 else 128 - code), steps_run, job_ranks


def _run_forwarding_signals(cmd: list[str], env: dict, stdout: int | None) -> int:
    """Run the command and wait for it; the signals above, sent to this process, are passed on to it (so that
    ``kill -USR1`` / ``kill -TERM`` of ``replaydiff record``'s pid reaches the job and its flight recorder, and the
    job is never left running orphaned). A SIGINT is passed on only to a command that left this process group: one
    still in it got the SIGINT already, as a terminal's Ctrl-C, ``timeout -s INT``, a CI runner or a scheduler sends
    it to the whole group, and a second one would land in its recorder's last write (or the job's own handler)."""
    import signal
    import threading

    proc = subprocess.Popen(cmd, env=env, stdout=stdout)

    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and _in_our_group(proc.pid):
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


def _in_our_group(pid: int) -> bool:
    """Whether process ``pid`` is in this process's group (so a signal sent to the group reached it too). A SIGINT
    sent to this process alone cannot be told from one sent to its group: the group is how SIGINT comes (a
    terminal, timeout, CI runners, schedulers); SIGTERM is the signal to send to record's pid alone."""
    try:
        return os.getpgid(pid) == os.getpgrp()
    except (OSError, AttributeError):  # it has just ended, or no process groups here
        return False


def _reports(folder: str, missed: list[str] | None = None) -> tuple[int | None, list[int]]:
    """What the job's processes reported at exit: the most optimizer steps any of them ran (None: none said, or one
    finished recording every step asked for: the count of a launcher such as torchrun, 0, says nothing then) and
    their ranks; why a process recorded nothing of a step it ran goes into ``missed`` (once each)."""
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
        if missed is not None and isinstance(report.get("missed"), str) and report["missed"] not in missed:
            missed.append(report["missed"])
    return (max(counts) if counts and not finished else None), sorted(ranks)
