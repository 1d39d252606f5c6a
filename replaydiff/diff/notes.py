"""What the diff says about one aligned op pair beside its status and verdict: typed notes (see ``compare.notes``).

``diff.pairs`` judges a pair into a status, a verdict and a tuple of these; the ``PairResult`` is built from them
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
    # A compiled unit against the eager ops of its region
    NO_UNIT_OUTPUT_MATCHED = "no output of the unit maps onto an eager op's output"
    NO_NODE_PARTS = ("no matched node's output differs from its eager op's while its inputs agree (the difference "
                     "builds up across nodes, or lies in nodes without an eager counterpart)")


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


@dataclass(frozen=True)
class UnitInputDiffered(Note):
    """A compiled unit's recorded input already differed from the eager op's input it stands for."""

    position: int
    side: str  # the eager op's side: "ref" or "target"
    eager: int

    def text(self) -> str:
        return f"unit input {self.position} already differed ({self.side} #{self.eager}'s input)"


@dataclass(frozen=True)
class UnitRecompiled(Note):
    """Where a unit and the eager ops part was found on this machine's compile of the unit's graph."""

    backend: str
    reproduces: bool

    def text(self) -> str:
        how = ("gives the recorded outputs bit for bit" if self.reproduces else
               "does NOT give the recorded outputs bit for bit (keeping every node can change how the backend "
               "fuses them; or another torch, device or compiler): the nodes judged are this machine's kernels")
        return f"the unit's graph recompiled here with {self.backend}, every node kept, {how}"


@dataclass(frozen=True)
class UnitNotLocalised(Note):
    """The unit could not be recompiled here: only its boundaries were judged; ``first`` the first differing
    output's node."""

    why: str
    first: str

    def text(self) -> str:
        return f"not localised inside the unit ({self.why}); the first differing output is node {self.first}"


@dataclass(frozen=True)
class NodesUnmatched(Note):
    """Nodes of the unit that no eager op stands for, and eager ops of the region that no node stands for."""

    nodes: tuple[str, ...]
    eager: int

    def text(self) -> str:
        parts = []
        if self.nodes:
            shown = ", ".join(self.nodes[:6]) + (f", +{len(self.nodes) - 6} more" if len(self.nodes) > 6 else "")
            parts.append(f"{len(self.nodes)} node(s) without an eager counterpart ({shown})")
        if self.eager:
            parts.append(f"{self.eager} eager op(s) of the region without a node (listed as structural)")
        return "; ".join(parts) + ": not judged"


@dataclass(frozen=True)
class RightGivenOwnInputs(Note):
    """Outputs beyond the fixed limits, but each side's op, replayed here alone from its own recorded inputs (at
    float64, with replay's calibration of an ill-conditioned op), is right: the op introduced no difference."""

    inputs_exact: bool | None  # the two sides' inputs are equal bit for bit (None: not known, a compiled unit)

    def text(self) -> str:
        why = ("the op is ill-conditioned here: its own rounding at its dtype is that large (a mean or sum that "
               "cancels to almost zero)") if self.inputs_exact else \
            ("its inputs' difference (within tolerance) carried through it, as its conditioning allows") \
            if self.inputs_exact is False else \
            "an ill-conditioned result (a mean or sum that cancels to almost zero), or its inputs' small difference " \
            "carried through"
        return f"outputs differ beyond the fixed limits, yet each side's op replayed here from its own inputs is " \
               f"right: {why}"


@dataclass(frozen=True)
class WrongGivenOwnInputs(Note):
    """Replayed alone from its own recorded inputs, one side's op (or both) is divergent: ``said`` is replay's
    reason."""

    side: str  # "ref", "target" or "both"
    said: str

    def text(self) -> str:
        who = "both sides' ops are" if self.side == "both" else f"the {self.side}'s op is"
        return f"replayed here from its own inputs, {who} divergent ({self.said})"
