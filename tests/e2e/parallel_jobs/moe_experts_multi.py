"""Expert parallelism by hand (correct), several experts on a rank: 4 experts on 2 ranks, 2 on each (moe.py's
layer, one ``nn.Linear`` per expert). Each rank regroups the rows it receives (by source rank, then expert) by
expert before running its experts, and puts the results back in the order they came before sending them back."""
import moe

moe.main(moe.Looped, experts=4)
