"""replaydiff: record one training step's aten ops, replay each in isolation, name the op that went wrong."""
__version__ = "0.1.0"

from replaydiff.errors import TraceError  # noqa: E402
from replaydiff.record import record, watch_compiles  # noqa: E402
from replaydiff.replay.references import register_reference, unregister_reference  # noqa: E402
from replaydiff.trace import open_trace  # noqa: E402

__all__ = ["TraceError", "open_trace", "record", "register_reference", "unregister_reference", "watch_compiles",
           "__version__"]
