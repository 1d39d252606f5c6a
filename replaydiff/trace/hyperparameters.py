"""Provides the optimizer hyperparameters a rank's trace holds: one JSON line per optimizer step recorded, in a side
file of the rank's directory (``trace/schema/hyperparameters.py`` spells the entry). Written by the recorder at each
step's start, read by the diff of a parallel run to name a setting the runs differ in (an lr multiplied by the world
size). A line cut short is skipped."""
from __future__ import annotations

import json
import os
from pathlib import Path

from replaydiff.trace.schema.hyperparameters import OptimizerStep, optimizer_step_from_wire, wire_optimizer_step

HYPERPARAMETERS = "optimizer.jsonl"


def append_optimizer_step(rank_dir: Path, step: OptimizerStep) -> None:
    """Append one step's settings (one line, written whole with one call)."""
    line = json.dumps(wire_optimizer_step(step), separators=(",", ":"), allow_nan=True) + "\n"
    fd = os.open(Path(rank_dir) / HYPERPARAMETERS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_optimizer_steps(rank_dir: Path) -> list[OptimizerStep]:
    """The optimizer steps a rank recorded, in order; [] when none (or recorded before this file existed)."""
    try:
        text = (Path(rank_dir) / HYPERPARAMETERS).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            step = optimizer_step_from_wire(json.loads(line))
        except ValueError:
            continue
        if step is not None:
            out.append(step)
    return out
