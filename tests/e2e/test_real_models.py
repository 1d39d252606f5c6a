"""Real model code we did not write: Hugging Face transformers models built from tiny configs, random weights.

Each records one AdamW training step and replays it at fp64: no op may be divergent or fail, and a fault planted in
one backward matmul must be named exactly. This is where ill-conditioned healthy ops (BERT's LayerNorm over inputs
with a large mean, attention's key-bias gradient that cancels to ~0) showed up first.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch
import transformers  # part of the `test` extra

from replaydiff import record
from replaydiff.faults import PlantedFault
from replaydiff.replay import ReplayOptions, Status, replay_trace
from replaydiff.trace import open_trace


def _build(name: str):
    ids = torch.randint(0, 100, (2, 12))
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
    if name == "bert":
        cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=100, max_position_embeddings=32)
        return transformers.BertForSequenceClassification(cfg), {"input_ids": ids, "labels": torch.tensor([0, 1])}
    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                       max_position_embeddings=32)
        return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    if name == "t5":
        cfg = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=100,
                                    decoder_start_token_id=0, pad_token_id=0)
        return transformers.T5ForConditionalGeneration(cfg), {"input_ids": ids,
                                                              "labels": torch.randint(0, 100, (2, 6))}
    if name == "vit":
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, image_size=16, patch_size=8, num_labels=3)
        return transformers.ViTForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 16, 16),
                                                             "labels": torch.tensor([0, 2])}
    if name == "mixtral":  # mixture of experts: routing (topk, index ops) and aten._grouped_mm, which has no fp64
        cfg = transformers.MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                         num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
        return transformers.MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    if name == "resnet":  # convolutions, batch norm, max pool
        cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
                                        layer_type="basic")
        return transformers.ResNetForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32),
                                                                "labels": torch.tensor([0, 2])}
    if name == "convnext":  # depthwise convolutions, channels-last LayerNorm, layer scale
        cfg = transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, num_stages=2)
        return transformers.ConvNextForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32),
                                                                  "labels": torch.tensor([0, 2])}
    if name == "bart":
        cfg = transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                      vocab_size=100, max_position_embeddings=32)
        return transformers.BartForConditionalGeneration(cfg), {"input_ids": ids,
                                                                "labels": torch.randint(0, 100, (2, 6))}
    raise ValueError(name)


def _record_step(name: str, out: Path, fault: PlantedFault | None = None) -> None:
    torch.manual_seed(0)
    model, batch = _build(name)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own config chatter
        with (fault or contextlib.nullcontext()), record(out):
            loss = model(**batch).loss
            loss.backward()
            opt.step()


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5", "vit", "mixtral", "resnet", "convnext", "bart"])
def test_clean_step_replays_clean(name: str, tmp_path: Path) -> None:
    _record_step(name, tmp_path)
    report = replay_trace(str(tmp_path), ReplayOptions())
    counts = report.counts()
    assert counts["divergent"] == 0 and counts["error"] == 0, [
        (r.index, r.op, r.status, r.reason) for r in report.ops if r.status in (Status.DIVERGENT, Status.ERROR)]
    assert counts["ok"] > 300
    assert {r.reason for r in report.ops if r.status is Status.SKIPPED} <= {"uninitialised output (empty*)",
                                                                       "non-aten op (profiler)"}
    phases = {r.phase for r in report.ops if r.status is Status.OK}
    assert phases == {"forward", "backward", "optimizer"}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_planted_backward_fault_is_named(name: str, tmp_path: Path) -> None:
    fault = PlantedFault("aten.mm.default", rel=1e-3, call=4)
    _record_step(name, tmp_path, fault)
    assert fault.planted
    mms = [op for op in open_trace(tmp_path).rank(0) if op.name == "aten.mm.default"]
    planted = mms[3].index
    report = replay_trace(str(tmp_path), ReplayOptions())
    assert [(r.index, r.op) for r in report.ops if r.status is Status.DIVERGENT] == [(planted, "aten.mm.default")]


def test_op_without_fp64_kernel_falls_back_and_still_finds_a_fault(tmp_path: Path) -> None:
    fault = PlantedFault("aten._grouped_mm.default", rel=1e-3, call=2)
    _record_step("mixtral", tmp_path, fault)
    grouped = [op.index for op in open_trace(tmp_path).rank(0) if op.name == "aten._grouped_mm.default"]
    report = replay_trace(str(tmp_path), ReplayOptions())
    assert [(r.index, r.op) for r in report.ops if r.status is Status.DIVERGENT] == [(grouped[1],
                                                                                "aten._grouped_mm.default")]
    others = [r for r in report.ops if r.op == "aten._grouped_mm.default" and r.index != grouped[1]]
    assert others and all(r.status is Status.OK and "replayed at fp32: at fp64 the op failed" in r.reason
                          for r in others)
    assert report.counts()["error"] == 0


def test_realistic_training_loop_replays_clean_and_bitwise(tmp_path: Path) -> None:
    """GPT-2 with gradient checkpointing, fp16 autocast, GradScaler, gradient clipping, foreach AdamW, a scheduler."""
    torch.manual_seed(0)
    model, batch = _build("gpt2")
    model.train()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    scaler = torch.amp.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with record(tmp_path):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
    names = {op.name for op in open_trace(tmp_path).rank(0)}
    assert {"aten._amp_foreach_non_finite_check_and_unscale_.default", "aten._amp_update_scale_.default",
            "aten._foreach_norm.Scalar", "aten._foreach_addcdiv_.ScalarList"} <= names
    for precision in ("fp64", "same"):
        counts = replay_trace(str(tmp_path), ReplayOptions(precision=precision)).counts()
        assert counts["divergent"] == 0 and counts["error"] == 0 and counts["ok"] > 800, (precision, counts)
