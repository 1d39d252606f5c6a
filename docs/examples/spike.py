"""A training script with a bug for the README's walk-through "A job too big to record whole".

40 AdamW steps of replaydiff's tiny transformer. Before step 25 a "rescale" meant for one layer's learning-rate
warm-up multiplies that layer's MLP weight by 100 instead (the bug). The loss jumps at step 25; nothing in any
kernel is wrong, so the question is which op wrote the bad value and where it enters the step.

    python docs/examples/spike.py
"""
import torch

from replaydiff.models.tiny import TinyTransformer, TransformerConfig

torch.manual_seed(0)
cfg = TransformerConfig(dropout=0.0)
model = TinyTransformer(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = model.example_batch()

for step in range(1, 41):
    if step == 25:
        with torch.no_grad():
            model.blocks[1].mlp[0].weight.mul_(100)  # the bug: meant to be 1.00, not 100
    loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0 or step == 25:
        print(f"step {step}: loss {loss.item():.4f}")
