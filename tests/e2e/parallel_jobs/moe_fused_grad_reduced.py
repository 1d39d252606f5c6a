"""Expert parallelism by hand with a bug, the experts fused (otherwise moe_fused.py: 4 experts on 2 ranks, each
rank's 2 stacked and run in one grouped GEMM): the stacked experts' gradient is all-reduced with the shared ones,
which sums rank 0's experts' gradients with rank 1's, other experts' (the whole model treated as data parallel)."""
import torch.distributed as dist

import moe


def reduce_all(model: moe.MoE) -> None:
    for p in model.shared() + model.expert_parameters():
        dist.all_reduce(p.grad)  # BUG: rank 0's experts' gradients summed with rank 1's, other experts'


moe.main(moe.Fused, experts=4, reduce=reduce_all)
