"""One step of a small policy network, recorded for `replaydiff invariance`: does a row's result depend on the rest
of the batch?

    python docs/examples/batch_invariance.py mlp/          # a batch of 8 rows, one torch thread
    replaydiff invariance mlp/                             # names the batch-variant ops, exit 1

The thread count is set before anything runs and recorded in the trace; the check runs each op with it.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import replaydiff

torch.set_num_threads(1)
torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
opt = torch.optim.SGD(policy.parameters(), lr=0.1)
states, actions = torch.randn(8, 32), torch.randint(0, 16, (8,))

with replaydiff.record(sys.argv[1]):
    logp = F.log_softmax(policy(states), dim=-1)
    loss = F.nll_loss(logp, actions)
    loss.backward()
    opt.step()
