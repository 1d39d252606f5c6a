"""Batch invariance on real model code we did not write: transformers' GPT-2 and T5 from tiny configs, one AdamW
step of 16-token sequences, recorded with one torch thread. Slicing one sequence gives every matmul 16 rows, which
this CPU's kernels treat as they treat the whole batch: nothing may be named, and every op that reads the batch must
be judged (attention's head splits, the label shift, the position bias followed through the data flow)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers  # part of the `test` extra

import replaydiff
from replaydiff.invariance import Finding, check_invariance
from replaydiff.trace import open_trace


def _step(name: str):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 16), generator=g)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, batch = transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
    elif name == "llama":  # rotary embeddings (a float buffer of the batch's length), grouped-query attention
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
        model, batch = transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    elif name == "bert":  # token type ids: a (1, 32) buffer read first, expanded to the batch
        cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      vocab_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        model = transformers.BertForSequenceClassification(cfg)
        batch = {"input_ids": ids, "labels": torch.tensor([0, 1, 0, 1])}
    elif name == "vit":  # patches from a convolution; the classifier reads one token per image
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     image_size=16, patch_size=4, num_labels=3)
        model = transformers.ViTForImageClassification(cfg)
        batch = {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.tensor([0, 2, 1, 0])}
    else:
        cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                    num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        model = transformers.T5ForConditionalGeneration(cfg)
        batch = {"input_ids": ids, "labels": torch.randint(1, 128, (4, 16), generator=g)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        model(**batch).loss.backward()
        opt.step()
    return step


def _sixteen_rows_agree(transposed: bool) -> bool:
    """Whether this machine's matmul gives 16 rows of a 64-row product (the models' sizes: width 32, up to 128
    outputs) their bits alone, with the weight as GPT-2's Conv1D holds it or transposed as nn.Linear does."""
    g = torch.Generator().manual_seed(1)
    for k, n in ((32, 96), (32, 128), (128, 32), (64, 32)):
        a = torch.randn(64, k, generator=g)
        w = torch.randn(n, k, generator=g).t() if transposed else torch.randn(k, n, generator=g)
        if not torch.equal(a[16:32].clone() @ w, (a @ w)[16:32]):
            return False
    return True


def _record_and_check(name: str, path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step = _step(name)
        with replaydiff.record(path):
            step()
        return check_invariance(open_trace(path).rank(0))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_a_classifier_that_reads_one_token_a_sequence_names_its_matmuls_only(name, tmp_path):
    """The pooler and classifier run on one row a sequence: a one-row slice meets the one-row matmul there; every
    other op, the token type ids broadcast from a buffer and the patches of a convolution included, is judged."""
    r = _record_and_check(name, tmp_path / "t")
    assert r.batch_size == 4
    assert {c.op for c in r.variant} <= {"aten.addmm.default", "aten.mm.default"}
    assert [c.index for c in r.checks if c.finding is Finding.NOT_JUDGED] == []


@pytest.mark.parametrize("name", ["gpt2", "t5", "llama"])
def test_a_transformers_step_of_16_token_sequences_gets_no_false_finding(name, tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows_agree = _sixteen_rows_agree(transposed=name != "gpt2")
        step = _step(name)
        with replaydiff.record(tmp_path / "t"):
            step()
        r = check_invariance(open_trace(tmp_path / "t").rank(0))
    finally:
        torch.set_num_threads(before)
    assert r.batch_size == 4
    # where this CPU's matmul gives 16 rows other bits alone, the check rightly names matmuls, and nothing else
    assert r.variant == () if rows_agree else \
        {c.op for c in r.variant} <= {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
    assert [c.index for c in r.checks if c.finding is Finding.NOT_JUDGED] == []
    judged = {c.op for c in r.checks if c.finding is Finding.INVARIANT}
    assert {"aten.native_layer_norm.default" if name == "gpt2" else "aten.mean.dim", "aten.embedding.default"} <= judged
    assert any("scaled_dot_product" in op for op in judged)  # attention, followed through its head split


def test_the_cli_on_a_gpt2_trace_exits_0_with_json_on_stdout(tmp_path):
    import subprocess
    import sys

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step = _step("gpt2")
        with replaydiff.record(tmp_path / "t"):
            step()
    finally:
        torch.set_num_threads(before)
    res = subprocess.run([sys.executable, "-m", "replaydiff", "invariance", str(tmp_path / "t"), "--json", "-"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["counts"]["variant"] == 0 and doc["counts"]["invariant"] > 0 and doc["threads"] == 1


def test_the_readme_s_invariance_example_is_what_the_documented_commands_print(tmp_path):
    """docs/examples/batch_invariance.py's commands, run from a folder holding the script at the same relative path,
    print the README's example; the figures of a differing slice (elements, ULPs) are this CPU's kernels', so only
    their lines' start is held to the README."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    here = tmp_path / "docs" / "examples"
    here.mkdir(parents=True)
    (here / "batch_invariance.py").write_text((root / "docs" / "examples" / "batch_invariance.py").read_text())
    done = subprocess.run([sys.executable, "docs/examples/batch_invariance.py", "mlp/"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    res = subprocess.run([sys.executable, "-m", "replaydiff", "invariance", "mlp/"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr
    printed = res.stdout.splitlines()
    readme = (root / "README.md").read_text()
    block = readme.split("$ python docs/examples/batch_invariance.py mlp/ && replaydiff invariance mlp/\n", 1)[1]
    lines = [line for line in block.split("```", 1)[0].splitlines() if line != "..."]
    assert lines
    for line in lines:
        if "elements differ" in line:
            assert any(p.startswith(line.split(":", 1)[0] + ":") for p in printed), line
        else:
            assert line in printed, line
