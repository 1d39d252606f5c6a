"""The on-disk trace: a directory with one sub-directory per rank, written as it goes and read one op at a time.

``open_trace`` is the way in; the records it gives are typed (the ``schema`` package alone knows the wire keys)."""
from replaydiff.trace.damage import MissingOps, describe_missing
from replaydiff.trace.format import FORMAT_NAME, FORMAT_VERSION
from replaydiff.trace.index import ModuleNode, TraceIndex
from replaydiff.trace.reader import RankTrace, Trace, open_trace
from replaydiff.trace.schema.ops import ArgPath, CollectiveInfo, OpRecord, RngState
from replaydiff.trace.schema.values import Opaque, TensorRef, TensorStats, iter_refs

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "ArgPath", "CollectiveInfo", "MissingOps", "ModuleNode", "Opaque",
           "OpRecord", "RankTrace", "RngState", "TensorRef", "TensorStats", "Trace", "TraceIndex", "describe_missing",
           "iter_refs", "open_trace"]
