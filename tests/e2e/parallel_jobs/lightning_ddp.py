"""Lightning's DDP strategy as users run it (correct), recorded at --step 2: a shuffled DistributedSampler picks each
rank's rows (the rows are selected inside the step, by the loader); Lightning averages the gradients. The single
process (python lightning_ddp.py) builds the same sampler for one replica, so its batches are the ranks' together."""
import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import jobkit


class Rows(Dataset):
    """Token ids and their next-token labels, one row each."""

    def __init__(self):
        self.ids = torch.cat([ids for ids, _ in jobkit.token_batches(padded=False)])
        self.labels = self.ids.roll(-1, dims=1)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.labels[i]


class LitLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lm = jobkit.TinyLM()

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        log.add(self.global_step, ids)
        return F.cross_entropy(self.lm(ids).flatten(0, 1), labels.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


world, rank = jobkit.init(start=False)  # Lightning starts the process group
torch.manual_seed(0)
module = LitLM()
data = Rows()
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=jobkit.ROWS // world, sampler=sampler)
log = jobkit.BatchLog()
trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=jobkit.STEPS,
                    use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(module, loader)
jobkit.finish(module.lm.named_parameters(), log, world, rank)
