"""Diffing two traces of one training step: where do two runs part ways?

``diff_traces(ref, target)`` aligns the op streams of each rank pair (even when they differ in length or order),
compares aligned ops on their inputs and outputs with replay's judging function, and names per rank the first op
whose inputs agree and whose outputs do not; ops that only carried a difference forward are ``inherited``.
"""
from replaydiff.diff.align import Alignment, align, module_key, op_keys
from replaydiff.diff.engine import DiffOptions, diff_traces, rank_pairs
from replaydiff.diff.environment import EnvDifference, environment_diff
from replaydiff.diff.result import (DiffReport, Evidence, Origin, OriginKind, PairResult, PairStatus, RankDiff,
                                    Unaligned)

__all__ = ["Alignment", "DiffOptions", "DiffReport", "EnvDifference", "Evidence", "Origin", "OriginKind",
           "PairResult", "PairStatus", "RankDiff", "Unaligned", "align", "diff_traces", "environment_diff",
           "module_key", "op_keys", "rank_pairs"]
