"""Comparing a recorded tensor with a reference: typed error measures, per-dtype tolerances, and the verdict."""
from replaydiff.compare.metrics import (ExactMismatch, FloatError, Measure, NonfiniteMismatch, ScalarMismatch,
                                        ShapeMismatch, ViewMismatch, measure)
from replaydiff.compare.tolerance import Tolerances, reduction_length
from replaydiff.compare.verdict import Verdict, judge, judge_measure

__all__ = ["ExactMismatch", "FloatError", "Measure", "NonfiniteMismatch", "ScalarMismatch", "ShapeMismatch",
           "Tolerances", "Verdict", "ViewMismatch", "judge", "judge_measure", "measure", "reduction_length"]
