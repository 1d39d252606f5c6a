"""Batch invariance, op by op: which op of a recorded step makes a row's result depend on the rest of the batch.

``check_invariance`` follows the step's batch dimension through the trace's data flow (``batch``), re-runs every op
whose inputs carry it on a slice of the batch at its recorded dtypes on the recording backend, and compares the
result bit for bit with the same slice of the recorded output (``analysis``); ``advice`` says what to do per kind of
op. The result is a frozen ``InvarianceResult`` that ``replaydiff.report.invariance`` renders.
"""
from replaydiff.invariance.advice import Advice, advice_for
from replaydiff.invariance.analysis import NoBatch, check_invariance, recorded_device
from replaydiff.invariance.result import Finding, InvarianceResult, KindSummary, OpCheck, Rows, SliceDiff, StepOutput

__all__ = ["Advice", "Finding", "InvarianceResult", "KindSummary", "NoBatch", "OpCheck", "Rows", "SliceDiff",
           "StepOutput", "advice_for", "check_invariance", "recorded_device"]
