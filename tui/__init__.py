"""The Textual app for drilling into a replay (planned; see the README). It imports replaydiff, never the reverse."""
