# source: https://github.com/Lightning-AI/pytorch-lightning/issues/5140 (failures.md row 10)
# reproduces: model.half() inside a LightningModule trained with fp16 mixed precision (Lightning's
#   MixedPrecision("16-mixed") plugin, here on CPU) -> ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# fix: finishes
import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()  # the user's .half()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        assert torch.isfinite(loss), "non-finite loss"
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


torch.manual_seed(0)
x = torch.randn(64, 16)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 2), batch_size=16)
trainer = pl.Trainer(accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=6, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Regressor(), loader)
print("trained", trainer.global_step, "steps")
