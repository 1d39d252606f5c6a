"""Replay: re-run each recorded op alone from its recorded inputs on a reference device and precision."""
from replaydiff.replay.engine import replay_trace
from replaydiff.replay.policy import ReplayOptions
from replaydiff.replay.result import OpResult, ReplayReport

__all__ = ["OpResult", "ReplayOptions", "ReplayReport", "replay_trace"]
