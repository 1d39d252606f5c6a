"""An optimizer's hyperparameters as a recorded step read them: one entry per ``optimizer.step()`` the recording
saw, with the optimizer's class and, per parameter group, each setting that is a plain number, flag or tuple of
numbers (lr, betas, eps, weight_decay, momentum...). The keys of the entry are spelled here only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_AT, _KIND, _GROUPS, _BUILT = "at", "kind", "groups", "built"
Setting = int | float | bool | str | tuple | None


@dataclass(frozen=True)
class OptimizerStep:
    """One optimizer step: the op number the step's first op got, the optimizer's class name, and each parameter
    group's settings as (name, value) pairs in name order."""

    at: int
    kind: str
    groups: tuple[tuple[tuple[str, Setting], ...], ...]
    built: str | None = None  # 'file.py:LINE' that assigned the optimizer in the code calling step(); None: unknown


def _plain(v: Any) -> Setting | type[NotImplemented]:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float)) for x in v) and len(v) <= 8:
        return tuple(v)
    return NotImplemented  # a tensor lr, a callable: not a setting this entry holds


def settings_of(group: dict) -> tuple[tuple[str, Setting], ...]:
    """A parameter group's plain settings (its parameters and anything else left out), in name order."""
    out = []
    for name in sorted(k for k in group if isinstance(k, str) and k != "params"):
        v = group[name]
        if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:  # a tensor lr (capturable Adam)
            try:
                v = v.item()
            except Exception:
                continue
        p = _plain(v)
        if p is not NotImplemented:
            out.append((name, p))
    return tuple(out)


def wire_optimizer_step(step: OptimizerStep) -> dict:
    return {_AT: step.at, _KIND: step.kind,
            _GROUPS: [[[n, list(v) if isinstance(v, tuple) else v] for n, v in g] for g in step.groups],
            **({_BUILT: step.built} if step.built else {})}


def optimizer_step_from_wire(d: Any) -> OptimizerStep | None:
    """The entry, or None when it is not sound (a line cut short, another writer's)."""
    try:
        groups = tuple(tuple((str(n), tuple(v) if isinstance(v, list) else v) for n, v in g) for g in d[_GROUPS])
        built = d.get(_BUILT)
        return OptimizerStep(int(d[_AT]), str(d[_KIND]), groups, built if isinstance(built, str) else None)
    except (KeyError, TypeError, ValueError):
        return None
