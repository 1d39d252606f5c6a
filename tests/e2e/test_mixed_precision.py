"""fp32 against bf16 autocast, the same step of the same model: the diff names no op when every bf16 op is right
given its own inputs, on every model family alike (a ViT-like model built here, GPT-2 and T5 from transformers
configs); a fault planted in a bf16 op, or in an autocast cast, is still where the difference is said to enter."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import transformers  # part of the `test` extra

from replaydiff import record
from replaydiff.cli.main import main
from replaydiff.trace import open_trace


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        return self.proj((a.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(d), _Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class TinyViT(nn.Module):
    """Patches by a strided convolution, a class token concatenated, position embeddings, pre-norm blocks."""

    def __init__(self, d: int = 32, heads: int = 2, depth: int = 2, patch: int = 4, img: int = 16) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.Sequential(*[_Block(d, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return nn.functional.cross_entropy(self.head(self.norm(self.blocks(x))[:, 0]), labels)


def _model(family: str):
    torch.manual_seed(0)
    if family == "vit":
        return TinyViT(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    ids = torch.randint(0, 100, (2, 12))
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=100,
                                    decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
        model = transformers.T5ForConditionalGeneration(cfg)
    return model, (ids, ids)


def _record(path, family: str, bf16: bool, plant: str | None = None) -> None:
    model, (x, y) = _model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with record(path, plant=plant):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(x, y) if family == "vit" else model(input_ids=x, labels=y).loss
            loss.backward()
            opt.step()


def _diff(ref, target, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["diff", str(ref), str(target)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("family", ["vit", "gpt2", "t5"])
def test_fp32_against_bf16_autocast_names_no_op_when_every_bf16_op_is_right(tmp_path, capsys, family):
    _record(tmp_path / "fp32", family, bf16=False)
    _record(tmp_path / "bf16", family, bf16=True)
    code, out = _diff(tmp_path / "fp32", tmp_path / "bf16", capsys)
    assert code == 0, out
    assert "judged at bfloat16's limits" in out and " 0 divergent, 0 inherited" in out, out
    assert "no op introduced a difference" in out, out


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_a_fault_in_a_bf16_op_or_in_an_autocast_cast_is_where_the_difference_enters(tmp_path, capsys, family):
    _record(tmp_path / "fp32", family, bf16=False)
    # the third addmm of the bf16 run, 5% off (bf16 rounds at 0.4%)
    _record(tmp_path / "mm", family, bf16=True, plant="aten.addmm.default:3:5e-2")
    planted = open_trace(tmp_path / "mm").rank(0).planted.index
    code, out = _diff(tmp_path / "fp32", tmp_path / "mm", capsys)
    assert code == 1
    assert f"first divergence ref #" in out and f" / target #{planted} aten.addmm.default" in out, out
    # the fourth cast autocast makes (a cast the bf16 run alone runs), 5% off
    _record(tmp_path / "cast", family, bf16=True, plant="aten._to_copy.default:4:5e-2")
    planted = open_trace(tmp_path / "cast").rank(0).planted.index
    code, out = _diff(tmp_path / "fp32", tmp_path / "cast", capsys)
    assert code == 1
    assert f"differences enter from target-only op #{planted} aten._to_copy.default" in out, out
