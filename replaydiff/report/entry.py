"""Rendering ``replaydiff.trend.entry.EntryFinding``: the line under the replay summary that says where a difference
enters a clean trace (or why a zoom-in's clean replay cannot see it), and the ``enters`` object of replay's JSON."""
from __future__ import annotations

from typing import TextIO

from replaydiff.rebuild_and_judge import shown
from replaydiff.trend.entry import Entry, EntryFinding


def to_json(f: EntryFinding) -> dict | None:
    """The ``enters`` object of replay's JSON (None: no entry found)."""
    e = f.entry
    if e is None:
        return None
    return {"rank": e.rank, "step": e.step, "index": e.index, "op": e.op, "module": e.module,
            "phase": e.phase, "position": e.position, "tensor": e.tensor, "producer": e.producer,
            "statistic": e.statistic, "value": e.value, "previous": e.previous,
            "previous_step": e.previous_step, "producer_op": e.producer_op,
            "producer_source": e.producer_source, "argument": e.argument}


_NONFINITE = {"nan": "NaN", "inf": "Inf"}


def describe_entry(e: Entry, skipped: int = 0) -> str:
    """The replay summary's line; ``skipped``: ops the replay could not judge (then it speaks of those it did).
    Strings from the trace (module paths, op names, source lines) are shown escaped, never obeyed."""
    where = shown(", ".join(x for x in (e.module or "no module", e.phase) if x))
    none = "no op in this trace is wrong" if not skipped else \
        f"no replayed op in this trace is wrong ({skipped} skipped)"
    if e.argument is not None:
        return f"{none}: the difference enters through argument {shown(e.argument)} of op #{e.index} " \
               f"{shown(e.op)} ({where}) at step {e.step}: {e.value!r} where step {e.previous_step} had " \
               f"{e.previous!r} (a learning rate or other hyperparameter changed)"
    at = f" at {shown(e.producer_source)}" if e.producer_source else ""
    whence = "from outside the trace" if e.producer is None else \
        f"from op #{e.producer} {shown(e.producer_op)}{at}, {e.producer_why}"
    if e.statistic in ("l2", "absmax"):
        what = f"{e.statistic} {e.value:.4g} against {e.previous:.4g} at step {e.previous_step}"
    else:
        what = f"{int(e.value)} {_NONFINITE.get(e.statistic, e.statistic)} value(s), none at step {e.previous_step}"
    return f"{none}: the difference enters through input {e.position} of op " \
           f"#{e.index} {shown(e.op)} ({where}) at step {e.step}, {whence} ({shown(e.tensor or '')}: {what})"


def render_text(f: EntryFinding, out: TextIO) -> None:
    """One line, or nothing when the finding holds nothing to say."""
    if f.entry is not None:
        line = describe_entry(f.entry, f.skipped)
    elif f.one_step is not None:
        step = f.one_step
        line = f"one step ({step}) in this trace: record --steps {step - 1}-{step} to see which input a difference " \
               f"enters through"
    elif f.steps is not None and f.factor is not None:
        line = f"no input from outside the replayed ops, and no optimizer argument, changed {f.factor:.0f}x or " \
               f"more from one step to the next (steps {f.steps[0]}-{f.steps[1]}): a change that builds up from " \
               f"smaller ones enters unseen here (trend's table and cause line show how it grew)"
    else:
        return
    out.write(line + "\n")
