"""Expert parallelism by hand with a bug, several experts on a rank (otherwise moe_experts_multi.py: 4 experts on 2
ranks): after running its 2 experts, a rank cuts their results (grouped by expert, then source rank) by the sizes of
the blocks they came in (by source rank, then expert) to put them back in that order, so that some rows of one
expert's results go back to tokens routed to the other expert, or from the other rank."""
import torch

import moe


class Misrouted(moe.Looped):
    def by_source(self, y, got):
        order = [e * self.world + s for s in range(self.world) for e in range(self.local)]
        return torch.cat([y.split(got.tolist())[k] for k in order])  # BUG: cut by (source, expert)'s sizes


moe.main(Misrouted, experts=4)
