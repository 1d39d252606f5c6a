"""Why every rank holds the same rows of the batch: the data samplers each rank's recorder saw built (where, and the
rank and replica count each was given), read from the ranks' traces. A sampler is built before the step that reads
it, so the step's ops cannot name it; its note can: "the DistributedSampler built at train.py:16 was given rank=0 on
rank 1". Where no note tells, the words say what to check instead, and name no line."""
from __future__ import annotations

from replaydiff.rebuild_and_judge import shown
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.samplers import read_samplers
from replaydiff.trace.schema.samplers import SamplerBuilt


def _built(s: SamplerBuilt) -> str:
    return f"the {shown(s.kind)}" + (f" built at {shown(s.at)}" if s.at else "")


def _wrong(s: SamplerBuilt, rank: int, world: int) -> str | None:
    """What is wrong with one rank's sampler, in words; None when it takes this rank's own share."""
    if s.replicas is not None and s.replicas != world:
        given = "was given" if s.replicas_given is not None else "took"
        what = "the whole dataset" if s.replicas == 1 else f"1/{s.replicas} of the dataset"
        return f"{_built(s)} {given} num_replicas={s.replicas} on {world} ranks: each rank reads {what}, in the " \
               f"same order"
    if s.rank is not None and s.rank != rank:
        given = "was given" if s.rank_given is not None else "took"
        return f"{_built(s)} {given} rank={s.rank} on rank {rank}"
    return None


def same_shard_cause(targets: list[RankTrace], batch_from_outside: bool) -> str:
    """The words after "each rank reads the same shard": the sampler that gives it, where the ranks' notes name one;
    what to check where they show none built; the general cause where nothing is known."""
    world = len(targets)
    notes = [read_samplers(t.root) for t in targets]
    for rank, note in enumerate(notes):
        for s in () if note is None else note.samplers:
            wrong = _wrong(s, rank, world)
            if wrong is not None:
                return wrong
    if all(n is not None for n in notes):
        built = [s for n in notes for s in n.samplers]
        if built:
            return (f"{_built(built[0])} takes each rank's own share (rank r of {world} on rank r): the same rows "
                    f"come from elsewhere (another loader, or a split or slice of the batch given the same rank on "
                    f"every rank)")
        if all(n.whole_process for n in notes):
            return ("no rank built a DistributedSampler: check how each rank gets its own rows (a DataLoader "
                    "without a sampler reads the whole dataset on every rank, in the same order where each rank "
                    "shuffles with the same seed; a split of the batch given the same rank on every rank)")
    return "a sampler or split given the same rank on every rank" + (
        "; the batch enters the step from outside it: look where each rank's loader or sampler is given its rank"
        if batch_from_outside else "")
