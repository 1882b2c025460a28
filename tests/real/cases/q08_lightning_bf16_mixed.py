# source: https://github.com/Lightning-AI/pytorch-lightning/issues/5140 (failures.md row 10: don't .half() the
#   model; let the precision flag do it)
# reproduces: nothing - a LightningModule with fp32 parameters, Trainer(precision="bf16-mixed") on CPU, with
#   gradient clipping.
# expect: quiet
import lightning.pytorch as pl
import torch
from torch import nn


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
x = torch.randn(128, 16)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 2), batch_size=16)
trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=16, gradient_clip_val=1.0,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Regressor(), loader)
print("trained", trainer.global_step, "steps")
