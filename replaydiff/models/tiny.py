"""A tiny GPT-style transformer and a tiny CNN, and a helper that runs one training step.

The default sizes are the reference step the README's figures are measured on (2 layers, d_model 64, 4 heads, seq 32,
batch 8, dropout 0.1, AdamW); the "mid" flavour (d_model 256, seq 128) is for the benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TransformerConfig:
    vocab: int = 128
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32
    batch: int = 8
    dropout: float = 0.1  # on: random ops must replay from their recorded generator state

    @classmethod
    def mid(cls) -> "TransformerConfig":
        return cls(d_model=256, seq=128)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TransformerConfig = TransformerConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def example_batch(self, device: str | torch.device = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, self.cfg.vocab, (self.cfg.batch, self.cfg.seq + 1), generator=g)
        return idx[:, :-1].to(device), idx[:, 1:].to(device)


class TinyCNN(nn.Module):
    """conv -> batch norm -> relu -> max pool, twice, then a linear classifier."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.classifier(self.features(x).flatten(1)), targets)

    @staticmethod
    def example_batch(device: str | torch.device = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(4, 3, 16, 16, generator=g).to(device), torch.randint(0, 10, (4,), generator=g).to(device)


def make_step(model: nn.Module, batch: tuple, optimizer: torch.optim.Optimizer,
              autocast_dtype: torch.dtype | None = None) -> Callable[[], torch.Tensor]:
    """A closure running one training step (forward, backward, optimizer) and returning the loss."""
    device_type = next(model.parameters()).device.type

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        if autocast_dtype is not None:
            with torch.autocast(device_type, dtype=autocast_dtype):
                loss = model(*batch)
        else:
            loss = model(*batch)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step
