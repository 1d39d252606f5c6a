"""Expert parallelism by hand (correct), the experts fused: 4 experts on 2 ranks, each rank's 2 experts' weights
stacked (2, D, D) and run in one grouped GEMM (``torch._grouped_mm``) over its rows grouped by expert, the single
process's 4 in one over every row (moe.py's ``Fused``): the reference's stack sharded on the expert dimension."""
import moe

moe.main(moe.Fused, experts=4)
