"""What the diff says about one aligned op pair beside its status and verdict: typed notes (see ``compare.notes``).

``diff.compare`` judges a pair into a status, a verdict and a tuple of these; the ``PairResult`` is built from them
in one place, where ``compare.notes.render`` writes them as the reason line the text and JSON reports show.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from replaydiff.compare.notes import Fact, Note


class DiffFact(Fact, Enum):
    """A note that is one fixed sentence."""

    NO_OUTPUT_DATA = "no output data on either side"
    NO_OUTPUT = "no output to compare (uninitialised or none)"
    INPUTS_DIFFERED = "inputs already differed"
    OTHER_GENERATOR_STATE = "random op drawn from another generator state"
    # Why a pair is divergent: how far its inputs were seen to agree.
    INPUTS_AGREE_IN_STATISTICS = "inputs agree in their statistics, outputs differ"
    INPUTS_EQUAL = "inputs equal bit for bit, outputs differ"
    INPUTS_WITHIN_TOLERANCE = "inputs agree within tolerance (not bit for bit), outputs differ"
    NO_INPUT_COMPARED = "outputs differ (no input could be compared)"
    OUTPUTS_DIFFER = "outputs differ"

@dataclass(frozen=True)
class InputDiffered(Note):
    """Inherited: tensor input ``position`` already differed."""

    position: int

    def text(self) -> str:
        return f"input {self.position} already differed"


@dataclass(frozen=True)
class CarriedFromStep(Note):
    """Inherited: inputs that agree only within tolerance (or could not be compared) descend from step inputs that
    already differed."""

    inputs_agree: bool | None

    def text(self) -> str:
        agree = "agree within tolerance" if self.inputs_agree else "could not be compared"
        return f"inputs {agree}, and descend from step inputs that already differed"


@dataclass(frozen=True)
class TensorInputCount(Note):
    """The two ops take different numbers of tensor inputs."""

    ref: int
    target: int

    def text(self) -> str:
        return f"{self.ref} tensor inputs against {self.target}"


@dataclass(frozen=True)
class PlainArgsDiffer(Note):
    """The non-tensor arguments differ; ``difference`` says where first."""

    difference: str

    def text(self) -> str:
        return "non-tensor arguments differ: " + self.difference
