"""Replay: re-run each recorded op alone from its recorded inputs on a reference device and precision."""
from replaydiff.replay.engine import ReplayPlan, Shard, finish, plan, replay_trace, run_shard
from replaydiff.replay.policy import ReplayOptions
from replaydiff.replay.result import OpResult, ReplayReport, Status
from replaydiff.replay.runner import OpReplayer

__all__ = ["OpReplayer", "OpResult", "ReplayOptions", "ReplayPlan", "ReplayReport", "Shard", "Status", "finish",
           "plan", "replay_op", "replay_trace", "run_shard"]


def replay_op(trace, op, options: ReplayOptions | None = None):
    """Replay one op of a RankTrace: (OpResult, [(recorded TensorRef or scalar, reference value), ...]).

    The reference values are what the reference device and precision computed, for a closer look (an element-wise
    error histogram, a repro)."""
    from replaydiff.replay.engine import replay_threads
    from replaydiff.replay.policy import reference_settings, replay_numerics

    import torch

    opts = options or ReplayOptions()
    # the thread count of a whole replay with these options: the same verdict as there (bitwise at `same`)
    numerics = replay_numerics(trace.environment.flags, opts.precision)
    with reference_settings(replay_threads(trace, opts), numerics), torch.inference_mode():
        return OpReplayer(trace, opts).replay_with_pairs(op)
