"""replaydiff: record one training step's aten ops, replay each in isolation, name the op that went wrong."""
__version__ = "0.1.0"

from replaydiff.record import record  # noqa: E402

__all__ = ["record", "__version__"]
