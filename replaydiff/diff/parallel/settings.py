"""The optimizer's settings of both runs, compared: each step the recorder noted (its class, and per parameter group
lr, betas, eps, weight decay, momentum...), the single process's against each rank's. A setting that differs (an lr
multiplied by the world size) is named with both values; it is what parts an update whose inputs agree."""
from __future__ import annotations

from dataclasses import dataclass

from replaydiff.diff.parallel.arguments import ratio_words, shown_pair
from replaydiff.trace.hyperparameters import read_optimizer_steps
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema.hyperparameters import OptimizerStep, Setting


@dataclass(frozen=True)
class SettingDifference:
    kind: str  # the optimizer's class
    group: int  # the parameter group
    name: str
    ref: Setting  # the single process's value
    theirs: Setting  # the ranks' (the first rank that differs)
    rank: int
    world: int
    built: str | None = None  # where the ranks' optimizer was built ('file.py:LINE'), where the recorder found it

    def describe(self) -> str:
        """'SGD group 0: lr 0.2 on the ranks, 0.1 in the single process (2x: the world size)'."""
        mine, other = shown_pair(self.ref, self.theirs)
        at = f" (the optimizer built at {self.built})" if self.built else ""
        return f"{self.kind} group {self.group}: {self.name} {other} on rank {self.rank}, {mine} in the single " \
               f"process{ratio_words(self.ref, self.theirs, self.world)}{at}"


def _steps(trace: RankTrace, ops: set[int]) -> list[OptimizerStep]:
    """The optimizer steps noted in the ops compared (a trace of several steps seen through one)."""
    steps = read_optimizer_steps(trace.root)
    return [s for s in steps if s.at in ops] or steps


def differing_settings(ref: RankTrace, ref_ops: set[int], ranks: list[tuple[int, RankTrace, set[int]]],
                       world: int) -> list[SettingDifference]:
    """Each setting some rank's optimizer steps with otherwise than the single process's, steps paired in order;
    empty when they agree or a side noted none (recorded before the note existed)."""
    mine = _steps(ref, ref_ops)
    out: list[SettingDifference] = []
    seen: set[tuple] = set()
    for rank, trace, ops in ranks:
        for a, b in zip(mine, _steps(trace, ops)):
            if a.kind != b.kind:
                key = ("kind",)
                if key not in seen:
                    seen.add(key)
                    out.append(SettingDifference("optimizer", 0, "class", a.kind, b.kind, rank, world, b.built))
                continue
            for g, (ga, gb) in enumerate(zip(a.groups, b.groups)):
                theirs = dict(gb)
                for name, v in ga:
                    if name in theirs and theirs[name] != v and (a.kind, g, name) not in seen:
                        seen.add((a.kind, g, name))
                        out.append(SettingDifference(a.kind, g, name, v, theirs[name], rank, world, b.built))
    return out
