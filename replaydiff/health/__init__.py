"""The health report of a replayed trace: ``build_health`` gathers the checks, the culprit, the worst ops, the error
per module, the environment and the likely causes (with their evidence) into a frozen ``HealthReport``;
``replaydiff.report.health`` renders it."""
from replaydiff.health.analysis import (ROUNDING_FACTOR, TOP, Cause, Check, HealthReport, ModuleRow, build_health,
                                        normalised_error)

__all__ = ["ROUNDING_FACTOR", "TOP", "Cause", "Check", "HealthReport", "ModuleRow", "build_health", "normalised_error"]
