"""Analysis over the steps of a trace: ``compute_trend`` (per-module series, the first sudden change, its cause and
the closer recording) and ``entry`` (where a difference enters a trace whose every op replays clean). Each returns a
frozen result; ``replaydiff.report`` renders it."""
from replaydiff.trend.analysis import (DEFAULT_THRESHOLD, DEFAULT_WINDOW, LOG_FLOOR, MIN_HISTORY, SCALE_FLOOR,
                                       STATISTICS, Cause, Change, LateWindow, NoSteps, NoTrend, Positions, Series,
                                       TrendResult, Unscored, Zoom, compute_trend, log10_of, sound_score)

__all__ = ["DEFAULT_THRESHOLD", "DEFAULT_WINDOW", "LOG_FLOOR", "MIN_HISTORY", "SCALE_FLOOR", "STATISTICS", "Cause",
           "Change", "LateWindow", "NoSteps", "NoTrend", "Positions", "Series", "TrendResult", "Unscored", "Zoom",
           "compute_trend", "log10_of", "sound_score"]
