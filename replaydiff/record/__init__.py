"""Recording: a dispatch mode that writes every aten op of a block into a trace directory."""
from replaydiff.record.options import RecordOptions
from replaydiff.record.api import record
from replaydiff.record.recorder import Recorder
from replaydiff.record.steps import MultiStepRecorder

__all__ = ["MultiStepRecorder", "RecordOptions", "Recorder", "record"]
