# source: https://github.com/Lightning-AI/pytorch-lightning/issues/19695 (failures.md row 22)
# reproduces: Lightning manual optimization under fp16 mixed precision calling loss.backward() instead of
#   self.manual_backward(loss): the scaler never scaled a loss -> AssertionError: Attempted unscale_ but _scale is
#   None.  This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration.
# expect: AMP405
import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn


class Manual(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        opt.zero_grad()
        loss.backward()  # should be self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
trainer = pl.Trainer(accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=4, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Manual(), torch.utils.data.DataLoader(data, batch_size=16))
