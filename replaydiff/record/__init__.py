"""Recording: a dispatch mode that writes every aten op of a block into a trace directory."""
from replaydiff.record.options import RecordOptions
from replaydiff.record.recorder import Recorder, record

__all__ = ["RecordOptions", "Recorder", "record"]
