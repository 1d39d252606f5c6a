"""A real training loop as users run it: Hugging Face's Trainer (tiny GPT-2, random weights, CPU), recorded with no
code change through `replaydiff record --step 3 -- python train.py`, replays clean at fp64 and bit for bit at same;
a fault planted with `--plant` is named exactly. The job is a process of its own, as a user's is; the CLI runs in this
process (``cli_here``), which spares four torch imports."""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import pytest

TRAIN = '''
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Toy(Dataset):
    def __init__(self):
        self.x = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=4, report_to=[], use_cpu=True,
                         save_strategy="no", dataloader_num_workers=0, seed=0, max_grad_norm=1.0, warmup_steps=1,
                         disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Toy()).train()
'''


@pytest.mark.slow
def test_trainer_step_replays_clean_and_a_planted_fault_is_named(tmp_path: Path, cli_here) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    _run = partial(cli_here, cwd=tmp_path)
    rec = _run("record", "--step", "3", "-o", "trace", "--", sys.executable, "train.py")
    assert rec.returncode == 0, rec.stderr
    for precision in ("fp64", "same"):
        out = _run("replay", "trace", "--precision", precision, "--json", "-")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr
        report = json.loads(out.stdout)
        assert report["summary"]["divergent"] == report["summary"]["error"] == 0
        phases = {o["phase"] for o in report["ops"]}
        assert {"forward", "backward", "optimizer"} <= phases  # the whole step: Trainer's optimizer step included
    rec = _run("record", "--step", "3", "--plant", "aten.addmm.default:5", "-o", "planted", "--", sys.executable,
               "train.py")
    assert rec.returncode == 0, rec.stderr
    out = _run("replay", "planted", "--json", "-")
    assert out.returncode == 1
    report = json.loads(out.stdout)
    planted = [o for o in report["ops"] if o["op"] == "aten.addmm.default"][4]  # the 5th call, read back
    assert report["first_divergent"]["index"] == planted["index"]
    assert [o["index"] for o in report["ops"] if o["status"] == "divergent"] == [planted["index"]]
