"""Built-in tiny models for the demo, the tests and the benchmark (random weights, no downloads)."""
from replaydiff.models.tiny import TinyCNN, TinyTransformer, TransformerConfig, make_step

__all__ = ["TinyCNN", "TinyTransformer", "TransformerConfig", "make_step"]
