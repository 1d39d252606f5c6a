"""The Textual app for drilling into a trace and its replay (`replaydiff tui`). It imports replaydiff, never the reverse.

Headless parts (``tui.model``, ``tui.details``, ``tui.keys``) import no textual; ``tui.app`` and the widgets do.
"""
