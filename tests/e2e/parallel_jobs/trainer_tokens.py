"""transformers.Trainer as users run it (correct): a tiny GPT-2 built from a config (random weights, no dropout),
rows padded with an attention_mask and labels -100 on the padding, the loss averaged over the tokens of every rank
(average_tokens_across_devices). Under torchrun the Trainer runs DDP; each rank takes its share of the global batch in
order, so the single process (python trainer_tokens.py) steps on the same rows."""
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import jobkit


class Padded(Dataset):
    """Rows of token ids, padded past their length: the first rows of each global batch are longer than the last."""

    def __init__(self):
        self.rows = [row for ids, _ in jobkit.token_batches() for row in ids]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        mask = (torch.arange(jobkit.SEQ) < jobkit.LENGTHS[i % len(jobkit.LENGTHS)]).long()
        ids = self.rows[i] * mask  # pad id 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class LoggedTrainer(Trainer):
    """Trainer, its loss untouched; each step's rows written down for the end-of-run check."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        log.add(self.state.global_step, inputs["input_ids"])
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


world, rank = jobkit.init(start=False)  # the Trainer starts the process group
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=jobkit.VOCAB, n_positions=jobkit.SEQ, n_embd=16, n_layer=1, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
args = TrainingArguments(output_dir="trainer-out", per_device_train_batch_size=jobkit.ROWS // world,
                         max_steps=jobkit.STEPS, learning_rate=1e-2, lr_scheduler_type="constant",
                         average_tokens_across_devices=True, train_sampling_strategy="sequential", use_cpu=True,
                         report_to=[], save_strategy="no", dataloader_num_workers=0, seed=0, disable_tqdm=True,
                         ddp_backend="gloo" if world > 1 else None)
log = jobkit.BatchLog()
LoggedTrainer(model=model, args=args, train_dataset=Padded()).train()
jobkit.finish(model.named_parameters(), log, world, rank)
