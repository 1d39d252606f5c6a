"""The ``replaydiff`` command line: one module per verb."""
