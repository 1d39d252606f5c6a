"""Comparing a recorded tensor with a reference: pure metric functions and per-dtype tolerances."""
from replaydiff.compare.metrics import tensor_metrics
from replaydiff.compare.tolerance import Tolerances, reduction_length

__all__ = ["tensor_metrics", "Tolerances", "reduction_length"]
