"""What the parallel jobs share and is no part of what they test: the process group, a tiny language model, seeded
token batches with padding, and the end-of-run report (parameters, a hash of each step's global batch) that lets the
test check a pair of runs saw the same data.

Each job runs as one process (``python job.py``: world size 1, the whole global batch) or under torchrun, and sees
the same global batch either way.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB, SEQ, ROWS, STEPS = 32, 6, 8, 2
# valid tokens per row (the rest is padding, label -100): the first half of the batch holds more than the second, so
# ranks hold different token counts
LENGTHS = [6, 6, 5, 6, 2, 3, 1, 2]


def init(start: bool = True) -> tuple[int, int]:
    """(world size, rank); under torchrun the gloo process group started (unless a framework starts it)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and start:
        dist.init_process_group("gloo")
    return world, rank


class TinyLM(nn.Module):
    """Embedding, a GELU MLP, a vocabulary head: token ids (B, T) -> logits (B, T, VOCAB)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        return self.head(self.down(self.act(self.up(self.embed(ids)))))


def token_batches(steps: int = STEPS, rows: int = ROWS, seed: int = 0, padded: bool = True
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch per step: (ids, labels), the next token to predict; with ``padded`` labels are -100 past each
    row's length (the padding), so that ranks hold different numbers of valid tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        labels = ids.roll(-1, dims=1).clone()
        for r in range(rows if padded else 0):
            labels[r, LENGTHS[r % len(LENGTHS)]:] = -100
        out.append((ids, labels))
    return out


def shard(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's contiguous share of a global batch (dim 0)."""
    return torch.tensor_split(t, world)[rank]


class BatchLog:
    """The rows each step consumed on this rank, to hash the global batch at the end of the run."""

    def __init__(self):
        self.steps: dict[int, list] = {}

    def add(self, step: int, ids: torch.Tensor) -> None:
        self.steps.setdefault(step, []).extend(ids.reshape(ids.shape[0], -1).tolist())


def finish(params, log: BatchLog, world: int, rank: int) -> None:
    """Write (rank 0) the parameters after the last step and a hash of each step's global batch (its rows over every
    rank, as a multiset) to the file $JOB_RESULT names; then leave the process group. Every rank calls it."""
    full = {}
    for name, p in params:
        p = p.detach()
        if hasattr(p, "full_tensor"):  # a DTensor (FSDP2): the whole parameter
            p = p.full_tensor()
        full[name] = p.reshape(-1).tolist()
    logs = [log.steps]
    if world > 1 and dist.is_initialized():
        logs = [None] * world
        dist.all_gather_object(logs, log.steps)
    steps = sorted({s for lg in logs for s in lg})
    hashes = [hashlib.sha256(json.dumps(sorted(r for lg in logs for r in lg.get(s, []))).encode()).hexdigest()[:16]
              for s in steps]
    if rank == 0 and os.environ.get("JOB_RESULT"):
        with open(os.environ["JOB_RESULT"], "w") as f:
            json.dump({"world": world, "batches": hashes, "params": full}, f)
    if world > 1 and dist.is_initialized():
        dist.barrier()  # gloo aborts a rank that leaves while another still talks to it
        dist.destroy_process_group()
