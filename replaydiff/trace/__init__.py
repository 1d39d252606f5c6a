"""The on-disk trace: a directory with one sub-directory per rank, written as it goes and read one op at a time."""
from replaydiff.trace.format import FORMAT_NAME, FORMAT_VERSION
from replaydiff.trace.reader import RankReader, TraceReader, open_trace

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "RankReader", "TraceReader", "open_trace"]
