"""Recording: a dispatch mode that writes every aten op of a block into a trace directory."""
from replaydiff.record.options import RecordOptions
from replaydiff.record.api import record
from replaydiff.record.recorder import Recorder
from replaydiff.record.multi_step import MultiStepRecorder
from replaydiff.record.unit_capture import watch_compiles

__all__ = ["MultiStepRecorder", "RecordOptions", "Recorder", "record", "watch_compiles"]
