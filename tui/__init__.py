"""The Textual app for drilling into a trace and its replay (`replaydiff tui`). It imports replaydiff, never the reverse.

Headless parts (``replaydiff.tui.model``, ``.details``, ``.keys``) import no textual; ``.app`` and the widgets do.
"""
