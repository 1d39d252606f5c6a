"""Rendering what a ``record`` run did (``replaydiff.record.outcome.RecordingOutcome``): the lines on stderr that say
what was recorded (or why nothing was), the plant, the budget and --rank warnings, the next commands, and whose
exit code record returns. They read the outcome and nothing else."""
from __future__ import annotations

import signal
from typing import TextIO

from replaydiff.errors import line, say, warn
from replaydiff.rebuild_and_judge import shown as escaped
from replaydiff.record.budget import budget_that_fits, format_size
from replaydiff.record.outcome import INTERRUPTED, HeldRank, PlantLanding, RecordingOutcome
from replaydiff.record.step_range import StepRange
from replaydiff.trace.schema import PlantedFaultInfo


def render_text(o: RecordingOutcome, out: TextIO, shown: str, budget: str | None = None) -> None:
    """Everything record says at the end of a run; ``shown`` and ``budget``: the trace directory and --budget as
    the user typed them."""
    options = o.options
    if not o.recorded:
        if options.flight:
            say(f"the flight recorder wrote nothing: no NaN/Inf, signal or exception (--flight-at-exit writes the "
                f"last {options.flight} steps at exit)", out)
            return
        say(f"nothing was recorded into {shown}: {why_nothing(o)}", out)
        return
    if options.plant:
        out.write("".join(plant_lines(o)))
    if options.budget:
        out.write(_budget_warning(o, budget or format_size(options.budget)))
    if options.ranks is not None:
        out.write(_absent_ranks_warning(o))
    done, missed = o.done, o.missed
    what = _flight_what(o) if options.flight else \
        steps_text(done or missed) if missed else f"steps {options.steps}" if options.steps else f"step {o.step}"
    note = ""
    if missed:
        ran = _ran(o.steps_run, o.code)
        note = f" {steps_text(missed).capitalize()} {'was' if len(missed) == 1 else 'were'} never " \
               f"reached: {ran}." if done else \
            f" {steps_text(missed).capitalize()} {'was' if len(missed) == 1 else 'were'} not completed: " \
            f"{ran}; the trace holds what ran of step {missed[0]} before the script ended."
    recorded = f"recorded {what}" if done or not missed else "recorded part of a step"
    code, n = o.code, len(o.ranks)
    if o.interrupted:  # Ctrl-C inside a recorded step
        summary = f"the command was interrupted (Ctrl-C or SIGINT; exit code {code}) before the recording " \
                  f"finished. The trace {shown} holds {_held_when_cut(o.held)}: it reads up to there."
        note = ""
    elif o.stopped and done and missed and not options.flight:  # stopped inside a step after whole ones
        # as trend reads it: the whole steps, then the one cut short
        summary = f"recording STOPPED part-way: {o.stopped}. The trace {shown} ({n} rank(s)) holds " \
                  f"{steps_text(done)} whole, then what was recorded of step {missed[0]} before that."
        if len(missed) > 1:
            rest = missed[1:]
            note = f" {steps_text(rest).capitalize()} {'was' if len(rest) == 1 else 'were'} never reached: " \
                   f"{_ran(o.steps_run, o.code)}."
    elif o.stopped:  # the recorder gave up part-way: what was asked for is not all in the trace
        summary = f"recording STOPPED part-way: {o.stopped}. The trace {shown} ({n} rank(s)) holds what was " \
                  f"recorded before that, not all of {what}."
    elif code and not o.all_complete:  # killed or crashed inside the recording: not a whole step
        summary = f"recording cut short: the command {ended(code)} before the recording finished. The trace " \
                  f"{shown} ({n} rank(s)) holds the ops recorded before that, not all of {what}."
    else:
        summary = f"{recorded} into {shown} ({n} rank(s))" + (f", but then the command {ended(code)}." if code else ".")
    head, _, commands = next_commands(o, shown).partition("\n")  # a say() is one line; the commands follow it
    say(f"{summary}{note} {head}", out)
    out.write(commands)
    if o.unmatched_filter is not None:  # a --module typo, said last
        warn(o.unmatched_filter, out)
    if not o.interrupted:  # that line gave the exit code already
        out.write(_exit_line(code))


def _flight_what(o: RecordingOutcome) -> str:
    """'the flight recorder's steps 5-7 (it wrote them because the output of Net.forward at job.py:24 holds NaN at
    step 7)': what a flight recording kept, and why, as its manifest says (a trace string: escaped)."""
    f = o.flight
    if f is None:
        return "the flight recorder"
    kept = f"the flight recorder's {steps_text(list(f.steps))}" if f.steps else "the flight recorder"
    return f"{kept} (written because {escaped(f.reason)})" if f.reason else kept


def plant_lines(o: RecordingOutcome) -> list[str]:
    """What the end of a recording says of ``--plant SPEC``: where it landed and what it changed, or, as a warning,
    that it planted nothing or changed nothing (replay will then have nothing to find). Ranks told the same are told
    in one line."""
    spec = o.options.plant
    if o.plants_unknown is not None:
        return [line(f"--plant {spec}: where it landed is unknown: {o.plants_unknown}")]
    groups: dict[tuple, list[PlantLanding]] = {}
    for pl in o.plants:
        p = pl.plant
        groups.setdefault((p.op, p.call, p.landed, p.calls_seen, p.index, p.effect, pl.where), []).append(pl)
    lines = []
    for members in groups.values():
        ranks = [pl.plant.rank for pl in members]
        on = f" on rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}" if len(o.plants) > 1 else ""
        lines.append(line(_plant_line(spec, members[0].plant, members[0].where, on)))
    return lines


def _plant_line(spec: str | None, p: PlantedFaultInfo, where: tuple[str, str | None] | None, on: str) -> str:
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


def next_commands(o: RecordingOutcome, shown: str) -> str:
    """What to type next, for the kind of trace just written: replay needs tensor data (``--tensors full``), trend
    many steps; a trace of statistics or shapes is for diff (against a trace of another run) and show."""
    uses = o.uses
    lines = [f"replaydiff show {shown}"]
    lines += [f"replaydiff {verb} {shown}" for verb in ("replay", "trend") if verb in uses]
    if "replay" not in uses and "diff" in uses:
        lines.append(f"replaydiff diff OTHER {shown}   (OTHER: a trace of the same step from another run)")
    note = "" if "replay" in uses else f" (--tensors {o.tensors}: it cannot be replayed)"
    return f"Next{note}:\n" + "".join(f"  {cmd}\n" for cmd in lines)


def ended(code: int) -> str:
    """How the command ended, from a non-zero exit code (128+N: killed by signal N)."""
    if code == INTERRUPTED:
        return f"was interrupted (Ctrl-C or SIGINT; exit code {code})"
    try:
        name = signal.Signals(code - 128).name if code > 128 else None
    except ValueError:
        name = None
    return f"was stopped by {name} (exit code {code})" if name else f"exited with code {code}"


def _held_when_cut(held: list[HeldRank] | None) -> str:
    """What a trace whose command was interrupted mid-step holds, per rank."""
    if held is None:
        return "what was recorded before the interrupt (`replaydiff show` says what reads back)"
    said = []
    for h in held:
        if h.last is None:
            said.append((h.rank, "no complete op"))
            continue
        before = f", after the steps recorded from step {h.since}" if h.since is not None else ""
        said.append((h.rank, f"step {h.step} up to op #{h.last}, its last complete op{before}"))
    if len(said) == 1:
        return said[0][1]
    return "; ".join(f"rank {rank}: {what}" for rank, what in said)


def _exit_line(code: int) -> str:
    """The last line of a recording whose command failed: record's exit code is the command's (as a wrapper's is),
    which may be one replaydiff gives a meaning of its own (3: unreadable trace), so it is said whose it is."""
    return line(f"the command {ended(code)}; record exits with the command's code") if code else ""


def _ran(steps_run: int | None, code: int) -> str:
    exited = f" (the command {ended(code)})" if code else ""
    return f"the script ran {steps_run} step{'s' if steps_run != 1 else ''} of its first optimizer{exited}"


def why_nothing(o: RecordingOutcome) -> str:
    options, step, steps_run, code, job_ranks = o.options, o.step, o.steps_run, o.code, o.job_ranks
    asked_ranks = ",".join(map(str, options.ranks or []))
    if options.ranks is not None and job_ranks and not set(job_ranks) & set(options.ranks):
        had = f"rank{'s' if len(job_ranks) > 1 else ''} {','.join(map(str, job_ranks))}"
        return f"no process of the command had a rank in --rank {asked_ranks}: the job's processes had {had}" \
            if len(job_ranks) > 1 else f"no process of the command had a rank in --rank {asked_ranks}: " \
                                       f"it ran as {had}"
    if o.not_recorded:
        return o.not_recorded
    if steps_run is None:  # no process of the command told how many steps it ran
        if code:
            return f"the command {ended(code)} before replaydiff's step hook saw it end"
        if job_ranks:
            return "the step hook ran, but no process said how many optimizer steps it ran"
        return "no process of the command ran replaydiff's step hook (is it a Python process that keeps PYTHONPATH?)"
    asked = StepRange.parse(options.steps) if options.steps else StepRange(step, step)
    if steps_run == 0 and code:  # it failed (a missing file, an exception) before any step: its error is above
        return f"the command {ended(code)} before its first optimizer step (its output above may say why)"
    if steps_run == 0:  # an inference loop, a hand-written update: no torch.optim step to count
        return "record --step/--steps count optimizer steps (torch.optim's step hooks) and the command ran none; " \
               "to record code without an optimizer step, put `with replaydiff.record(\"trace/\"):` around it " \
               "(README, \"record: one step\")"
    ran = _ran(steps_run, code)
    if steps_run < asked.first:
        return f"step {step} was never reached: {ran}" if not options.steps else \
            f"steps {options.steps} were never reached: {ran}"
    if options.ranks is not None:
        return f"{ran}, but no process had a rank in --rank {asked_ranks}"
    return f"{ran}, and none of them was recorded"


def _budget_warning(o: RecordingOutcome, budget: str) -> str:
    """One warning when ``--budget`` left tensor data out: which ops, and a budget that fits everything (for the
    rank that needs the most): what it wrote plus what it left out. Each rank names its own ops."""
    per_rank = o.budget_left
    left = [x for xs in per_rank.values() for x in xs]
    if not left or o.budget_need is None or o.options.budget is None:
        return ""
    if len(per_rank) > 1:  # each rank's ops by number: one range over several ranks would say nothing
        what = "; ".join(f"rank {r}: {x.describe()}" for r, xs in per_rank.items() for x in xs)
    else:
        what = left[0].describe()
    return line(f"--budget {budget} was reached: {what}; --budget {format_size(budget_that_fits(o.budget_need))} "
                f"would fit everything (replay judges only the ops with data)", "warning")


def _absent_ranks_warning(o: RecordingOutcome) -> str:
    """One warning when --rank names ranks the job does not have (``--rank 0,3`` of a 2-process job), which
    would otherwise record rank 0 alone without a word."""
    asked, world, recorded = o.options.ranks or [], o.world_size, o.recorded_ranks
    if world is None:
        return ""
    absent = [r for r in asked if r >= world]
    if not absent:
        return ""
    names = f"rank{'s' if len(absent) > 1 else ''} {','.join(map(str, absent))} {'are' if len(absent) > 1 else 'is'}"
    job = f"ranks 0-{world - 1}" if world > 1 else "rank 0"
    return line(f"--rank {','.join(map(str, asked))}: {names} not in this job of {world} "
                f"process{'es' if world > 1 else ''} ({job}); recorded rank{'s' if len(recorded) > 1 else ''} "
                f"{','.join(map(str, recorded))}", "warning")


def steps_text(steps: list[int]) -> str:
    """``step 6``, ``steps 4-5``, ``steps 2,4`` or ``steps 10-2000:10`` (the syntax of --steps)."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    every = steps[1] - steps[0]
    if len(steps) == 2 and every > 1:
        return f"steps {steps[0]},{steps[1]}"
    return f"steps {steps[0]}-{steps[-1]}" + (f":{every}" if every > 1 else "")
