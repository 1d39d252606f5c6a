"""What tests/integration/test_steps.py and tests/e2e/test_steps_e2e.py share: a tiny GPT-2, its training loop, a
weight spike to find, and one intra-op thread for every test."""
from __future__ import annotations

import pytest
import torch
import transformers  # part of the `test` extra


VOCAB, SEQ = 50, 8


def gpt2(layers: int = 2) -> transformers.GPT2LMHeadModel:
    """The smallest GPT-2 that still has every kind of layer; dropout off so that steps differ only by the batch."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=16, n_layer=layers, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def train(model: torch.nn.Module, steps: int, before_step=None) -> torch.Tensor:
    """``steps`` AdamW steps on random token batches; ``before_step(step, model, ids)`` runs before each forward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        if before_step is not None:
            before_step(step, model, ids)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss


def module_path(model: torch.nn.Module, target: torch.nn.Module) -> str:
    """A module's path as traces spell it: the root's class name, then the attribute path."""
    return next(name for name, m in model.named_modules(prefix=type(model).__name__) if m is target)


def scale_weight_at(step_no: int, factor: float):
    def plant(step: int, model, ids) -> None:
        if step == step_no:
            with torch.no_grad():
                model.transformer.h[1].mlp.c_fc.weight.mul_(factor)
    return plant


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors on a shared 2-core machine: waking a second intra-op thread costs more than the work (measured:
    60 steps of the tiny GPT-2 take 8.7 s with two threads under load, 0.4 s with one). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
