"""The environment diff shown before any op: what differs between the two runs' snapshots, with a hint where a
difference is a known cause of numerical differences (TF32 on one side only, other CPU thread counts, another NCCL
algorithm); the hints are the table of known causes (replaydiff/causes.py).

Each trace's manifest carries the environment snapshot of replaydiff.record (versions, devices, numerics flags, thread
counts, NCCL_* / TORCH_* / CUDA_* ... variables, world size). Both snapshots are flattened to dotted keys and compared;
hostname and rank always differ between processes and explain nothing, so they are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replaydiff.causes import hint_for
from replaydiff.trace.schema.environment import Environment, env_key

_IGNORED = frozenset({env_key("hostname"), env_key("rank")})


@dataclass(frozen=True)
class EnvDifference:
    key: str  # dotted, e.g. "flags.cuda.matmul.allow_tf32", "variables.NCCL_ALGO", "devices.0.name"
    ref: Any  # None when the key is absent on that side
    target: Any
    hint: str | None = None

    def to_json(self) -> dict:
        return {"key": self.key, "ref": self.ref, "target": self.target, "hint": self.hint}


def environment_diff(ref: Environment | dict, target: Environment | dict) -> list[EnvDifference]:
    """Every environment entry that differs, those with a known numerical effect (a hint) first. Takes a trace's
    ``RankTrace.environment`` or a snapshot as stored."""
    a, b = (e.flat() if isinstance(e, Environment) else Environment.from_wire(e).flat() for e in (ref, target))
    diffs = [EnvDifference(k, a.get(k), b.get(k), hint_for(k)) for k in sorted(set(a) | set(b))
             if k not in _IGNORED and a.get(k) != b.get(k)]
    return sorted(diffs, key=lambda d: d.hint is None)
