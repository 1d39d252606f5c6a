"""Rendering replay results: text for people, JSON (schema ``replaydiff.replay/1``) for machines."""
from replaydiff.report.json_report import JSON_FORMAT, load_replay_json, report_to_json
from replaydiff.report.text import render_replay

__all__ = ["JSON_FORMAT", "load_replay_json", "report_to_json", "render_replay"]
