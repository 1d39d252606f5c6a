"""Expert parallelism by hand with a bug: the experts' gradients are all-reduced with the shared ones (the whole
model's gradients treated as data parallelism's), which sums rank 0's expert's gradient with rank 1's, a different
expert's (otherwise moe_experts.py: moe.py's layer, one expert on each of 2 ranks)."""
import torch.distributed as dist

import moe


def reduce_all(model: moe.MoE) -> None:
    for p in model.shared() + model.expert_parameters():
        dist.all_reduce(p.grad)  # BUG: the expert's gradient summed with another rank's expert's


moe.main(moe.Looped, experts=2, reduce=reduce_all)
